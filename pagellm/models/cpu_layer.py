"""A Llama-family decoder layer as one C call on the CPU (`pagellm/ops/c/cpu_layer.c`).

On a CPU decode step the Python between a layer's kernels (module calls, dispatch, allocation,
ctypes) cost about as much as its matrix products. After the KV cache is bound, the worker fuses
every decoder layer that runs the C kernels anyway: float32, the four projections GGUF blocks, the
`cpu` attention backend, one tensor-parallel rank, Llama's graph (Llama, Mistral, Qwen2; not
Qwen3's q/k norms). The C side calls the same kernels in the same order as the modules, so the
output is bit for bit theirs (tested); a layer that does not qualify keeps its modules.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.attention.backend import AttentionMetadata
from pagellm.distributed import parallel_state
from pagellm.lora.batch import LoRABatch
from pagellm.lora.layers import AdaptedLinear
from pagellm.ops.c import build as native
from pagellm.ops.c import cpu_ops, decoder_layer
from pagellm.quantization.gguf import GGUFLinearMethod

logger = logging.getLogger(__name__)

@dataclass
class _StepPlan:
    """One step's batch description for C, built by the step's first fused layer of a KV cache
    group and reused by the group's others (it rides in the group's `AttentionMetadata.backend_plan`,
    which the `cpu` backend leaves unused)."""

    step: decoder_layer.LayerStep
    tensors: tuple[torch.Tensor, ...]
    """What the struct points into, kept alive for the step."""


def why_not_fused(layer: nn.Module) -> str | None:
    """Why `layer` (a decoder layer, KV cache bound) keeps its modules; None: it can be fused."""
    blocker = getattr(layer, "cpu_fusion_blocker", None)
    if blocker is None:
        return f"{type(layer).__name__} is not a Llama decoder layer"
    reason = blocker()
    if reason is not None:
        return reason
    attn = layer.self_attn
    if parallel_state().tp_size != 1:
        return "tensor parallelism sums the row-parallel projections across ranks"
    if attn.attn.logits_soft_cap is not None:
        return "its attention scores are soft-capped"
    if attn.attn.sinks is not None:
        return "its attention has sinks"
    if not attn.attn.backend.fused_cpu_layer:
        return f"the {attn.attn.backend.name} attention backend is not the one the fused layer computes"
    if attn.attn.kv_cache is None:
        return "the KV cache is not bound"
    k_cache = attn.attn.kv_cache[0]
    if k_cache.device.type != "cpu" or k_cache.dtype != torch.float32:
        return "the KV cache is not float32 on the CPU"
    if not cpu_ops.attention_supports(k_cache):
        return f"head size {attn.attn.head_dim} is not a multiple of 8 up to 256"
    linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    if not all(isinstance(lin.quant_method, GGUFLinearMethod) for lin in linears):
        return "not every projection keeps GGUF blocks"
    if any(lin.bias is not None for lin in linears[1:]):
        return "only the q/k/v projection may have a bias"
    return None


class FusedDecoderLayer:
    """Called in place of a `LlamaDecoderLayer`'s modules: same arguments, same results."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        k_cache, v_cache = attn.attn.kv_cache
        params = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.qkv_proj.bias,
                  attn.rotary_emb.cos_sin_cache, attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight,
                  mlp.down_proj.weight, k_cache, v_cache)
        self._keep = params
        """The tensors the struct points into (the layer holds them too; these may be replaced)."""
        in_norm, post_norm, bias, cos_sin, qkv, o, gate_up, down, _, _ = (
            None if p is None else p.data_ptr() for p in params)
        self.hidden_size = layer.input_layernorm.weight.shape[0]
        self.c = decoder_layer.DecoderLayer(
            hidden_size=self.hidden_size, num_heads=attn.attn.num_heads, num_kv_heads=attn.attn.num_kv_heads,
            head_dim=attn.attn.head_dim, intermediate_size=mlp.down_proj.input_size, block_size=k_cache.shape[1],
            sliding_window=attn.attn.sliding_window or 0, eps=layer.input_layernorm.eps, scale=attn.attn.scale,
            input_norm=in_norm, post_norm=post_norm,
            qkv_bias=bias, cos_sin=cos_sin, qkv=qkv, o=o, gate_up=gate_up, down=down,
            qkv_type=attn.qkv_proj.quant_method.qtype, o_type=attn.o_proj.quant_method.qtype,
            gate_up_type=mlp.gate_up_proj.quant_method.qtype, down_type=mlp.down_proj.quant_method.qtype,
            k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr())
        if layer.post_attention_layernorm.eps != layer.input_layernorm.eps:
            raise ValueError("the fused layer takes one RMSNorm epsilon for both norms")
        self.kv_group = attn.attn.kv_group
        """Its KV cache group, whose block table and slots it reads (`AttentionMetadata.for_group`)."""
        self.scratch_per_token = decoder_layer.scratch_floats_per_token(self.c)
        self.projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        """In the order of `decoder_layer.LORA_PROJECTIONS`."""
        self._lora_batch: LoRABatch | None = None

    def attach_lora(self, adapted: dict[nn.Module, AdaptedLinear], batch: LoRABatch) -> None:
        """Apply the adapter slots of these projections (float32) to the rows `batch` assigns them."""
        for slots, module in zip(self.c.lora, self.projections):
            lora = adapted.get(module)
            if lora is None:
                continue
            offsets = lora.part_offsets
            slots.a, slots.b = lora.a.data_ptr(), lora.b.data_ptr()
            slots.rank, slots.num_parts = lora.rank, len(offsets) - 1
            slots.part_offsets[:len(offsets)] = offsets
            self._keep += (lora.a, lora.b)
        self._lora_batch = batch

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                 attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        md = attn_metadata.for_group(self.kv_group)
        plan = md.backend_plan
        if not isinstance(plan, _StepPlan):
            plan = md.backend_plan = self._plan(positions, md)
        hidden = hidden.contiguous()
        first = residual is None
        residual = torch.empty_like(hidden) if first else residual.contiguous()
        out = torch.empty_like(hidden)
        status = decoder_layer.run(self.c, plan.step, hidden.data_ptr(), residual.data_ptr(), first, out.data_ptr())
        if status:
            raise MemoryError("the fused CPU decoder layer could not allocate its GEMM scratch memory")
        return out, residual

    def _plan(self, positions: torch.Tensor, md: AttentionMetadata) -> _StepPlan:
        tensors = (positions.to(torch.int64).contiguous(), md.slot_mapping.to(torch.int64).contiguous(),
                   md.query_start_loc.to(torch.int32).contiguous(), md.seq_lens.to(torch.int32).contiguous(),
                   md.block_table.to(torch.int32).contiguous(),
                   torch.empty(md.num_tokens * self.scratch_per_token, dtype=torch.float32))
        lora = self._lora_batch
        if lora is not None and lora.active:
            tensors += (lora.token_slots,)
        pos, slots, qsl, seq_lens, block_table, scratch = tensors[:6]
        step = decoder_layer.LayerStep(num_tokens=md.num_tokens, num_seqs=md.num_seqs,
                                       block_table_stride=block_table.stride(0),
                                       positions=pos.data_ptr(), slots=slots.data_ptr(), query_start=qsl.data_ptr(),
                                       seq_lens=seq_lens.data_ptr(), block_table=block_table.data_ptr(),
                                       scratch=scratch.data_ptr(),
                                       lora_slots=tensors[6].data_ptr() if len(tensors) > 6 else None)
        return _StepPlan(step, tensors)


def fuse_decoder_layers(layers: list[nn.Module]) -> bool:
    """Give every layer a `fused` call when all of them qualify (a step's plan is shared by all
    its layers); returns whether they were fused. Needs the CPU kernels and bound KV caches."""
    if not layers or native.unavailable_reason() is not None:
        return False
    reasons = {why_not_fused(layer) for layer in layers}
    if reasons != {None}:
        logger.debug("decoder layers run module by module: %s", "; ".join(sorted(r for r in reasons if r)))
        return False
    fused = [FusedDecoderLayer(layer) for layer in layers]
    for layer, call in zip(layers, fused):
        layer.fused = call
    return True
