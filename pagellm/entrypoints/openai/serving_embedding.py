"""POST /v1/embeddings: one or several inputs, embedded concurrently by a pooling-runner engine."""
from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol_embedding import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagellm.entrypoints.openai.serving_base import OpenAIServing, _wait_for_disconnect
from pagellm.outputs import EmbeddingRequestOutput
from pagellm.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        """The embeddings of `request.input`, in order. Every input is submitted to the engine at
        once, so the scheduler batches them. `dimensions` is refused (400) unless it equals the
        model's hidden size: the decoder LMs served here were not trained for truncated
        (Matryoshka) embeddings, so a shorter prefix of the vector would mean nothing."""
        model = self.check_model(request.model)
        if not self.engine.config.is_pooling:
            raise APIError("this server runs the generate runner, which cannot compute embeddings; start the server "
                           "with --runner pooling to serve /v1/embeddings")
        hidden_size = self.engine.config.source.arch.hidden_size
        if request.dimensions is not None and request.dimensions != hidden_size:
            raise APIError(f"dimensions must be this model's hidden size ({hidden_size}) or left out: the model does "
                           f"not support shorter (Matryoshka) embeddings, got {request.dimensions}", param="dimensions")
        prompts = [self._prompt(p, request) for p in _inputs(request.input)]
        params = PoolingParams(normalize=request.normalize, truncate_prompt_tokens=request.truncate_prompt_tokens)
        request_id = self.make_request_id("embd", request.request_id, raw_request)
        outputs = await self._embed_all(prompts, params, request_id, raw_request)
        data = [EmbeddingData(embedding=_encode(out.outputs.embedding, request.encoding_format), index=i)
                for i, out in enumerate(outputs)]
        num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        response = EmbeddingResponse(id=request_id, model=model, data=data,
                                     usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
        return JSONResponse(response.model_dump())

    def _prompt(self, prompt: str | list[int], request: EmbeddingRequest) -> dict[str, Any]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer().encode(prompt, add_special_tokens=request.add_special_tokens)
        else:
            token_ids = prompt
        self.check_prompt_ids(token_ids, "input")
        return {"prompt_token_ids": token_ids}

    async def _embed_all(self, prompts: list[dict[str, Any]], params: PoolingParams, request_id: str,
                         raw_request: Request) -> list[EmbeddingRequestOutput]:
        """Every prompt's final output, in order; the first failure (or the client going away)
        aborts the others."""
        async def one(index: int, prompt: dict[str, Any]) -> EmbeddingRequestOutput:
            request_id_i = request_id if len(prompts) == 1 else f"{request_id}-{index}"
            first, outputs = await self.start(prompt, params, request_id_i)
            final = first
            async for final in self.follow(first, outputs):
                pass
            if not isinstance(final, EmbeddingRequestOutput):  # aborted (request timeout, shutdown)
                raise APIError("the embedding request was aborted before it finished", 503)
            return final

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        results = asyncio.gather(*tasks)
        disconnected = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            done, _ = await asyncio.wait((results, disconnected), return_when=asyncio.FIRST_COMPLETED)
            if results in done:
                return results.result()
            raise APIError("the client disconnected before the response was ready")
        finally:
            disconnected.cancel()
            for task in tasks:
                task.cancel()  # a no-op once done; else cancelling aborts its engine request
            if not results.done():
                results.cancel()
            # Retrieve a failed gather's exception once the others are cancelled, so that asyncio
            # does not log it as never retrieved.
            await asyncio.gather(*tasks, return_exceptions=True)


def _inputs(value: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The request's inputs as a list: one text or one token-id prompt becomes a list of one."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    if not value:
        raise APIError("input is empty: send a text, token ids, or a non-empty list of them", param="input")
    return list(value)


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding
