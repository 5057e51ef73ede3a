"""Request and response bodies of Anthropic's Messages API (POST /v1/messages), text in and out."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pagellm.entrypoints.openai.protocol import Int64, StrictModel


class TextBlock(StrictModel):
    """The only content block accepted: images, documents, tool use and results are refused."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    """Accepted and ignored: the prefix cache reuses a repeated prompt prefix by itself."""
    citations: list[Any] | None = None


def joined(content: str | list[TextBlock]) -> str:
    """A message's text; text blocks are joined by newlines."""
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class CountTokensRequest(StrictModel):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Int64
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: Int64 | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    """Accepted and ignored, as on text blocks."""


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicUsage(BaseModel):
    input_tokens: int
    """Prompt tokens not read from the prefix cache (Anthropic counts cache reads apart)."""
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextContent]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence"] | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class MessagesEvent(BaseModel, extra="allow"):
    """One streamed event: its `type` names the SSE event; the other fields depend on it."""

    type: str
