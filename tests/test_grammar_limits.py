"""Grammar limits: specs whose compile or matching would run long are refused at once, before
xgrammar sees them, with the limit named; ordinary specs (the benchmark suite of real-world
schemas) pass; a compile past its time limit does not hold up later ones."""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import random
import threading
import time

import httpx
import pytest
from conftest import SHARED_SERVER_FLAGS
from conftest import SHARED_SERVER_NAME as MODEL_NAME
from engine_utils import wait_for
from server_utils import RemoteServer

from pagellm import LLM, SamplingParams
from pagellm.config import GrammarLimits, StructuredOutputsConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output import GrammarError
from pagellm.structured_output.compile_pool import CompilePool
from pagellm.structured_output.errors import LimitExceeded
from pagellm.structured_output.limits import check_limits
from pagellm.structured_output.manager import GrammarManager
from pagellm.structured_output.source import GrammarChecker
from pagellm.structured_output.syntax import parse_grammar, parse_regex

SUITE = json.load(open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "json_schemas.json")))
QUICK_S = 1.0
"""A refusal comes well within this, on a shared CPU too (the check itself takes under a millisecond)."""


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


FINDINGS = {
    "nested quantifier": (StructuredOutputsParams(regex="(a+)+$"), "allow_ambiguous_repetition"),
    "product of counts": (StructuredOutputsParams(regex="(x{1000}){100}"), "max_regex_expansion"),
    "huge count": (StructuredOutputsParams(regex="[a-z]{1,60000}"), "max_regex_expansion"),
    "enum of 10,000": (StructuredOutputsParams(json={"enum": list(range(10000))}), "max_enum_values"),
    "60 levels": (StructuredOutputsParams(json=nested(60)), "max_depth"),
}
"""What the adversarial run sent (issue 53): each was a 200 after 7.6-23.6 s holding a compile thread."""

REFUSED = {
    "empty-matching repetition": (StructuredOutputsParams(regex="(a*)*b"), "allow_ambiguous_repetition"),
    "words with optional spaces": (StructuredOutputsParams(regex=r"(\w+\s?)*$"), "allow_ambiguous_repetition"),
    "counted ambiguous words": (StructuredOutputsParams(regex="([a-z]+ ?){1,5}"), "allow_ambiguous_repetition"),
    "classic URL ReDoS": (StructuredOutputsParams(regex=r"^(https?://)?([\da-z.-]+)\.([a-z.]{2,6})([/\w .-]*)*/?$"),
                          "allow_ambiguous_repetition"),
    "count past int32": (StructuredOutputsParams(regex="a{0,99999999999}"), "max_regex_expansion"),
    "schema pattern": (StructuredOutputsParams(json={"type": "string", "pattern": "(a|b+)+c"}),
                       "allow_ambiguous_repetition"),
    "schema patterns together": (StructuredOutputsParams(json={"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": "^.{0,500}$"} for i in range(5)}}), "max_regex_expansion"),
    "patternProperties name": (StructuredOutputsParams(json={"type": "object", "patternProperties": {
        "(x+x+)+y": {"type": "string"}}}), "allow_ambiguous_repetition"),
    "optional properties": (StructuredOutputsParams(json={"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(1000)}}), "max_object_properties"),
    "many subschemas": (StructuredOutputsParams(json={"type": "object", "properties": {
        f"o{i}": {"type": "object", "properties": {f"p{j}": {"type": "integer"} for j in range(100)}}
        for i in range(60)}}), "max_schema_nodes"),
    "consts": (StructuredOutputsParams(json={"anyOf": [{"const": i} for i in range(3000)]}), "max_enum_values"),
    "choices": (StructuredOutputsParams(choice=[str(i) for i in range(3000)]), "max_enum_values"),
    "grammar nested repetition": (StructuredOutputsParams(grammar='root ::= ("a"+ "b"?)+'),
                                  "allow_ambiguous_repetition"),
    "grammar through a rule": (StructuredOutputsParams(grammar='root ::= (word " "?)*\nword ::= [a-z] [a-z]*'),
                               "allow_ambiguous_repetition"),
    "grammar count": (StructuredOutputsParams(grammar='root ::= ("ab"{100}){100}'), "max_regex_expansion"),
    "grammar regex macro": (StructuredOutputsParams(grammar='root ::= Regex("(a+)+")'), "allow_ambiguous_repetition"),
    "grammar nesting": (StructuredOutputsParams(grammar="root ::= " + "(" * 40 + '"a"' + ")" * 40), "max_depth"),
    "stacked repetitions": (StructuredOutputsParams(grammar='root ::= "a"' + "?" * 60000), "max_depth"),
    "structural tag schema": (StructuredOutputsParams(structural_tag={
        "structures": [{"begin": "<f>", "schema": nested(40), "end": "</f>"}], "triggers": ["<f>"]}), "max_depth"),
    "structural tag regex": (StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
        "type": "sequence", "elements": [{"type": "regex", "pattern": "(a*)*"}]}}), "allow_ambiguous_repetition"),
}

ACCEPTED_REGEXES = [
    r"\d{3}-\d{4}", r"^[A-Z][a-z]+( [A-Z][a-z]+)*$", r"^[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}$",
    r"^(\d{1,3}\.){3}\d{1,3}$", r"(\d+,)*\d+", r"(\w+\s)*\w+", r"([^,]*,){10}[^,]*", r"(a|aa)+$", r"(ab|a)*c",
    r"\w+\s*\w+$", r"((ab)+c)*", r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$", r"^[A-Za-z0-9+/]{0,1000}={0,2}$",
    r".{0,1000}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,8} [0-9]{1,3}",
    r"^(?:\+?1[-. ]?)?\(?\d{3}\)?[-. ]?\d{3}[-. ]?\d{4}$",
    r"^#(?:[0-9a-fA-F]{3}){1,2}$", r"(?<year>\d{4})-(?<month>\d{2})", r"\p{L}+", r"[\u00C0-\u017F]+",
]
ACCEPTED_GRAMMARS = [
    'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?',
    # JSON, as llama.cpp's grammars write it
    'root ::= value\nvalue ::= object | array | string | number | ("true" | "false" | "null") ws\n'
    'object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws\n'
    'array ::= "[" ws ( value ("," ws value)* )? "]" ws\n'
    'string ::= "\\"" ( [^"\\\\] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\\"" ws\n'
    'number ::= ("-"? ([0-9] | [1-9] [0-9]*)) ("." [0-9]+)? ([eE] [-+]? [0-9]+)? ws\n'
    'ws ::= ([ \\t\\n] ws)?  # optional whitespace',
    'root ::= item ("," item)*\nitem ::= [a-z]+',
]


def refusal(params: StructuredOutputsParams, limits: GrammarLimits = GrammarLimits()) -> LimitExceeded:
    with pytest.raises(LimitExceeded) as e:
        check_limits(params, limits)
    return e.value


def test_every_schema_of_the_real_world_suite_passes_the_limits():
    for case in SUITE:
        check_limits(StructuredOutputsParams(json=case["schema"]), GrammarLimits())


@pytest.mark.parametrize("pattern", ACCEPTED_REGEXES)
def test_ordinary_regexes_pass(pattern):
    check_limits(StructuredOutputsParams(regex=pattern), GrammarLimits())
    check_limits(StructuredOutputsParams(json={"type": "string", "pattern": pattern}), GrammarLimits())


@pytest.mark.parametrize("grammar", ACCEPTED_GRAMMARS)
def test_ordinary_grammars_pass(grammar):
    check_limits(StructuredOutputsParams(grammar=grammar), GrammarLimits())


@pytest.mark.parametrize("name", [*FINDINGS, *REFUSED])
def test_specs_past_a_limit_are_refused_naming_it(name):
    params, limit = {**FINDINGS, **REFUSED}[name]
    assert refusal(params).limit == limit


def test_the_frontend_check_refuses_the_findings_at_once_naming_kind_and_limit():
    """The GrammarChecker every request passes (offline and served) refuses before xgrammar parses."""
    checker = GrammarChecker(StructuredOutputsConfig())
    for params, limit in FINDINGS.values():
        start = time.monotonic()
        with pytest.raises(GrammarError) as e:
            checker.check(params)
        assert time.monotonic() - start < QUICK_S
        assert str(e.value).startswith(f"structured_outputs.{params.kind}: ")
        assert f"({limit} of --structured-outputs-limits)" in str(e.value)


def test_messages_say_where_and_why():
    assert "(at /properties/a/properties/a/" in refusal(FINDINGS["60 levels"][0]).reason
    assert refusal(FINDINGS["nested quantifier"][0]).reason.startswith("repeats '(a+)+' around an unbounded "
                                                                       "repetition ('a+')")
    assert "write out to 100000 " in refusal(FINDINGS["product of counts"][0]).reason
    pattern = refusal(StructuredOutputsParams(json={"properties": {"x": {"type": "string", "pattern": "(a+)+"}}}))
    assert pattern.reason.startswith("the pattern at /properties/x/pattern repeats '(a+)+'")
    assert refusal(REFUSED["grammar through a rule"][0]).reason.startswith("rule 'root' repeats '(word \" \"?)*'")


def test_limits_are_configurable_and_checked():
    assert GrammarLimits.parse(None) == GrammarLimits()
    raised = GrammarLimits.parse('{"max_depth": 64, "allow_ambiguous_repetition": true}')
    assert (raised.max_depth, raised.allow_ambiguous_repetition, raised.max_enum_values) == (64, True, 2048)
    check_limits(FINDINGS["60 levels"][0], raised)
    check_limits(FINDINGS["nested quantifier"][0], raised)
    check_limits(StructuredOutputsParams(json={"enum": list(range(10000))}), GrammarLimits(max_enum_values=10000))
    for bad, message in [('{"max_dept": 3}', "unknown key"), ({"max_depth": 0}, "integer >= 1"),
                         ({"max_depth": True}, "integer >= 1"), ({"allow_ambiguous_repetition": 1}, "true or false"),
                         ("[1]", "must be a JSON object")]:
        with pytest.raises(ValueError, match=message) as e:
            EngineArgs(structured_outputs_limits=bad).validate()
        assert "structured_outputs_limits (--structured-outputs-limits)" in str(e.value)


def test_the_serve_flag_sets_the_limits():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--structured-outputs-limits", '{"max_enum_values": 10}']))
    assert GrammarLimits.parse(args.structured_outputs_limits).max_enum_values == 10
    assert '"max_depth": 32' in parser.format_help().replace("\n", " ").replace("  ", " ")


def test_the_parsers_never_fail_on_any_text():
    """Tolerant: whatever the text, a structure or a LimitExceeded (xgrammar judges validity)."""
    rng = random.Random(0)
    alphabet = list("()[]{}|*+?.^$\\-,:=!<>#'\"aZ09 \n") + ["{2,3}", "(?:", "(?<n>", "\\u{", "\\x4", "::=", "\\p{"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        for parse in (parse_regex, parse_grammar):
            try:
                parse(text, 4)
            except LimitExceeded:
                pass
        try:
            check_limits(StructuredOutputsParams(regex=text or "a"), GrammarLimits(max_depth=4))
            check_limits(StructuredOutputsParams(grammar="root ::= " + text), GrammarLimits(max_depth=4))
        except LimitExceeded:
            pass


def test_the_largest_specs_are_checked_in_linear_time():
    """At the byte limit (64 KiB), built to make the check work hardest (0.2-0.6 s each on a busy
    2-core machine; xgrammar's own parse of the spec takes a fifth of that, its compile far more)."""
    max_bytes = StructuredOutputsConfig().max_bytes
    deep = "(" * 30 + "(a*b|c)*" + ")*" * 30
    cases = [
        StructuredOutputsParams(regex=("(ab*c|d)*" * (max_bytes // 9))[:max_bytes]),
        StructuredOutputsParams(regex=(deep * (max_bytes // len(deep)))),
        StructuredOutputsParams(grammar="\n".join(f"r{i} ::= (r{i + 1} [a-z]*)* | \"x\"" for i in range(2500))),
        StructuredOutputsParams(json={"anyOf": [{"type": "string", "pattern": "[a-z]+(-[a-z]+)*"}] * 2000}),
    ]
    for params in cases:
        start = time.monotonic()
        try:
            check_limits(params, GrammarLimits(max_regex_expansion=10**9, max_schema_nodes=10**9))
        except LimitExceeded:
            pass
        assert time.monotonic() - start < 2 * QUICK_S, params.kind


def test_a_written_off_compile_gives_its_thread_back():
    """A compile past its limit keeps running (xgrammar cannot stop it), but a fresh thread takes
    its place: later compiles run at once. One at a time: a second overdue compile keeps its thread."""
    pool = CompilePool(threads=1, max_written_off=1, name="test-compile")

    def held() -> tuple[concurrent.futures.Future, threading.Event]:
        started, release = threading.Event(), threading.Event()
        future = pool.submit(lambda: started.set() or release.wait(30))
        assert started.wait(10)
        return future, release

    stuck, release = held()
    queued = pool.submit(lambda: "done")
    assert not queued.done(), "one thread, busy: the next compile queues"
    assert pool.write_off(stuck) and pool.written_off == 1
    assert queued.result(timeout=10) == "done", "the fresh thread runs it while the stuck one goes on"
    assert not stuck.done()
    also_stuck, also_release = held()
    assert not pool.write_off(also_stuck), "at most one written off at once"
    release.set()
    assert stuck.result(timeout=10) is True
    asyncio.run(wait_for(lambda: pool.written_off == 0))  # its thread ended with its compile
    assert pool.write_off(also_stuck), "the next overdue compile may be written off"
    assert pool.submit(lambda: 7).result(timeout=10) == 7
    also_release.set()
    assert also_stuck.result(timeout=10) is True
    pool.shutdown()


def test_an_overdue_spec_is_refused_at_once_until_its_compile_ends():
    """The time limit runs once the vocabulary table is built (the first grammar's one-time work).
    The same spec again while its overdue compile runs would take as long: refused without a
    thread; another spec compiles meanwhile; once the overdue compile ends, the spec compiles as
    usual (xgrammar has cached it by then)."""
    manager = GrammarManager(None, 100, timeout_s=0.05, reasoning_parser=None)
    release = threading.Event()
    compiled = []

    def build(source, prompt_token_ids, eos_token_ids):
        compiled.append(source.text)
        release.wait(30)
        return None, (None, None)

    manager._build = build
    slow = StructuredOutputsParams(regex="[a-z]+")
    first = manager.start(slow, [1], frozenset())
    while not compiled:
        assert not first.ready()
        manager.wait(0.01)
    assert not first.ready()
    manager.wait(0.1)  # past the limit, but the vocabulary table is not built yet: that time does not count
    assert not first.ready()
    manager._compiler = object()  # built
    with pytest.raises(GrammarError, match="took longer than 0.05 s to compile"):
        while not first.ready():
            manager.wait(0.01)
    with pytest.raises(GrammarError, match="for an earlier request, and is compiling still"):
        manager.start(slow, [1], frozenset()).ready()
    other = manager.start(StructuredOutputsParams(regex="[0-9]+"), [1], frozenset())
    while len(compiled) < 2:  # on the thread that took the overdue compile's place
        manager.wait(0.01)
    assert compiled == ["[a-z]+", "[0-9]+"], "no second compile of the overdue spec"
    release.set()
    while not other.ready():
        manager.wait(0.01)
    asyncio.run(wait_for(lambda: not manager._overdue))  # the overdue compile ended too
    again = manager.start(slow, [1], frozenset())
    while not again.ready():
        manager.wait(0.01)
    assert compiled == ["[a-z]+", "[0-9]+", "[a-z]+"]
    manager.shutdown()


@pytest.mark.slow
def test_the_server_refuses_each_finding_at_once_naming_the_field(smollm2_server):
    """Each finding, in the field a client would send it in: a 400 naming that field, well within a
    second, and the server serves structured output normally afterwards."""
    url = smollm2_server.url
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    cmpl = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 8}
    chat_path, cmpl_path = "/v1/chat/completions", "/v1/completions"

    def json_schema(schema: dict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}

    deep_tool = {"type": "function", "function": {"name": "f", "parameters": nested(60)}}
    cases = [
        (cmpl_path, {**cmpl, "structured_outputs": {"regex": "(a+)+$"}}, "structured_outputs.regex"),
        (cmpl_path, {**cmpl, "guided_regex": "(x{1000}){100}"}, "guided_regex"),
        (chat_path, {**chat, "structured_outputs": {"regex": "[a-z]{1,60000}"}}, "structured_outputs.regex"),
        (chat_path, {**chat, "response_format": json_schema({"enum": list(range(10000))})},
         "response_format.json_schema.schema"),
        (chat_path, {**chat, "response_format": json_schema(nested(60))}, "response_format.json_schema.schema"),
        (cmpl_path, {**cmpl, "guided_json": nested(60)}, "guided_json"),
        (chat_path, {**chat, "tools": [deep_tool], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools[0].function.parameters"),
    ]
    with httpx.Client(timeout=60) as client:
        for path, body, param in cases:
            start = time.monotonic()
            response = client.post(f"{url}{path}", json=body)
            elapsed = time.monotonic() - start
            error = response.json()["error"]
            assert (response.status_code, error["param"], error["type"]) == (400, param, "BadRequestError"), error
            assert error["message"].startswith(f"{param}: the ") and "--structured-outputs-limits" in error["message"]
            assert elapsed < QUICK_S, f"{param}: refused after {elapsed:.2f} s"
        fine = client.post(f"{url}{cmpl_path}", json={**cmpl, "guided_regex": "(yes|no)"})
    assert fine.status_code == 200 and fine.json()["choices"][0]["text"] in ("yes", "no"), fine.text


@pytest.mark.slow
def test_offline_each_finding_is_a_value_error_naming_the_field_at_once(smollm2_path):
    llm = LLM(smollm2_path, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    try:
        for params, limit in FINDINGS.values():
            start = time.monotonic()
            with pytest.raises(ValueError) as e:
                llm.generate(["Hi"], SamplingParams(max_tokens=8, structured_outputs=params), use_tqdm=False)
            assert time.monotonic() - start < QUICK_S
            assert str(e.value).startswith(f"structured_outputs.{params.kind}: ") and limit in str(e.value)
        assert not llm.llm_engine.has_unfinished_requests()
        fine = llm.generate(["Answer:"], SamplingParams(temperature=0, max_tokens=4, structured_outputs=(
            StructuredOutputsParams(choice=["yes", "no"]))), use_tqdm=False)
        assert fine[0].outputs[0].text in ("yes", "no")
    finally:
        llm.llm_engine.shutdown()


def slow_to_compile() -> dict:
    """Within every static limit, but several seconds of xgrammar's compile (7 s on a 2-core
    machine): objects of 500 optional properties, any of four."""
    return {"anyOf": [{"type": "object", "properties": {f"p{k}_{i}": {"type": "string"} for i in range(500)}}
                      for k in range(4)]}


@pytest.mark.slow
def test_the_server_refuses_a_compile_past_its_time_limit_and_serves_on(smollm2_path):
    """Past --structured-outputs-compile-timeout: a 400 naming the field; the same spec again is
    refused at once while its compile runs on; another grammar request is served meanwhile."""
    server = RemoteServer(smollm2_path, *SHARED_SERVER_FLAGS, "--structured-outputs-compile-timeout", "1")
    try:
        check_limits(StructuredOutputsParams(json=slow_to_compile()), GrammarLimits())
        cmpl = {"model": MODEL_NAME, "prompt": "Answer:", "max_tokens": 4, "temperature": 0}
        slow = {**cmpl, "guided_json": slow_to_compile()}
        with httpx.Client(base_url=server.url, timeout=60) as client:
            warm = client.post("/v1/completions", json={**cmpl, "guided_regex": "(yes|no)"})
            assert warm.status_code == 200, "the one-time vocabulary table build does not count against the limit"
            first = client.post("/v1/completions", json=slow)
            error = first.json()["error"]
            assert (first.status_code, error["param"]) == (400, "guided_json")
            assert "took longer than 1 s to compile" in error["message"]
            start = time.monotonic()
            again = client.post("/v1/completions", json=slow)
            assert again.status_code == 400 and "is compiling still" in again.json()["error"]["message"]
            other = client.post("/v1/completions", json={**cmpl, "guided_regex": "(no|yes)"})
            assert other.status_code == 200 and other.json()["choices"][0]["text"] in ("yes", "no")
            assert time.monotonic() - start < 5 * QUICK_S, "nothing waited for the overdue compile"
        assert "goes on in a thread of its own" in server.log_tail(100_000)
    finally:
        assert server.stop() == 0
