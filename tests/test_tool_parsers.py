"""Tool-call and reasoning parsers, without a model: each parser on finished outputs, and the same
outputs streamed in pieces of every size (tags and JSON split anywhere), assembled as the openai
SDK assembles deltas, must give the same message."""
from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.openai.chat_output import ChatOutput, finish_reason
from pagellm.entrypoints.openai.tool_parsers import (
    TOOL_PARSER_REGISTRY,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolParser,
)
from pagellm.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, scan_object, value_end
from pagellm.reasoning.parsers import ReasoningParser

WEATHER = {"city": "Paris", "days": [1, 2], "note": "a \"quoted\" } brace"}
HERMES = ("Let me check.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": WEATHER})
          + "\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>")


def assemble(output: ChatOutput, text: str, step: int) -> dict:
    """The message a client assembles from `text` streamed `step` characters at a time."""
    stream = output.stream()
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for k, piece in enumerate(pieces):
        delta = stream.delta(piece, final=k == len(pieces) - 1)
        message["content"] += delta.get("content", "")
        message["reasoning_content"] += delta.get("reasoning_content", "")
        assert delta.get("reasoning") == delta.get("reasoning_content"), "the two reasoning names differ"
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                assert call["index"] not in message["tool_calls"], "a call opened twice"
                assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
                message["tool_calls"][call["index"]] = {"name": call["function"]["name"], "arguments": ""}
            message["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
    message["called"] = stream.called_tools
    return message


def finished(output: ChatOutput, text: str) -> dict:
    message = output.message(text)
    calls = {i: {"name": c.function.name, "arguments": c.function.arguments}
             for i, c in enumerate(message.tool_calls or ())}
    return {"content": message.content or "", "reasoning_content": message.reasoning_content or "",
            "tool_calls": calls, "called": bool(calls)}


def check_streams_match(output: ChatOutput, text: str) -> dict:
    """The finished message, after checking that every streaming of `text` assembles into it."""
    expected = finished(output, text)
    for step in (1, 2, 3, 7, len(text) or 1):
        assert assemble(output, text, step) == expected, f"streamed {step} characters at a time"
    return expected


def test_hermes_content_then_calls():
    message = check_streams_match(ChatOutput(tools=HermesToolParser()), HERMES)
    assert message["content"] == "Let me check.\n"
    assert [c["name"] for c in message["tool_calls"].values()] == ["get_weather", "get_time"]
    assert json.loads(message["tool_calls"][0]["arguments"]) == WEATHER
    assert message["tool_calls"][1]["arguments"] == "{}"


@pytest.mark.parametrize("text", ["Plain text, no calls.", "Less <than> and <toolbox> stay content <tool",
                                  "Cut off: <tool_call>\n{\"name\": \"get_weather\", \"argu",
                                  "Malformed: <tool_call>{name: get_weather}</tool_call>", ""])
def test_hermes_text_that_is_not_a_complete_call_is_content(text):
    parser = HermesToolParser()
    assert parser.extract(text).content == text and not parser.extract(text).calls
    assert finished(ChatOutput(tools=parser), text)["content"] == text


def test_hermes_call_without_closing_tag_counts():
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}}'
    assert check_streams_match(ChatOutput(tools=HermesToolParser()), text)["tool_calls"] == {
        0: {"name": "f", "arguments": '{"x": 1}'}}


def test_streamed_name_waits_for_the_arguments():
    """A stream names a call once it is known to be one, and never sends a partial name."""
    stream = ChatOutput(tools=HermesToolParser()).stream()
    assert stream.delta('<tool_call>{"name": "get_we', final=False) == {}
    assert stream.delta('ather"', final=False) == {}
    delta = stream.delta(', "arguments": {"ci', final=False)
    assert delta["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "  "])
def test_llama3_json_calls(prefix):
    text = prefix + '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    message = check_streams_match(ChatOutput(tools=Llama3JsonToolParser()), text)
    assert message["content"] == ""
    assert message["tool_calls"] == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                     1: {"name": "get_time", "arguments": "{}"}}


@pytest.mark.parametrize("text", ["The answer is 4.", '{"answer": 4, "name": "x"}', '{"name": "x", "value": 1}',
                                  "{not json}"])
def test_llama3_json_other_text_is_content(text):
    assert check_streams_match(ChatOutput(tools=Llama3JsonToolParser()), text) == {
        "content": text, "reasoning_content": "", "tool_calls": {}, "called": False}


def test_a_call_cut_off_is_content_once_finished():
    """A call the output never finishes (max_tokens): a response returns the text as content, while a
    stream has already sent the call's start (it cannot take it back); finish_reason says "length"."""
    text = '{"name": "f", "parameters": {"a": '
    assert finished(ChatOutput(tools=Llama3JsonToolParser()), text)["content"] == text
    assert assemble(ChatOutput(tools=Llama3JsonToolParser()), text, 4)["tool_calls"] == {
        0: {"name": "f", "arguments": '{"a": '}}


def test_mistral_array_after_its_marker():
    text = 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": [1, {"y": "]"}]}}, {"name": "b", "arguments": {}}]'
    message = check_streams_match(ChatOutput(tools=MistralToolParser()), text)
    assert message["content"] == "Sure. "
    assert message["tool_calls"] == {0: {"name": "a", "arguments": '{"x": [1, {"y": "]"}]}'},
                                     1: {"name": "b", "arguments": "{}"}}
    assert MistralToolParser.needs_special_tokens and not HermesToolParser.needs_special_tokens


def test_required_and_named_outputs():
    """What the grammars of tool_choice required (an array of name/parameters) and a named function
    (its arguments object) make the model write."""
    required = '[{"name": "a", "parameters": {"q": "x"}}, {"name": "b", "parameters": {}}]'
    assert check_streams_match(ChatOutput(tools=JsonArrayToolParser()), required)["tool_calls"] == {
        0: {"name": "a", "arguments": '{"q": "x"}'}, 1: {"name": "b", "arguments": "{}"}}
    named = '{"city": "Paris", "unit": "C"}'
    assert check_streams_match(ChatOutput(tools=NamedToolParser("get_weather")), named)["tool_calls"] == {
        0: {"name": "get_weather", "arguments": named}}
    # Cut off by max_tokens: the text is returned as content, not as a call with broken arguments.
    assert finished(ChatOutput(tools=NamedToolParser("f")), '{"city": "Pa') == {
        "content": '{"city": "Pa', "reasoning_content": "", "tool_calls": {}, "called": False}


def test_registry_has_vllms_names():
    assert set(TOOL_PARSER_REGISTRY.names()) >= {"hermes", "llama3_json", "mistral"}


def test_json_scan_spans_and_errors():
    text = '{"a": "}{", "b" : [1, "]"], "c": tru'
    obj = scan_object(text, 0)
    assert [(m.key, text[m.start:m.end] if m.end else None) for m in obj.members] == [
        ("a", '"}{"'), ("b", '[1, "]"]'), ("c", None)]
    assert obj.end is None and value_end('"ab\\"c" rest', 0) == 7 and value_end("12", 0) is None
    with pytest.raises(MalformedJSON):
        scan_object('{"a" 1}', 0)


# ----------------------------------------------------------------------------------------------- reasoning

QWEN3 = "<think>\nThe user greets.\n</think>\n\nHello!"


def test_qwen3_reasoning():
    message = check_streams_match(ChatOutput(ReasoningParser.named("qwen3")), QWEN3)
    assert message["reasoning_content"] == "\nThe user greets.\n" and message["content"] == "\n\nHello!"
    # No <think> at the start: no reasoning (thinking off, or a model that does not reason).
    for text in ("Hello!", "Say <think> to me"):
        assert check_streams_match(ChatOutput(ReasoningParser.named("qwen3")), text)["content"] == text


def test_deepseek_r1_reasoning_starts_in_the_prompt():
    parser = ChatOutput(ReasoningParser.named("deepseek_r1"))
    for text in ("The user greets.</think>Hello!", "<think>The user greets.</think>Hello!"):
        message = check_streams_match(parser, text)
        assert (message["reasoning_content"], message["content"]) == ("The user greets.", "Hello!")
    # Never closed (cut off by max_tokens): all of it is reasoning.
    assert check_streams_match(parser, "Still thinking <th")["reasoning_content"] == "Still thinking <th"


def test_tool_calls_are_read_after_the_reasoning():
    output = ChatOutput(ReasoningParser.named("qwen3"), HermesToolParser())
    text = "<think>I need the weather; <tool_call> would help.</think>\n" + HERMES
    message = check_streams_match(output, text)
    assert message["reasoning_content"] == "I need the weather; <tool_call> would help."
    assert [c["name"] for c in message["tool_calls"].values()] == ["get_weather", "get_time"]
    response = output.message(text)
    assert response.reasoning == response.reasoning_content and response.content == "\nLet me check.\n"


def test_finish_reason_and_message_shape():
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length" and finish_reason("stop", False) == "stop"
    only_calls = ChatOutput(tools=NamedToolParser("f")).message("{}").model_dump()
    assert only_calls["content"] is None and only_calls["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert "reasoning_content" not in only_calls
    plain = ChatOutput().message("hi").model_dump()
    assert plain == {"role": "assistant", "content": "hi"}, "no tool or reasoning keys without them"
