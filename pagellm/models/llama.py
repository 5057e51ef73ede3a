"""Llama (and Mistral, same weights and graph): the base the Qwen models override in small places."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.attention.layer import Attention
from pagellm.config.arch import ModelArchConfig
from pagellm.distributed import parallel_state, stage_layers
from pagellm.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from pagellm.models.cpu_layer import FusedDecoderLayer
from pagellm.models.interface import IntermediateTensors

# (Hugging Face name part, fused parameter name part, shard id for its weight_loader)
_STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\."
                       r"(?:(k_scale|v_scale|kv_scale)|(k_proj\.output_scale|v_proj\.output_scale))$")
"""A float8 KV cache's per-tensor scales as checkpoints store them (llm-compressor's, AutoFP8's older names)."""

class OtherStageLayer(nn.Module):
    """Stands in for a layer another pipeline stage holds, so that parameter names stay global."""


def check_silu(config: ModelArchConfig) -> None:
    """The MLPs here compute SiLU(gate) x up; refuse a config that says otherwise."""
    act = config.hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; only 'silu' is")


class LlamaMLP(nn.Module):
    """down(SiLU(gate x) * up x), of `intermediate_size` (default the config's); its output summed
    over tensor-parallel ranks unless `reduce_results` is False (the caller sums it with more)."""

    def __init__(self, config: ModelArchConfig, intermediate_size: int | None = None,
                 reduce_results: bool = True) -> None:
        super().__init__()
        check_silu(config)
        bias = config.hf_config.get("mlp_bias", False)
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=bias)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    attention_sinks: ClassVar[bool] = False
    """Whether each head has a learned sink logit in its softmax (GPT-OSS's `sinks`)."""

    def __init__(self, config: ModelArchConfig, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: the keys each query sees, itself included (None: all before it)."""
        super().__init__()
        qkv_bias, o_bias = self.projection_biases(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=qkv_bias
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=o_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, config.head_dim,
                              config.head_dim**-0.5, attn_backend, sliding_window, sinks=self.attention_sinks)

    @staticmethod
    def projection_biases(config: ModelArchConfig) -> tuple[bool, bool]:
        """Whether (q/k/v, o) projections have a bias."""
        bias = config.hf_config.get("attention_bias", False)
        return bias, bias

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] as the rotary embedding takes them (here as projected)."""
        return q, k

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(-1, self.attn.num_heads, self.attn.head_dim)
        k = k.view(-1, self.attn.num_kv_heads, self.attn.head_dim)
        q, k = self.normalize_qk(q, k)
        return self.o_proj(self.attn(q, k, v, attn_metadata, self.rotary_emb, positions))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
        attention_cls: type[LlamaAttention],
        mlp: nn.Module,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, rotary_emb, attn_backend, sliding_window)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused: FusedDecoderLayer | None = None
        """The whole layer as one C call, set by the worker on the CPU where it applies (cpu_layer.py)."""

    def cpu_fusion_blocker(self) -> str | None:
        """Why this layer's graph is not the one the fused C layer computes (`cpu_layer`); None: it is."""
        if type(self.self_attn).normalize_qk is not LlamaAttention.normalize_qk:
            return f"{type(self.self_attn).__name__} changes q/k before the rotary embedding"
        if type(self.mlp) is not LlamaMLP:
            return f"its MLP is a {type(self.mlp).__name__}, not a dense Llama MLP"
        if type(self.self_attn.rotary_emb).forward is not RotaryEmbedding.forward:
            return f"its {type(self.self_attn.rotary_emb).__name__} rotates otherwise than by one position a token"
        return None

    def smoothable(self) -> list[tuple[RMSNorm, nn.Module]]:
        """(norm, linear layer that reads only its output) pairs: a per-channel scale divided out of
        the norm's weight can multiply the layer's input columns (SmoothQuant)."""
        pairs = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, LlamaMLP):
            pairs.append((self.post_attention_layernorm, self.mlp.gate_up_proj))
        return pairs

    def clippable(self) -> list[nn.Module]:
        """Linear layers whose rounding error is best judged on their own product: not the q/k/v
        projection, whose q and k errors matter through the attention scores (AWQ leaves q and k
        unclipped; v is fused with them here)."""
        mlp = [self.mlp.gate_up_proj, self.mlp.down_proj] if isinstance(self.mlp, LlamaMLP) else []
        return [self.self_attn.o_proj, *mlp]

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it is added); the next norm adds them."""
        if self.fused is not None and hidden.shape[0] == attn_metadata.num_tokens:
            return self.fused(positions, hidden, residual, attn_metadata)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


MLPForLayer = Callable[[ModelArchConfig, int], nn.Module]
"""Builds the MLP of decoder layer `index` (dense, or a mixture of experts)."""


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelArchConfig, attn_backend: AttentionBackend, attention_cls: type[LlamaAttention],
        mlp_for_layer: MLPForLayer,
    ) -> None:
        super().__init__()
        ps = parallel_state()
        self.is_first_stage, self.is_last_stage = ps.is_first_stage, ps.is_last_stage
        self.local_layers = stage_layers(config.num_hidden_layers, ps.pp_rank, ps.pp_size)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if self.is_first_stage else None)
        # One cos/sin table shared by every layer.
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
            config.max_model_len,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary_emb, attn_backend, attention_cls, mlp_for_layer(config, i),
                              config.sliding_windows[i])
            if i in self.local_layers
            else OtherStageLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """The last stage returns the final hidden states; the others, what the next stage takes
        as `intermediate` (the first stage embeds `input_ids` instead, unless given their
        `inputs_embeds`: a vision-language model's, images' features in place of some)."""
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden, residual = intermediate
        for i in self.local_layers:
            hidden, residual = self.layers[i](positions, hidden, residual, attn_metadata)
        if not self.is_last_stage:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head, loading Hugging Face `LlamaForCausalLM`-style weights
    (`interface.CausalLM`).

    Subclasses change the attention block through `attention_cls`, a layer's MLP through
    `mlp_for_layer`, the decoder stack through `model_cls` (built alike, with the same parts:
    `embed_tokens`, `layers`, `norm`, `local_layers`), and how checkpoint tensors map to parameters
    through `checkpoint_target` and `checkpoint_parts`.
    """

    attention_cls: type[LlamaAttention] = LlamaAttention
    model_cls: type[nn.Module] = LlamaModel

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, attn_backend, self.attention_cls, self.mlp_for_layer)
        self.lm_head = None
        if self.model.is_last_stage:
            shares_embedding = config.tie_word_embeddings and self.model.is_first_stage
            tied = self.model.embed_tokens.weight if shares_embedding else None
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, weight=tied)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] (flat batch) -> final hidden states [T, hidden_size] (on the
        last pipeline stage; see `LlamaModel.forward`)."""
        return self.model(input_ids, positions, attn_metadata, intermediate)

    def mlp_for_layer(self, config: ModelArchConfig, index: int) -> nn.Module:
        """The MLP of decoder layer `index`."""
        return LlamaMLP(config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in the model's dtype."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.decoder_layers()]

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """This pipeline stage's layers."""
        return [self.model.layers[i] for i in self.model.local_layers]

    def _on_other_stage(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to a pipeline stage other than this one."""
        layer = _LAYER_INDEX.match(name)
        if layer is not None:
            return int(layer.group(1)) not in self.model.local_layers
        if name.startswith("model.embed_tokens."):  # also the head's weight when tied
            tied_head_here = self.config.tie_word_embeddings and self.lm_head is not None
            return self.model.embed_tokens is None and not tied_head_here
        return name.startswith(("model.norm.", "lm_head.")) and not self.model.is_last_stage

    def checkpoint_parts(self, param_name: str) -> dict[object, str]:
        """The Hugging Face tensors parameter `param_name` is loaded from, by the shard id its
        weight_loader takes for each ({None: name} for a parameter loaded from one tensor)."""
        parts = {shard: param_name.replace(fused, hf) for hf, fused, shard in _STACKED_PARAMS if fused in param_name}
        if parts:
            return parts
        if param_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return {None: "model.embed_tokens.weight"}
        return {None: param_name}

    def checkpoint_names(self, param_name: str) -> list[str]:
        """The Hugging Face tensor names that parameter `param_name` is loaded from."""
        return list(dict.fromkeys(self.checkpoint_parts(param_name).values()))

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """(the parameter Hugging Face tensor `name` fills, the shard id its weight_loader takes)."""
        for hf_part, fused_part, part_id in _STACKED_PARAMS:
            if hf_part in name:
                return name.replace(hf_part, fused_part), part_id
        return name, None

    def shards_filled(self, target: str, shard_id: object) -> set:
        """The shard ids of `checkpoint_parts(target)` that the tensor loaded as `shard_id` filled."""
        return {shard_id}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into this rank's parameters; returns the names filled."""
        params = dict(self.named_parameters())
        shards_seen: dict[str, set] = {}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # shares the embedding, loaded from its own name
            if self._on_other_stage(name):
                continue
            if name == "model.embed_tokens.weight" and self.model.embed_tokens is None:
                name = "lm_head.weight"  # a last stage without the embedding holds the tied head alone
            kv_scale = _KV_SCALE.match(name)
            if kv_scale is not None:
                kind = kv_scale.group(2) or kv_scale.group(3).replace("_proj.output_scale", "_scale")
                self.model.layers[int(kv_scale.group(1))].self_attn.attn.load_kv_scale(kind, tensor)
                continue
            target, shard_id = self.checkpoint_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}; "
                                 + _mismatch_hint(target, params))
            param.weight_loader(param, tensor, shard_id)
            shards_seen.setdefault(target, set()).update(self.shards_filled(target, shard_id))
        # A fused parameter counts as loaded only once every one of its parts has arrived; one that
        # has some parts but not all names the tensors the checkpoint lacks.
        loaded, lacking = set(), []
        for name, seen in shards_seen.items():
            parts = self.checkpoint_parts(name)
            lacking += [hf_name for shard, hf_name in parts.items() if shard not in seen]
            if seen >= parts.keys():
                loaded.add(name)
        if lacking:
            raise ValueError(f"the checkpoint lacks {len(lacking)} tensor(s) beside others of the same parameters: "
                             f"{', '.join(lacking[:8])}" + (", ..." if len(lacking) > 8 else ""))
        return loaded


_QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_zero_point",
                       "weight_shape", "weight_g_idx", "input_scale")
"""Tensor names that GPTQ, AWQ, fp8 and compressed-tensors checkpoints give a linear layer."""


def _mismatch_hint(target: str, params: dict[str, torch.nn.Parameter]) -> str:
    """Why a checkpoint tensor may match no parameter: the layer is stored otherwise than the
    engine expects (quantized against dense, or another format), or another architecture."""
    layer, _, suffix = target.rpartition(".")
    expected = sorted(p.rpartition(".")[2] for p in params if p.startswith(layer + "."))
    if not expected and suffix not in _QUANTIZED_SUFFIXES:
        return "is the checkpoint for a different architecture than its config.json says?"
    return ("does the checkpoint's quantization_config (or --quantization) describe how its layers are stored?"
            + (f" {layer!r} here holds {', '.join(expected)}" if expected else ""))
