"""What a chat request's `tools` and `tool_choice` ask of the output, as vLLM reads them.

- `none` (the default without tools): plain content; the template still sees the tools.
- `auto` (the default with tools): the model decides; the server's `--tool-call-parser` reads the
  calls out of its text. Needs `--enable-auto-tool-choice`, else a 400 (as vLLM).
- `required`: the output is constrained to a JSON array of one or more `{"name", "parameters"}`
  objects, one schema per tool (at most one call with `parallel_tool_calls: false`).
- a named function: the output is constrained to that function's arguments object.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai.constraints import OutputConstraint
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.protocol_tools import NamedToolChoice, Tool
from pagellm.entrypoints.openai.tool_parsers import JsonArrayToolParser, NamedToolParser, ToolParser
from pagellm.sampling_params import StructuredOutputsParams

_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a chat request's output is constrained and read for tool calls."""

    constraint: OutputConstraint | None = None
    parser: ToolParser | None = None
    """Reads the calls out of the output; None: the output is plain content."""


NO_TOOLS = ToolPlan()


def plan_tools(request: ChatCompletionRequest, auto_parser: ToolParser | None) -> ToolPlan:
    """The plan for `request`; `auto_parser` is the server's --tool-call-parser when
    --enable-auto-tool-choice is on. 400 naming the field for tools and choices that do not fit."""
    tools, choice = request.tools, request.tool_choice
    if tools is not None and not tools:
        raise APIError("tools must not be empty: send at least one tool, or leave the field out", param="tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise APIError(f"tool_choice {_describe(choice)} needs tools to choose from; send `tools`", param="tool_choice")
    names = [tool.function.name for tool in tools or ()]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise APIError(f"tools holds more than one function named {', '.join(map(repr, duplicated))}", param="tools")
    if choice == "none":
        return NO_TOOLS
    if choice == "auto":
        if auto_parser is None:
            raise APIError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                           '--tool-call-parser; send tool_choice "required" or a named function instead, or '
                           '"none"', param="tool_choice")
        return ToolPlan(parser=auto_parser)
    if choice == "required":
        schema = _calls_schema(tools, request.parallel_tool_calls)
        return ToolPlan(OutputConstraint(StructuredOutputsParams(json=schema), "tools",
                                         "JSON schema of the calls (from the tools' parameters)"),
                        JsonArrayToolParser())
    index, tool = next(((i, t) for i, t in enumerate(tools) if t.function.name == choice.function.name), (0, None))
    if tool is None:
        raise APIError(f"tool_choice names the function {choice.function.name!r}, which is not among tools "
                       f"({', '.join(map(repr, names))})", param="tool_choice")
    schema = tool.function.parameters if tool.function.parameters is not None else _NO_PARAMETERS
    return ToolPlan(OutputConstraint(StructuredOutputsParams(json=schema), "tools",
                                     f"parameters of function {tool.function.name!r}",
                                     f"tools[{index}].function.parameters"),
                    NamedToolParser(tool.function.name))


def _describe(choice: str | NamedToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming {choice.function.name!r}"


def _calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """An array of one or more calls, each `{"name": <a tool's name>, "parameters": <its arguments>}`.
    Each tool's `$defs` move to the root, where its `#/$defs/...` references point once its schema
    sits inside the array's."""
    definitions: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = copy.deepcopy(tool.function.parameters) if tool.function.parameters is not None else _NO_PARAMETERS
        shared = parameters.pop("$defs", {})
        if not isinstance(shared, dict):
            raise APIError(f"tools: the `$defs` of function {tool.function.name!r} must be an object", param="tools")
        for name, definition in shared.items():
            if definitions.setdefault(name, definition) != definition:
                raise APIError(f"tools define `$defs` entry {name!r} differently; with tool_choice \"required\" "
                               "their definitions share one namespace", param="tools")
        variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                          "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema
