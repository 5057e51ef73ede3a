"""GGUF block types and, for the GPU, their conversion into the layout the Triton kernel reads.

A GGUF block packs `values` weights of one row into `nbytes` bytes: 2- to 8-bit codes, a float16
scale, and for some types a minimum or per-sub-block scales. The GPU keeps the codes (2- to 4-bit
two a byte, 5- to 8-bit one a byte) with a scale, and where the type has one an offset, per group
of 16 or 32 inputs: W = (code - zero) * scale + offset, the same float32 values the gguf package's
`dequantize` gives (a code times a scale is exact in float32, and the one addition rounds as it
does there). Bits a weight on the GPU: Q4_0 4.5, Q4_1 5, Q8_0 8.5 (as in the file); Q4_K 6 (4.5 in
the file: its 6-bit sub-block scales and minimums multiplied out into float32); Q2_K 8 (2.6) and
Q3_K 6 (3.4): a nibble a code and float32 scales (and Q2_K's minimums) per 16; 5- and 6-bit codes
take a byte each: Q5_0 8.5 (5.5), Q5_1 9 (6), Q5_K 10 (5.5), Q6_K 10 (6.6).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagellm.quantization.int4 import pack_pairs, unpack_pairs

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14
"""GGML type ids."""
BLOCKS = {t: GGML_QUANT_SIZES[GGMLQuantizationType(t)]
          for t in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)}
"""GGML type id -> (weights, bytes) per block (the gguf package's table), for the types kept
quantized on some device."""


@dataclass(frozen=True, slots=True)
class GroupedWeight:
    """A weight [N, K] as the Triton kernel reads it (`triton_matmul.dequant_matmul`)."""

    codes: torch.Tensor
    """uint8 [N, K / 2] (two 4-bit codes a byte, k = 2j low) or int8 [N, K]."""
    scale: torch.Tensor
    """[N, K / group], float16 where the file's scale is exact in it, else float32."""
    offset: torch.Tensor | None
    """[N, K / group] added to each weight of its group (the block minimum), or None."""
    zero: int
    """Subtracted from every code."""
    group: int


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of `in_features` weights stored as `qtype` blocks."""
    values, nbytes = BLOCKS[qtype]
    return in_features // values * nbytes


def to_grouped(qtype: int, raw: torch.Tensor, in_features: int) -> GroupedWeight:
    """GGUF blocks uint8 [N, row bytes] -> the kernel's layout, on raw's device."""
    values, nbytes = BLOCKS[qtype]
    rows = raw.shape[0]
    b = raw.reshape(rows, in_features // values, nbytes)
    if qtype in (Q4_0, Q4_1):
        d = _f16(b[..., 0:2])
        qs = b[..., 2 if qtype == Q4_0 else 4:]  # value j in byte j's low nibble, j + 16 in its high one
        q = torch.cat((qs & 0xF, qs >> 4), dim=-1).reshape(rows, in_features)
        offset = _f16(b[..., 2:4]) if qtype == Q4_1 else None
        return GroupedWeight(pack_pairs(q), d, offset, 8 if qtype == Q4_0 else 0, 32)
    if qtype == Q8_0:
        codes = b[..., 2:].contiguous().view(torch.int8).reshape(rows, in_features)
        return GroupedWeight(codes, _f16(b[..., 0:2]), None, 0, 32)
    if qtype in (Q5_0, Q5_1):
        d = _f16(b[..., 0:2])
        first = 2 if qtype == Q5_0 else 4  # Q5_1: the minimum, then the high bits
        high = _bits(b[..., first:first + 4], 32)  # bit j of the little-endian word: value j's fifth bit
        qs = b[..., first + 4:]
        q = (torch.cat((qs & 0xF, qs >> 4), dim=-1) | (high << 4)).to(torch.int8).reshape(rows, in_features)
        if qtype == Q5_0:
            return GroupedWeight(q - 16, d, None, 0, 32)
        return GroupedWeight(q, d, _f16(b[..., 2:4]), 0, 32)
    if qtype in (Q2_K, Q3_K):
        # 2-bit codes: chunk c of 32 bytes holds value 128 c + 32 s + l in bits 2s of byte l.
        qs = b[..., 16:80] if qtype == Q2_K else b[..., 32:96]
        q = torch.cat([(qs.reshape(rows, -1, 2, 1, 32) >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)
        q = q.reshape(rows, -1, 256)
        if qtype == Q2_K:  # 16 sub-blocks: a 4-bit scale (low nibble) and minimum (high) each
            sub, d, dmin = b[..., :16], _f16(b[..., 80:82]).float(), _f16(b[..., 82:84]).float()
            scale = (d[..., None] * (sub & 0xF).float()).reshape(rows, -1)
            offset = -(dmin[..., None] * (sub >> 4).float()).reshape(rows, -1)
            return GroupedWeight(pack_pairs(q.reshape(rows, in_features)), scale, offset, 0, 16)
        # Q3_K: bit i of high-mask byte l is value 32 i + l's third bit (set: +4); 16 6-bit
        # sub-block scales, biased by 32: four low bits from 8 bytes' nibbles, two high from 4 bytes.
        high = ((b[..., :32].reshape(rows, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=raw.device)[:, None])
                & 1).reshape(rows, -1, 256)
        low_bits = torch.cat((b[..., 96:104] & 0xF, b[..., 96:104] >> 4), dim=-1)
        high_bits = torch.cat([(b[..., 104:108] >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)
        sub = (low_bits | (high_bits << 4)).float() - 32
        scale = (_f16(b[..., 108:110]).float()[..., None] * sub).reshape(rows, -1)
        return GroupedWeight(pack_pairs((q | (high << 2)).reshape(rows, in_features)), scale, None, 4, 16)
    if qtype in (Q4_K, Q5_K):
        d, dmin = _f16(b[..., 0:2]).float(), _f16(b[..., 2:4]).float()
        packed = b[..., 4:16].reshape(rows, -1, 3, 4)  # 8 sub-blocks' 6-bit scales and minimums
        low, mid, high = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
        sc = torch.cat((low & 0x3F, (high & 0xF) | ((low >> 2) & 0x30)), dim=-1)
        mn = torch.cat((mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)), dim=-1)
        scale = (d[..., None] * sc.float()).reshape(rows, -1)
        offset = -(dmin[..., None] * mn.float()).reshape(rows, -1)
        qs = b[..., 16 if qtype == Q4_K else 48:].reshape(rows, -1, 4, 1, 32)  # sub-block 2i: chunk i's low nibbles
        q = torch.cat((qs & 0xF, qs >> 4), dim=-2).reshape(rows, -1, 8, 32)
        if qtype == Q4_K:
            return GroupedWeight(pack_pairs(q.reshape(rows, in_features)), scale, offset, 0, 32)
        # Q5_K: byte l of 32 high-bit bytes holds bit 4 of value l of each sub-block (sub-block j: bit j).
        qh = b[..., 16:48].reshape(rows, -1, 1, 32)
        high = torch.cat([(qh >> j) & 1 for j in range(8)], dim=-2)
        return GroupedWeight((q | (high << 4)).to(torch.int8).reshape(rows, in_features), scale, offset, 0, 32)
    if qtype == Q6_K:
        ql = b[..., :128].reshape(rows, -1, 2, 1, 64)
        ql = torch.cat((ql & 0xF, ql >> 4), dim=-2).reshape(rows, -1, 8, 32)
        qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).reshape(rows, -1, 8, 32)
        codes = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(rows, in_features)
        sub_scales = b[..., 192:208].contiguous().view(torch.int8).float()  # [rows, blocks, 16]
        scale = (_f16(b[..., 208:210]).float()[..., None] * sub_scales).reshape(rows, -1)
        return GroupedWeight(codes, scale, None, 0, 16)
    raise ValueError(f"GGML type {qtype} has no GPU layout")


def bytes_per_weight(qtype: int, gpu: bool) -> float:
    """What one weight of `qtype` blocks takes as kept: the file's blocks (CPU), or the GPU layout."""
    values, nbytes = BLOCKS[qtype]
    if not gpu:
        return nbytes / values
    g = to_grouped(qtype, torch.zeros(1, nbytes, dtype=torch.uint8), values)
    return sum(t.numel() * t.element_size() for t in (g.codes, g.scale, g.offset) if t is not None) / values


def dequantize(w: GroupedWeight) -> torch.Tensor:
    """The float32 weight [N, K] (what the gguf package's dequantize gives)."""
    q = unpack_pairs(w.codes) if w.codes.dtype == torch.uint8 else w.codes
    values = (q.float() - w.zero) * w.scale.float().repeat_interleave(w.group, dim=1)
    if w.offset is not None:
        values += w.offset.float().repeat_interleave(w.group, dim=1)
    return values


def _bits(word_bytes: torch.Tensor, count: int) -> torch.Tensor:
    """uint8 [..., count / 8] (a little-endian bit field) -> uint8 [..., count], bit j at j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=word_bytes.device)
    return ((word_bytes[..., :, None] >> shifts) & 1).reshape(*word_bytes.shape[:-1], count)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] (little-endian float16) -> float16 [...]."""
    return two_bytes.contiguous().view(torch.float16).squeeze(-1)
