"""The decoder layer as one C call (`cpu_layer.c`): its structs, mirrored field for field, and the
call. `pagellm.models.cpu_layer` fills them from a model's layer."""
from __future__ import annotations

import ctypes
import functools

from pagellm.ops.c import build

_i64, _f32, _i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_int32
_ptr = ctypes.c_void_p


class LoRASlots(ctypes.Structure):
    """Mirrors `LoRASlots` in cpu_layer.c: one projection's adapter slots (a NULL: not adapted)."""

    _fields_ = [("a", _ptr), ("b", _ptr), ("rank", _i64), ("num_parts", _i64), ("part_offsets", _i64 * 4)]


LORA_PROJECTIONS = ("qkv", "o", "gate_up", "down")
"""The order of `DecoderLayer.lora`."""


class DecoderLayer(ctypes.Structure):
    """Mirrors `DecoderLayer` in cpu_layer.c, field for field."""

    _fields_ = [
        ("hidden_size", _i64), ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
        ("intermediate_size", _i64), ("block_size", _i64), ("sliding_window", _i64), ("eps", _f32), ("scale", _f32),
        ("input_norm", _ptr), ("post_norm", _ptr), ("qkv_bias", _ptr), ("cos_sin", _ptr),
        ("qkv", _ptr), ("o", _ptr), ("gate_up", _ptr), ("down", _ptr),
        ("qkv_type", _i32), ("o_type", _i32), ("gate_up_type", _i32), ("down_type", _i32),
        ("k_cache", _ptr), ("v_cache", _ptr), ("lora", LoRASlots * len(LORA_PROJECTIONS)),
    ]


class LayerStep(ctypes.Structure):
    """Mirrors `LayerStep` in cpu_layer.c."""

    _fields_ = [
        ("num_tokens", _i64), ("num_seqs", _i64), ("block_table_stride", _i64),
        ("positions", _ptr), ("slots", _ptr), ("query_start", _ptr), ("seq_lens", _ptr), ("block_table", _ptr),
        ("scratch", _ptr), ("lora_slots", _ptr),
    ]


def scratch_floats_per_token(layer: DecoderLayer) -> int:
    """float32 scratch elements the call needs per token of a step."""
    return _lib().decoder_layer_scratch(ctypes.byref(layer))


def run(layer: DecoderLayer, step: LayerStep, hidden: int, residual: int, first: bool, out: int) -> int:
    """One layer over a step (pointers to float32 [tokens, hidden] each); nonzero: no scratch memory."""
    return _lib().decoder_layer(ctypes.byref(layer), ctypes.byref(step), hidden, residual, int(first), out)


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = build.library()
    lib.decoder_layer_scratch.argtypes = [_ptr]
    lib.decoder_layer_scratch.restype = _i64
    lib.decoder_layer.argtypes = [_ptr, _ptr, _ptr, _ptr, ctypes.c_int, _ptr]
    lib.decoder_layer.restype = ctypes.c_int
    return lib
