"""Tool calls as a JSON array of `{"name": ..., "<arguments key>": {...}}` objects, optionally after a
marker: Mistral's `[TOOL_CALLS][...]` (`mistral`), and the output `tool_choice: "required"` is
constrained to (no marker, `parameters`, as vLLM builds that grammar)."""
from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    call_from_object,
    content_before,
)
from pagellm.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, scan_objects, skip_whitespace


class JsonArrayToolParser(ToolParser):
    def __init__(self, marker: str = "", argument_keys: tuple[str, ...] = ("parameters",)) -> None:
        self.marker = marker
        """Text before the array ("": the array is the whole output); what precedes it is content."""
        self.argument_keys = argument_keys

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, start = content_before(text, self.marker, final) if self.marker else ("", 0)
        if start < 0:
            return ParsedOutput(content)
        i = skip_whitespace(text, start + len(self.marker))
        if i == len(text):
            return ParsedOutput(content, [ParsedCall(None, "", False)])
        # One call may come as a bare object rather than an array of one.
        first = i + 1 if text[i] == "[" else i
        try:
            objects, _ = scan_objects(text, first, ",")
        except MalformedJSON:
            objects = None
        if not objects:
            return ParsedOutput(content, [ParsedCall(None, "", False)])
        return ParsedOutput(content, [call_from_object(text, obj, self.argument_keys) for obj in objects])


class MistralToolParser(JsonArrayToolParser):
    """`mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the array format of Mistral
    7B v0.3 and Mistral Small/Nemo). `[TOOL_CALLS]` is a special token, so it is kept in the text."""

    needs_special_tokens = True

    def __init__(self) -> None:
        super().__init__("[TOOL_CALLS]", ("arguments",))
