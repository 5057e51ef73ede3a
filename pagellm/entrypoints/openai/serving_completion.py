"""POST /v1/completions: one text or token-id prompt, streamed or not."""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.logprobs import completion_logprobs
from pagellm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagellm.entrypoints.openai.serving_base import OpenAIServing
from pagellm.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        prompt = _single_prompt(request.prompt)
        if isinstance(prompt, str):
            engine_prompt = {"prompt": prompt, "prompt_token_ids": self.tokenizer().encode(prompt)}
        else:
            engine_prompt = {"prompt_token_ids": prompt}
        self.check_prompt_ids(engine_prompt["prompt_token_ids"], "prompt")
        num_prompt_tokens = len(engine_prompt["prompt_token_ids"])
        self.check_fits(request, num_prompt_tokens, "prompt", request.max_tokens, "max_tokens")
        params = self.sampling_params(request, request.max_tokens)
        request_id = self.make_request_id("cmpl", request.request_id, raw_request)

        first, outputs = await self.start(engine_prompt, params, request_id)
        # After truncate_prompt_tokens the echo is what the model saw.
        echo = self._echo_text(prompt, first, num_prompt_tokens, request) if request.echo else ""
        if request.stream:
            return self.event_stream(self._chunks(first, outputs, request, request_id, model, echo), raw_request)
        final = await self.last(first, outputs, raw_request)
        choices = [CompletionChoice(index=o.index, text=echo + o.text, finish_reason=o.finish_reason,
                                    logprobs=self._logprobs(final, o, request, 0, True),
                                    stop_reason=o.stop_reason,
                                    prompt_logprobs=final.prompt_logprobs if request.prompt_logprobs is not None
                                    else None)
                   for o in final.outputs]
        response = CompletionResponse(id=request_id, model=model, choices=choices, usage=self.usage(final))
        return JSONResponse(response.model_dump())

    def _echo_text(self, prompt: str | list[int], first: RequestOutput, num_prompt_tokens: int,
                   request: CompletionRequest) -> str:
        if isinstance(prompt, str) and len(first.prompt_token_ids) == num_prompt_tokens:
            return prompt
        return self.tokenizer().decode(first.prompt_token_ids, skip_special_tokens=request.skip_special_tokens)

    def _logprobs(self, out: RequestOutput, o: CompletionOutput, request: CompletionRequest, text_offset: int,
                  opening: bool) -> CompletionLogprobs | None:
        """`o`'s logprobs, its text starting at `text_offset` in the choice; `opening` (the choice's
        first chunk) puts an echoed prompt's logprobs first."""
        if request.logprobs is None or o.logprobs is None:
            return None
        token_ids, entries = o.token_ids, o.logprobs
        if opening and request.echo:
            token_ids, entries = [*out.prompt_token_ids, *token_ids], [*(out.prompt_logprobs or ()), *entries]
        return completion_logprobs(token_ids, entries, text_offset, self.engine.tokenizer)

    async def _chunks(self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None],
                      request: CompletionRequest, request_id: str, model: str,
                      echo: str) -> AsyncGenerator[CompletionResponse, None]:
        created = int(time.time())
        sent: dict[int, int] = {}  # characters of each choice's text sent so far
        num_tokens: dict[int, int] = {}
        last = first
        async for last, o in self.deltas(first, outputs, num_tokens):
            opening = o.index not in sent
            text = echo + o.text if opening else o.text
            logprobs = self._logprobs(last, o, request, sent.get(o.index, 0), opening)
            sent[o.index] = sent.get(o.index, 0) + len(text)
            choice = CompletionChoice(index=o.index, text=text, logprobs=logprobs, finish_reason=o.finish_reason,
                                      stop_reason=o.stop_reason)
            yield CompletionResponse(id=request_id, created=created, model=model, choices=[choice])
        if request.stream_options is not None and request.stream_options.include_usage:
            yield CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                     usage=self.usage(last, sum(num_tokens.values())))


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(f"a list of {len(prompt)} prompts in one request is not supported yet; "
                           "send one request per prompt", param="prompt")
        return prompt[0]
    return prompt
