"""The input embeddings of a step of a model that takes images: its tokens' embeddings, the
placeholder rows' replaced by their images' features."""
from __future__ import annotations

import torch

from pagellm.models.interface import MultiModalEmbeds


def embed_with_images(embed_tokens: torch.nn.Module, input_ids: torch.Tensor,
                      mm_embeds: MultiModalEmbeds) -> torch.Tensor:
    """[T, hidden_size]: `embed_tokens(input_ids)`, `mm_embeds`' rows holding its features."""
    rows, features = mm_embeds
    embeds = embed_tokens(input_ids)
    embeds[rows] = features.to(embeds.dtype)
    return embeds
