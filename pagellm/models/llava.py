"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector and a
Llama language model; the projected features of each image replace its placeholder tokens' embeddings.

The vision tower is transformers' own `CLIPVisionModel` module: it runs once per image, off the
per-token path that pagellm's kernels speed up, and reusing the reference implementation keeps its
numerics Hugging Face's. The language model is pagellm's Llama (paged attention, TP, quantization).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import transformers
from torch import nn
from transformers.activations import ACT2FN

from pagellm.attention.backend import AttentionBackend
from pagellm.config.arch import ModelArchConfig
from pagellm.models.llama import LlamaForCausalLM
from pagellm.models.vision_embeds import ImageEmbedsForward

_TEXT_PREFIXES = (
    ("language_model.model.", "model."),  # transformers < 4.52, and what 5.x saves
    ("model.language_model.", "model."),  # transformers 4.52 to 4.57
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class LlavaProjector(nn.Module):
    """linear_2(act(linear_1(vision features))): vision hidden size -> the language model's."""

    def __init__(self, vision_size: int, text_size: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_size, text_size, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(text_size, text_size, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(ImageEmbedsForward, LlamaForCausalLM):
    """Loads Hugging Face LLaVA checkpoints (`interface.CausalLM` and `interface.SupportsImages`)."""

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        super().__init__(config, attn_backend)
        hf = config.hf_config
        vision = dict(hf["vision_config"])
        if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"config.json's vision_config: model_type {vision['model_type']!r} is not supported; "
                             "pagellm's LLaVA runs a CLIP vision tower ('clip_vision_model')")
        layer = hf.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError(f"config.json's vision_feature_layer must be one layer index, got {layer!r}")
        self.feature_layer = layer
        self.select_strategy = hf.get("vision_feature_select_strategy", "default")
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"config.json's vision_feature_select_strategy must be 'default' or 'full', "
                             f"got {self.select_strategy!r}")
        vision_config = transformers.CLIPVisionConfig(**{k: v for k, v in vision.items() if k != "model_type"})
        vision_config._attn_implementation = "sdpa"
        self.vision_tower = transformers.CLIPVisionModel(vision_config)
        self.multi_modal_projector = LlavaProjector(vision_config.hidden_size, config.hidden_size,
                                                    hf.get("projector_hidden_act", "gelu"),
                                                    hf.get("multimodal_projector_bias", True))

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """pixel_values [B, 3, H, W] -> features [B, N, hidden_size]: the chosen vision layer's
        hidden states (without the class token under the "default" strategy), projected (a
        fixed-size tower: no grid)."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        out = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True)
        features = out.hidden_states[self.feature_layer]
        if self.select_strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def checkpoint_names(self, param_name: str) -> list[str]:
        if param_name.startswith(("vision_tower.", "multi_modal_projector.")):
            return [param_name]
        return [name.replace("model.", "language_model.model.", 1).replace("lm_head.", "language_model.lm_head.", 1)
                for name in super().checkpoint_names(param_name)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The vision tower's and the projector's tensors copied as they are, the language model's
        renamed to pagellm Llama's names and loaded by it."""
        loaded: set[str] = set()
        loaded |= super().load_weights(self._language_weights(weights, loaded))
        return loaded

    def _language_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                          loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors under Llama's names; on the way, the others are loaded
        (their names added to `loaded`)."""
        params = dict(self.named_parameters())
        for name, tensor in weights:
            target = _vision_target(name)
            if target is None:
                yield _language_name(name), tensor
                continue
            param = params.get(target)
            if param is None:
                if target.endswith("position_ids"):
                    continue  # a buffer older checkpoints saved; recomputed by CLIP's embeddings
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model's "
                                 f"{target} {tuple(param.shape)}: is config.json's vision_config this checkpoint's?")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(target)


def _language_name(name: str) -> str:
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _vision_target(name: str) -> str | None:
    """The parameter a vision tower or projector tensor fills (None: a language model tensor).
    Checkpoints from transformers < 5 nest the tower's tensors under `vision_model.`."""
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            local = name[len(prefix):]
            return "vision_tower." + local.removeprefix("vision_model.")
    for prefix in _PROJECTOR_PREFIXES:
        if name.startswith(prefix):
            return "multi_modal_projector." + name[len(prefix):]
    return None
