"""POST /v1/chat/completions: a conversation through the chat template, streamed or not."""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    UsageInfo,
)
from pagellm.entrypoints.openai.serving_base import OpenAIServing
from pagellm.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        text, token_ids = self.render_chat(request)
        if request.max_completion_tokens is not None:
            max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = request.max_tokens, "max_tokens"
        self.check_fits(len(token_ids), "messages", max_tokens, param)
        params = request.to_sampling_params(max_tokens)
        request_id = self.make_request_id("chatcmpl", request.request_id)

        first, outputs = await self.start({"prompt": text, "prompt_token_ids": token_ids}, params, request_id)
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            return self.event_stream(self._chunks(first, outputs, request_id, model, request.n, include_usage))
        final = await self.last(first, outputs, raw_request)
        choices = [ChatChoice(index=o.index, message=AssistantMessage(content=o.text), finish_reason=o.finish_reason,
                              stop_reason=o.stop_reason) for o in final.outputs]
        response = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=self.usage(final))
        return JSONResponse(response.model_dump())

    async def _chunks(self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None], request_id: str,
                      model: str, n: int, include_usage: bool) -> AsyncGenerator[ChatCompletionChunk, None]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)

        # OpenAI's first chunk names the role, with no content yet.
        yield chunk([ChatStreamChoice(index=i, delta={"role": "assistant", "content": ""}) for i in range(n)])
        sent: dict[int, int] = {}  # characters of each choice's text already sent (outputs are cumulative)
        final = first
        async for final in self.follow(first, outputs):
            for o in final.outputs:
                delta = o.text[sent.get(o.index, 0):]
                if not delta and o.finish_reason is None:
                    continue  # a token that completes no character yet
                sent[o.index] = len(o.text)
                yield chunk([ChatStreamChoice(index=o.index, delta={"content": delta} if delta else {},
                                              finish_reason=o.finish_reason, stop_reason=o.stop_reason)])
        if include_usage:
            yield chunk([], self.usage(final))
