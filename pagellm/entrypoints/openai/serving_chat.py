"""POST /v1/chat/completions: a conversation through the chat template, streamed or not."""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.chat_output import ChatOutput, finish_reason
from pagellm.entrypoints.openai.logprobs import chat_logprobs
from pagellm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    UsageInfo,
)
from pagellm.entrypoints.openai.serving_base import OpenAIServing, Started
from pagellm.outputs import CompletionOutput


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        request_id = self.make_request_id("chatcmpl", request.request_id, raw_request)
        run = await self.start_chat(request, request_id, raw_request)
        model, started = run.model, run.started
        if request.stream:
            return self.event_stream(self._chunks(started, run.output, request, request_id, model), raw_request)
        [final] = await self.finals([started], raw_request)
        choices = []
        for o in final.outputs:
            message = run.output.message(o.text)
            choices.append(ChatChoice(
                index=o.index, message=message, logprobs=self._logprobs(o, request),
                finish_reason=finish_reason(o.finish_reason, bool(message.tool_calls)), stop_reason=o.stop_reason,
                token_ids=o.token_ids if request.return_token_ids else None))
        response = ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=self.usage([final]),
            prompt_logprobs=final.prompt_logprobs,
            prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None,
            kv_transfer_params=final.kv_transfer_params)
        return JSONResponse(response.model_dump())

    def _logprobs(self, o: CompletionOutput, request: ChatCompletionRequest) -> ChatLogprobs | None:
        if not request.logprobs or o.logprobs is None:
            return None
        return chat_logprobs(o.token_ids, o.logprobs, request.top_logprobs or 0, self.engine.tokenizer,
                             request.return_tokens_as_token_ids)

    async def _chunks(self, started: Started, output: ChatOutput, request: ChatCompletionRequest, request_id: str,
                      model: str) -> AsyncGenerator[ChatCompletionChunk, None]:
        created = int(time.time())
        first = started[0]
        num_tokens: dict[int, int] = {}
        streams = [output.stream() for _ in range(request.n)]

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
            if usage is None and request.continuous_usage:
                usage = self.usage([first], sum(num_tokens.values()))
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)

        # OpenAI's first chunk of each choice names the role, with no content yet.
        for i in range(request.n):
            opening = chunk([ChatStreamChoice(index=i, delta={"role": "assistant", "content": ""})])
            if request.return_token_ids and i == 0:
                opening.prompt_token_ids = first.prompt_token_ids
            yield opening
        async for index, _, o in self.deltas([started], num_tokens):
            stream = streams[index]
            delta = stream.delta(o.text, final=o.finish_reason is not None)
            logprobs = self._logprobs(o, request)
            if not delta and o.finish_reason is None and logprobs is None and not request.return_token_ids:
                continue  # text held back (a tag that may be starting): nothing to say yet
            yield chunk([ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                          finish_reason=finish_reason(o.finish_reason, stream.called_tools),
                                          stop_reason=o.stop_reason,
                                          token_ids=o.token_ids if request.return_token_ids else None)])
        if request.final_usage:
            yield chunk([], self.usage([first], sum(num_tokens.values())))
