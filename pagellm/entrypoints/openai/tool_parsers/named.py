"""The output of `tool_choice: {"type": "function", "function": {"name": ...}}`: the grammar makes
the whole output the named function's arguments object."""
from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser, is_json_object
from pagellm.entrypoints.openai.tool_parsers.json_scan import skip_whitespace, value_end


class NamedToolParser(ToolParser):
    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_whitespace(text, 0)
        end = value_end(text, start)
        arguments = text[start:end]
        return ParsedOutput("", [ParsedCall(self.name, arguments, is_json_object(arguments))])
