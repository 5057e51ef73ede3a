"""The forward of a causal LM that takes images: a step's input embeddings are its tokens', the
placeholder rows' replaced by their images' features."""
from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.models.interface import IntermediateTensors, MultiModalEmbeds


class ImageEmbedsForward:
    """Mixed in before a `CausalLM` (whose `model` has `embed_tokens` and takes `inputs_embeds`)."""

    model: torch.nn.Module

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate: IntermediateTensors | None = None,
                mm_embeds: MultiModalEmbeds | None = None) -> torch.Tensor | IntermediateTensors:
        if mm_embeds is None:
            return self.model(input_ids, positions, attn_metadata, intermediate)
        rows, features = mm_embeds
        embeds = self.model.embed_tokens(input_ids)
        embeds[rows] = features.to(embeds.dtype)
        return self.model(input_ids, positions, attn_metadata, intermediate, inputs_embeds=embeds)
