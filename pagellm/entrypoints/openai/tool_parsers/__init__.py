"""Tool-call parsers, by the names vLLM's `--tool-call-parser` uses: each reads the calls a model
family writes into its text (for `tool_choice: "auto"`), plus the parsers for the outputs that
`required` and a named `tool_choice` constrain with a grammar. `TOOL_PARSER_REGISTRY` lists the
`--tool-call-parser` names; `register_tool_parser` adds one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.config.registry import Registry, check_ref, resolve
from pagellm.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser
from pagellm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagellm.entrypoints.openai.tool_parsers.json_array import JsonArrayToolParser, MistralToolParser
from pagellm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagellm.entrypoints.openai.tool_parsers.named import NamedToolParser
from pagellm.entrypoints.openai.tool_parsers.streaming import ToolCallStreamer, tool_call_id


@dataclass(frozen=True, slots=True)
class ToolParserEntry:
    """A `--tool-call-parser`: how a model family writes tool calls in its text."""

    name: str
    cls: Any
    """A `ToolParser` subclass (constructed without arguments), or its "package.module:Class" name."""
    description: str = ""
    """What `--help` says of it: the format, and the models that write it."""


TOOL_PARSER_REGISTRY: Registry[ToolParserEntry] = Registry("tool parser", "--tool-call-parser", builtins=(
    ToolParserEntry("hermes", HermesToolParser, "<tool_call>{...}</tool_call>: Hermes, Qwen2.5, Qwen3"),
    ToolParserEntry("llama3_json", Llama3JsonToolParser, "Llama 3.x JSON"),
    ToolParserEntry("mistral", MistralToolParser, "[TOOL_CALLS][...]"),
))
"""Every `--tool-call-parser`, by name."""


def register_tool_parser(name: str, parser_cls: type[ToolParser] | str, *, description: str = "",
                         override: bool = False) -> None:
    """Make `name` a `--tool-call-parser`: `parser_cls` (a `ToolParser` subclass constructed without
    arguments, or its "package.module:Class" name). A name already registered is refused unless
    `override`."""
    check_ref(parser_cls, f"register_tool_parser({name!r})")
    if not isinstance(parser_cls, str):
        _check_parser_class(parser_cls, name)
    TOOL_PARSER_REGISTRY.register(ToolParserEntry(name, parser_cls, description), override=override)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class of `--tool-call-parser name`."""
    return _check_parser_class(resolve(TOOL_PARSER_REGISTRY.get(name).cls), name)


def _check_parser_class(cls: Any, name: str) -> type[ToolParser]:
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise ValueError(f"tool parser {name!r} must be a subclass of "
                         f"pagellm.entrypoints.openai.tool_parsers.ToolParser, got {cls!r}")
    return cls


__all__ = ["TOOL_PARSER_REGISTRY", "HermesToolParser", "JsonArrayToolParser", "Llama3JsonToolParser",
           "MistralToolParser", "NamedToolParser", "ParsedCall", "ParsedOutput", "ToolCallStreamer", "ToolParser",
           "ToolParserEntry", "get_tool_parser", "register_tool_parser", "tool_call_id"]
