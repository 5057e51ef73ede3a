"""The unified token-budget scheduler, driven like the engine with a fake worker (pure Python).

The fake worker keeps its own state from the diff-based SchedulerOutput (new requests, cached
request deltas, freed ids), exactly as a real worker must, and samples a token that is a pure
function of the request's token history. So any scheduling (chunking, batching, preemption and
recomputation) must give the same tokens as running the request alone.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest

from pagellm.core.kv_cache_groups import window_blocks
from pagellm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagellm.core.request import EngineCoreRequest, Request, RequestStatus
from pagellm.core.scheduler import Scheduler, SchedulerLimits
from pagellm.sampling_params import SamplingParams

EOS = 2


def next_token(history: list[int], num_prompt_tokens: int) -> int:
    """Deterministic 'model': depends on the whole history; never EOS (all values >= 10)."""
    acc = 17
    for t in history:
        acc = (acc * 1_000_003 + t) % 998_244_353
    return 10 + acc % 5000


def make_record(rid: str, prompt, max_tokens: int = 8, **sp) -> EngineCoreRequest:
    sp.setdefault("max_tokens", max_tokens)
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(**sp),
                             eos_token_ids=frozenset({EOS}), max_tokens=max_tokens)


def reference(prompt: list[int], max_tokens: int, fn=next_token) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fn(tokens, len(prompt)))
    return tokens[len(prompt):]


@dataclass
class WorkerState:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_ids: list[list[int]]
    """Per KV cache group."""


@dataclass
class FakeWorker:
    fn: object = next_token
    reqs: dict[str, WorkerState] = field(default_factory=dict)

    def execute(self, sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.freed_req_ids:
            assert rid in self.reqs, f"freed {rid!r} that the worker never saw"
            del self.reqs[rid]
        for nr in out.scheduled_new_reqs:
            assert nr.req_id not in self.reqs, f"{nr.req_id!r} sent as new twice"
            self.reqs[nr.req_id] = WorkerState(
                [*nr.record.prompt_token_ids, *nr.output_token_ids], len(nr.record.prompt_token_ids),
                nr.num_computed_tokens, [list(ids) for ids in nr.block_ids])
        for cr in out.scheduled_cached_reqs:
            st = self.reqs[cr.req_id]
            assert st.num_computed == cr.num_computed_tokens
            for table, ids in zip(st.block_ids, cr.new_block_ids, strict=True):
                table += ids
        # A request the worker holds comes again only when more than its progress changed (new
        # blocks); the worker advances the others by their scheduled tokens (checked below).
        assert {cr.req_id for cr in out.scheduled_cached_reqs} <= set(out.num_scheduled_tokens)
        assert all(rid in self.reqs for rid in out.num_scheduled_tokens)
        assert all(any(cr.new_block_ids) for cr in out.scheduled_cached_reqs)
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            assert n > 0
            st = self.reqs[rid]
            # The worker's block tables are the scheduler's where it still holds the blocks (a sliding
            # window gave the others back, unread), and hold every token to be computed.
            size = sched.limits.block_size
            for table, held, window in zip(st.block_ids, sched.kv.req_to_blocks[rid], sched.limits.sliding_windows,
                                           strict=True):
                assert len(table) == len(held)
                assert [i for i, b in zip(table, held) if b is not None] == [b.block_id for b in held if b is not None]
                # Every block the step's queries read is held: all, or from the first one's window on.
                first = 0 if window is None else max(st.num_computed - window + 1, 0) // size
                assert None not in held[first:-(-(st.num_computed + n) // size)]
            st.num_computed += n
            assert st.num_computed <= len(st.token_ids)
            assert len(st.block_ids[0]) * sched.limits.block_size >= st.num_computed
            req = sched.requests[rid]
            assert req.num_computed_tokens == st.num_computed
            assert st.token_ids == req.all_token_ids
            if st.num_computed == len(st.token_ids):
                tok = self.fn(st.token_ids, st.num_prompt_tokens)
                st.token_ids.append(tok)
                req_ids.append(rid)
                sampled.append(tok)
        # Sampled exactly the requests whose prefill (or decode) reached the end of their tokens.
        assert set(req_ids) == {rid for rid in out.num_scheduled_tokens
                                if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens}
        return ModelRunnerOutput(req_ids, [[t] for t in sampled])


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class Driver:
    def __init__(self, limits: SchedulerLimits, fn=next_token) -> None:
        self.s = Scheduler(limits)
        self.w = FakeWorker(fn)
        self.results: dict[str, Result] = {}
        self.steps: list[SchedulerOutput] = []
        self.preempted: list[tuple[int, str]] = []  # (step index, req id)
        self.admitted: list[str] = []

    def add(self, rid: str, prompt, max_tokens: int = 8, **sp) -> Request:
        req = self.s.add_request(make_record(rid, prompt, max_tokens, **sp))
        self.results[rid] = Result()
        return req

    def step(self) -> SchedulerOutput:
        s, lim = self.s, self.s.limits
        out = s.schedule()
        self.steps.append(out)
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert out.total_num_scheduled_tokens <= lim.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= lim.max_num_seqs
        assert len(s.running) <= lim.max_num_seqs
        for rid in out.freed_req_ids:
            if rid in s.requests:  # still alive: it was preempted
                self.preempted.append((len(self.steps) - 1, rid))
        self.admitted += [nr.req_id for nr in out.scheduled_new_reqs]
        mro = self.w.execute(s, out)
        for eco in s.update_from_output(mro):
            r = self.results[eco.req_id]
            assert r.finish_reason is None, "output after finishing"
            r.tokens += eco.new_token_ids
            r.finish_reason, r.stop_reason = eco.finish_reason, eco.stop_reason
            r.num_cached_tokens = eco.num_cached_tokens
        return out

    def run(self, max_steps: int = 2000) -> dict[str, Result]:
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests():
                break
            self.step()
        assert not self.s.has_unfinished_requests(), "did not finish"
        # One more step delivers the last freed ids to the worker.
        out = self.s.schedule()
        self.w.execute(self.s, out)
        assert out.is_empty
        assert self.w.reqs == {}, "worker still holds requests the scheduler finished"
        assert_drained(self.s)
        return self.results


def assert_drained(s: Scheduler) -> None:
    assert not s.running and not s.waiting and not s.requests
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
    assert s.make_stats().kv_cache_usage == 0.0
    assert s.kv.usage == 0.0


def limits(**kw) -> SchedulerLimits:
    base = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=4, num_blocks=256,
                enable_prefix_caching=True)
    base.update(kw)
    # By default as long as the pool allows: a longer max_model_len is refused at construction.
    base.setdefault("max_model_len", min(256, base["num_blocks"] * base["block_size"]))
    return SchedulerLimits(**base)


def prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 900 for i in range(n)]


# -- budget, batching, ordering ------------------------------------------------------------------

@pytest.mark.parametrize("caching", [True, False])
def test_budget_and_max_num_seqs_respected_and_outputs_match_reference(caching):
    d = Driver(limits(max_num_batched_tokens=16, max_num_seqs=3, enable_prefix_caching=caching))
    specs = {f"r{i}": (prompt(i, 3 + 7 * i), 2 + i) for i in range(7)}
    for rid, (p, mt) in specs.items():
        d.add(rid, p, max_tokens=mt)
    res = d.run()
    for rid, (p, mt) in specs.items():
        assert res[rid].tokens == reference(p, mt)
        assert res[rid].finish_reason == "length"
    # The budget is used: some step filled it exactly.
    assert max(o.total_num_scheduled_tokens for o in d.steps) == 16
    stats = d.s.make_stats()
    assert stats.num_generation_tokens == sum(mt for _, mt in specs.values())
    assert stats.num_scheduled_tokens_total == sum(o.total_num_scheduled_tokens for o in d.steps)
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


def test_max_num_seqs_caps_running_and_admission_is_fcfs():
    d = Driver(limits(max_num_seqs=2))
    for i in range(5):
        d.add(f"r{i}", prompt(i, 5), max_tokens=3)
    out = d.step()
    assert [nr.req_id for nr in out.scheduled_new_reqs] == ["r0", "r1"]
    assert [r.request_id for r in d.s.waiting] == ["r2", "r3", "r4"]
    d.run()
    assert d.admitted == ["r0", "r1", "r2", "r3", "r4"]


def test_running_requests_are_scheduled_before_waiting_ones():
    d = Driver(limits(max_num_batched_tokens=8))
    d.add("a", prompt(1, 5), max_tokens=10)
    d.add("b", prompt(2, 5), max_tokens=10)
    out = d.step()  # a: 5 tokens, b: first 3 (chunked)
    assert out.num_scheduled_tokens == {"a": 5, "b": 3}
    d.add("c", prompt(3, 30), max_tokens=2)
    out = d.step()
    # Running first, in admission order (a decodes 1, b continues its prefill), then c.
    assert list(out.num_scheduled_tokens) == ["a", "b", "c"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 2, "c": 5}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["c"]
    # A waiting request never takes the budget a running request needs.
    d.add("z", prompt(4, 50), max_tokens=1)
    out = d.step()
    assert out.num_scheduled_tokens["a"] == 1 and out.num_scheduled_tokens["b"] == 1
    d.run()


def test_chunked_prefill_mixes_with_decodes():
    d = Driver(limits(max_num_batched_tokens=8))
    d.add("a", prompt(1, 3), max_tokens=20)
    d.add("b", prompt(2, 2), max_tokens=20)
    d.step()  # both prefills in one step
    long_prompt = prompt(9, 40)
    d.add("long", long_prompt, max_tokens=2)
    long_req = d.s.requests["long"]
    chunks = []
    while long_req.num_computed_tokens < len(long_prompt):
        n_a = len(d.results["a"].tokens)
        n_b = len(d.results["b"].tokens)
        out = d.step()
        # Each step: one decode token for each of a and b, the rest of the budget to the prompt.
        assert out.num_scheduled_tokens["a"] == 1 and out.num_scheduled_tokens["b"] == 1
        assert len(d.results["a"].tokens) == n_a + 1 and len(d.results["b"].tokens) == n_b + 1
        chunks.append(out.num_scheduled_tokens["long"])
        if long_req.num_computed_tokens < len(long_prompt):
            assert d.results["long"].tokens == [], "no token before the prefill completes"
        assert out.total_num_scheduled_tokens <= 8
    assert sum(chunks) == 40
    assert len(chunks) == 7  # 6 tokens per step: 6 * 6 + 4
    assert all(c == 6 for c in chunks[:-1])
    assert len(d.results["long"].tokens) == 1, "the step completing the prefill samples a token"
    res = d.run()
    assert res["long"].tokens == reference(long_prompt, 2)
    assert res["a"].tokens == reference(prompt(1, 3), 20)


def test_fcfs_head_of_line_when_blocks_are_short():
    # The head of the waiting queue doesn't fit; a smaller request behind it must not jump ahead.
    d = Driver(limits(num_blocks=6, max_num_batched_tokens=64, enable_prefix_caching=False))
    d.add("a", prompt(1, 16), max_tokens=2)   # 4 blocks (+1 for its sampled token)
    d.step()
    d.add("big", prompt(2, 12), max_tokens=1)  # needs 3 blocks, 2 free
    d.add("small", prompt(3, 2), max_tokens=1)  # would fit
    out = d.step()
    assert "big" not in out.num_scheduled_tokens and "small" not in out.num_scheduled_tokens
    d.run()
    assert d.admitted == ["a", "big", "small"]


# -- preemption ----------------------------------------------------------------------------------

@pytest.mark.parametrize("caching", [True, False])
def test_preemption_picks_latest_admitted_and_recomputes_same_tokens(caching):
    # 8 blocks of 4 tokens. Three requests of 8-token prompts, 12 tokens each to generate: each
    # wants up to 5 blocks, so decoding runs out of blocks and must preempt.
    d = Driver(limits(num_blocks=8, block_size=4, max_num_batched_tokens=64,
                      enable_prefix_caching=caching))
    specs = {rid: (prompt(i, 8), 12) for i, rid in enumerate(["a", "b", "c"])}
    for rid, (p, mt) in specs.items():
        d.add(rid, p, max_tokens=mt)
    d.step()
    assert d.admitted == ["a", "b", "c"]

    # Step until the first preemption and inspect the scheduler right after it.
    while not d.preempted:
        running_before = [r.request_id for r in d.s.running]
        out = d.step()
    step_idx, victim = d.preempted[0]
    assert victim == running_before[-1] == "c", "the most recently admitted request goes first"
    assert victim in out.freed_req_ids
    assert victim not in out.num_scheduled_tokens
    assert not out.scheduled_new_reqs, "no admission in the step that preempted"
    assert "a" in out.num_scheduled_tokens and "b" in out.num_scheduled_tokens
    req = d.s.requests[victim]
    assert d.s.waiting[0] is req
    assert req.status == RequestStatus.PREEMPTED
    assert req.num_computed_tokens == 0
    assert req.num_preemptions == 1
    assert d.s.kv.get_block_ids(victim) == ([],)
    assert d.s.make_stats().num_preemptions >= 1

    res = d.run()
    for rid, (p, mt) in specs.items():
        assert res[rid].tokens == reference(p, mt), rid
        assert res[rid].finish_reason == "length"
    # A preempted request restarts as a new request carrying its generated tokens.
    resent = [nr for o in d.steps[step_idx + 1:] for nr in o.scheduled_new_reqs if nr.req_id == victim]
    assert resent, "the preempted request was never rescheduled"
    assert resent[0].record.prompt_token_ids == specs[victim][0]
    assert resent[0].output_token_ids


def test_preempted_request_goes_back_in_front_of_waiting():
    d = Driver(limits(num_blocks=6, block_size=4, max_num_seqs=2, enable_prefix_caching=False))
    d.add("a", prompt(1, 8), max_tokens=10)
    d.add("b", prompt(2, 8), max_tokens=10)
    d.add("c", prompt(3, 4), max_tokens=1)  # waits: max_num_seqs=2
    d.step()
    while not d.preempted:
        d.step()
    _, victim = d.preempted[0]
    assert victim == "b"
    assert [r.request_id for r in d.s.waiting] == ["b", "c"]
    res = d.run()
    assert res["b"].tokens == reference(prompt(2, 8), 10)
    assert d.admitted.index("c") > [i for i, r in enumerate(d.admitted) if r == "b"][1], (
        "the preempted request is readmitted before later arrivals")


def test_two_requests_contending_for_blocks_both_complete():
    # Together they need more blocks than exist: the earlier one keeps its place, the later one
    # (here preempting itself, being last in the running list) goes and is recomputed.
    d = Driver(limits(num_blocks=4, block_size=4, max_num_batched_tokens=64,
                      enable_prefix_caching=True))
    d.add("a", prompt(1, 7), max_tokens=6)   # up to 12 tokens -> 3 blocks
    d.add("b", prompt(2, 4), max_tokens=4)   # up to 7 tokens -> 2 blocks
    res = d.run()
    assert res["a"].tokens == reference(prompt(1, 7), 6)
    assert res["b"].tokens == reference(prompt(2, 4), 4)
    assert [rid for _, rid in d.preempted][0] == "b"


# -- stop conditions -----------------------------------------------------------------------------

def scripted(tokens_after_prompt: list[int]):
    """A model whose i-th output token is tokens_after_prompt[i] (then continues with next_token)."""
    def fn(history, num_prompt_tokens):
        i = len(history) - num_prompt_tokens
        return tokens_after_prompt[i] if i < len(tokens_after_prompt) else next_token(history, 0)
    return fn


def test_stop_on_eos():
    d = Driver(limits(), fn=scripted([11, 12, EOS, 13, 14]))
    d.add("r", prompt(1, 5), max_tokens=10)
    res = d.run()["r"]
    assert res.tokens == [11, 12, EOS]
    assert res.finish_reason == "stop"
    assert res.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    d = Driver(limits(), fn=scripted([11, EOS, 12, EOS, 13]))
    d.add("r", prompt(1, 5), max_tokens=5, ignore_eos=True)
    res = d.run()["r"]
    assert res.tokens == [11, EOS, 12, EOS, 13]
    assert res.finish_reason == "length"


def test_stop_token_ids():
    d = Driver(limits(), fn=scripted([11, 12, 77, 13]))
    d.add("r", prompt(1, 5), max_tokens=10, stop_token_ids=[99, 77])
    res = d.run()["r"]
    assert res.tokens == [11, 12, 77]
    assert res.finish_reason == "stop"
    assert res.stop_reason == 77


def test_stop_token_ids_apply_even_with_ignore_eos():
    d = Driver(limits(), fn=scripted([EOS, 77, 13]))
    d.add("r", prompt(1, 5), max_tokens=10, stop_token_ids=[77], ignore_eos=True)
    res = d.run()["r"]
    assert res.tokens == [EOS, 77]
    assert res.stop_reason == 77


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_stop_on_max_tokens(max_tokens):
    d = Driver(limits())
    d.add("r", prompt(1, 5), max_tokens=max_tokens)
    res = d.run()["r"]
    assert res.tokens == reference(prompt(1, 5), max_tokens)
    assert len(res.tokens) == max_tokens
    assert res.finish_reason == "length"
    assert res.stop_reason is None


def test_stop_on_max_model_len():
    d = Driver(limits(max_model_len=14))
    req = d.add("r", prompt(1, 10), max_tokens=100)
    res = d.run()["r"]
    assert len(res.tokens) == 4
    assert req.num_tokens == 14
    assert res.finish_reason == "length"


# -- aborts --------------------------------------------------------------------------------------

def test_abort_waiting_request_never_seen_by_workers():
    d = Driver(limits(max_num_seqs=1))
    d.add("a", prompt(1, 5), max_tokens=4)
    d.add("b", prompt(2, 5), max_tokens=4)
    d.step()
    assert [r.request_id for r in d.s.waiting] == ["b"]
    ended = d.s.finish_requests(["b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in ended] == ["b"]
    assert ended[0].status == RequestStatus.FINISHED_ABORTED
    assert ended[0].status.finish_reason == "abort"
    assert "b" not in d.s.requests and not d.s.waiting
    out = d.step()
    assert "b" not in out.freed_req_ids
    d.run()
    assert all("b" not in o.freed_req_ids for o in d.steps)


def test_abort_running_request_frees_blocks_and_tells_workers():
    d = Driver(limits())
    d.add("a", prompt(1, 9), max_tokens=10)
    d.add("b", prompt(2, 9), max_tokens=10)
    d.step()
    d.step()
    free_before = d.s.kv.pool.num_free_blocks
    held = len(d.s.kv.get_block_ids("b")[0])
    assert held > 0
    d.s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert d.s.kv.pool.num_free_blocks == free_before + held
    assert d.s.kv.get_block_ids("b") == ([],)
    assert [r.request_id for r in d.s.running] == ["a"]
    out = d.step()
    assert out.freed_req_ids == {"b"}
    assert "b" not in d.w.reqs
    out = d.step()
    assert "b" not in out.freed_req_ids, "reported once"
    d.run()


def test_abort_while_step_in_flight_drops_its_token():
    d = Driver(limits())
    d.add("a", prompt(1, 5), max_tokens=5)
    out = d.s.schedule()
    mro = d.w.execute(d.s, out)
    assert mro.req_ids == ["a"]
    d.s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert d.s.update_from_output(mro) == []
    out = d.s.schedule()
    assert out.freed_req_ids == {"a"} and out.is_empty
    d.w.execute(d.s, out)
    assert d.w.reqs == {}
    assert_drained(d.s)


def test_abort_preempted_request_is_not_reported_twice():
    d = Driver(limits(num_blocks=6, block_size=4, enable_prefix_caching=False))
    d.add("a", prompt(1, 8), max_tokens=12)
    d.add("b", prompt(2, 8), max_tokens=12)
    while not d.preempted:
        d.step()
    _, victim = d.preempted[0]
    d.s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
    out = d.step()
    assert victim not in out.freed_req_ids
    d.run()


def test_duplicate_request_id_rejected():
    d = Driver(limits())
    d.add("x", prompt(1, 5))
    with pytest.raises(ValueError, match="x"):
        d.add("x", prompt(2, 5))
    d.step()
    with pytest.raises(ValueError):
        d.add("x", prompt(3, 5))
    d.run()


# -- prefix caching through the scheduler --------------------------------------------------------

def test_shared_prefix_gives_hits_and_same_outputs():
    shared = prompt(5, 32)
    d = Driver(limits(max_num_batched_tokens=128))
    d.add("first", shared + [7], max_tokens=3)
    d.run()
    specs = {f"r{i}": shared + prompt(10 + i, 3 + i) for i in range(3)}
    for rid, p in specs.items():
        d.add(rid, p, max_tokens=4)
    res = d.run()
    stats = d.s.make_stats()
    assert stats.prefix_cache_hits >= 3 * 32
    assert stats.prefix_cache_queries >= 33 + sum(len(p) for p in specs.values())
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries
    for rid, p in specs.items():
        assert res[rid].tokens == reference(p, 4)
        assert res[rid].num_cached_tokens == 32
    assert res["first"].num_cached_tokens == 0


def test_identical_prompts_in_one_step_share_blocks():
    shared = prompt(5, 17)
    d = Driver(limits(max_num_batched_tokens=128))
    d.add("a", shared, max_tokens=2)
    d.add("b", shared, max_tokens=2)
    out = d.step()
    # b is admitted in the same step and hits a's 4 full blocks (registered at allocation).
    assert out.num_scheduled_tokens == {"a": 17, "b": 1}
    assert d.s.kv.get_block_ids("a")[0][:4] == d.s.kv.get_block_ids("b")[0][:4]
    res = d.run()
    assert res["a"].tokens == res["b"].tokens == reference(shared, 2)


def test_prefix_stats_not_inflated_by_blocked_admission_retries():
    # A request that waits for blocks for several steps is one prefix-cache query, not one per
    # step it was looked at. (Counting every retry makes the hit rate meaningless under load.)
    d = Driver(limits(num_blocks=5, block_size=4, max_num_seqs=8))
    d.add("a", prompt(1, 16), max_tokens=4)  # holds 4-5 blocks for a few steps
    d.step()
    d.add("b", prompt(2, 8), max_tokens=1)
    d.run()
    assert d.s.make_stats().prefix_cache_queries == 16 + 8


# -- configuration -------------------------------------------------------------------------------

def test_request_that_can_never_fit_is_refused_not_spun_forever():
    # 4 blocks of 4 tokens hold 16 tokens; max_model_len claims 64. A 20-token prompt can never
    # be scheduled: the scheduler must say so (ValueError at limits construction or add_request)
    # instead of keeping has_unfinished_requests() true forever.
    with pytest.raises(ValueError):
        d = Driver(limits(num_blocks=4, block_size=4, max_model_len=64, max_num_batched_tokens=8))
        d.add("r", prompt(1, 20), max_tokens=4)
        for _ in range(200):
            if not d.s.has_unfinished_requests():
                break
            d.step()


@pytest.mark.parametrize("caching", [True, False])
def test_sliding_window_groups_give_blocks_back_and_keep_the_outputs(caching):
    """A full-attention group and two of a 10-token window, under chunked prefill, shared prefixes
    and preemption: the same tokens as alone; a decoding request's windowed groups hold at most
    what the window reaches (the fake worker checks that they hold all of it), fewer than the full one."""
    d = Driver(limits(max_num_batched_tokens=16, max_num_seqs=4, num_blocks=70, max_model_len=96,
                      sliding_windows=(None, 10, 10), enable_prefix_caching=caching))
    shared = prompt(7, 30)
    specs = {f"r{i}": (shared[:12 + 6 * i] + prompt(i, 3 + 5 * i), 30 + i) for i in range(6)}
    for rid, (p, mt) in specs.items():
        d.add(rid, p, max_tokens=mt)
    fewer = False
    for _ in range(2000):
        if not d.s.has_unfinished_requests():
            break
        out = d.step()
        for rid in d.s.kv.req_to_blocks:
            full, *sliding = d.s.kv.num_blocks_held(rid)
            request = d.s.requests[rid]
            if out.num_scheduled_tokens.get(rid) == 1 and request.num_computed_tokens > request.num_prompt_tokens + 1:
                assert all(n <= window_blocks(10, 4) for n in sliding)
                fewer = fewer or max(sliding) < full
    res = d.run()
    for rid, (p, mt) in specs.items():
        assert res[rid].tokens == reference(p, mt)
    assert fewer and d.s.num_preemptions > 0
    if caching:
        assert d.s.kv.prefix_stats.hits > 0


def test_overlapped_schedule_decodes_from_a_placeholder():
    # schedule() for step N+1 may run before step N's tokens are known (async scheduling): a
    # request that samples at step N is scheduled again with that token as a placeholder input.
    s = Scheduler(limits(num_blocks=4, block_size=4))
    s.add_request(make_record("c", prompt(1, 4), max_tokens=3))
    out1 = s.schedule()
    out2 = s.schedule()                      # before step 1's token is known
    assert out1.num_scheduled_tokens == {"c": 4} and out2.num_scheduled_tokens == {"c": 1}
    c = s.requests["c"]
    assert c.num_output_placeholders == 2 and c.num_computed_tokens == 5
    s.update_from_output(ModelRunnerOutput(["c"], [[50]]))
    assert s.schedule().num_scheduled_tokens == {"c": 1}   # samples the third and last token
    assert s.schedule().num_scheduled_tokens == {}         # two in flight reach max_tokens
    s.update_from_output(ModelRunnerOutput(["c"], [[51]]))
    assert s.update_from_output(ModelRunnerOutput(["c"], [[52]]))[0].finish_reason == "length"
    assert c.output_token_ids == [50, 51, 52]
    assert_drained(s)


def test_late_output_for_request_preempted_by_overlapped_schedule():
    # Pipelined (schedule N+1 before update N), a request can be preempted while a token sampled
    # for it is still in flight: that token is dropped and sampled again after recomputation.
    s = Scheduler(limits(num_blocks=2, block_size=4))
    s.add_request(make_record("c", prompt(1, 4), max_tokens=5))
    s.add_request(make_record("b", prompt(2, 1), max_tokens=2))
    out1 = s.schedule()                      # c's prefill fills block 1, b's takes block 2
    assert out1.num_scheduled_tokens == {"c": 4, "b": 1}
    out2 = s.schedule()                      # c's placeholder decode needs a 3rd block: b is preempted
    assert out2.num_scheduled_tokens == {"c": 1} and "b" in out2.freed_req_ids
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 0
    s.update_from_output(ModelRunnerOutput(["c", "b"], [[50], [51]]))   # b's token arrives late
    assert b.output_token_ids == [] and s.requests["c"].output_token_ids == [50]
    s.finish_requests(list(s.requests), RequestStatus.FINISHED_ABORTED)
    assert_drained(s)


def test_pipeline_batches_wait_for_tokens_and_carry_them_to_the_workers():
    # Several pipeline stages: batches are scheduled while earlier ones are in flight, a request
    # is not scheduled again before its token is back, and workers (which never see samples)
    # learn each token from the scheduler output. Chunked prompts go on in the next batch.
    s = Scheduler(limits(max_num_batched_tokens=12), workers_see_samples=False)
    lengths = {"a": 20, "b": 7, "c": 3}
    for rid, n in lengths.items():
        s.add_request(make_record(rid, prompt(len(rid) + n, n), max_tokens=5))
    worker: dict[str, list[int]] = {}
    in_flight: deque[tuple[set[str], ModelRunnerOutput]] = deque()  # (scheduled ids, output)
    chunked_while_in_flight = False
    while s.has_unfinished_requests() or in_flight:
        out = s.schedule()
        for new in out.scheduled_new_reqs:
            worker[new.req_id] = [*new.record.prompt_token_ids, *new.output_token_ids]
        for cached in out.scheduled_cached_reqs:
            tokens, num_prompt = worker[cached.req_id], lengths[cached.req_id]
            for scheduled, output in in_flight:
                assert cached.req_id not in output.req_ids, "scheduled while its token was in flight"
                chunked_while_in_flight |= cached.req_id in scheduled
            tokens[max(cached.num_computed_tokens, num_prompt):] = cached.new_token_ids
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            if s.requests[rid].num_computed_tokens == len(worker[rid]):  # reached the end: samples
                sampled[rid] = next_token(worker[rid], lengths[rid])
        if not out.is_empty:
            in_flight.append((set(out.num_scheduled_tokens),
                              ModelRunnerOutput(list(sampled), [[t] for t in sampled.values()])))
        if len(in_flight) == 2 or (out.is_empty and in_flight):
            s.update_from_output(in_flight.popleft()[1])
    assert chunked_while_in_flight
    for rid, n in lengths.items():
        assert worker[rid][n:n + 4] == reference(prompt(len(rid) + n, n), 4)
    assert_drained(s)


@pytest.mark.parametrize("caching", [True, False])
def test_a_decoding_request_reaches_the_worker_only_when_it_needs_a_block(caching):
    d = Driver(limits(enable_prefix_caching=caching))  # blocks of 4 tokens
    d.add("a", prompt(1, 6), max_tokens=9)
    d.step()  # 6 prompt tokens in 2 blocks, the first token sampled
    sent = []
    while d.s.has_unfinished_requests():
        request = d.s.requests["a"]
        computed = request.num_computed_tokens
        out = d.step()
        if out.scheduled_cached_reqs:
            assert [c.req_id for c in out.scheduled_cached_reqs] == ["a"]
            sent.append(computed)
    # Decoding position 8 is the first past its 2 blocks, then 12: a new block each time; the
    # steps in between change nothing on the worker but its progress.
    assert sent == [8, 12]
