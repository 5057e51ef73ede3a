"""How a choice's generated text becomes the assistant message: the reasoning first (with
--reasoning-parser), then tool calls read from the text after it (serving_tools.py), whole for a
response and as deltas for a stream. Both run the same parsers over the text, so a stream
assembles into the message a response would hold."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai.protocol import AssistantMessage
from pagellm.entrypoints.openai.protocol_tools import FunctionCall, ToolCall
from pagellm.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParser
from pagellm.reasoning.parsers import ReasoningParser


@dataclass(frozen=True, slots=True)
class ChatOutput:
    """The parsers a chat request's choices go through (none: the text is the content)."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None

    def message(self, text: str) -> AssistantMessage:
        """The message a finished choice's `text` holds."""
        if self.reasoning is None and self.tools is None:
            return AssistantMessage(content=text)
        reasoning, content = None, text
        if self.reasoning is not None:
            split = self.reasoning.split(text, final=True)
            reasoning, content = split.reasoning or None, split.content
        calls = None
        if self.tools is not None:
            parsed = self.tools.extract(content)
            content = parsed.content
            calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls] or None
        return AssistantMessage(content=content or None, tool_calls=calls, reasoning_content=reasoning,
                                reasoning=reasoning)

    def stream(self) -> "ChoiceStream":
        return ChoiceStream(self)


def finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """A choice that called tools and ended by itself finishes with "tool_calls", as OpenAI's do."""
    return "tool_calls" if called_tools and reason == "stop" else reason


class ChoiceStream:
    """One streamed choice: `delta` turns each new piece of text into the chunk's delta."""

    def __init__(self, output: ChatOutput) -> None:
        self.output = output
        self._text = ""
        self._reasoning_sent = 0
        self._content_sent = 0
        self._tools = ToolCallStreamer(output.tools) if output.tools is not None else None

    @property
    def called_tools(self) -> bool:
        return self._tools is not None and self._tools.called

    def delta(self, added: str, final: bool) -> dict[str, Any]:
        """What to send for `added` text; `final`: the choice's text is complete."""
        if self.output.reasoning is None and self._tools is None:
            return {"content": added} if added else {}
        self._text += added
        delta: dict[str, Any] = {}
        content = self._text
        if self.output.reasoning is not None:
            split = self.output.reasoning.split(self._text, final)
            content = split.content
            reasoning = (split.reasoning or "")[self._reasoning_sent:]
            if reasoning:
                delta["reasoning_content"] = delta["reasoning"] = reasoning
                self._reasoning_sent += len(reasoning)
        if self._tools is not None:
            new_content, calls = self._tools.update(content, final)
            if calls:
                delta["tool_calls"] = calls
        else:
            new_content = content[self._content_sent:]
            self._content_sent = len(content)
        if new_content:
            delta["content"] = new_content
        return delta
