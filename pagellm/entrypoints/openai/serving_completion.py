"""POST /v1/completions: one or several text or token-id prompts, streamed or not."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.constraints import one_constraint, request_constraints
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.logprobs import completion_logprobs
from pagellm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from pagellm.entrypoints.openai.serving_base import OpenAIServing, Started
from pagellm.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class _Prompt:
    """One prompt of a request, once submitted."""

    started: Started
    echo: str
    """The text an echo puts in front of each of its choices ("" without echo)."""

    @property
    def first(self) -> RequestOutput:
        return self.started[0]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        prompts = self.prompt_list(request.prompt, "prompt")
        engine_prompts = []
        token_ids = await self.token_ids_of(prompts, request.add_special_tokens, "prompt",
                                            request.truncate_prompt_tokens is not None)
        for prompt, ids in zip(prompts, token_ids):
            self.check_prompt_ids(ids, "prompt")
            text = {"prompt": prompt} if isinstance(prompt, str) else {}
            engine_prompts.append({**text, "prompt_token_ids": ids, "cache_salt": request.cache_salt})
        # max_tokens 0 with echo scores the prompt: one token is generated (the engine needs one
        # step past the prompt) and left out of the response.
        prompt_only = request.max_tokens == 0
        if prompt_only and not request.echo:
            raise APIError("max_tokens must be at least 1; 0 is only allowed with echo=true (to score the "
                           "prompt)", param="max_tokens")
        max_tokens = 1 if prompt_only else request.max_tokens
        for p in engine_prompts:
            self.check_fits(request, len(p["prompt_token_ids"]), "prompt", max_tokens, "max_tokens")
        constraint = one_constraint(request_constraints(request))
        params = self.sampling_params(request, max_tokens, constraint)
        await self.admit(raw_request, [len(p["prompt_token_ids"]) for p in engine_prompts], params, "prompt",
                         "max_tokens", request.priority)
        request_id = self.make_request_id("cmpl", request.request_id, raw_request)

        started = await self.start_all(engine_prompts, params, request_id, constraint, model.lora_request,
                                       request.priority)
        # After truncate_prompt_tokens the echo is what the model saw.
        submitted = [_Prompt(s, self._echo_text(prompt, s[0], len(p["prompt_token_ids"]), request)
                             if request.echo else "")
                     for prompt, p, s in zip(prompts, engine_prompts, started)]
        if request.stream:
            return self.event_stream(self._chunks(submitted, request, request_id, model.name, prompt_only),
                                     raw_request)
        finals = await self.finals(started, raw_request)
        if prompt_only:
            finals = [dataclasses.replace(f, outputs=[_nothing_generated(o) for o in f.outputs]) for f in finals]
        choices = []
        for i, (prompt, final) in enumerate(zip(submitted, finals)):
            choices += [CompletionChoice(
                index=i * request.n + o.index, text=prompt.echo + o.text, finish_reason=o.finish_reason,
                logprobs=self._logprobs(final, o, request, 0, True), stop_reason=o.stop_reason,
                prompt_logprobs=final.prompt_logprobs if request.prompt_logprobs is not None else None,
                **self._token_ids(final, o, request, True)) for o in final.outputs]
        response = CompletionResponse(id=request_id, model=model.name, choices=choices, usage=self.usage(finals),
                                      kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None)
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
        return completion_logprobs(token_ids, entries, text_offset, self.engine.tokenizer,
                                   request.return_tokens_as_token_ids)

    @staticmethod
    def _token_ids(out: RequestOutput, o: CompletionOutput, request: CompletionRequest,
                   opening: bool) -> dict[str, list[int] | None]:
        if not request.return_token_ids:
            return {}
        return {"token_ids": o.token_ids, "prompt_token_ids": out.prompt_token_ids if opening else None}

    async def _chunks(self, prompts: Sequence[_Prompt], request: CompletionRequest, request_id: str, model: str,
                      prompt_only: bool) -> AsyncGenerator[CompletionResponse, None]:
        created = int(time.time())
        firsts = [p.first for p in prompts]
        sent: dict[int, int] = {}  # characters of each choice's text sent so far
        num_tokens: dict[int, int] = {}

        def usage_so_far() -> UsageInfo:
            return self.usage(firsts, 0 if prompt_only else sum(num_tokens.values()))

        async for index, out, o in self.deltas([p.started for p in prompts], num_tokens, request.n):
            if prompt_only:
                if o.finish_reason is None:
                    continue  # the scored prompt goes out with the finish
                o = _nothing_generated(o)
            opening = index not in sent
            text = prompts[index // request.n].echo + o.text if opening else o.text
            logprobs = self._logprobs(out, o, request, sent.get(index, 0), opening)
            sent[index] = sent.get(index, 0) + len(text)
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=o.finish_reason,
                                      stop_reason=o.stop_reason, **self._token_ids(out, o, request, opening))
            yield CompletionResponse(id=request_id, created=created, model=model, choices=[choice],
                                     usage=usage_so_far() if request.continuous_usage else None)
        if request.final_usage:
            yield CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage_so_far())


def _nothing_generated(o: CompletionOutput) -> CompletionOutput:
    """`o` without the token generated to score a prompt (max_tokens 0)."""
    return dataclasses.replace(o, text="", token_ids=[], logprobs=[] if o.logprobs is not None else None,
                               cumulative_logprob=None if o.logprobs is None else 0.0, stop_reason=None,
                               finish_reason="length")
