"""POST /v1/chat/completions: a conversation through the chat template, streamed or not."""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.logprobs import chat_logprobs
from pagellm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    UsageInfo,
)
from pagellm.entrypoints.openai.serving_base import OpenAIServing
from pagellm.outputs import CompletionOutput, RequestOutput


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        request_id = self.make_request_id("chatcmpl", request.request_id, raw_request)
        run = await self.start_chat(request, request_id)
        model, first, outputs = run.model, run.first, run.outputs
        if request.stream:
            return self.event_stream(self._chunks(first, outputs, request, request_id, model), raw_request)
        final = await self.last(first, outputs, raw_request)
        choices = [ChatChoice(index=o.index, message=AssistantMessage(content=o.text),
                              logprobs=self._logprobs(o, request), finish_reason=o.finish_reason,
                              stop_reason=o.stop_reason) for o in final.outputs]
        response = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=self.usage(final),
                                          prompt_logprobs=final.prompt_logprobs)
        return JSONResponse(response.model_dump())

    def _logprobs(self, o: CompletionOutput, request: ChatCompletionRequest) -> ChatLogprobs | None:
        if not request.logprobs or o.logprobs is None:
            return None
        return chat_logprobs(o.token_ids, o.logprobs, request.top_logprobs or 0, self.engine.tokenizer)

    async def _chunks(self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None],
                      request: ChatCompletionRequest, request_id: str,
                      model: str) -> AsyncGenerator[ChatCompletionChunk, None]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)

        # OpenAI's first chunk of each choice names the role, with no content yet.
        for i in range(request.n):
            yield chunk([ChatStreamChoice(index=i, delta={"role": "assistant", "content": ""})])
        num_tokens: dict[int, int] = {}
        last = first
        async for last, o in self.deltas(first, outputs, num_tokens):
            yield chunk([ChatStreamChoice(index=o.index, delta={"content": o.text} if o.text else {},
                                          logprobs=self._logprobs(o, request), finish_reason=o.finish_reason,
                                          stop_reason=o.stop_reason)])
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk([], self.usage(last, sum(num_tokens.values())))
