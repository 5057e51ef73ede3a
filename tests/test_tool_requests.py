"""How tool-calling and structured-output request fields become one output constraint, without a
server: the grammars tool_choice builds (checked against xgrammar's parser and jsonschema), the
defaults and the refusals, and what the chat template receives."""
from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from pagellm.cli import build_parser
from pagellm.entrypoints.openai.constraints import one_constraint, request_constraints
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.entrypoints.openai.serving_tools import NO_TOOLS, plan_tools
from pagellm.entrypoints.openai.tool_parsers import HermesToolParser, JsonArrayToolParser, NamedToolParser

HI = [{"role": "user", "content": "hi"}]
ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}}, "required": ["street"]}


def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


WEATHER = tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
SHIP = tool("ship", {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
                     "$defs": {"Address": ADDRESS}})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=HI, **fields)


def test_required_builds_an_array_of_calls_with_shared_definitions():
    plan = plan_tools(chat(tools=[WEATHER, SHIP, tool("now")], tool_choice="required"), None)
    assert isinstance(plan.parser, JsonArrayToolParser) and plan.constraint.field == "tools"
    schema = plan.constraint.params.json
    assert schema["$defs"] == {"Address": ADDRESS} and "maxItems" not in schema
    xgr.Grammar.from_json_schema(json.dumps(schema))  # xgrammar's parser takes it
    calls = [{"name": "ship", "parameters": {"to": {"street": "Main St"}}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(calls, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ship", "parameters": {"to": {}}}], schema)
    parsed = plan.parser.extract(json.dumps(calls))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [(c["name"], c["parameters"]) for c in calls]
    single = plan_tools(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), None)
    assert single.constraint.params.json["maxItems"] == 1
    assert SHIP["function"]["parameters"]["$defs"], "the request's own schema is left as it was"


def test_named_function_constrains_to_its_arguments():
    plan = plan_tools(chat(tools=[WEATHER, tool("now")], tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}}), None)
    assert isinstance(plan.parser, NamedToolParser) and plan.parser.name == "get_weather"
    assert plan.constraint.params.json == WEATHER["function"]["parameters"]
    no_parameters = plan_tools(chat(tools=[tool("now")], tool_choice={"type": "function", "function": {"name": "now"}}),
                               None)
    assert no_parameters.constraint.params.json == {"type": "object", "properties": {}}
    error = no_parameters.constraint.error("is not supported: Unsupported type")
    assert error.message == "tools[0].function.parameters: the parameters of function 'now' is not supported: " \
                            "Unsupported type"
    assert error.param == "tools[0].function.parameters"
    second = plan_tools(chat(tools=[WEATHER, tool("now")],
                             tool_choice={"type": "function", "function": {"name": "now"}}), None)
    assert second.constraint.error("x").param == "tools[1].function.parameters"


def test_tool_choice_defaults_and_auto():
    hermes = HermesToolParser()
    assert plan_tools(chat(), None) is NO_TOOLS
    assert plan_tools(chat(tools=[WEATHER], tool_choice="none"), None) is NO_TOOLS
    assert plan_tools(chat(tools=[WEATHER]), hermes).parser is hermes, "auto is the default with tools"
    assert plan_tools(chat(tools=[WEATHER]), hermes).constraint is None, "auto does not constrain the output"


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": []}, "tools", "must not be empty"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools", "more than one function named 'get_weather'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "ship"}}}, "tool_choice",
     "not among tools ('get_weather')"),
    ({"tools": [SHIP, tool("ship2", {"$defs": {"Address": {"type": "integer"}}})], "tool_choice": "required"},
     "tools", "`$defs` entry 'Address' differently"),
])
def test_tool_refusals_name_the_field(fields, param, message):
    with pytest.raises(APIError) as e:
        plan_tools(chat(**fields), None)
    assert e.value.param == param and message in e.value.message


def test_each_constraint_field_maps_to_the_engine_params():
    """Each field gives its kind of spec, and errors about the spec name where in the request it is."""
    schema = {"type": "object"}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
              "response_format", "json", schema, "response_format.json_schema.schema"),
             ({"response_format": {"type": "json_object"}}, "response_format", "json_object", True,
              "response_format"),
             ({"structured_outputs": {"json": schema}}, "structured_outputs", "json", schema,
              "structured_outputs.json"),
             ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs", "grammar", 'root ::= "a"',
              "structured_outputs.grammar"),
             ({"guided_json": json.dumps(schema)}, "guided_json", "json", json.dumps(schema), "guided_json"),
             ({"guided_regex": "a+"}, "guided_regex", "regex", "a+", "guided_regex"),
             ({"guided_choice": ["a", "b"]}, "guided_choice", "choice", ["a", "b"], "guided_choice"),
             ({"guided_grammar": "root ::= \"a\""}, "guided_grammar", "grammar", 'root ::= "a"', "guided_grammar")]
    for fields, field, kind, value, param in cases:
        for request in (CompletionRequest(prompt="x", **fields), chat(**fields)):
            constraint = one_constraint(request_constraints(request))
            assert (constraint.field, constraint.params.kind, getattr(constraint.params, kind)) == (field, kind, value)
            assert constraint.error("is not supported").param == param
    assert one_constraint(request_constraints(chat(response_format={"type": "text"}))) is None
    compact = request_constraints(chat(structured_outputs={"regex": "a", "disable_any_whitespace": True}))
    assert compact[0].params.disable_any_whitespace


def test_the_chat_template_gets_tool_calls_as_sent_with_object_arguments():
    request = ChatCompletionRequest(messages=[*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}])
    user, assistant, result = (m.for_template() for m in request.messages)
    assert user == {"role": "user", "content": "hi"}, "no keys the client did not send (templates test for them)"
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [{"city": "Paris"}, "not json"]
    assert assistant["content"] is None and result == {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}


def test_tool_call_parser_flag_takes_vllms_names():
    ns = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert (ns.enable_auto_tool_choice, ns.tool_call_parser) == (True, "hermes")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "pythonic"])
