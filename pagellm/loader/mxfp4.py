"""MXFP4 checkpoints (OCP Microscaling Formats v1.0: FP4 E2M1 elements in blocks of 32 that share
one E8M0 scale), as GPT-OSS stores its experts' weights, dequantized at load.

A weight `<name>` [..., out, in] is stored as `<name>_blocks` uint8 [..., out, in / 32, 16], two
elements a byte (the even one in the low nibble, as GPT-OSS packs them), and `<name>_scales` uint8
[..., out, in / 32]: each block's power of two, biased by 127 (255 is NaN).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

MXFP4_BLOCK = 32
"""Elements sharing one scale."""
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit code: sign, two exponent bits (bias 1), one mantissa bit."""
E8M0_BIAS = 127
E8M0_NAN = 255
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
_ROWS_PER_CHUNK = 1 << 16
"""Blocks dequantized at a time (their float32 values): bounds the memory a large tensor takes beyond its result."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> [..., G x 32] in `dtype` (bfloat16
    holds every value exactly, but for scales beyond its range)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., G, {MXFP4_BLOCK // 2}] must match their scales [..., G]; got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    flat_blocks, flat_scales = blocks.reshape(-1, MXFP4_BLOCK // 2), scales.reshape(-1)
    out = torch.empty(flat_blocks.shape[0], MXFP4_BLOCK, dtype=dtype)
    for start in range(0, flat_blocks.shape[0], _ROWS_PER_CHUNK):
        codes = flat_blocks[start:start + _ROWS_PER_CHUNK].long()
        values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1).flatten(1)
        exponents = flat_scales[start:start + _ROWS_PER_CHUNK]
        scaled = torch.ldexp(values, exponents.int()[:, None] - E8M0_BIAS)
        out[start:start + _ROWS_PER_CHUNK] = scaled.masked_fill((exponents == E8M0_NAN)[:, None], float("nan"))
    return out.view(*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK)


def iter_mxfp4_dequantized(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with each `<name>_blocks` / `<name>_scales` pair replaced by `<name>` dequantized to
    bfloat16 and laid out as transformers holds it once dequantized: [..., in, out] (its
    GptOssExperts' parameters), a transposed view. Other tensors pass as they are; a pair's halves
    may come in either order, any tensors apart."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        suffix = next((s for s in (BLOCKS_SUFFIX, SCALES_SUFFIX) if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        other = pending.pop(base + (SCALES_SUFFIX if suffix == BLOCKS_SUFFIX else BLOCKS_SUFFIX), None)
        if other is None:
            pending[name] = tensor
            continue
        blocks, scales = (tensor, other) if suffix == BLOCKS_SUFFIX else (other, tensor)
        try:
            yield base, dequantize_mxfp4(blocks, scales).transpose(-1, -2)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {base!r}: {e}") from None
    if pending:
        raise ValueError(f"the MXFP4 checkpoint holds {', '.join(sorted(pending))} without its "
                         f"{BLOCKS_SUFFIX} / {SCALES_SUFFIX} counterpart")
