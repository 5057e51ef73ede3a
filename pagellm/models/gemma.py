"""Gemma 2 and Gemma 3 (text): Llama's projections in a layer of four norms, alternating sliding-window
and full attention.

What differs from Llama: RMSNorms scale by (1 + weight) (loaded as such: checkpoints store weight);
the embedding is scaled by sqrt(hidden_size); a layer norms its attention's and its MLP's outputs
too (post_attention_layernorm, pre/post_feedforward_layernorm); the MLP is GELU (tanh) x up; scores
are scaled by query_pre_attn_scalar^-0.5. Gemma 2 soft-caps attention scores and the final logits;
Gemma 3 norms each query and key head (q_norm, k_norm) and rotates its sliding layers with their
own base frequency (`rope_local_base_freq`, no scaling).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.config.arch import ModelArchConfig
from pagellm.distributed import parallel_state, stage_layers
from pagellm.layers import (
    GeluTanhAndMul,
    MergedColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from pagellm.models.interface import IntermediateTensors
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM, MLPForLayer, OtherStageLayer

_ACTIVATIONS = ("gelu_pytorch_tanh",)


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w): the parameter holds 1 + w, so the norm computes as Llama's."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = _one_plus_loader


def _one_plus_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    # In float32: 1 + w as Hugging Face computes it, then rounded to the parameter's dtype.
    default_weight_loader(param, loaded_weight.float() + 1.0, shard_id)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate x) * up x)."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        act = config.hf_config.get("hidden_activation") or config.hf_config.get("hidden_act") or _ACTIVATIONS[0]
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_activation {act!r} is not supported for {config.architecture}; "
                             f"supported: {', '.join(_ACTIVATIONS)}")
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=False)
        self.act_fn = GeluTanhAndMul()
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2Attention(LlamaAttention):
    """Scores scaled by query_pre_attn_scalar^-0.5 and soft-capped by attn_logit_softcapping."""

    def __init__(self, config: ModelArchConfig, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend,
                 sliding_window: int | None = None) -> None:
        super().__init__(config, rotary_emb, attn_backend, sliding_window)
        hf = config.hf_config
        self.attn.scale = hf.get("query_pre_attn_scalar", config.head_dim) ** -0.5
        self.attn.logits_soft_cap = hf.get("attn_logit_softcapping")


class Gemma3Attention(Gemma2Attention):
    """Gemma 2's, with a (1 + weight) RMSNorm over each query and key head before the rotary embedding."""

    def __init__(self, config: ModelArchConfig, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend,
                 sliding_window: int | None = None) -> None:
        super().__init__(config, rotary_emb, attn_backend, sliding_window)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class GemmaDecoderLayer(nn.Module):
    """Attention and MLP, each between an input norm and an output norm, then added to the stream."""

    def __init__(self, config: ModelArchConfig, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend,
                 attention_cls: type[LlamaAttention], mlp: nn.Module, sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, rotary_emb, attn_backend, sliding_window)
        self.mlp = mlp
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def smoothable(self) -> list[tuple[RMSNorm, nn.Module]]:
        """(norm, linear layer that reads only its output) pairs (SmoothQuant), as Llama's."""
        return [(self.input_layernorm, self.self_attn.qkv_proj),
                (self.pre_feedforward_layernorm, self.mlp.gate_up_proj)]

    def clippable(self) -> list[nn.Module]:
        return [self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the stream after its attention); the next norm adds them."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, attn_metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


def _rope(config: ModelArchConfig, sliding: bool) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling) of a layer's rotary embedding. Gemma 3 rotates its sliding layers with
    `rope_local_base_freq` unscaled; transformers >= 5 writes both as `rope_parameters` by layer kind."""
    hf = config.hf_config
    by_kind = hf.get("rope_parameters") or {}
    kind = "sliding_attention" if sliding else "full_attention"
    if kind in by_kind:
        params = by_kind[kind]
        return params["rope_theta"], params if params.get("rope_type", "default") != "default" else None
    if sliding and config.architecture == "Gemma3ForCausalLM":
        return hf.get("rope_local_base_freq") or 10000.0, None
    return config.rope_theta, config.rope_scaling


class GemmaModel(nn.Module):
    """The decoder stack (`LlamaForCausalLM.model_cls`): the embedding scaled by sqrt(hidden_size)."""

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend, attention_cls: type[LlamaAttention],
                 mlp_for_layer: MLPForLayer) -> None:
        super().__init__()
        if config.hf_config.get("use_bidirectional_attention"):
            raise ValueError(f"{config.architecture} with use_bidirectional_attention (an embedding model) is not "
                             f"supported: pagellm runs Gemma's causal attention")
        ps = parallel_state()
        self.is_first_stage, self.is_last_stage = ps.is_first_stage, ps.is_last_stage
        self.local_layers = stage_layers(config.num_hidden_layers, ps.pp_rank, ps.pp_size)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if self.is_first_stage else None)
        # Rounded to the model's dtype, as Hugging Face multiplies it.
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)
        rotaries: dict[tuple, RotaryEmbedding] = {}  # one table per distinct (base, scaling)

        def rotary(sliding: bool) -> RotaryEmbedding:
            base, scaling = _rope(config, sliding)
            key = (base, repr(scaling))
            if key not in rotaries:
                rotaries[key] = RotaryEmbedding(config.head_dim, config.max_position_embeddings, base, scaling)
            return rotaries[key]

        windows = config.sliding_windows
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, rotary(windows[i] is not None), attn_backend, attention_cls,
                              mlp_for_layer(config, i), windows[i])
            if i in self.local_layers else OtherStageLayer()
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        if self.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids) * self.normalizer, None
        else:
            hidden, residual = intermediate
        for i in self.local_layers:
            hidden, residual = self.layers[i](positions, hidden, residual, attn_metadata)
        if not self.is_last_stage:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: every other layer (the even ones) attends within `sliding_window`; scores soft-capped
    at attn_logit_softcapping, the logits at final_logit_softcapping."""

    attention_cls = Gemma2Attention
    model_cls = GemmaModel

    def mlp_for_layer(self, config: ModelArchConfig, index: int) -> nn.Module:
        return GemmaMLP(config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.hf_config.get("final_logit_softcapping")
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's language model: five of every six layers (`layer_types`, or `sliding_window_pattern`)
    attend within `sliding_window`; q/k norms; no soft caps unless the config sets them."""

    attention_cls = Gemma3Attention
