"""Builds a model on its device, fills in its weights and gives it a KV cache: the target's, and a
draft model's."""
from __future__ import annotations

import logging
import math
import mmap
import time
from collections.abc import Sequence

import numpy as np
import torch

from pagellm.attention import get_attn_backend
from pagellm.core.kv_cache_groups import KVCacheGroup, layer_slots
from pagellm.distributed import parallel_state, stage_layers
from pagellm.layers.linear_method import process_weights_after_loading
from pagellm.loader import ModelSource, initialize_dummy_weights, iter_weights
from pagellm.models import CausalLM, get_model_class
from pagellm.models.cpu_layer import fuse_decoder_layers
from pagellm.quantization import build_quant_config
from pagellm.quantization.base import Calibration, CalibrationSource
from pagellm.tokenizer import load_tokenizer
from pagellm.worker.batch import attention_layout, padded_block_table

logger = logging.getLogger(__name__)

_PROMPT_BLOCK_SIZE = 16
"""The block size of `prompt_hidden_states`'s layout (its slots matter only with a bound cache)."""


def build_model(source: ModelSource, quantization: str | None, dtype: torch.dtype, device: torch.device,
                attention_backend: str, seed: int) -> CausalLM:
    """The model of `source` in eval mode, its weights loaded (random ones for load_format dummy,
    from `seed`) and kept in the `quantization` method's form where it applies."""
    start = time.perf_counter()
    model_cls = get_model_class(source.arch.architecture)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    quant = build_quant_config(quantization, source.path, source.arch.hf_config)
    try:
        with torch.device(device):
            model = model_cls(source.arch, get_attn_backend(attention_backend))
            keep_quantized = quant.apply(model) if quant is not None else set()
    finally:
        torch.set_default_dtype(previous_dtype)
    if source.load_format == "dummy":
        initialize_dummy_weights(model, seed)
    else:
        loaded = model.load_weights(iter_weights(source, keep_quantized))
        missing = {name for name, _ in model.named_parameters()} - loaded
        if missing:
            tensors = [hf_name for name in sorted(missing) for hf_name in model.checkpoint_names(name)]
            raise ValueError(f"checkpoint {source.path} lacks {len(tensors)} tensor(s): {', '.join(tensors[:8])}"
                             + (", ..." if len(tensors) > 8 else ""))
        if quant is not None:
            quant.prepare_weights(model, _calibration_source(source, quant.name))
    process_weights_after_loading(model.modules())
    for param in model.parameters():
        # The loaders are bound to their layers (param -> loader -> layer -> param): without them
        # the model holds no reference cycle, so a dropped engine's weights are freed at once, even
        # after gc.freeze() (which keeps frozen cycles until exit).
        param.__dict__.pop("weight_loader", None)
    logger.info("loaded %s (%s%s) in %.2f s", source.path, dtype,
                f", {quant.name} weights" if quant is not None else "", time.perf_counter() - start)
    return model.eval()


@torch.inference_mode()
def prompt_hidden_states(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """`model`'s last hidden states [len(ids), hidden] for one prompt from position 0 (through its KV
    cache if one is bound, of ceil(len(ids) / 16) blocks per KV cache group; without one the
    backends attend within the batch and ignore the slots)."""
    device = next(model.parameters()).device
    n = len(ids)
    blocks = -(-n // _PROMPT_BLOCK_SIZE)
    # Each KV cache group its own blocks: group g blocks g x blocks ... (a bound cache holds as many, `bind_kv_cache`).
    num_groups = 1 + max(layer.kv_group for layer in model.attention_layers())
    tables = [padded_block_table([list(range(g * blocks, (g + 1) * blocks))]) for g in range(num_groups)]
    layout = attention_layout(tables, np.zeros(1, dtype=np.int64), np.array([n], dtype=np.int64), _PROMPT_BLOCK_SIZE,
                              device)
    return model(torch.tensor(ids, dtype=torch.int64, device=device), layout.positions, layout.attn_metadata)


def _calibration_source(source: ModelSource, method: str) -> CalibrationSource:
    """How `method` (quantizing at load) runs the model on a calibration text: the text's tokens, as
    many as the model has positions, through `prompt_hidden_states`. None, with a warning, where a
    pipeline stage holds part of the model or there is no tokenizer."""

    def calibration(text: str) -> Calibration | None:
        if parallel_state().pp_size > 1:
            logger.warning("%s: no calibration at load with pipeline parallelism (a stage holds part of the "
                           "model); the weights are quantized without it", method)
            return None
        try:
            tokenizer = load_tokenizer(source)
        except ValueError:  # a folder without tokenizer.json (the engine may serve token ids alone)
            tokenizer = None
        if tokenizer is None:
            logger.warning("%s: no tokenizer to calibrate with; the weights are quantized without calibration",
                           method)
            return None
        ids = tokenizer.encode(text)[:source.arch.max_position_embeddings]
        return Calibration(ids, prompt_hidden_states)

    return calibration


def _local_slots(model: CausalLM, groups: Sequence[KVCacheGroup]) -> list[tuple[int, int]]:
    """(KV cache group, slot) of each of this pipeline stage's attention layers, in order."""
    ps = parallel_state()
    slots = layer_slots(groups)
    local = [slots[i] for i in stage_layers(model.config.num_hidden_layers, ps.pp_rank, ps.pp_size)]
    if len(local) != len(model.attention_layers()):
        raise ValueError(f"{type(model).__name__} has {len(model.attention_layers())} attention layers on this "
                         f"pipeline stage, not the {len(local)} decoder layers its config gives the stage")
    return local


def kv_bytes_per_block(model: CausalLM, groups: Sequence[KVCacheGroup], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of `model`'s KV cache on this rank: the slots its layers store in (every
    group's layers share a block's slots, `pagellm.core.kv_cache_groups`), its share of the KV heads."""
    layers = model.attention_layers()
    num_slots = len({slot for _, slot in _local_slots(model, groups)})
    return 2 * num_slots * block_size * layers[0].num_kv_heads * layers[0].head_dim * dtype.itemsize


def bind_kv_cache(model: CausalLM, groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int,
                  dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocate `model`'s KV cache (keys and values per slot of a block) and hand each layer its
    slot's and its group; on the CPU, fuse the decoder layers that can run as one C call each."""
    layers = model.attention_layers()
    shape = (num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    local = _local_slots(model, groups)
    caches = {slot: (_zeros(shape, dtype, device), _zeros(shape, dtype, device))
              for slot in sorted({slot for _, slot in local})}
    for layer, (group, slot) in zip(layers, local):
        layer.kv_cache, layer.kv_group = caches[slot], group
    if device.type == "cpu" and fuse_decoder_layers(model.decoder_layers()):
        logger.info("decoder layers run as one C call each (CPU, GGUF blocks)")
    return list(caches.values())


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. On the CPU it is anonymous memory, which the OS hands out
    zeroed and commits page by page on first write: a cache sized for the worst case costs
    neither start-up time nor resident memory until its blocks are used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, math.prod(shape) * dtype.itemsize), dtype=dtype).view(shape)
