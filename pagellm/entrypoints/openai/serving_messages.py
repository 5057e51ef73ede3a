"""POST /v1/messages (and /v1/messages/count_tokens): Anthropic's Messages API, as a chat request
on the chat completions path. Its errors take Anthropic's shape (errors.py picks it by path)."""
from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ChatPromptFields, UsageInfo
from pagellm.entrypoints.openai.protocol_anthropic import (
    AnthropicUsage,
    CountTokensRequest,
    CountTokensResponse,
    MessagesEvent,
    MessagesRequest,
    MessagesResponse,
    TextContent,
    joined,
)
from pagellm.entrypoints.openai.serving_base import ChatRun, OpenAIServing
from pagellm.outputs import CompletionOutput

_NAMES = {"stop": "stop_sequences"}
"""Chat request fields -> the Messages API's names for them, for error messages."""


class AnthropicServingMessages(OpenAIServing):
    async def create_message(self, request: MessagesRequest, raw_request: Request) -> Response:
        chat = ChatCompletionRequest(model=request.model, messages=_conversation(request), stream=request.stream,
                                     max_tokens=request.max_tokens, stop=request.stop_sequences,
                                     temperature=request.temperature, top_p=request.top_p, top_k=request.top_k)
        run = await self.start_chat(chat, self.make_request_id("msg", None, raw_request), raw_request, _NAMES)
        message_id = f"msg_{uuid.uuid4().hex}"
        if request.stream:
            return self.event_stream(self._events(run, message_id), raw_request, named=True)
        [final] = await self.finals([run.started], raw_request)
        o = final.outputs[0]
        stop_reason, stop_sequence = _stop(o)
        # Without the reasoning (--reasoning-parser) the output may begin with.
        text = run.output.message(o.text).content or ""
        message = MessagesResponse(id=message_id, model=run.model, content=[TextContent(text=text)],
                                   stop_reason=stop_reason, stop_sequence=stop_sequence,
                                   usage=_usage(self.usage([final])))
        return JSONResponse(message.model_dump())

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        """The prompt's length in tokens, as /v1/messages would render it."""
        self.check_model(request.model)
        _, token_ids = await self.render_chat(ChatPromptFields(messages=_conversation(request)))
        return CountTokensResponse(input_tokens=len(token_ids))

    async def _events(self, run: ChatRun, message_id: str) -> AsyncGenerator[MessagesEvent, None]:
        """The stream's events, as Anthropic sends them: one text block, then the stop reason and usage."""
        start = MessagesResponse(id=message_id, model=run.model, content=[], usage=_usage(self.usage([run.first], 0)))
        yield MessagesEvent(type="message_start", message=start.model_dump())
        yield MessagesEvent(type="content_block_start", index=0, content_block={"type": "text", "text": ""})
        yield MessagesEvent(type="ping")
        num_tokens: dict[int, int] = {}
        last = None
        choice = run.output.stream()  # the content deltas, without the reasoning
        async for _, _, last in self.deltas([run.started], num_tokens):
            content = choice.delta(last.text, last.finish_reason is not None).get("content")
            if content:
                yield MessagesEvent(type="content_block_delta", index=0,
                                    delta={"type": "text_delta", "text": content})
        yield MessagesEvent(type="content_block_stop", index=0)
        stop_reason, stop_sequence = _stop(last)
        yield MessagesEvent(type="message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            usage={"output_tokens": sum(num_tokens.values())})
        yield MessagesEvent(type="message_stop")


def _conversation(request: CountTokensRequest) -> list[ChatMessage]:
    """The system prompt and messages as the chat path's messages; 400 for what it cannot run."""
    if request.tools:
        raise APIError("tools are not supported by this server yet; remove them from the request", param="tools")
    if request.tool_choice is not None and request.tool_choice.get("type") not in ("auto", "none"):
        raise APIError("tool_choice needs tools, which this server does not support yet; remove it",
                       param="tool_choice")
    if request.thinking is not None and request.thinking.get("type") != "disabled":
        raise APIError('extended thinking is not supported by this server: omit thinking or send {"type": '
                       '"disabled"}', param="thinking")
    system: list[dict[str, Any]] = [] if request.system is None else [
        {"role": "system", "content": joined(request.system)}]
    return [ChatMessage.model_validate(m) for m in
            system + [{"role": m.role, "content": joined(m.content)} for m in request.messages]]


def _stop(o: CompletionOutput) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished sequence."""
    if o.finish_reason == "length":
        return "max_tokens", None
    if isinstance(o.stop_reason, str):
        return "stop_sequence", o.stop_reason
    return "end_turn", None


def _usage(usage: UsageInfo) -> AnthropicUsage:
    cached = usage.prompt_tokens_details.cached_tokens
    return AnthropicUsage(input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
                          cache_read_input_tokens=cached)
