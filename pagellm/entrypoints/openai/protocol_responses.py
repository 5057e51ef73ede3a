"""Request and response bodies of OpenAI's Responses API (POST /v1/responses): text and images in, text out.

Fields the server accepts but cannot act on (tools, background runs) are
refused by serving_responses.py with a 400 naming them; the rest of OpenAI's optional fields are
accepted, and those that do not change generation (metadata, reasoning, include, ...) are echoed
or ignored.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.openai.protocol import Int64, StrictModel


class InputContentPart(StrictModel):
    type: Literal["input_text", "output_text"]
    """Text a message holds (`output_text` when a previous response's output is sent back)."""
    text: str
    # What an output_text part sent back from a previous response also carries.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImagePart(StrictModel):
    type: Literal["input_image"]
    image_url: str
    """A data:, http(s):// or file:// URL, taken as a chat image_url part's (docs/serving.md#images)."""
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted and ignored: the model's processor decides the resolution."""


class InputMessage(StrictModel):
    """One message of the conversation; other item types (function calls, reasoning) are refused."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[InputContentPart | InputImagePart, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None

    def chat_parts(self) -> list[dict[str, Any]]:
        """The content as the chat path's text and image_url parts."""
        if isinstance(self.content, str):
            return [{"type": "text", "text": self.content}]
        return [{"type": "image_url", "image_url": {"url": p.image_url}} if isinstance(p, InputImagePart)
                else {"type": "text", "text": p.text} for p in self.content]


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    """A system message in front of the conversation; not carried over by previous_response_id."""
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    previous_response_id: str | None = None
    """Continue the conversation of a stored response (its input and output come first)."""
    store: bool = True
    """Keep this response (in memory, the last few hundred) so that a later request can continue it."""
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    text: dict[str, Any] | None = None
    """`{"format": {"type": "text" | "json_object" | "json_schema", ...}}`: the output's form, as chat's
    response_format (json_schema's fields flattened: name, schema, strict)."""
    reasoning: dict[str, Any] | None = None
    """Accepted and ignored: the model does not reason separately."""
    include: list[str] | None = None
    service_tier: str | None = None
    background: bool = False
    top_logprobs: Int64 | None = Field(default=None, ge=0)
    """Only 0 (logprobs are not returned by this endpoint)."""

    @field_validator("input", mode="before")
    @classmethod
    def _messages_only(cls, value: Any) -> Any:
        # One clear error naming the item, instead of pydantic's attempt at each branch of the union.
        if not isinstance(value, (str, list)):
            raise PydanticCustomError("invalid_input", "must be a string or a list of messages, got {kind}",
                                      {"kind": type(value).__name__})
        for i, item in enumerate(value if isinstance(value, list) else ()):
            kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
            if kind != "message":
                raise PydanticCustomError("unsupported_item", "only message items are supported by this server, "
                                          "got {kind}", {"param": f"{i}.type", "kind": repr(kind)})
        return value


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = {"effort": None, "summary": None}
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = {"format": {"type": "text"}}
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}


class ResponseEvent(BaseModel, extra="allow"):
    """One streamed event: its `type` names the SSE event; the other fields depend on it."""

    type: str
    sequence_number: int
