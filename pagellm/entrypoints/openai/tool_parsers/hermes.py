"""`hermes`: Hermes 2 Pro / Qwen2.5 / Qwen3 style, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Text before the first `<tool_call>` is the message content; text between and after the calls is
dropped (models put newlines there). A call without its closing tag still counts if its JSON is
complete: generation may stop right after it.
"""
from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    call_from_object,
    content_before,
)
from pagellm.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, scan_object, skip_whitespace

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, start = content_before(text, START, final)
        parsed = ParsedOutput(content)
        while start >= 0:
            i = skip_whitespace(text, start + len(START))
            if i == len(text):
                parsed.calls.append(ParsedCall(None, "", False))
                break
            try:
                obj = scan_object(text, i)
            except MalformedJSON:
                parsed.calls.append(ParsedCall(None, "", False))
                break
            parsed.calls.append(call_from_object(text, obj, ("arguments",)))
            if obj.end is None:
                break
            start = text.find(START, obj.end)
        return parsed
