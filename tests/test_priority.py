"""Priority scheduling (`--scheduling-policy priority`, vLLM's): admission by (priority, arrival),
preemption of the lowest priority first, and a waiting request of a higher priority preempting a
running one of a lower priority; at the scheduler (fake worker), through `LLM` and over HTTP."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import msgspec
import openai
import pytest
from engine_utils import TINY_LLAMA, assert_no_leak, wait_for
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from test_scheduler import Driver, Result, limits, make_record, prompt, reference

from pagellm import LLM, SamplingParams
from pagellm.core.outputs import SchedulerStats
from pagellm.core.request import RequestStatus
from pagellm.core.request_queue import PriorityRequestQueue
from pagellm.core.scheduler import Scheduler
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.admission import Admission, Work
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.metrics.stats import IterationStats
from pagellm.sampling_params import StructuredOutputsParams


def driver(policy: str, **kw) -> Driver:
    d = Driver(limits(**kw))
    d.s = Scheduler(d.s.limits, policy=policy)
    return d


def add(d: Driver, rid: str, priority: int, prompt_ids: list[int], max_tokens: int = 8,
        arrival_time: float | None = None) -> None:
    record = make_record(rid, prompt_ids, max_tokens)
    changes = {"priority": priority} | ({} if arrival_time is None else {"arrival_time": arrival_time})
    d.s.add_request(msgspec.structs.replace(record, **changes))
    d.results[rid] = Result()


def finish_steps(d: Driver) -> dict[str, int]:
    """Run to the end; the step at which each request finished."""
    finished: dict[str, int] = {}
    step = 0
    while d.s.has_unfinished_requests():
        d.step()
        for rid, r in d.results.items():
            if r.finish_reason is not None and rid not in finished:
                finished[rid] = step
        step += 1
    return finished


# -- the scheduler ---------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_high_priority_request_behind_32_low_ones_starts_and_finishes_first(policy):
    d = driver(policy, max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(32):
        add(d, f"low{i}", 1, prompt(i, 6))
    add(d, "high", 0, prompt(99, 6))
    first = d.step()
    finished = finish_steps(d)
    for rid, r in d.results.items():
        seed = 99 if rid == "high" else int(rid[3:])
        assert r.tokens == reference(prompt(seed, 6), 8), rid
    lows = [finished[f"low{i}"] for i in range(32)]
    if policy == "priority":
        assert first.scheduled_new_reqs[0].req_id == "high"
        assert finished["high"] <= min(lows)
        assert sum(step > finished["high"] for step in lows) == 32 - 3, "only the 3 admitted beside it end with it"
    else:  # the control: first come, first served runs it last
        assert "high" not in [nr.req_id for nr in first.scheduled_new_reqs]
        assert finished["high"] >= max(lows)


def test_equal_priorities_keep_arrival_order():
    d = driver("priority", max_num_seqs=1)
    # Added out of arrival order: the record's arrival_time decides among equals, not the call order.
    for rid, priority, arrival in (("c", 2, 3.0), ("a", 2, 1.0), ("x", 0, 9.0), ("b", 2, 2.0), ("y", 0, 8.0),
                                   ("z", 7, 0.0)):
        add(d, rid, priority, prompt(ord(rid), 5), max_tokens=2, arrival_time=arrival)
    finish_steps(d)
    assert d.admitted == ["y", "x", "a", "b", "c", "z"]


def test_fcfs_ignores_priorities():
    d = driver("fcfs", max_num_seqs=1)
    for i, priority in enumerate((5, 0, 3)):
        add(d, f"r{i}", priority, prompt(i, 5), max_tokens=2)
    finish_steps(d)
    assert d.admitted == ["r0", "r1", "r2"]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_under_memory_pressure_the_lowest_priority_is_preempted(policy):
    """`low` runs first, alone; `high` is admitted after it. Blocks then run out: the priority policy
    preempts `low` (the lowest priority), fcfs the most recently admitted (`high`)."""
    d = driver(policy, num_blocks=8, block_size=4, max_num_batched_tokens=16)
    add(d, "low", 5, prompt(1, 12), max_tokens=16)
    d.step()
    add(d, "high", 0, prompt(2, 8), max_tokens=12)
    finish_steps(d)
    assert d.results["low"].tokens == reference(prompt(1, 12), 16)
    assert d.results["high"].tokens == reference(prompt(2, 8), 12)
    victims = {rid for _, rid in d.preempted}
    assert victims == ({"low"} if policy == "priority" else {"high"})


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_waiting_high_priority_request_preempts_a_lower_running_one(policy):
    d = driver(policy, num_blocks=8, block_size=4, max_num_batched_tokens=32)
    add(d, "low", 5, prompt(1, 20), max_tokens=8)
    for _ in range(3):
        d.step()
    assert d.s.kv.pool.num_free_blocks < 3
    add(d, "peer", 5, prompt(3, 12), max_tokens=4)  # the same priority: never preempts
    add(d, "high", 0, prompt(2, 12), max_tokens=4)
    out = d.step()
    if policy == "priority":
        assert [nr.req_id for nr in out.scheduled_new_reqs] == ["high"]
        assert "low" in out.freed_req_ids and "low" not in out.num_scheduled_tokens
        assert d.s.requests["low"].status == RequestStatus.PREEMPTED
    else:
        assert not out.scheduled_new_reqs and not d.preempted
    finished = finish_steps(d)
    for rid, seed, n, mt in (("low", 1, 20, 8), ("peer", 3, 12, 4), ("high", 2, 12, 4)):
        assert d.results[rid].tokens == reference(prompt(seed, n), mt), rid
    if policy == "priority":
        assert finished["high"] < finished["low"] and {rid for _, rid in d.preempted} == {"low"}
        assert d.admitted.index("peer") > d.admitted.index("low", 1), "the peer waits behind its elder"


@dataclass
class CompilingGrammar:
    """A grammar that compiles until `compiled` is set, then constrains nothing (no bitmask)."""

    compiled: bool = False
    active: bool = False

    def ready(self) -> bool:
        return self.compiled

    def accept(self, token_id: int) -> bool:
        return False

    def cancel(self) -> None:
        pass


@dataclass
class CompilingGrammars:
    started: list[CompilingGrammar] = field(default_factory=list)

    def start(self, params, prompt_token_ids, eos_token_ids) -> CompilingGrammar:
        self.started.append(CompilingGrammar())
        return self.started[-1]

    def wait(self, timeout_s: float) -> None:
        pass


def test_a_high_priority_request_whose_grammar_compiles_lets_others_go_then_comes_first():
    grammars = CompilingGrammars()
    d = Driver(limits(max_num_seqs=1))
    d.s = Scheduler(d.s.limits, grammars=grammars, policy="priority")
    record = make_record("high", prompt(0, 5), max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    d.s.add_request(msgspec.structs.replace(record, priority=0))
    d.results["high"] = Result()
    for i in range(3):
        add(d, f"low{i}", 1, prompt(i + 1, 5), max_tokens=2)
    d.step()
    assert d.admitted == ["low0"], "the compiling request lets the next one go"
    assert [r.request_id for r in d.s.waiting] == ["high", "low1", "low2"], "and keeps its place"
    grammars.started[0].compiled = True
    finish_steps(d)
    assert d.admitted == ["low0", "high", "low1", "low2"]


def test_aborting_a_waiting_request_takes_it_out_of_the_queue():
    d = driver("priority", max_num_seqs=1)
    for rid, priority in (("a", 1), ("b", 0), ("c", 1), ("d", 2)):
        add(d, rid, priority, prompt(ord(rid), 5), max_tokens=2)
    d.step()
    assert d.s.make_stats().num_waiting_by_priority == {1: 2, 2: 1}
    [aborted] = d.s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert aborted.request_id == "a" and "a" not in d.s.requests
    assert [r.request_id for r in d.s.waiting] == ["c", "d"]
    assert d.s.make_stats().num_waiting_by_priority == {1: 1, 2: 1}
    d.results.pop("a")
    finish_steps(d)
    assert d.admitted == ["b", "c", "d"]
    assert d.s.make_stats().num_waiting_by_priority == {}


def test_the_priority_queue_drops_removed_entries_lazily():
    q = PriorityRequestQueue()
    s = Scheduler(limits(), policy="priority")
    reqs = [s.add_request(msgspec.structs.replace(make_record(f"r{i}", [1, 2]), priority=p, arrival_time=float(i)))
            for i, p in enumerate((3, 1, 2, 1))]
    for r in reqs:
        q.push(r)
    q.remove(reqs[1])
    assert len(q) == 3 and q.peek() is reqs[3]
    assert [q.pop_next().request_id for _ in range(3)] == ["r3", "r2", "r0"]
    assert len(q) == 0 and not q.num_by_priority


def test_an_unknown_policy_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--scheduling-policy"):
        Scheduler(limits(), policy="lifo")
    with pytest.raises(ValueError, match="--scheduling-policy"):
        EngineArgs(scheduling_policy="lifo").validate()


def test_waiting_requests_per_priority_are_a_gauge_whose_empty_series_go():
    logger = PrometheusStatLogger("tiny", num_engines=2)

    def waiting() -> dict[tuple[str, str], float]:
        text = logger.render().decode()
        return {(s.labels["engine"], s.labels["priority"]): s.value
                for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "pagellm:num_requests_waiting_by_priority"}

    logger.record(SchedulerStats(num_waiting_reqs=3, num_waiting_by_priority={0: 2, -5: 1}), IterationStats(), 0)
    logger.record(SchedulerStats(num_waiting_reqs=1, num_waiting_by_priority={7: 1}), IterationStats(), 1)
    assert waiting() == {("0", "0"): 2, ("0", "-5"): 1, ("1", "7"): 1}
    logger.record(SchedulerStats(num_waiting_reqs=4, num_waiting_by_priority={-5: 4}), IterationStats(), 0)
    assert waiting() == {("0", "-5"): 4, ("1", "7"): 1}


# -- LLM, offline ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(folder)


def tiny_llm(model: str, policy: str, **kw) -> LLM:
    return LLM(model, load_format="dummy", device="cpu", dtype="float32", max_model_len=128,
               scheduling_policy=policy, enable_prefix_caching=False, **kw)


def test_priorities_change_the_order_not_the_outputs(tiny_model):
    prompts = [[10 + 7 * i + j for j in range(20 + 4 * i)] for i in range(8)]
    priorities = [3, 0, 2, 1, 0, 5, 1, 2]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # Few blocks and sequences: admission order and preemptions differ from fcfs's.
    fcfs = tiny_llm(tiny_model, "fcfs", num_gpu_blocks_override=16, block_size=8, max_num_seqs=3)
    expected = [o.outputs[0].token_ids for o in fcfs.generate(prompts, params, use_tqdm=False)]
    llm = tiny_llm(tiny_model, "priority", num_gpu_blocks_override=16, block_size=8, max_num_seqs=3)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=priorities)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.llm_engine.get_stats().num_preemptions > 0, "the pool is small enough to preempt"
    assert_no_leak(llm.llm_engine)
    one_at_a_time = tiny_llm(tiny_model, "priority", max_num_seqs=1)
    outs = one_at_a_time.generate(prompts, params, use_tqdm=False, priority=priorities)
    assert [o.outputs[0].token_ids for o in outs] == expected
    started = sorted(range(len(prompts)), key=lambda i: outs[i].metrics["first_token_time"])
    assert started == sorted(range(len(prompts)), key=lambda i: priorities[i])
    with pytest.raises(ValueError, match="priority has 2 entries but there are 8 prompts"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="priority 1: this engine schedules first come, first served"):
        fcfs.generate(prompts[:2], params, use_tqdm=False, priority=[0, 1])
    assert_no_leak(fcfs.llm_engine)


# -- the server ------------------------------------------------------------------------------------

def test_the_admission_gate_grants_room_by_priority():
    admission = Admission(max_seqs=1, max_tokens=None, max_waiting=8, queue_timeout_s=None, patience_s=1000.0)

    async def run() -> list[str]:
        held = await admission.acquire(Work(1, 10))
        granted: list[str] = []

        async def wait(name: str, priority: int) -> None:
            await admission.acquire(Work(1, 10), priority)
            granted.append(name)

        tasks = []
        for name, priority in (("low", 5), ("high", 0), ("mid", 2), ("high2", 0)):
            tasks.append(asyncio.create_task(wait(name, priority)))
            await wait_for(lambda n=len(tasks): admission.num_waiting == n)
        for n in range(4):
            admission.release(held)
            await wait_for(lambda: len(granted) == n + 1)
        await asyncio.gather(*tasks)
        admission.release(held)
        assert (admission.seqs, admission.num_waiting) == (0, 0)
        return granted

    assert asyncio.run(run()) == ["high", "high2", "mid", "low"]


def test_a_patient_request_at_the_gate_is_passed_only_by_higher_priorities():
    """Patience 0: the pair of priority 1 keeps the freed sequence against its own priority and
    lower ones; a request of priority 0 still takes it."""
    admission = Admission(max_seqs=2, max_tokens=None, max_waiting=4, queue_timeout_s=None, patience_s=0.0)

    async def run() -> None:
        first, second = await admission.acquire(Work(1, 10)), await admission.acquire(Work(1, 10))
        pair = asyncio.create_task(admission.acquire(Work(2, 20), 1))
        await wait_for(lambda: admission.num_waiting == 1)
        admission.release(first)
        same = asyncio.create_task(admission.acquire(Work(1, 10), 1))
        await wait_for(lambda: admission.num_waiting == 2)
        assert admission.seqs == 1, "kept for the pair"
        urgent = await asyncio.wait_for(admission.acquire(Work(1, 10), 0), 10.0)  # passes without waiting
        assert admission.seqs == 2 and not pair.done() and not same.done()
        admission.release(urgent)
        admission.release(second)
        assert await pair == Work(2, 20) and not same.done()
        admission.release(Work(2, 20))
        assert await same == Work(1, 10)
        admission.release(Work(1, 10))
        assert (admission.seqs, admission.num_waiting) == (0, 0)

    asyncio.run(run())


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_the_server_takes_priority_only_under_the_priority_policy(tiny_model, policy):
    engine = AsyncLLM.from_engine_args(EngineArgs(tiny_model, load_format="dummy", device="cpu", dtype="float32",
                                                  max_model_len=128, scheduling_policy=policy))
    try:
        with TestClient(build_app(engine, "tiny")) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http,
                                   max_retries=0)
            plain = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0.0)
            if policy == "fcfs":
                with pytest.raises(openai.BadRequestError) as refused:
                    client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4,
                                              extra_body={"priority": 2})
                error = refused.value.body
                assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
                assert refused.value.status_code == 400
                return
            urgent = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0.0,
                                               extra_body={"priority": -3})
            assert urgent.choices[0].text == plain.choices[0].text
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_chat_takes_one_priority_per_conversation(smollm2_path):
    llm = LLM(smollm2_path, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=512,
              scheduling_policy="priority", max_num_seqs=1)
    conversations = [[{"role": "user", "content": f"Name a colour, then count to {n}."}] for n in (3, 5, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    plain = llm.chat(conversations, params, use_tqdm=False)
    ranked = llm.chat(conversations, params, use_tqdm=False, priority=[2, 0, 1])
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in plain]
    assert [o.prompt for o in ranked] == [o.prompt for o in plain], "outputs stay in the order of the conversations"
    started = sorted(range(3), key=lambda i: ranked[i].metrics["first_token_time"])
    assert started == [1, 2, 0], "one sequence at a time, by priority"
    with pytest.raises(ValueError, match="priority has 1 entries but there are 3 prompts"):
        llm.chat(conversations, params, use_tqdm=False, priority=[0])
    assert_no_leak(llm.llm_engine)
