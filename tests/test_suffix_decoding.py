"""Suffix decoding: the bounded-depth suffix trie, the proposer (its own tokens, other requests'
outputs, the bounded cache, the probability and depth bounds), its settings, and lossless output
through the engine."""
from __future__ import annotations

import numpy as np
import pytest
from engine_utils import assert_no_leak

from pagellm import LLM, SamplingParams
from pagellm.spec_decode import SpeculativeConfig, SuffixProposer, build_host_proposer
from pagellm.spec_decode.suffix import INDEX_BUDGET
from pagellm.spec_decode.suffix_tree import SuffixTrie


def suffix(k: int = 8, depth: int = 24, cached: int = 1000, factor: float = 1.0, min_prob: float = 0.1
           ) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig(k, method="suffix", suffix_decoding_max_tree_depth=depth,
                                            suffix_decoding_max_cached_requests=cached,
                                            suffix_decoding_max_spec_factor=factor,
                                            suffix_decoding_min_token_prob=min_prob))


def finish(proposer: SuffixProposer, req_id: str, prompt: list[int], output: list[int]) -> None:
    """A request that decoded `output` after `prompt` (proposed for once) and finished."""
    proposer.propose(prompt + output, 8, req_id, len(prompt))
    proposer.forget(req_id)


def paths(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every substring in `trie` with its count."""
    found, stack = {}, [((), trie.root)]
    while stack:
        prefix, node = stack.pop()
        for token, child in node.children():
            found[prefix + (token,)] = child.count
            stack.append((prefix + (token,), child))
    return found


def test_trie_counts_every_substring_up_to_its_depth():
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        depth = int(rng.integers(1, 6))
        trie = SuffixTrie(depth)
        cursor = trie.cursor()
        for start in range(0, len(tokens), 3):  # appended a few at a time, as decoding does
            cursor = trie.append(cursor, tokens[start:start + 3])
        expected: dict[tuple[int, ...], int] = {}
        for i in range(len(tokens)):
            for n in range(1, min(depth, len(tokens) - i) + 1):
                expected[tuple(tokens[i:i + n])] = expected.get(tuple(tokens[i:i + n]), 0) + 1
        assert paths(trie) == expected


def test_trie_removal_leaves_what_the_other_sequences_make():
    rng = np.random.default_rng(1)
    sequences = [rng.integers(0, 3, size=int(rng.integers(1, 20))).tolist() for _ in range(6)]
    trie, reference = SuffixTrie(4), SuffixTrie(4)
    for sequence in sequences:
        trie.insert(sequence)
    for sequence in sequences[3:]:
        reference.insert(sequence)
    for sequence in sequences[:3]:
        trie.remove(sequence)
    assert paths(trie) == paths(reference) and paths(reference)
    for sequence in sequences[3:]:
        trie.remove(sequence)
    assert trie.root.child is None and trie.root.more is None


def test_proposes_from_the_requests_own_tokens():
    proposer = suffix()
    assert proposer.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 10) == [4, 5, 9]  # a 3-token match: 3 tokens
    assert proposer.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 2) == [4, 5]     # capped by what may still come
    # A loop: the longest match (5 tokens) was seen continued once, by one token; the 3-token match
    # continues three tokens, all certain.
    assert proposer.propose([7, 7, 7, 7, 7, 7], 10) == [7, 7, 7]
    assert proposer.propose([5, 6, 7], 10) == [] and proposer.propose([5, 6, 5], 0) == []
    assert suffix(factor=0.5).propose([1, 2, 3, 4, 5, 9, 1, 2, 3, 4], 10) == [5, 9]  # half the 4-token match


def test_proposes_from_another_finished_requests_output():
    proposer = suffix()
    finish(proposer, "a", [100, 101, 102], [1, 2, 3, 4, 5, 6])
    assert proposer.num_cached_requests == 1
    assert proposer.propose([50, 51, 1, 2, 3], 10, "b", 2) == [4, 5, 6]
    # Its prompt is not cached: only what it generated.
    assert proposer.propose([60, 100, 101], 10, "c", 3) == []


def brute_force(tokens: list[int], k: int, depth: int, factor: float, min_prob: float, max_tokens: int) -> list[int]:
    """The proposer's rule on one request's tokens, written plainly from substring counts: for each
    suffix (< depth tokens) seen followed by something, the most frequent next token (ties: the one
    first seen) while the product of the shares stays >= min_prob, up to factor x its length; of
    those, the one with the largest sum of the products (ties: the longest suffix)."""
    def count(s: list[int]) -> int:
        return sum(tokens[i:i + len(s)] == s for i in range(len(tokens) - len(s) + 1))

    def next_tokens(s: list[int]) -> list[tuple[int, int]]:  # (count, token), in order of first occurrence
        seen: dict[int, int] = {}
        for i in range(len(tokens) - len(s)):
            if tokens[i:i + len(s)] == s:
                seen.setdefault(tokens[i + len(s)], i)
        return sorted(((count(s + [t]), t) for t in seen), key=lambda ct: (-ct[0], seen[ct[1]]))

    best, best_score = [], 0.0
    for length in range(min(depth - 1, len(tokens)), 0, -1):
        path, out, prob, score = tokens[len(tokens) - length:], [], 1.0, 0.0
        while len(out) < min(k, max_tokens, int(factor * length + 1e-9)) and len(path) < depth:
            options = next_tokens(path)
            if not options:
                break
            prob *= options[0][0] / sum(c for c, _ in options)
            if prob < min_prob:
                break
            out.append(options[0][1])
            path, score = path + [options[0][1]], score + prob
        if score > best_score:
            best, best_score = out, score
    return best


def test_proposals_match_the_plain_rule_on_random_histories():
    rng = np.random.default_rng(2)
    for _ in range(1500):
        depth, k = int(rng.integers(2, 7)), int(rng.integers(1, 7))
        factor, min_prob = float(rng.choice([0.5, 1.0, 2.0])), float(rng.choice([0.0, 0.2, 0.5]))
        tokens = rng.integers(0, int(rng.integers(2, 5)), size=int(rng.integers(1, 30))).tolist()
        max_tokens = int(rng.integers(0, 8))
        got = suffix(k, depth, factor=factor, min_prob=min_prob).propose(tokens, max_tokens)
        assert got == brute_force(tokens, k, depth, factor, min_prob, max_tokens), (tokens, k, depth, factor, min_prob)


def test_a_growing_request_gives_the_proposals_of_its_whole_history():
    rng = np.random.default_rng(3)
    proposer = suffix(k=4)
    histories: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(150):
        for req_id, tokens in histories.items():
            tokens += rng.integers(0, 5, size=int(rng.integers(1, 4))).tolist()
            assert proposer.propose(tokens, 5, req_id) == suffix(k=4).propose(tokens, 5)


def test_the_cache_keeps_the_latest_requests_only():
    proposer = suffix(cached=2)
    for req_id, output in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8]), ("c", [9, 10, 11, 12])):
        finish(proposer, req_id, [0], output)
    assert proposer.num_cached_requests == 2
    assert proposer.propose([20, 1, 2], 10, "x") == []  # "a" was evicted
    assert proposer.propose([20, 5, 6], 10, "y") == [7, 8] and proposer.propose([20, 9, 10], 10, "z") == [11, 12]
    expected = SuffixTrie(24)
    for output in ([5, 6, 7, 8], [9, 10, 11, 12]):
        expected.insert(output)
    assert paths(proposer.cache) == paths(expected)
    none = suffix(cached=0)
    finish(none, "a", [0], [1, 2, 3, 4])
    assert none.num_cached_requests == 0 and none.propose([1, 2], 10, "b") == []


def test_a_request_that_never_proposed_leaves_nothing_behind():
    proposer = suffix()
    proposer.forget("never-seen")
    assert proposer.num_cached_requests == 0 and not paths(proposer.cache)


def test_min_token_prob_stops_an_uncertain_continuation():
    outputs = ([1, 2, 7, 8], [1, 2, 7, 8], [1, 2, 9, 8])  # after 1 2: 7 two times in three
    for min_prob, expected in ((0.5, [7, 8]), (0.7, [])):
        proposer = suffix(min_prob=min_prob)
        for i, output in enumerate(outputs):
            finish(proposer, str(i), [0], output)
        assert proposer.propose([30, 1, 2], 10, "new") == expected
    # The probability is the path's: 2/3, then 2/3 * 1/2 below 0.4.
    proposer = suffix(min_prob=0.4)
    for i, output in enumerate(([1, 2, 7, 8], [1, 2, 7, 6], [1, 2, 9, 8])):
        finish(proposer, str(i), [0], output)
    assert proposer.propose([30, 1, 2], 10, "new") == [7]


def test_depth_bounds_match_and_continuation():
    tokens = [1, 2, 3, 4, 5, 1, 2, 3]
    assert suffix(depth=24).propose(tokens, 10) == [4, 5, 1]
    assert suffix(depth=3).propose(tokens, 10) == [4]  # a match of 2 and one token under it
    assert suffix(depth=1).propose(tokens, 10) == []    # no room for a match at all


@pytest.mark.parametrize("value, match", [
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth must be an integer >= 1"),
    ({"suffix_decoding_max_tree_depth": 2.5}, "suffix_decoding_max_tree_depth"),
    ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests must be an integer >= 0"),
    ({"suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor must be a finite number >= 0"),
    ({"suffix_decoding_max_spec_factor": "2"}, "suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be between 0 and 1.0"),
    ({"suffix_decoding_min_token_prob": float("nan")}, "suffix_decoding_min_token_prob"),
    ({"prompt_lookup_max": 3}, "key(s) prompt_lookup_max do not apply to method 'suffix'"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens must be an integer between 1 and 16"),
])
def test_bad_settings_name_the_key(value, match):
    with pytest.raises(ValueError, match=r"speculative_config \(--speculative-config\)") as e:
        SpeculativeConfig.parse({"method": "suffix", **value})
    assert match in str(e.value)


def test_settings_parse_as_vllm_takes_them():
    config = SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_tree_depth": 32, '
                                     '"suffix_decoding_max_cached_requests": 5, "suffix_decoding_max_spec_factor": 2, '
                                     '"suffix_decoding_min_token_prob": 0.3}')
    assert (config.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob) == (16, 32, 5, 2.0, 0.3)
    assert isinstance(build_host_proposer(config), SuffixProposer)
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob do not apply to method 'ngram'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.2})


# -- through the engine (SmolLM2, CPU) ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("k, prefix_caching", [(2, True), (5, False)])
def test_greedy_output_is_token_identical(smollm2_path, k, prefix_caching):
    """Chunked prefill (a 24-token budget), preemption (14 blocks for 4 requests) or prefix caching;
    the prompts twice, the second time with the first run's outputs in the global tree."""
    from test_spec_decode import CONVERSATIONS, ENGINE, run  # noqa: PLC0415

    plain_llm = LLM(smollm2_path, **ENGINE, kv_cache_memory_bytes=32 << 20)
    tokenizer = plain_llm.get_tokenizer()
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
               for c in CONVERSATIONS]
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    plain = run(plain_llm, prompts, params)
    llm = LLM(smollm2_path, **ENGINE, max_num_batched_tokens=24, num_gpu_blocks_override=14,
              enable_prefix_caching=prefix_caching,
              speculative_config={"method": "suffix", "num_speculative_tokens": k})
    scheduler = llm.llm_engine.engine_core.scheduler
    first = run(llm, prompts, params)
    accepted_first = scheduler.spec_stats.num_accepted_tokens
    assert scheduler.proposer.num_cached_requests == len(prompts)
    second = run(llm, prompts, params)
    for got in (first, second):
        assert [ids for ids, _ in got] == [ids for ids, _ in plain]
        for (_, spec_lps), (_, plain_lps) in zip(got, plain):
            assert len(spec_lps) == len(plain_lps)
            for a, b in zip(spec_lps, plain_lps):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    stats = scheduler.make_stats()
    assert stats.num_preemptions > 0 or stats.prefix_cache_hits > 0
    # The second run, its outputs all cached, is proposed more than the first.
    assert scheduler.spec_stats.num_accepted_tokens - accepted_first > accepted_first > 0
    assert_no_leak(llm.llm_engine)


@pytest.mark.slow
def test_aborted_requests_reach_the_cache(smollm2_path):
    from test_spec_decode import ENGINE  # noqa: PLC0415

    llm = LLM(smollm2_path, **ENGINE, kv_cache_memory_bytes=32 << 20,
              speculative_config={"method": "suffix", "num_speculative_tokens": 3})
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": list(range(10, 30))},
                       SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request(["r"])
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.scheduler.proposer.num_cached_requests == 1
    assert_no_leak(engine)


def test_a_long_prompt_is_indexed_over_several_steps():
    """At most INDEX_BUDGET tokens a call join a request's own trie; until it has caught up with
    the request's tokens it proposes nothing of its own, then what the whole history gives."""
    tokens = [1, 2, 3, 4, 5] + [9] * (2 * INDEX_BUDGET) + [1, 2, 3]
    proposer = suffix()
    assert proposer.propose(tokens, 10, "r") == [] and proposer.propose(tokens, 10, "r") == []
    assert proposer.propose(tokens, 10, "r") == [4, 5, 9] == suffix().propose(tokens, 10)
