"""Batched multi-LoRA products as two Triton kernels over tiles of rows that share an adapter (the
SGMV idea): a shrink h = x A_s^T and an expand y += h B_s^T, for many adapters in one launch each.

The host groups the batch's rows by slot into tiles of at most `BLOCK_M` rows (`plan_tiles` in
`pagellm.ops.lora`, which also holds the layout and the torch oracle); one program multiplies one
tile with its slot's matrices on the tensor cores, reading each adapter's weights once per tile
rather than once per row. The launch grid is the plan's number of tiles, padding tiles (slot -1)
included: they return at once, so a CUDA graph captured with a plan of `max_tiles` tiles replays
correctly whatever rows and slots the next step's plan holds.

The shrink reads all parts of a fused layer (q/k/v, gate/up) in one product ([BLOCK_M, parts x
rank], float32). Few tiles (decode) would leave most of the GPU idle over a long in_features loop, so
the shrink splits in_features over `shrink_splits` programs a tile, each writing its partial product
to its own plane of h [splits, rows, parts x rank]; the expand sums the planes as it reads h (no
atomics: the result does not depend on the order programs ran in). The expand splits the output
columns into blocks of BLOCK_N, each within one part, so a block reads one part's `rank` columns of
h; where no power of two of 16 or more divides every part boundary, it launches once per part.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm.ops.dispatch import triton_interpreting
from pagellm.ops.lora import TilePlan
from pagellm.ops.triton.utils import dot_f32

BLOCK_M = 16
"""Rows a tile: the tensor cores' least (`tl.dot` needs 16). Pass it to `plan_tiles`."""
_BLOCK_K = 64
"""Inputs a step of the shrink's loop over in_features."""
_MAX_BLOCK_N = 128
_MIN_BLOCK = 16  # tl.dot's least dimension
_MAX_PARTS = 3
_MAX_SPLITS = 32
_TARGET_PROGRAMS = 128
"""Programs the shrink aims for (about an H100's SMs): splits = this over the tiles."""
_MIN_SPLIT_K = 256
"""The least in_features a split reads (the loop's cost against the expand's extra reads)."""


@dataclass(frozen=True, slots=True)
class LoRATilesDevice:
    """A `TilePlan` on the device (int32 tensors) and the rows a tile holds at most."""

    sorted_rows: torch.Tensor
    tile_slot: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    block_m: int
    """At least the plan's longest tile; the kernels' BLOCK_M (a power of two, 16 or more)."""

    def __post_init__(self) -> None:
        if self.block_m < _MIN_BLOCK or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m must be a power of two >= {_MIN_BLOCK}, not {self.block_m}")

    @property
    def num_tiles(self) -> int:
        return self.tile_slot.shape[0]


def to_device(plan: TilePlan, device: torch.device | str, block_m: int = BLOCK_M) -> LoRATilesDevice:
    """`plan` (made with `plan_tiles(..., block_m)`) as int32 tensors on `device`."""
    if len(plan.tile_slot) and int((plan.tile_end - plan.tile_start).max()) > block_m:
        raise ValueError(f"the plan has tiles of more than {block_m} rows")
    tensors = (torch.from_numpy(arr.astype("int32", copy=False)).to(device)
               for arr in (plan.sorted_rows, plan.tile_slot, plan.tile_start, plan.tile_end))
    return LoRATilesDevice(*tensors, block_m=block_m)


@triton.jit
def _tile_rows(rows_ptr, slot_ptr, start_ptr, end_ptr, BLOCK_M: tl.constexpr):
    """This program's tile: its slot (-1: padding), its rows (int64, 0 where masked) and their mask."""
    tile = tl.program_id(0)
    slot = tl.load(slot_ptr + tile)
    start = tl.load(start_ptr + tile)
    end = tl.load(end_ptr + tile)
    idx = start + tl.arange(0, BLOCK_M)
    m_ok = idx < end
    rows = tl.load(rows_ptr + idx, mask=m_ok, other=0).to(tl.int64)
    return slot, rows, m_ok


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr,  # x [T, K], a [S, PR, K], out [splits, T, PR] float32; last dims contiguous
    rows_ptr, slot_ptr, start_ptr, end_ptr,  # the tile plan
    K, PR, K_PER_SPLIT,  # K_PER_SPLIT: a multiple of BLOCK_K
    stride_xm, stride_as, stride_ar, stride_os, stride_om,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr,  # see `dot_f32`
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    slot, rows, m_ok = _tile_rows(rows_ptr, slot_ptr, start_ptr, end_ptr, BLOCK_M)
    if slot < 0:
        return
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < PR
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + rr[:, None] * stride_ar
    split = tl.program_id(1)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_rows + rk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += dot_f32(x, tl.trans(a.to(x.dtype)), IEEE, INTERPRET)
    out_tile = out_ptr + split.to(tl.int64) * stride_os + rows[:, None] * stride_om + rr[None, :]
    tl.store(out_tile, acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    y_ptr, h_ptr, b_ptr,  # y [T, N], h [splits, T, P * R], b [S, N, R]; last dims contiguous
    rows_ptr, slot_ptr, start_ptr, end_ptr,  # the tile plan
    col_start, col_end,  # the columns of this launch (all of y's, or one part's)
    split1, split2,  # the inner part boundaries, in order; N where there are fewer parts
    R, SPLITS,
    stride_ym, stride_hs, stride_hm, stride_bs, stride_bn,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    slot, rows, m_ok = _tile_rows(rows_ptr, slot_ptr, start_ptr, end_ptr, BLOCK_M)
    if slot < 0:
        return
    n0 = col_start + tl.program_id(1) * BLOCK_N
    part = (n0 >= split1).to(tl.int32) + (n0 >= split2).to(tl.int32)  # the block lies within one part
    rn = n0 + tl.arange(0, BLOCK_N)
    n_ok = rn < col_end
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    h_tile = h_ptr + rows[:, None] * stride_hm + part * R + rr[None, :]
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(SPLITS):  # the shrink's partial products
        h += tl.load(h_tile + split * stride_hs, mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + rn[:, None] * stride_bn + rr[None, :],
                mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    dtype = y_ptr.dtype.element_ty  # the products in y's type, on the tensor cores; the sum in float32
    delta = dot_f32(h.to(dtype), tl.trans(b.to(dtype)), IEEE, INTERPRET)
    mask = m_ok[:, None] & n_ok[None, :]
    y_tile = y_ptr + rows[:, None] * stride_ym + rn[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0)
    tl.store(y_tile, (y.to(tl.float32) + delta).to(dtype), mask=mask)


def shrink_splits(in_features: int, num_tiles: int) -> int:
    """How many planes the shrink splits `in_features` over (see the module's docstring): enough
    programs to fill the GPU when tiles are few, each reading at least `_MIN_SPLIT_K` inputs."""
    by_programs = max(1, _TARGET_PROGRAMS // max(num_tiles, 1))
    return max(1, min(_MAX_SPLITS, by_programs, in_features // _MIN_SPLIT_K))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, tiles: LoRATilesDevice, out: torch.Tensor) -> None:
    """out[:, row] = the partial products of x[row] @ a[slot].T in float32 for every row of every tile
    of `tiles`, in_features split over out's planes (their sum is the product; `shrink_splits` says
    how many planes to give); other rows of `out` are left as they are. x [T, K]; a [S, P * R, K];
    out [splits, T, P * R] float32, or [T, P * R] for one plane."""
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"x [T, K] and a [S, P*R, K] disagree: {tuple(x.shape)}, {tuple(a.shape)}")
    planes = out if out.dim() == 3 else out.unsqueeze(0)
    if out.dtype != torch.float32 or planes.shape[1:] != (x.shape[0], a.shape[1]):
        raise ValueError(f"out must be float32 [splits, {x.shape[0]}, {a.shape[1]}], "
                         f"not {out.dtype} {tuple(out.shape)}")
    _check_rows_dense(x, a, planes)
    if tiles.num_tiles == 0:
        return
    pr, k, splits = a.shape[1], a.shape[2], planes.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, splits), _BLOCK_K) * _BLOCK_K
    _shrink_kernel[(tiles.num_tiles, splits)](
        x, a, planes, tiles.sorted_rows, tiles.tile_slot, tiles.tile_start, tiles.tile_end,
        k, pr, k_per_split, x.stride(0), a.stride(0), a.stride(1), planes.stride(0), planes.stride(1),
        IEEE=x.dtype == torch.float32, INTERPRET=triton_interpreting(),
        BLOCK_M=tiles.block_m, BLOCK_R=_block(pr), BLOCK_K=_BLOCK_K,
    )


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, part_offsets: tuple[int, ...],
                tiles: LoRATilesDevice) -> None:
    """y[row, n] += h[row, part(n) R : part(n) R + R] @ b[slot, n] for every row of every tile, in
    place in y's dtype (the sum in float32). y [T, N]; h [T, P * R], or the shrink's planes
    [splits, T, P * R] (summed here); b [S, N, R]; `part_offsets`: P + 1 increasing column offsets
    from 0 to N, P at most 3."""
    parts = len(part_offsets) - 1
    if not 1 <= parts <= _MAX_PARTS:
        raise ValueError(f"1 to {_MAX_PARTS} parts, not {parts}")
    n, rank = y.shape[1], b.shape[2]
    if part_offsets[0] != 0 or part_offsets[-1] != n or list(part_offsets) != sorted(part_offsets):
        raise ValueError(f"part offsets {part_offsets} must increase from 0 to N = {n}")
    planes = h if h.dim() == 3 else h.unsqueeze(0)
    if b.shape[1] != n or planes.shape[1:] != (y.shape[0], parts * rank):
        raise ValueError(f"y {tuple(y.shape)}, h {tuple(h.shape)} and b {tuple(b.shape)} disagree "
                         f"for {parts} parts")
    _check_rows_dense(y, planes, b)
    if tiles.num_tiles == 0:
        return
    splits = [*part_offsets[1:-1], n, n][:2]
    for col_start, col_end, block_n in expand_launches(part_offsets):
        grid = (tiles.num_tiles, triton.cdiv(col_end - col_start, block_n))
        _expand_kernel[grid](
            y, planes, b, tiles.sorted_rows, tiles.tile_slot, tiles.tile_start, tiles.tile_end,
            col_start, col_end, *splits, rank, planes.shape[0], y.stride(0), planes.stride(0), planes.stride(1),
            b.stride(0), b.stride(1),
            IEEE=y.dtype == torch.float32, INTERPRET=triton_interpreting(),
            BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_R=_block(rank),
        )


def expand_launches(part_offsets: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """The expand's launches as (first column, one past the last, BLOCK_N): one over all columns with
    the largest power of two from 16 to 128 that divides every inner part boundary (a block never
    straddles two parts), else one per part, each its own column range."""
    inner, n = part_offsets[1:-1], part_offsets[-1]
    block = min(_MAX_BLOCK_N, _block(n))
    while block >= _MIN_BLOCK and any(offset % block for offset in inner):
        block //= 2
    if block >= _MIN_BLOCK:
        return [(0, n, block)]
    return [(lo, hi, min(_MAX_BLOCK_N, _block(hi - lo))) for lo, hi in itertools.pairwise(part_offsets)]


def _block(size: int) -> int:
    """The next power of two >= size, at least tl.dot's 16."""
    return max(_MIN_BLOCK, triton.next_power_of_2(size))


def _check_rows_dense(*tensors: torch.Tensor) -> None:
    """The kernels take every stride but the last (1)."""
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("the kernels need tensors whose last dimension is contiguous")
