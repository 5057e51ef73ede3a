"""A stream's tool calls as OpenAI sends them: per call, a first delta with its index, id, type and
name, then fragments of its arguments' JSON text, which clients concatenate."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser


def tool_call_id() -> str:
    """A new call's id (vLLM's form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class _SentCall:
    id: str
    arguments_sent: int
    """Characters of the arguments' text sent so far."""


class ToolCallStreamer:
    """One choice's stream: each `update` with the text so far gives what to send since the last."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._content_sent = 0
        self._calls: list[_SentCall] = []

    @property
    def called(self) -> bool:
        """Whether any tool call has been sent."""
        return bool(self._calls)

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, tool-call deltas to send) for the text generated so far; `final`: the
        text is complete."""
        parsed: ParsedOutput = self.parser.parse(text, final)
        content = parsed.content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(parsed.content))
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            if index < len(self._calls):
                sent = self._calls[index]
                if len(call.arguments) > sent.arguments_sent:
                    deltas.append({"index": index, "function": {"arguments": call.arguments[sent.arguments_sent:]}})
                    sent.arguments_sent = len(call.arguments)
            elif call.name is not None:
                sent = _SentCall(tool_call_id(), len(call.arguments))
                self._calls.append(sent)
                deltas.append({"index": index, "id": sent.id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
            else:
                break  # calls go out in order: a later one waits for this one's name
        return content, deltas
