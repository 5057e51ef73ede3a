"""Speculative decoding (prompt lookup and a draft model): its config, the proposers, lossless
verification, and several tokens per request per step through the engine."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from engine_utils import assert_no_leak
from prometheus_client import CollectorRegistry

from pagellm import LLM, SamplingParams
from pagellm.core.outputs import SchedulerStats, SpecDecodeStats
from pagellm.engine.arg_utils import EngineArgs
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.metrics.stats import IterationStats
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.rejection import verify
from pagellm.spec_decode import NgramProposer, SpeculativeConfig


@pytest.mark.parametrize("value, match", [
    ("{not json", "not valid JSON"),
    ([3], "must be a JSON object"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "between 1 and 16"),
    ({"num_speculative_tokens": True}, "between 1 and 16"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "method must be one of ngram, draft_model, suffix"),
    ({"num_speculative_tokens": 2, "method": "draft_model"}, "needs model"),
    ({"num_speculative_tokens": 2, "model": "draft.gguf", "prompt_lookup_max": 3},
     "do not apply to method 'draft_model'"),
    ({"num_speculative_tokens": 2, "quantization": "gguf"}, "do not apply to method 'ngram'"),
    ({"num_speculative_tokens": 2, "lookahead": 1}, "unknown key"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must be >= prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_config_errors_name_the_flag(value, match):
    with pytest.raises(ValueError, match=r"speculative_config \(--speculative-config\)") as e:
        SpeculativeConfig.parse(value)
    assert match in str(e.value)


def test_config_parses_vllms_shape():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert config == SpeculativeConfig(3, prompt_lookup_min=2, prompt_lookup_max=5)
    draft = SpeculativeConfig.parse({"model": "draft.gguf", "num_speculative_tokens": 2})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "draft.gguf", 2)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 1, "prompt_lookup_max": 1}).prompt_lookup_min == 1
    with pytest.raises(ValueError, match="one rank only"):
        EngineArgs(speculative_config={"num_speculative_tokens": 2}, tensor_parallel_size=2).validate()


def test_ngram_proposes_what_followed_the_latest_full_occurrence():
    propose = NgramProposer(SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=3)).propose
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 10) == [4, 5, 9]        # suffix [1, 2, 3] seen at 0
    assert propose([1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3], 10) == [7, 1, 2]  # latest of two occurrences
    assert propose([1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]      # capped by what may still be generated
    assert propose([8, 5, 6, 9, 5, 6], 10) == [9, 5, 6]                  # shorter n-grams when longer ones miss
    assert propose([5, 6, 7], 10) == [] and propose([5, 6, 5], 0) == []
    assert propose([7] * 10, 10) == [7, 7, 7]  # a loop: an occurrence with a full proposal after it
    assert propose([4, 7, 7, 7, 7], 10) == [7]  # none has: the latest


def brute_force_proposal(tokens: list[int], k: int, low: int, high: int, max_tokens: int) -> list[int]:
    """The proposer's rule, written plainly: the longest n (high down to low) whose last-n suffix
    occurred earlier; of its occurrences, the latest with min(k, max_tokens) tokens after it, else
    the latest."""
    limit = min(k, max_tokens)
    if limit <= 0:
        return []
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts:
            full = [s for s in starts if s + n + limit <= len(tokens)]
            start = (full or starts)[-1] + n
            return tokens[start:start + limit]
    return []


def test_ngram_matches_the_plain_rule_on_random_histories():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        low = int(rng.integers(1, 4))
        high, k = int(rng.integers(low, 6)), int(rng.integers(1, 6))
        tokens = rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(1, 40))).tolist()
        max_tokens = int(rng.integers(0, 7))
        got = NgramProposer(SpeculativeConfig(k, low, high)).propose(tokens, max_tokens)
        assert got == brute_force_proposal(tokens, k, low, high, max_tokens), (tokens, k, low, high, max_tokens)


def test_ngram_keeps_a_growing_history_per_request():
    """With a request id the proposer converts only the new tokens of each call: the same proposals
    as from the whole history, for histories growing past the array's first capacity."""
    rng = np.random.default_rng(1)
    proposer = NgramProposer(SpeculativeConfig(3, 1, 3))
    histories = {"a": [], "b": []}
    for _ in range(400):
        for req_id, tokens in histories.items():
            tokens += rng.integers(0, 6, size=int(rng.integers(1, 4))).tolist()
            assert proposer.propose(tokens, 5, req_id) == proposer.propose(tokens, 5)
    proposer.forget("a")
    assert "a" not in proposer._arrays and len(histories["a"]) > 256


def metadata(params: list[SamplingParams], vocab: int) -> SamplingMetadata:
    params = [p.apply_model_defaults({}) for p in params]
    return SamplingMetadata.build(params, [0] * len(params), vocab, torch.device("cpu"),
                                  torch.Generator().manual_seed(0))


# 50,000 rows take seconds a case: the first runs in the quick tier, the others are slow.
@pytest.mark.parametrize("draft", [pytest.param(1, id="likely draft"),
                                   pytest.param(4, id="less likely draft", marks=pytest.mark.slow),
                                   pytest.param(3, id="draft cut by top_k", marks=pytest.mark.slow)])
def test_verification_emits_exactly_the_target_distribution(draft):
    """50,000 rows verify the same draft: the first token emitted (the draft if accepted, else the
    replacement) must follow p, and the draft must be accepted with probability p(draft)."""
    rows, logits = 50_000, torch.tensor([0.3, 2.0, 1.1, -0.5, 0.9, 1.4])
    params = SamplingParams(temperature=0.7, top_k=5)
    md = metadata([params] * rows, len(logits))
    p = torch.softmax(logits / 0.7, dim=-1)
    p[3] = 0.0  # top_k=5 drops the smallest logit's token
    p /= p.sum()
    tokens, accepted = verify(logits.expand(rows, -1).clone(), md, torch.full((rows,), draft))
    freq = torch.bincount(tokens, minlength=len(logits)).double() / rows
    sigma = (p.double() * (1 - p.double()) / rows).sqrt()
    assert ((freq - p.double()).abs() <= 5 * sigma + 1e-12).all(), (freq, p)
    rate = accepted.double().mean().item()
    assert abs(rate - p[draft].item()) <= 5 * (p[draft].item() * (1 - p[draft].item()) / rows) ** 0.5 + 1e-12


def test_greedy_verification_accepts_exactly_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    md = metadata([SamplingParams(temperature=0)] * 3, 3)
    tokens, accepted = verify(logits, md, torch.tensor([1, 2, -1]))
    assert tokens.tolist() == [1, 0, 2] and accepted.tolist() == [True, False, False]


# -- through the engine (SmolLM2, CPU) ------------------------------------------------------------

REWRITE = ("Rewrite this paragraph with its spelling fixed and nothing else changed: The quick brown fox jumpd "
           "over the lazy dog. It was a sunny day and the fox was very hapy. The dog did not care, becuase it "
           "was sleeping under a big tree near the river.")
CONVERSATIONS = [
    [{"role": "user", "content": REWRITE}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "List three prime numbers larger than 50."}],
    [{"role": "user", "content": "Repeat after me: one two three four, one two three four, one two three four."}],
]
ENGINE = dict(dtype="float32", device="cpu", max_model_len=200, max_num_seqs=4)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str):
    return LLM(smollm2_path, **ENGINE, kv_cache_memory_bytes=16 << 20).get_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in CONVERSATIONS]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or []]) for o in outputs]


@pytest.fixture(scope="module")
def plain(smollm2_path: str, prompts):
    llm = LLM(smollm2_path, **ENGINE, kv_cache_memory_bytes=32 << 20)
    return run(llm, prompts, SamplingParams(temperature=0, max_tokens=40, logprobs=2))


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_output_is_token_identical(smollm2_path, prompts, plain, k):
    """Chunked prefill (a 24-token budget) and preemption (a cache of 14 blocks for 4 requests)."""
    llm = LLM(smollm2_path, **ENGINE, max_num_batched_tokens=24, num_gpu_blocks_override=14,
              enable_prefix_caching=k % 2 == 0,
              speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3})
    got = run(llm, prompts, SamplingParams(temperature=0, max_tokens=40, logprobs=2))
    stats = llm.llm_engine.engine_core.scheduler.make_stats()
    assert [ids for ids, _ in got] == [ids for ids, _ in plain]
    for (_, spec_lps), (_, plain_lps) in zip(got, plain):  # logprobs of the accepted tokens too
        assert len(spec_lps) == len(plain_lps)
        for a, b in zip(spec_lps, plain_lps):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert stats.num_preemptions > 0 or stats.prefix_cache_hits > 0  # shared prefixes fit the cache
    assert 0 < stats.spec.num_accepted_tokens <= stats.spec.num_draft_tokens <= k * stats.spec.num_drafts
    assert stats.spec.accepted_per_position[0] >= stats.spec.accepted_per_position[-1]
    # More than one token per step on average: the run took fewer steps than tokens.
    assert stats.spec.num_accepted_tokens > 10
    assert_no_leak(llm.llm_engine)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_steps_overlap_while_speculation_is_paused_by_batch_size(smollm2_path, prompts, plain, method):
    """disable_by_batch_size 3 with async scheduling: the four requests overlap their steps (no
    proposals), then, once fewer than three run, speculate one step at a time; greedy output
    stays that of plain decoding, and both kinds of steps happened."""
    spec = ({"method": "ngram", "num_speculative_tokens": 3} if method == "ngram"
            else {"model": smollm2_path, "num_speculative_tokens": 3})
    llm = LLM(smollm2_path, **ENGINE, kv_cache_memory_bytes=32 << 20, async_scheduling=True,
              speculative_config={**spec, "disable_by_batch_size": 3})
    core = llm.llm_engine.engine_core
    depths = []
    execute = core.executor.execute_model
    core.executor.execute_model = lambda so: (depths.append((len(core._in_flight), bool(so.scheduled_spec_tokens))),
                                              execute(so))[1]
    got = run(llm, prompts, SamplingParams(temperature=0, max_tokens=40, logprobs=2))
    assert [ids for ids, _ in got] == [ids for ids, _ in plain]
    assert any(in_flight == 1 for in_flight, _ in depths)  # launched while a step ran
    assert any(drafts for _, drafts in depths) and not any(drafts for in_flight, drafts in depths if in_flight)
    assert core.scheduler.spec_stats.num_accepted_tokens > 0
    assert_no_leak(llm.llm_engine)


@pytest.mark.slow
def test_max_tokens_and_stops_are_never_overshot(smollm2_path, prompts):
    llm = LLM(smollm2_path, **ENGINE, kv_cache_memory_bytes=32 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    rewrite = prompts[0]
    full = llm.generate([rewrite], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    for n in (1, 2, 7, 13):
        out = llm.generate([rewrite], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full.token_ids[:n] and out.finish_reason == "length"
    # A stop token inside a run of accepted drafts ends the output there.
    stop_at = full.token_ids[20]
    out = llm.generate([rewrite], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    first = full.token_ids.index(stop_at)
    assert out.token_ids == full.token_ids[:first + 1] and out.stop_reason == stop_at
    word = full.text.split()[8]
    out = llm.generate([rewrite], SamplingParams(temperature=0, max_tokens=40, stop=[word]), use_tqdm=False)[0]
    assert out.outputs[0].text == full.text[:full.text.index(word)]
    assert llm.llm_engine.engine_core.scheduler.spec_stats.num_accepted_tokens > 0
    assert_no_leak(llm.llm_engine)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_sampled_tokens_keep_their_distribution(smollm2_path, tokenizer, method):
    """Seeded requests at temperature 1 continuing a repeated phrase, so that drafts are proposed
    from the second token on (about half accepted): the distribution of the 2nd to 4th tokens with
    speculation matches the one without (chi-square over the tokens both runs saw 10+ times). Suffix
    decoding also proposes from the earlier requests' outputs."""
    prompt = tokenizer.encode("red green blue, red green blue, red green blue, red green blue, red",
                              add_special_tokens=False)
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True) for s in range(300)]
    runs = {}
    for name, spec in (("plain", None), ("spec", {"method": method, "num_speculative_tokens": 3})):
        llm = LLM(smollm2_path, **{**ENGINE, "max_num_seqs": 64}, kv_cache_memory_bytes=64 << 20,
                  speculative_config=spec)
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        runs[name] = [o.outputs[0].token_ids for o in outs]
        if spec is not None:
            stats = llm.llm_engine.engine_core.scheduler.spec_stats
            assert stats.num_drafts > 200
            assert 0.2 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.95
    for position in (1, 2, 3):
        a = np.bincount([ids[position] for ids in runs["plain"]], minlength=49152)
        b = np.bincount([ids[position] for ids in runs["spec"]], minlength=49152)
        common = (a >= 10) & (b >= 10)
        table = np.stack([np.append(a[common], a[~common].sum()), np.append(b[common], b[~common].sum())]).astype(float)
        table = table[:, table.sum(0) > 0]
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        chi2 = ((table - expected) ** 2 / expected).sum()
        dof = table.shape[1] - 1
        assert dof >= 1, "the pattern left no choice to sample"
        assert chi2 < dof + 5 * (2 * dof) ** 0.5, (position, chi2, dof)  # far above would mean bias


def test_metrics_count_drafts_and_acceptances():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry=registry, max_model_len=64)
    for drafts, accepted, per_pos in ((4, 3, [2, 1]), (10, 6, [4, 2])):
        logger.record(SchedulerStats(spec=SpecDecodeStats(drafts // 2, drafts, accepted, per_pos)), IterationStats())
    value = registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert value("pagellm:spec_decode_num_draft_tokens_total", labels) == 10
    assert value("pagellm:spec_decode_num_accepted_tokens_total", labels) == 6
    assert value("pagellm:spec_decode_num_drafts_total", labels) == 5
    assert value("pagellm:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": "1"}) == 2


def test_verification_graphs_pad_each_query_to_the_captured_length():
    """CPU-side layout of `DecodeGraphs` for verification steps (the replay itself needs CUDA)."""
    from pagellm.attention.backend import AttentionMetadata  # noqa: PLC0415
    from pagellm.worker.cuda_graphs import DecodeGraphs, padded_rows  # noqa: PLC0415

    assert padded_rows(np.array([0, 1, 4, 6]), 3).tolist() == [0, 3, 4, 5, 6, 7]
    graphs = DecodeGraphs(lambda *a: None, max_num_seqs=600, max_blocks_per_seq=4, device=torch.device("cpu"),
                          verify_len=5)
    assert graphs.verify_sizes[-1] * 5 <= 2048 < graphs.sizes[-1] * 5

    def md(query_lens: list[int]) -> AttentionMetadata:
        qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        return AttentionMetadata(int(qsl[-1]), None, None, None, None, max(query_lens), 0, qsl,
                                 np.array(query_lens, dtype=np.int32))

    assert graphs.fits(md([1] * 512)) and not graphs.fits(md([1] * 513))
    assert graphs.fits(md([5, 1, 3])) and not graphs.fits(md([6, 1]))
    assert not graphs.fits(md([2] * (graphs.verify_sizes[-1] + 1)))
    decode_only = DecodeGraphs(lambda *a: None, max_num_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    assert decode_only.fits(md([1, 1])) and not decode_only.fits(md([2, 1]))


@pytest.mark.slow
def test_engine_core_process_streams_several_tokens_a_step(smollm2_path, prompts):
    """Through AsyncLLM (the server's engine, core in its own process): the same greedy text as
    offline speculation, streamed in deltas, and the speculation counters in its stats."""
    import asyncio  # noqa: PLC0415

    from pagellm import EngineArgs  # noqa: PLC0415
    from pagellm.engine.async_llm import AsyncLLM  # noqa: PLC0415

    spec = {"method": "ngram", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0, max_tokens=40)
    offline = LLM(smollm2_path, **ENGINE, kv_cache_memory_bytes=32 << 20, speculative_config=spec)
    expected = offline.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0]
    llm = AsyncLLM.from_engine_args(EngineArgs(smollm2_path, **ENGINE, kv_cache_memory_bytes=32 << 20,
                                               speculative_config=spec))
    try:
        async def run():
            return [out async for out in llm.generate({"prompt_token_ids": prompts[0]}, params, "spec")]

        stream = asyncio.run(run())
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert stream[-1].outputs[0].token_ids == expected.token_ids
    assert len(stream) < len(expected.token_ids)  # some outputs brought several tokens
    assert stats.spec is not None and stats.spec.num_accepted_tokens > 0


# -- draft model ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def noisy_draft(hf_smollm2_model, tmp_path_factory) -> str:
    """SmolLM2 with Gaussian noise (0.15 of each matrix's std) in its layers' matrices, in bfloat16
    safetensors: a draft model that agrees with the target on about half of its drafts, so that
    both acceptance and rejection happen, at every draft position."""
    from safetensors.torch import save_file  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("noisy-smollm2")
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for name, tensor in hf_smollm2_model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embeddings
            continue
        if tensor.dim() == 2 and "embed" not in name:
            tensor = tensor + 0.15 * tensor.std() * torch.randn(tensor.shape, generator=generator)
        weights[name] = tensor.to(torch.bfloat16).contiguous()
    save_file(weights, str(folder / "model.safetensors"))
    config = hf_smollm2_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]  # (unset in a config read from GGUF)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_draft_model_greedy_output_is_token_identical(smollm2_path, noisy_draft, prompts, plain, k):
    """As with prompt lookup: chunked prefill (a 24-token budget, which also splits the draft's
    catch-up on the prompts), preemption (14 blocks, each holding both models' KV) and prefix
    caching; drafts accepted and rejected at every position."""
    llm = LLM(smollm2_path, **ENGINE, max_num_batched_tokens=24, num_gpu_blocks_override=14,
              enable_prefix_caching=k % 2 == 1, speculative_config={"model": noisy_draft, "num_speculative_tokens": k})
    got = run(llm, prompts, SamplingParams(temperature=0, max_tokens=40, logprobs=2))
    stats = llm.llm_engine.engine_core.scheduler.make_stats()
    assert [ids for ids, _ in got] == [ids for ids, _ in plain]
    for (_, spec_lps), (_, plain_lps) in zip(got, plain):
        assert len(spec_lps) == len(plain_lps)
        for a, b in zip(spec_lps, plain_lps):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert stats.num_preemptions > 0 or stats.prefix_cache_hits > 0
    spec = stats.spec
    assert 10 < spec.num_accepted_tokens < spec.num_draft_tokens  # both verdicts happen
    assert spec.accepted_per_position[-1] > 0
    assert_no_leak(llm.llm_engine)


@pytest.mark.slow
def test_draft_model_proposing_for_itself_is_always_accepted(smollm2_path, prompts, plain):
    """SmolLM2 drafting for itself (the same GGUF): its drafts are exactly the target's greedy
    tokens (the CPU kernels give the same results whatever the batch), so every draft is accepted,
    which fails if the draft's KV or positions are off by one anywhere; max_tokens is never
    overshot."""
    llm = LLM(smollm2_path, **ENGINE, kv_cache_memory_bytes=32 << 20,
              speculative_config={"model": smollm2_path, "num_speculative_tokens": 4})
    got = run(llm, prompts, SamplingParams(temperature=0, max_tokens=40))
    spec = llm.llm_engine.engine_core.scheduler.spec_stats
    assert [ids for ids, _ in got] == [ids for ids, _ in plain]
    assert spec.num_draft_tokens > 40 and spec.num_accepted_tokens == spec.num_draft_tokens
    for n in (1, 2, 7):
        out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == plain[0][0][:n] and out.finish_reason == "length"
    assert_no_leak(llm.llm_engine)


def test_draft_lookahead_never_takes_a_request_past_max_model_len():
    """The scheduler with draft-model speculation (k = 3) and a worker that accepts every draft
    and proposes k more each step: a request decoding to max_model_len (32 = 2 blocks of 16) never
    holds a third block (a wider block table than the CUDA graphs' would not fit them), every
    step's tokens fit, and the output stops exactly at the length."""
    from pagellm.core.outputs import ModelRunnerOutput  # noqa: PLC0415
    from pagellm.core.request import EngineCoreRequest  # noqa: PLC0415
    from pagellm.core.scheduler import Scheduler, SchedulerLimits  # noqa: PLC0415

    limits = SchedulerLimits(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=32, block_size=16,
                             num_blocks=8, enable_prefix_caching=True)
    scheduler = Scheduler(limits, speculative=SpeculativeConfig(3, method="draft_model", model="draft"))
    request = scheduler.add_request(EngineCoreRequest(
        request_id="r", prompt_token_ids=list(range(1, 21)),
        sampling_params=SamplingParams(max_tokens=100, ignore_eos=True), eos_token_ids=frozenset(), max_tokens=12))
    next_token = 100
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        assert len(scheduler.kv.get_block_ids("r")) <= 2
        assert request.num_computed_tokens <= limits.max_model_len
        drafts = so.scheduled_spec_tokens.get("r", [])
        sampled = [*drafts, next_token]  # every draft accepted, then one token of its own
        next_token += 1
        scheduler.update_from_output(ModelRunnerOutput(
            ["r"], [sampled], draft_token_ids={"r": list(range(next_token, next_token + 3))}))
        next_token += 3
    assert request.num_tokens == limits.max_model_len and request.status.finish_reason == "length"
    assert scheduler.spec_stats.num_accepted_tokens > 0


def test_draft_model_config_errors_name_the_flag(tmp_path):
    def tiny(name: str, vocab: int, positions: int = 256) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": positions}))
        return str(folder)

    target = tiny("target", 256)
    for spec, match in (({"model": tiny("other-vocab", 300)}, "share the target's tokenizer"),
                        ({"model": tiny("short", 256, positions=64)}, "lower --max-model-len"),
                        ({"model": str(tmp_path / "missing")}, "missing")):
        args = EngineArgs(target, load_format="dummy", device="cpu", max_model_len=128,
                          speculative_config={**spec, "num_speculative_tokens": 2})
        with pytest.raises(ValueError, match=r"speculative_config \(--speculative-config\) model") as e:
            args.create_engine_config()
        assert match in str(e.value)
    config = EngineArgs(target, load_format="dummy", device="cpu", max_model_len=128,
                        speculative_config={"model": tiny("draft", 256), "num_speculative_tokens": 2}
                        ).create_engine_config()
    assert config.draft.source.load_format == "dummy" and config.draft.source.arch.vocab_size == 256


def test_spec_stats_of_several_engines_add_up():
    total = SpecDecodeStats.total([SpecDecodeStats(1, 4, 3, [2, 1]), SpecDecodeStats(2, 6, 1, [1, 0])])
    assert total == SpecDecodeStats(3, 10, 4, [3, 1]) and SpecDecodeStats.total([]) is None
