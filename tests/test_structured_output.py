"""Structured output in the engine: outputs always in the language, with the engine's other features."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr

from pagellm import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from pagellm.engine.arg_utils import EngineArgs
from pagellm.reasoning import get_reasoning_tags
from pagellm.structured_output import GrammarError
from pagellm.structured_output.bitmask import apply_token_bitmask
from pagellm.structured_output.manager import GrammarManager, RequestGrammar

SUITE = json.load(open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "json_schemas.json")))
MAX_LEN = 512


@pytest.fixture(scope="module")
def llm(smollm2_path: str) -> LLM:
    return LLM(smollm2_path, device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=MAX_LEN)


def _chat(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}])


def test_bitmask_masks_exactly_the_disallowed_tokens_of_the_grammar_rows() -> None:
    torch.manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(5, vocab)
    bits = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), dtype=torch.int32)
    rows = torch.tensor([4, 0, 2])
    masked = apply_token_bitmask(logits, rows, bits)
    # Bit j of word w allows token 32 * w + j.
    allowed = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)[:, :vocab]
    for i, row in enumerate(rows.tolist()):
        assert torch.equal(masked[row], logits[row].masked_fill(~allowed[i], float("-inf")))
    assert torch.equal(masked[[1, 3]], logits[[1, 3]])  # other rows untouched
    assert allowed.any() and not allowed.all()


@pytest.mark.slow
def test_every_schema_of_the_suite_gives_valid_json(llm: LLM) -> None:
    """32 schemas (nested objects, bounded arrays, enums, $ref/$defs, patterns, ranges, optional
    fields, anyOf/oneOf, tuples) in one batch: every output parses and validates."""
    prompts = [_chat(llm, case["prompt"] + " Answer in JSON.") for case in SUITE]
    # Compact JSON (no optional whitespace) keeps the outputs, and the test, short.
    params = [SamplingParams(temperature=0, max_tokens=128, structured_outputs=StructuredOutputsParams(
        json=c["schema"], disable_any_whitespace=True)) for c in SUITE]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for case, out in zip(SUITE, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", case["name"]
        jsonschema.validate(json.loads(completion.text), case["schema"])


@pytest.mark.slow
def test_regex_choice_grammar_and_json_object_hold_when_sampling(llm: LLM) -> None:
    specs = {
        "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} [0-9]{1,3}"),
        "choice": StructuredOutputsParams(choice=["yes", "no", "maybe \"later\""]),
        "grammar": StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
        "json_object": StructuredOutputsParams(json_object=True),
    }
    prompt = _chat(llm, "Answer briefly.")
    # Two seeds each, n=2: sampling explores the language, children keep their own matchers.
    params = [SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=32, structured_outputs=spec)
              for spec in specs.values() for seed in range(2)]
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    checks = {
        "regex": lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", t),
        "choice": lambda t: t in ("yes", "no", 'maybe "later"'),
        "grammar": lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t),
        "json_object": lambda t: isinstance(json.loads(t), dict),
    }
    for i, out in enumerate(outputs):
        kind = list(specs)[i // 2]
        for completion in out.outputs:
            if completion.finish_reason == "stop":  # a JSON object may run past max_tokens
                assert checks[kind](completion.text), (kind, completion.text)
        assert any(c.finish_reason == "stop" for c in out.outputs) or kind == "json_object"


@pytest.mark.slow
def test_grammar_requests_survive_preemption_and_async_scheduling(smollm2_path: str, llm: LLM) -> None:
    """Greedy grammar requests next to plain ones give the same outputs when a tiny KV cache
    preempts them mid-output and steps overlap: the matcher follows the tokens kept, not the steps."""
    cases = [c for c in SUITE if c["name"] in ("nested_address", "order", "pattern_phone")]
    prompts = [_chat(llm, c["prompt"]) for c in cases] + [_chat(llm, "Tell me a story.")]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=c["schema"]))
              for c in cases] + [SamplingParams(temperature=0, max_tokens=32)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(smollm2_path, device="cpu", dtype="float32", num_gpu_blocks_override=10, max_model_len=128,
                async_scheduling=True)
    try:
        got = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
        assert tight.llm_engine.get_stats().num_preemptions > 0
    finally:
        tight.llm_engine.shutdown()
    assert got == expected


@pytest.mark.slow
def test_a_slow_compile_delays_no_other_request_and_times_out(smollm2_path: str, monkeypatch) -> None:
    """A compile that does not finish (held here by an event) keeps its request waiting while the
    others run to the end; past the compile time limit the request ends, refused, alone."""
    release = threading.Event()
    original = GrammarManager._build

    def held(self, *args):
        release.wait(30)
        return original(self, *args)

    monkeypatch.setattr(GrammarManager, "_build", held)
    engine = LLMEngine.from_engine_args(EngineArgs(
        smollm2_path, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256,
        structured_outputs_compile_timeout=60.0))
    try:
        slow = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json_object=True))
        engine.add_request("slow", "Give me JSON.", slow)
        engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=4))
        finished = {}
        while "plain" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert "slow" not in finished and len(finished["plain"].outputs[0].token_ids) == 4
        release.set()  # the compile completes: the request runs, constrained
        while "slow" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        out = finished["slow"].outputs[0]
        assert out.finish_reason == "length" or isinstance(json.loads(out.text), dict)

        release.clear()
        engine.engine_core.grammars._timeout_s = 0.2
        engine.add_request("late", "Give me JSON.", slow)
        engine.add_request("other", "Hi", SamplingParams(temperature=0, max_tokens=2))
        while not {"late", "other"} <= finished.keys():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert finished["late"].outputs[0].finish_reason == "abort" and not finished["late"].outputs[0].token_ids
        assert len(finished["other"].outputs[0].token_ids) == 2
        assert not engine.has_unfinished_requests()
    finally:
        release.set()
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("spec, message", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     "structured_outputs.json: is not supported"),
    (StructuredOutputsParams(json='{"type": "obj'), "structured_outputs.json: is not valid JSON"),
    (StructuredOutputsParams(regex="(a"), "structured_outputs.regex: is not supported"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar: is not supported"),
    (StructuredOutputsParams(json={"type": "object", "description": "x" * 70000}),
     "structured_outputs.json: is 700"),
    (StructuredOutputsParams(json='{"items":' * 2000 + "{}" + "}" * 2000), "structured_outputs.json: is nested too deeply"),
])
def test_bad_specs_are_refused_before_the_engine(llm: LLM, spec: StructuredOutputsParams, message: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(message)):
        llm.generate(["Hi"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.slow
def test_a_grammar_left_with_nothing_to_sample_aborts_the_request(llm: LLM) -> None:
    """allowed_token_ids leaving none of the tokens the grammar allows: the request ends as aborted,
    never as a 'stop' whose text breaks the grammar, and the engine goes on."""
    spec = StructuredOutputsParams(choice=["yes", "no"])
    outside = llm.get_tokenizer().encode("zzz", add_special_tokens=False)[:1]
    banned, fine = llm.generate(["Answer:", "Answer:"], [
        SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec, allowed_token_ids=outside),
        SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec)], use_tqdm=False)
    assert banned.outputs[0].finish_reason == "abort"
    assert fine.outputs[0].finish_reason == "stop" and fine.outputs[0].text in ("yes", "no")
    assert not llm.llm_engine.has_unfinished_requests()


def test_structured_outputs_params_validation() -> None:
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_the_grammar_waits_for_the_end_of_reasoning() -> None:
    """With a reasoning parser, tokens before the end-of-reasoning token are free, and the grammar
    constrains what follows; a prompt that already closed the reasoning starts constrained; where
    the model opens its reasoning itself (Qwen3), the first token may open it or start the answer."""
    vocab = ["a", "b", "{", "}", "</think>", "<think>", "<eos>"]
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[6])).compile_grammar('root ::= "{" "}"')

    def grammar(state) -> RequestGrammar:
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result((xgr.GrammarMatcher(compiled), state))
        g = RequestGrammar(done, "grammar", 10.0)
        assert g.ready()
        return g

    def allowed(g: RequestGrammar) -> set[int]:
        bits = np.zeros((1, 1), dtype=np.int32)
        g.fill(bits, 0)
        return {i for i in range(len(vocab)) if (int(bits[0, 0]) >> i) & 1}

    waiting = grammar((4, None))
    assert not waiting.active
    assert not waiting.accept(0) and not waiting.accept(1)  # reasoning: anything goes
    assert not waiting.accept(4) and waiting.active  # </think>: the grammar starts
    assert allowed(waiting) == {2}
    assert not waiting.accept(2) and not waiting.accept(3)
    assert waiting.accept(6)  # complete: the output ends

    opening = grammar((None, (5, 4)))
    assert opening.active and allowed(opening) == {2, 5}  # the answer, or <think>
    assert not opening.accept(5) and not opening.active and not opening.accept(0) and not opening.accept(4)
    assert allowed(opening) == {2}
    answering = grammar((None, (5, 4)))
    assert not answering.accept(2) and allowed(answering) == {3}  # answered at once: no <think> any more

    manager = GrammarManager.__new__(GrammarManager)
    manager._reasoning_ids = (5, 4)
    for name in ("deepseek_r1", "qwen3"):
        manager._reasoning = get_reasoning_tags(name)
        assert manager._reasoning_state([9, 5, 0, 4, 9]) == (None, None)  # closed in the prompt (thinking off)
        assert manager._reasoning_state([9, 4, 9, 5, 0]) == (4, None)  # opened in the prompt: wait for the end
    manager._reasoning = get_reasoning_tags("deepseek_r1")
    assert manager._reasoning_state([9, 9]) == (4, None)  # the template's <think> is implied
    manager._reasoning = get_reasoning_tags("qwen3")
    assert manager._reasoning_state([9, 9]) == (None, (5, 4))  # the model decides
