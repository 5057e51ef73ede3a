"""`llama3_json`: Llama 3.1-3.3's JSON tool calls, `{"name": ..., "parameters": {...}}`.

The output is either a call (optionally after `<|python_tag|>`; several are separated by `;`) or
plain content: it is a call when it starts with an object whose keys are only `name` and
`parameters` (or `arguments`). Until that is known, a stream holds the text back.
"""
from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser, call_from_object
from pagellm.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, scan_objects, skip_whitespace

PYTHON_TAG = "<|python_tag|>"
_CALL_KEYS = frozenset({"name", "parameters", "arguments"})


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_whitespace(text, i + len(PYTHON_TAG))
        elif not final and i < len(text) and PYTHON_TAG.startswith(text[i:]):
            return ParsedOutput("")  # perhaps the tag, cut off
        if i == len(text):
            return ParsedOutput(text if final else "")
        if text[i] != "{":
            return ParsedOutput(text)
        try:
            objects, _ = scan_objects(text, i, ";")
        except MalformedJSON:
            return ParsedOutput(text)
        if any(member.key not in _CALL_KEYS for obj in objects for member in obj.members):
            return ParsedOutput(text)
        return ParsedOutput("", [call_from_object(text, obj, ("parameters", "arguments")) for obj in objects])
