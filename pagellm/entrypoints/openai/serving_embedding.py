"""POST /v1/embeddings: one or several inputs, embedded concurrently by a pooling-runner engine."""
from __future__ import annotations

import base64

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
from pagellm.entrypoints.openai.serving_base import OpenAIServing
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
        hidden_size = self.engine.config.model.source.arch.hidden_size
        if request.dimensions is not None and request.dimensions != hidden_size:
            raise APIError(f"dimensions must be this model's hidden size ({hidden_size}) or left out: the model does "
                           f"not support shorter (Matryoshka) embeddings, got {request.dimensions}", param="dimensions")
        inputs = self.prompt_list(request.input, "input")
        prompts = []
        for token_ids in await self.token_ids_of(inputs, request.add_special_tokens, "input",
                                                 request.truncate_prompt_tokens is not None):
            self.check_prompt_ids(token_ids, "input")
            prompts.append({"prompt_token_ids": token_ids})
        params = PoolingParams(normalize=request.normalize, truncate_prompt_tokens=request.truncate_prompt_tokens)
        await self.admit(raw_request, [len(p["prompt_token_ids"]) for p in prompts], params, "input")
        request_id = self.make_request_id("embd", request.request_id, raw_request)
        started = await self.start_all(prompts, params, request_id, lora_request=model.lora_request)
        outputs = await self.finals(started, raw_request)
        if not all(isinstance(out, EmbeddingRequestOutput) for out in outputs):  # request timeout, shutdown
            raise APIError("the embedding request was aborted before it finished", 503)
        data = [EmbeddingData(embedding=_encode(out.outputs.embedding, request.encoding_format), index=i)
                for i, out in enumerate(outputs)]
        num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        response = EmbeddingResponse(id=request_id, model=model.name, data=data,
                                     usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
        return JSONResponse(response.model_dump())


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding
