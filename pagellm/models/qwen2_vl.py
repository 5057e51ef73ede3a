"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`):
a vision transformer at the image's own resolution (patches, 2D rotary positions, window attention
in 2.5, a merger of 2x2 patches into one feature) and a Qwen2 language model whose rotary embedding
turns by three positions a token (M-RoPE: temporal, height, width; `MRotaryEmbedding`). The worker
lays out those positions (`pagellm.worker.mrope`).

The vision transformer is transformers' own module (`Qwen2_5_VisionTransformerPretrainedModel`,
`Qwen2VisionTransformerPretrainedModel`): it runs once per image, off the per-token path that
pagellm's kernels speed up, and reusing the reference implementation keeps its numerics Hugging
Face's; the cost is its attention, sdpa over each image's (or window's) patches, not pagellm's
kernels. The language model is pagellm's Qwen2 (paged attention, TP, quantization).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

from pagellm.attention.backend import AttentionBackend
from pagellm.config.arch import ModelArchConfig
from pagellm.layers.rotary import MRotaryEmbedding
from pagellm.models.qwen2 import Qwen2ForCausalLM
from pagellm.models.vision_embeds import ImageEmbedsForward

_VISION_PREFIXES = ("model.visual.", "visual.")
"""Where checkpoints keep the vision transformer: transformers >= 4.52 under `model.`, before (and
the Qwen releases) at the top."""
_TEXT_PREFIX = "model.language_model."
"""Where transformers >= 4.52 keeps the language model's decoder (before: `model.`, as Qwen2's)."""


def mrope_section(hf_config: dict) -> list[int]:
    """config.json's `mrope_section`: in `rope_scaling` ({"type": "mrope", ...}), or in
    `rope_parameters` (transformers >= 5)."""
    for key in ("rope_scaling", "rope_parameters"):
        section = (hf_config.get(key) or {}).get("mrope_section")
        if section is not None:
            return list(section)
    raise ValueError("config.json's rope_scaling must give mrope_section (the head_dim / 2 rotary pairs "
                     "each of the temporal, height and width positions turns)")


class Qwen2VLForConditionalGeneration(ImageEmbedsForward, Qwen2ForCausalLM):
    """Loads Hugging Face Qwen2-VL checkpoints (`interface.CausalLM` and `interface.SupportsImages`)."""

    vision_cls: type[nn.Module] = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel
    vision_config_cls: type = Qwen2VLVisionConfig

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        rope_type = (config.rope_scaling or {}).get("rope_type", (config.rope_scaling or {}).get("type", "default"))
        if rope_type not in ("mrope", "default"):
            raise ValueError(f"config.json's rope_scaling type {rope_type!r} is not supported with M-RoPE; "
                             "pagellm's Qwen2-VL turns by the default frequencies")
        # The language model's frequencies are the default ones; M-RoPE replaces its rotation below.
        super().__init__(dataclasses.replace(config, rope_scaling=None), attn_backend)
        self.config = config
        hf = config.hf_config
        rotary = MRotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                  mrope_section(hf))
        for i in self.model.local_layers:
            self.model.layers[i].self_attn.rotary_emb = rotary
        vision = {k: v for k, v in hf["vision_config"].items() if k != "model_type"}
        vision_config = self.vision_config_cls(**vision)
        vision_config._attn_implementation = "sdpa"
        self.visual = self.vision_cls(vision_config)

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """pixel_values [B, patches, patch values] of B images of one grid `image_grid_thw` [B, 3]
        -> their merged features [B, N, hidden_size]."""
        if image_grid_thw is None:
            raise ValueError(f"{type(self).__name__} encodes images with their patch grid (image_grid_thw)")
        dtype = self.visual.patch_embed.proj.weight.dtype
        out = self.visual(pixel_values.flatten(0, 1).to(dtype), grid_thw=image_grid_thw)
        return out.pooler_output.view(len(pixel_values), -1, out.pooler_output.shape[-1])

    def checkpoint_names(self, param_name: str) -> list[str]:
        if param_name.startswith("visual."):
            return [param_name]
        return super().checkpoint_names(param_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The vision transformer's tensors copied as they are, the language model's (under either
        layout's names) loaded by Qwen2."""
        loaded: set[str] = set()
        loaded |= super().load_weights(self._language_weights(weights, loaded))
        return loaded

    def _language_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                          loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors under Qwen2's names; on the way, the vision transformer's
        are loaded (their names added to `loaded`)."""
        params = dict(self.named_parameters())
        for name, tensor in weights:
            prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
            if prefix is None:
                yield ("model." + name[len(_TEXT_PREFIX):] if name.startswith(_TEXT_PREFIX) else name), tensor
                continue
            target = "visual." + name[len(prefix):]
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model's "
                                 f"{target} {tuple(param.shape)}: is config.json's vision_config this checkpoint's?")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(target)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL's model with a vision transformer that attends within windows in most
    blocks (its RMSNorm and gated MLP too), which transformers' module holds."""

    vision_cls = modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel
    vision_config_cls = Qwen2_5_VLVisionConfig
