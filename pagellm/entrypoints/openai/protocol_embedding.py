"""Request and response bodies of POST /v1/embeddings: OpenAI's fields plus vLLM's extras."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from pagellm.entrypoints.openai.protocol import REQUEST_ID_PATTERN, Int64, StrictModel


class EmbeddingRequest(StrictModel):
    model: str | None = None
    """A served model name; None: the first one."""
    input: str | list[Int64] | list[str] | list[list[Int64]]
    """One text, one prompt as token ids, or a list of either (one embedding each, in order)."""
    encoding_format: Literal["float", "base64"] = "float"
    """float: a list of numbers; base64: the little-endian float32 bytes, base64-encoded."""
    dimensions: Int64 | None = None
    """Length of each vector; allowed only as the model's hidden size (no Matryoshka support)."""
    user: str | None = None
    """Accepted for OpenAI compatibility; not used."""
    # vLLM's extras
    truncate_prompt_tokens: Int64 | None = Field(default=None, ge=1)
    """Keep only the last this-many tokens of each input."""
    add_special_tokens: bool = True
    """Let the tokenizer add its special tokens (BOS) to text inputs."""
    normalize: bool | None = None
    """L2-normalize each vector; None: the server's --pooler-config (default true)."""
    request_id: str | None = Field(default=None, pattern=REQUEST_ID_PATTERN)
    """The engine's request id prefix; default: the X-Request-Id header, else a random one."""


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
