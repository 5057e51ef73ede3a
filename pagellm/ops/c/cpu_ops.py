"""The C implementations (`cpu_kernels.c`) of the small ops, for float32 tensors on the CPU.

Same contracts as `torch_ops` (new output tensors, inputs untouched); `dispatch` picks them for
contiguous float32 CPU tensors when the kernels build here.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from pagellm.ops.c import build as native


@functools.cache
def available() -> bool:
    """Whether the kernels build and load on this machine."""
    return native.unavailable_reason() is None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    _lib().rms_norm(x.data_ptr(), None, weight.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps,
                    out.data_ptr(), None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x, residual = x.contiguous(), residual.contiguous()
    out, summed = torch.empty_like(x), torch.empty_like(x)
    _lib().rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps,
                    out.data_ptr(), summed.data_ptr())
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    _lib().silu_and_mul(x.data_ptr(), x.numel() // x.shape[-1], d, out.data_ptr())
    return out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = positions.to(torch.int64).contiguous()
    return _rotate(positions, query, cos_sin_cache), _rotate(positions, key, cos_sin_cache)


def _rotate(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] whose heads are contiguous (a view into a fused qkv output may skip between rows)."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    _lib().rotary(x.data_ptr(), x.shape[0], x.shape[1], x.shape[2], x.stride(0), positions.data_ptr(),
                  cos_sin_cache.data_ptr(), out.data_ptr())
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, num_tokens: int) -> None:
    """Rows t < num_tokens of key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D]
    at slots[t] (negative: not written)."""
    lib = _lib()
    for new, cache in ((key, k_cache), (value, v_cache)):
        if new.stride(-1) != 1 or new.stride(-2) != new.shape[-1]:
            new = new.contiguous()
        lib.write_rows(new.data_ptr(), num_tokens, new.shape[1] * new.shape[2], new.stride(0), slots.data_ptr(),
                       cache.data_ptr())


def attention_supports(query: torch.Tensor) -> bool:
    """Whether `paged_attention` takes queries like this one (float32, head size a multiple of 8 up to 256)."""
    head_dim = query.shape[-1]
    return query.dtype == torch.float32 and head_dim % 8 == 0 and head_dim <= 256


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of query [T, H, D] (heads contiguous; sequence b's queries at
    query_start_loc[b]:query_start_loc[b+1], the last of its seq_lens[b] positions) over the paged
    caches -> [T, H, D]; each query sees its last `sliding_window` positions (None: all), its
    scores capped by `logits_soft_cap`, each head's softmax joined by its `sinks` logit [H] (see
    `AttentionBackend.forward`)."""
    if query.stride(-1) != 1 or query.stride(-2) != query.shape[-1]:
        query = query.contiguous()
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    num_heads, head_dim = query.shape[1:]
    out = torch.empty(query.shape, dtype=query.dtype)
    _lib().paged_attention(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
        block_table.stride(0), query_start_loc.data_ptr(), seq_lens.data_ptr(), len(seq_lens), num_heads,
        k_cache.shape[2], head_dim, k_cache.shape[1], scale, sliding_window or 0, logits_soft_cap or 0.0,
        None if sinks is None else sinks.data_ptr(), out.data_ptr())
    return out


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = native.library()
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, f32, ptr, ptr]
    lib.silu_and_mul.argtypes = [ptr, i64, i64, ptr]
    lib.rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr]
    lib.write_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr]
    lib.paged_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, f32, i64, f32,
                                    ptr, ptr]
    for fn in (lib.rms_norm, lib.silu_and_mul, lib.rotary, lib.write_rows, lib.paged_attention):
        fn.restype = None
    return lib
