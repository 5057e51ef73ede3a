"""POST /v1/completions: one text or token-id prompt, streamed or not."""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from pagellm.entrypoints.openai.serving_base import OpenAIServing
from pagellm.outputs import RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        prompt = _single_prompt(request.prompt)
        if isinstance(prompt, str):
            engine_prompt = {"prompt": prompt, "prompt_token_ids": self.tokenizer().encode(prompt)}
        else:
            engine_prompt = {"prompt_token_ids": prompt}
        num_prompt_tokens = len(engine_prompt["prompt_token_ids"])
        self.check_fits(num_prompt_tokens, "prompt", request.max_tokens, "max_tokens")
        params = request.to_sampling_params(request.max_tokens, best_of=request.best_of)
        request_id = self.make_request_id("cmpl", request.request_id)
        echo = self._echo_text(prompt, request) if request.echo else ""

        first, outputs = await self.start(engine_prompt, params, request_id)
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            return self.event_stream(self._chunks(first, outputs, request_id, model, echo, include_usage))
        final = await self.last(first, outputs, raw_request)
        choices = [CompletionChoice(index=o.index, text=echo + o.text, finish_reason=o.finish_reason,
                                    stop_reason=o.stop_reason) for o in final.outputs]
        response = CompletionResponse(id=request_id, model=model, choices=choices, usage=self.usage(final))
        return JSONResponse(response.model_dump())

    def _echo_text(self, prompt: str | list[int], request: CompletionRequest) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer().decode(prompt, skip_special_tokens=request.skip_special_tokens)

    async def _chunks(self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None], request_id: str,
                      model: str, echo: str, include_usage: bool) -> AsyncGenerator[CompletionResponse, None]:
        created = int(time.time())
        sent: dict[int, int] = {}  # characters of each choice's text already sent (outputs are cumulative)
        final = first
        async for final in self.follow(first, outputs):
            for o in final.outputs:
                delta = o.text[sent.get(o.index, 0):]
                if not delta and o.finish_reason is None:
                    continue  # a token that completes no character yet
                if o.index not in sent:
                    delta = echo + delta
                sent[o.index] = len(o.text)
                choice = CompletionChoice(index=o.index, text=delta, finish_reason=o.finish_reason,
                                          stop_reason=o.stop_reason)
                yield CompletionResponse(id=request_id, created=created, model=model, choices=[choice])
        if include_usage:
            yield CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                     usage=self.usage(final))


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(f"a list of {len(prompt)} prompts in one request is not supported yet; "
                           "send one request per prompt", param="prompt")
        return prompt[0]
    return prompt
