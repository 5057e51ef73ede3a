"""The memory ledger of one engine rank, computed rather than measured: what `Worker.determine_num_blocks`
will find, so that capacity can be planned before the hardware is at hand (`pagellm plan`).

GPU, as the worker sizes it: KV budget = gpu_memory_utilization x total memory - the profiled peak
of the largest step (weights, buffers, activations) - memory outside PyTorch (CUDA context, kernels).
The largest step (`ModelRunner.run_largest_step`) is max_num_batched_tokens fresh prompt tokens over
max_num_seqs sequences, sampled with top-k/top-p; its activation peak is the larger of
  - the forward pass: the MLP holds the residual stream, its normed input, gate/up and the activation
    (measured: 4 x hidden + 3 x intermediate elements per token), and
  - the sampler: 40 bytes per logit (max_num_seqs x vocab; `sample.sampler.apply_filters` holds the
    float32 logits, a scaled and a sorted copy, int64 sort indices, probabilities, cumulative mass,
    masks and the scattered result at once) while the final hidden states are still alive,
plus cuBLAS's workspace (a mixture-of-experts layer counts, in place of the intermediate size, what
its token's top-k experts and shared expert hold: an estimate, not calibrated). Weights and KV bytes
per block come from the engine's own model class, built on the meta device, as do the weights one
decode step reads (all but the embedding rows it does not gather and the experts it does not
choose). Calibrated on an H200 (benchmarks/results/kv_sizing_h200_20261201T151500Z.json): the
activation peaks of Llama-3.1-8B, Qwen2.5-7B, Qwen3-8B and SmolLM2 at several step budgets agree
within 3 MB.
CPU: the budget is fixed (--kv-cache-memory-bytes, else min(4 GiB, RAM / 4) shared by the ranks).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagellm.attention import get_attn_backend
from pagellm.config.arch import ModelArchConfig
from pagellm.config.dtype_sizes import kv_cache_element_bytes
from pagellm.config.quantization import quantized_weight_bytes
from pagellm.core.kv_cache_groups import KVCacheGroup, block_slots, kv_cache_groups, max_blocks_held
from pagellm.distributed.parallel_state import init_tensor_parallel, parallel_state
from pagellm.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from pagellm.layers.moe import FusedMoE
from pagellm.models import get_model_class
from pagellm.quantization.gguf import GGUFConfig, kept_weight_bytes
from pagellm.worker.cuda_graphs import capture_sizes
from pagellm.worker.kv_offload import OffloadingWorker

SAMPLER_BYTES_PER_LOGIT = 40
"""Measured on an H200: 40.0 bytes per (sequence x vocabulary entry) between 256, 384 and 1024 sequences."""
FORWARD_ELEMENTS_PER_TOKEN_HIDDEN, FORWARD_ELEMENTS_PER_TOKEN_INTERMEDIATE = 4, 3
"""The forward pass's activation peak per token, in elements of hidden_size and intermediate_size."""
CUBLAS_WORKSPACE_BYTES = 32 << 20
"""cuBLAS's workspace on Hopper, allocated through PyTorch's allocator on the first matmul."""
CUDA_CONTEXT_BYTES = 720_175_104
"""Memory outside PyTorch in a fresh engine process after its first step, measured on an H200 with
CUDA 13 (the worker measures its own; tensor parallelism adds NCCL's buffers, not modelled here)."""
CUDA_GRAPH_BASE_BYTES, CUDA_GRAPH_BYTES_PER_SIZE = 100 << 20, 5 << 19
"""Decode graphs, a rough fit of the 88 to 314 MiB measured for 11 to 67 captured batch sizes (15% under
to 57% over). The engine captures them after sizing the KV cache, in the room the activation peak leaves."""


@dataclass(slots=True, frozen=True)
class PlanSpec:
    """What the ledger is computed for: one engine rank's model, settings and workload."""

    arch: ModelArchConfig
    device: str
    """"cpu" or "cuda"."""
    dtype_bytes: int
    """Bytes per element of the model dtype (weights, activations, KV cache unless fp8)."""
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    input_len: int
    """Typical prompt tokens per request."""
    output_len: int
    """Typical output tokens per request."""
    total_memory_bytes: int | None = None
    """The GPU's memory (cuda); the machine's RAM (cpu), for the fit check only."""
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    quantization: str = "none"
    gguf_types: dict[str, int] | None = None
    """quantization gguf: the file's block type per checkpoint tensor (Hugging Face names)."""
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    """Mixture-of-experts layers place whole experts on the ranks (--enable-expert-parallel)."""
    kv_cache_memory_bytes: int | None = None
    """An explicit KV budget per rank (the engine's --kv-cache-memory-bytes)."""
    cpu_kv_cache_bytes: int = 4 << 30
    """The CPU's default budget for the whole replica (EngineConfig.default_cpu_kv_cache_bytes)."""
    enforce_eager: bool = False
    host_kv_bytes: int = 0
    """The host KV tier's pool on this rank (--kv-offloading-size; 0: none). On a GPU its copies'
    staging buffers come out of the KV budget."""


@dataclass(slots=True, frozen=True)
class Ledger:
    """Bytes of one rank and what they buy."""

    spec: PlanSpec
    weights_bytes: int
    """Parameters, linear layers at the quantization's size."""
    decode_weights_bytes: int
    """The weights a one-token decode step reads (`ModelBytes.decode_weights`)."""
    buffers_bytes: int
    """Non-parameter tensors of the model (the rotary cos/sin table) and the CUDA allocator's rounding."""
    activation_peak_bytes: int
    non_torch_bytes: int
    """CUDA context and kernels (0 on the CPU)."""
    cuda_graph_bytes: int
    """Decode graphs, taken after the KV cache is sized (0 on the CPU or with enforce_eager)."""
    kv_budget_bytes: int
    """What is left for the KV cache; <= 0 when nothing is."""
    kv_bytes_per_block: int
    """One block: a slot per layer of the largest KV cache group (`pagellm.core.kv_cache_groups`)."""
    encoder_peak_bytes: int = 0
    """A vision model's encoder running on a step's images (`vision_encoder_bytes`); 0 without one."""
    encoder_cache_bytes: int = 0
    """The images' features kept until their placeholders are computed; 0 without a vision tower."""

    @property
    def kv_groups(self) -> tuple[KVCacheGroup, ...]:
        return kv_cache_groups(self.spec.arch.sliding_windows, self.spec.max_model_len)

    @property
    def kv_bytes_per_token(self) -> int:
        """What a token costs held in every group (all layers, and a smaller group's unused slots)."""
        return self.kv_bytes_per_block * len(self.kv_groups) // self.spec.block_size

    @property
    def num_kv_blocks(self) -> int:
        return max(0, (self.kv_budget_bytes - self.staging_bytes) // self.kv_bytes_per_block)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_bytes_per_block

    @property
    def staging_bytes(self) -> int:
        """The host tier's device staging buffers (GPU), deducted from the KV budget."""
        if not self.spec.host_kv_bytes or self.spec.device != "cuda":
            return 0
        return OffloadingWorker.device_bytes(self.kv_bytes_per_block)

    @property
    def num_host_kv_blocks(self) -> int:
        return self.spec.host_kv_bytes // self.kv_bytes_per_block

    @property
    def host_kv_tokens(self) -> int:
        """Tokens of evicted prefixes the host tier keeps, beside the device's."""
        return self.num_host_kv_blocks * self.spec.block_size

    @property
    def kv_cache_tokens(self) -> int:
        """Block slots (blocks x block size); with several KV cache groups, what the groups share."""
        return self.num_kv_blocks * self.spec.block_size

    @property
    def tokens_per_seq(self) -> int:
        return min(self.spec.input_len + self.spec.output_len, self.spec.max_model_len)

    def group_blocks_per_seq(self, num_tokens: int, num_new_tokens: int = 1) -> list[int]:
        """Per KV cache group, the most blocks a sequence of `num_tokens` tokens holds, computing
        `num_new_tokens` a step: all its blocks, or a sliding window's share."""
        return [max_blocks_held(g.sliding_window, num_tokens, self.spec.block_size, num_new_tokens)
                for g in self.kv_groups]

    @property
    def blocks_per_seq(self) -> int:
        """Blocks a decoding sequence of tokens_per_seq tokens holds, over the groups."""
        return sum(self.group_blocks_per_seq(self.tokens_per_seq))

    @property
    def max_model_len_fits(self) -> bool:
        """Whether one request of max_model_len tokens fits, its prompt in max_num_batched_tokens chunks
        (the engine's start-up check, `SchedulerLimits`)."""
        spec = self.spec
        chunk = min(spec.max_num_batched_tokens, spec.max_model_len)
        return sum(self.group_blocks_per_seq(spec.max_model_len, chunk)) <= self.num_kv_blocks

    @property
    def kv_limited_seqs(self) -> int:
        """Sequences of input_len + output_len tokens whose KV fits at once."""
        return self.num_kv_blocks // self.blocks_per_seq

    @property
    def max_concurrent_seqs(self) -> int:
        """Sequences that run at once: the KV cache's limit or max_num_seqs, whichever is lower."""
        return min(self.spec.max_num_seqs, self.kv_limited_seqs)

    @property
    def peak_bytes(self) -> int:
        """Everything at the largest step, KV cache included (the GPU's limit is utilization x total)."""
        return (self.weights_bytes + self.buffers_bytes + self.activation_peak_bytes + self.non_torch_bytes
                + self.kv_cache_bytes)


def compute_ledger(spec: PlanSpec) -> Ledger:
    """The ledger of `spec` (see the module docstring)."""
    sizes = model_bytes(spec)
    on_gpu = spec.device == "cuda"
    encoder_peak, encoder_cache = vision_encoder_bytes(spec)
    # The encoder runs before the step's forward pass; its output (the cache) lives through it.
    activation = (max(activation_peak_bytes(spec), encoder_peak) + encoder_cache
                  + (CUBLAS_WORKSPACE_BYTES if on_gpu else 0))
    non_torch = CUDA_CONTEXT_BYTES if on_gpu else 0
    if spec.kv_cache_memory_bytes is not None:
        budget = spec.kv_cache_memory_bytes
    elif on_gpu:
        if spec.total_memory_bytes is None:
            raise ValueError("the GPU's memory is unknown: pass --gpu-memory-gib")
        resident = sizes.weights + sizes.buffers + sizes.allocator_rounding
        budget = int(spec.total_memory_bytes * spec.gpu_memory_utilization) - (resident + activation) - non_torch
    else:
        budget = spec.cpu_kv_cache_bytes // spec.tensor_parallel_size
    return Ledger(spec, sizes.weights, sizes.decode_weights, sizes.buffers + sizes.allocator_rounding, activation,
                  non_torch, cuda_graph_bytes(spec), budget, sizes.kv_bytes_per_block, encoder_peak, encoder_cache)


def vision_encoder_bytes(spec: PlanSpec) -> tuple[int, int]:
    """(activation peak, feature cache) of a fixed-resolution vision tower (a CLIP `vision_config`
    with an image_size: LLaVA-1.5) on one step's images: as many as the scheduler's encoder budget
    (max_num_batched_tokens placeholders, at least one image) lets start at once. The tower keeps
    every layer's hidden states (the feature layer is read off them) beside one layer's MLP, and the
    projected features of those images stay until their placeholders are computed. (0, 0) for a
    model without such a tower (text-only, or a dynamic-resolution one, not modelled yet)."""
    vision = spec.arch.hf_config.get("vision_config")
    if not vision or "image_size" not in vision:
        return 0, 0
    hidden, intermediate = vision.get("hidden_size", 768), vision.get("intermediate_size", 3072)
    tokens = (vision["image_size"] // vision.get("patch_size", 32)) ** 2  # placeholders an image
    images = max(1, spec.max_num_batched_tokens // tokens)
    positions = images * (tokens + 1)  # with the class token
    layers = vision.get("num_hidden_layers", 12)
    tower = positions * spec.dtype_bytes * ((layers + 1) * hidden + 2 * hidden + 2 * intermediate)
    features = images * tokens * spec.arch.hidden_size * spec.dtype_bytes
    return tower + 2 * features, features  # the projector's hidden layer and output beside the tower


def activation_peak_bytes(spec: PlanSpec) -> int:
    """Activation peak of the largest step on one rank, without cuBLAS's workspace."""
    arch, tp, elem = spec.arch, spec.tensor_parallel_size, spec.dtype_bytes
    tokens = spec.max_num_batched_tokens
    seqs = min(spec.max_num_seqs, tokens)
    mlp = (FORWARD_ELEMENTS_PER_TOKEN_HIDDEN * arch.hidden_size
           + FORWARD_ELEMENTS_PER_TOKEN_INTERMEDIATE * mlp_intermediate_per_token(spec))
    # Residual, normed input and output of attention, the fused qkv and the attention output:
    # below the MLP for every model so far, kept so that an unusual shape is not underestimated.
    q_size = arch.num_attention_heads // tp * arch.head_dim
    kv_size = max(1, arch.num_key_value_heads // tp) * arch.head_dim
    attention = 3 * arch.hidden_size + q_size + 2 * kv_size + 2 * q_size
    forward = tokens * elem * max(mlp, attention)
    # The logits are gathered from every rank, so each rank samples the whole vocabulary.
    sampler = seqs * arch.vocab_size * SAMPLER_BYTES_PER_LOGIT + tokens * arch.hidden_size * elem
    return max(forward, sampler)


def mlp_intermediate_per_token(spec: PlanSpec) -> int:
    """The intermediate channels one token's MLP holds on a rank, the largest over the layers: a dense
    layer's slice of intermediate_size; a mixture of experts' top-k experts (slices of them, or whole
    ones under expert parallelism, all on one rank at worst) and its shared expert's slice."""
    arch, tp = spec.arch, spec.tensor_parallel_size
    layers = range(arch.num_hidden_layers)
    dense = arch.intermediate_size // tp if not all(arch.is_moe_layer(i) for i in layers) else 0
    if not arch.num_experts:
        return dense
    expert = arch.moe_intermediate_size if spec.expert_parallel else arch.moe_intermediate_size // tp
    experts_here = min(arch.num_experts_per_tok, arch.num_experts // tp if spec.expert_parallel else arch.num_experts)
    return max(dense, experts_here * expert + arch.shared_expert_intermediate_size // tp)


def cuda_graph_bytes(spec: PlanSpec) -> int:
    if spec.device != "cuda" or spec.enforce_eager:
        return 0
    return CUDA_GRAPH_BASE_BYTES + CUDA_GRAPH_BYTES_PER_SIZE * len(capture_sizes(spec.max_num_seqs))


@dataclass(slots=True, frozen=True)
class ModelBytes:
    weights: int
    """Parameters, each once (a tied LM head shares the embedding), linear layers at the quantization's size."""
    decode_weights: int
    """What a one-token decode step reads of them: not the embedding table (it gathers one row) unless
    it is the LM head too, and of each mixture-of-experts layer the top-k experts only (as many as this
    rank holds, at most)."""
    buffers: int
    """Non-parameter tensors (the rotary cos/sin table)."""
    allocator_rounding: int
    """What PyTorch's CUDA allocator charges for these tensors beyond their sizes."""
    kv_bytes_per_block: int


def model_bytes(spec: PlanSpec) -> ModelBytes:
    """The bytes of one tensor-parallel rank's model, read off the engine's own model class built on
    the meta device (no memory), so every architecture the engine supports is counted as allocated."""
    linear_layers = (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)
    try:
        with _as_tensor_parallel_rank(spec.tensor_parallel_size, spec.expert_parallel), torch.device("meta"):
            model = get_model_class(spec.arch.architecture)(spec.arch, get_attn_backend("torch"))
    except ValueError as e:
        if spec.tensor_parallel_size == 1:
            raise
        # The layers cannot be split over that many ranks.
        raise ValueError(f"--tensor-parallel-size {spec.tensor_parallel_size}: {e}") from None
    gguf = GGUFConfig(spec.gguf_types or {}) if spec.quantization == "gguf" else None
    per_weight = spec.dtype_bytes if gguf else quantized_weight_bytes(spec.quantization, spec.dtype_bytes)
    on_gpu = spec.device == "cuda"
    sizes: list[int] = []
    decode: list[float] = []  # what a one-token decode step reads of each
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            table = isinstance(module, (*linear_layers, VocabParallelEmbedding)) and name == "weight"
            kept = gguf.method_for(module, model.checkpoint_names(f"{prefix}.{name}"), on_gpu) if gguf and table \
                else None
            if kept is not None:  # the file's blocks (the CPU's kernels) or their GPU layout
                sizes.append(kept_weight_bytes(kept, module, on_gpu))
            else:
                # Quantization methods store linear layers' weights; embeddings, norms and biases stay.
                quantized = isinstance(module, linear_layers) and name == "weight"
                sizes.append(math.ceil(param.numel() * (per_weight if quantized else spec.dtype_bytes)))
            decode.append(sizes[-1] * _decode_read_fraction(model, module))
    buffers = [b.numel() * b.element_size() for b in model.buffers()]
    rounding = sum(cuda_allocated_bytes(n) - n for n in sizes + buffers) if spec.device == "cuda" else 0
    layers = model.attention_layers()
    kv_elem = kv_cache_element_bytes(spec.kv_cache_dtype, spec.dtype_bytes)
    slots = block_slots(kv_cache_groups(spec.arch.sliding_windows, spec.max_model_len))
    kv_block = 2 * slots * spec.block_size * layers[0].num_kv_heads * layers[0].head_dim * kv_elem
    return ModelBytes(sum(sizes), round(sum(decode)), sum(buffers), rounding, kv_block)


def _decode_read_fraction(model: torch.nn.Module, module: torch.nn.Module) -> float:
    """The fraction of `module`'s parameters a one-token decode step reads (see `ModelBytes.decode_weights`)."""
    if isinstance(module, FusedMoE):
        return min(module.top_k, module.num_local_experts) / module.num_local_experts
    if type(module) is VocabParallelEmbedding:  # not the LM head (a subclass), which a tied table is
        return 1.0 if model.config.tie_word_embeddings else 0.0
    return 1.0


def cuda_allocated_bytes(num_bytes: int) -> int:
    """What PyTorch's CUDA caching allocator charges for a tensor of `num_bytes` made in a fresh segment.

    Sizes round up to 512 bytes; a tensor of 10 MiB or more gets a segment rounded up to 2 MiB, and
    the rest of that segment is split off only if it exceeds 1 MiB, else the tensor is charged all of
    it (Qwen2.5-7B's weights: 57 MiB of this).
    """
    size = max(512, -(-num_bytes // 512) * 512)
    if size < 10 << 20:
        return size
    segment = -(-size // (2 << 20)) * (2 << 20)
    return segment if segment - size <= 1 << 20 else size


@contextlib.contextmanager
def _as_tensor_parallel_rank(tp_size: int, expert_parallel: bool) -> Iterator[None]:
    """Build layers as rank 0 of `tp_size` would (they read the process's parallel state), then restore it."""
    state = parallel_state()
    saved = (state.tp_rank, state.tp_size, state.tp_group, state.expert_parallel)
    init_tensor_parallel(0, tp_size, expert_parallel=expert_parallel)
    try:
        yield
    finally:
        state.tp_rank, state.tp_size, state.tp_group, state.expert_parallel = saved
