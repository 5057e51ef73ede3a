"""The batched LoRA kernels (`pagellm.ops.triton.lora`) against the torch oracle of `pagellm.ops.lora`,
and the host tile plan they run on.

Without a GPU the kernels run under Triton's CPU interpreter at small sizes. Every batch mixes rows of
several slots with rows of none (-1), one slot on more rows than a tile holds, and an adapter of half
the buffer's rank (zero-padded); each check against the oracle is also shown to fail where a row
reads another slot's adapter.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

# Without a GPU, conftest.py sets TRITON_INTERPRET before this module defines any kernel.
pytest.importorskip("triton")

from pagellm.ops.lora import lora_expand_ref, lora_shrink_ref, max_tiles, plan_tiles
from pagellm.ops.triton.lora import (
    BLOCK_M,
    LoRATilesDevice,
    expand_launches,
    lora_expand,
    lora_shrink,
    shrink_splits,
    to_device,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
TOKENS, SLOTS, IN_FEATURES = 48, 4, 80  # in_features: a whole and a partial step of the shrink's loop
# (part offsets, rank): one part of rank 8 (below the kernels' 16), q/k/v of rank 16, and parts whose
# boundary no power of two >= 16 divides (the expand launches once per part).
LAYERS = [((0, 64), 8), ((0, 64, 96, 128), 16), ((0, 40, 64), 16)]
# The shrink's products of 16-bit inputs are exact in float32, as the oracle's: only the order of the
# sums differs. The expand rounds h to y's type before its products, and the sum once to y's type
# (the interpreter truncates: off by at most 2**-7 relative).
SHRINK_TOL = {"rtol": 1e-4, "atol": 1e-4}
EXPAND_TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-6, "atol": 2**-5},
              torch.float16: {"rtol": 2**-6, "atol": 2**-5}}
SENTINEL = -123.0


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """Fresh random inputs for every case, reproducible from the test id."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def batch_slots(gen: torch.Generator) -> torch.Tensor:
    """Each row's slot: random, -1 among them, slot 0 on more rows than one tile holds."""
    slots = torch.randint(-1, SLOTS, (TOKENS,), generator=gen, dtype=torch.int32)
    slots[torch.randperm(TOKENS, generator=gen)[:BLOCK_M + 4]] = 0
    return slots


def wrong_slots(slots: torch.Tensor) -> torch.Tensor:
    """Every row with an adapter moved to the next slot: what a kernel reading the wrong slot computes."""
    return torch.where(slots >= 0, (slots + 1) % SLOTS, slots)


def adapters(gen: torch.Generator, part_offsets: tuple[int, ...], rank: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """a [S, P x rank, K] and b [S, N, rank] (scaled so h and the delta are about 1), slot 1's adapter
    of half the rank: its other rows of A and columns of B zero."""
    parts, n = len(part_offsets) - 1, part_offsets[-1]
    a = torch.randn(SLOTS, parts, rank, IN_FEATURES, generator=gen) * IN_FEATURES**-0.5
    b = torch.randn(SLOTS, n, rank, generator=gen) * rank**-0.5
    a[1, :, rank // 2:] = 0
    b[1, :, rank // 2:] = 0
    return a.reshape(SLOTS, parts * rank, IN_FEATURES).to(DEVICE, dtype), b.to(DEVICE, dtype)


def device_tiles(slots: torch.Tensor, padding: int = 3) -> LoRATilesDevice:
    """The plan of `slots` with `padding` tiles more than the rows need (as a CUDA graph's fixed plan)."""
    plan = plan_tiles(slots.numpy(), BLOCK_M, num_tiles=max_tiles(TOKENS, SLOTS, BLOCK_M) + padding)
    return to_device(plan, DEVICE)


def expanded_ref(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, part_offsets: tuple[int, ...],
                 slots: torch.Tensor) -> torch.Tensor:
    """The oracle's y + h B^T in float32 (the kernel's one rounding to y's type is within the tolerance)."""
    ref = y.float()
    lora_expand_ref(ref, h, b, part_offsets, slots.to(DEVICE))
    return ref


@pytest.mark.parametrize("block_m", [BLOCK_M, 4])
@pytest.mark.parametrize("padding", [None, 5])
def test_plan_tiles_covers_each_row_once_in_a_tile_of_its_slot(block_m: int, padding: int | None) -> None:
    rng = np.random.default_rng(block_m)
    slots = rng.integers(-1, 6, size=100)
    slots[rng.permutation(100)[:40]] = 2  # a slot of several tiles
    num_tiles = None if padding is None else max_tiles(100, 7, block_m) + padding
    plan = plan_tiles(slots, block_m, num_tiles)
    real = plan.tile_slot >= 0
    if num_tiles is not None:
        assert len(plan.tile_slot) == num_tiles
    assert real.sum() <= max_tiles(100, 7, block_m)
    assert (plan.tile_slot[~real] == -1).all() and (plan.tile_start[~real] == plan.tile_end[~real]).all()
    sizes = plan.tile_end[real] - plan.tile_start[real]
    assert ((sizes >= 1) & (sizes <= block_m)).all()
    covered = []
    for slot, start, end in zip(plan.tile_slot[real], plan.tile_start[real], plan.tile_end[real]):
        rows = plan.sorted_rows[start:end]
        assert (slots[rows] == slot).all(), "a tile holds a row of another slot"
        covered.extend(rows.tolist())
    assert sorted(covered) == np.flatnonzero(slots >= 0).tolist(), "rows with an adapter, each exactly once"


def test_plan_tiles_refuses_too_few_tiles() -> None:
    slots = np.array([0] * 17 + [1, -1])
    assert len(plan_tiles(slots, 16, num_tiles=3).tile_slot) == 3
    with pytest.raises(ValueError, match="need 3 tiles"):
        plan_tiles(slots, 16, num_tiles=2)


def test_to_device_refuses_tiles_longer_than_the_kernels_block() -> None:
    with pytest.raises(ValueError, match="more than 16 rows"):
        to_device(plan_tiles(np.zeros(40, dtype=np.int32), 32), DEVICE, 16)
    with pytest.raises(ValueError, match="power of two"):
        to_device(plan_tiles(np.zeros(40, dtype=np.int32), 16), DEVICE, 24)


@pytest.mark.parametrize("part_offsets,launches", [
    ((0, 4096, 5120, 6144), [(0, 6144, 128)]),
    ((0, 64, 96, 128), [(0, 128, 32)]),
    ((0, 100), [(0, 100, 128)]),  # a single part: the last block masked
    ((0, 40, 64), [(0, 40, 64), (40, 64, 32)]),  # 40 = 8 x 5: a launch per part
])
def test_expand_launches_keep_each_block_within_a_part(part_offsets: tuple[int, ...],
                                                       launches: list[tuple[int, int, int]]) -> None:
    assert expand_launches(part_offsets) == launches


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("part_offsets,rank", LAYERS)
@pytest.mark.parametrize("splits", [None, 2, 3], ids=["one plane", "2 planes", "3 planes, one empty"])
def test_shrink_matches_the_oracle(part_offsets: tuple[int, ...], rank: int, dtype: torch.dtype, splits: int | None,
                                   gen: torch.Generator) -> None:
    """in_features split over planes (80 over 3: 64, 16 and none) sum to the product."""
    slots = batch_slots(gen)
    x = torch.randn(TOKENS, IN_FEATURES, generator=gen).to(DEVICE, dtype)
    a, _ = adapters(gen, part_offsets, rank, dtype)
    planes = (1 if splits is None else splits, TOKENS, a.shape[1])
    h = torch.full(planes[1:] if splits is None else planes, SENTINEL, device=DEVICE)
    lora_shrink(x, a, device_tiles(slots), h)
    h = h.view(planes)
    used = (slots >= 0).to(DEVICE)
    total = h[:, used].sum(0)
    torch.testing.assert_close(total, lora_shrink_ref(x, a, slots.to(DEVICE))[used], **SHRINK_TOL)
    assert not torch.allclose(total, lora_shrink_ref(x, a, wrong_slots(slots).to(DEVICE))[used], **SHRINK_TOL)
    assert (h[:, ~used] == SENTINEL).all(), "rows without an adapter are left as they were"
    if splits is not None:
        assert not torch.allclose(h[0, used], total, **SHRINK_TOL), "each plane holds a part of the sum"


def test_shrink_splits_fill_the_gpu_when_tiles_are_few() -> None:
    assert shrink_splits(4096, 2) > 1 and shrink_splits(14336, 2) > shrink_splits(4096, 2)
    assert shrink_splits(4096, 200) == 1, "many tiles fill the GPU alone"
    assert shrink_splits(64, 1) == 1, "too few inputs to split"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("part_offsets,rank", LAYERS)
def test_expand_matches_the_oracle(part_offsets: tuple[int, ...], rank: int, dtype: torch.dtype,
                                   gen: torch.Generator) -> None:
    slots = batch_slots(gen)
    _, b = adapters(gen, part_offsets, rank, dtype)
    h = torch.randn(TOKENS, (len(part_offsets) - 1) * rank, generator=gen).to(DEVICE)
    y0 = torch.randn(TOKENS, part_offsets[-1], generator=gen).to(DEVICE, dtype)
    y = y0.clone()
    lora_expand(y, h, b, part_offsets, device_tiles(slots))
    torch.testing.assert_close(y.float(), expanded_ref(y0, h, b, part_offsets, slots), **EXPAND_TOL[dtype])
    assert not torch.allclose(y.float(), expanded_ref(y0, h, b, part_offsets, wrong_slots(slots)),
                              **EXPAND_TOL[dtype])
    unused = (slots < 0).to(DEVICE)
    assert torch.equal(y[unused], y0[unused]), "rows without an adapter are left as they were"


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=str)
@pytest.mark.parametrize("splits", [1, 2])
def test_shrink_then_expand_matches_the_oracle(dtype: torch.dtype, splits: int, gen: torch.Generator) -> None:
    """The expand sums the shrink's planes."""
    part_offsets, rank = LAYERS[1]
    slots = batch_slots(gen)
    x = torch.randn(TOKENS, IN_FEATURES, generator=gen).to(DEVICE, dtype)
    a, b = adapters(gen, part_offsets, rank, dtype)
    y0 = torch.randn(TOKENS, part_offsets[-1], generator=gen).to(DEVICE, dtype)
    tiles = device_tiles(slots)
    h = torch.empty(splits, TOKENS, a.shape[1], device=DEVICE)
    y = y0.clone()
    lora_shrink(x, a, tiles, h)
    lora_expand(y, h, b, part_offsets, tiles)

    def ref(row_slots: torch.Tensor) -> torch.Tensor:
        return expanded_ref(y0, lora_shrink_ref(x, a, row_slots.to(DEVICE)), b, part_offsets, row_slots)

    torch.testing.assert_close(y.float(), ref(slots), **EXPAND_TOL[dtype])
    assert not torch.allclose(y.float(), ref(wrong_slots(slots)), **EXPAND_TOL[dtype])


def test_weights_of_another_dtype_are_cast_to_the_activations(gen: torch.Generator) -> None:
    """float32 A and B with bfloat16 activations, their values bfloat16's (the cast exact: the interpreter
    truncates where the GPU rounds)."""
    part_offsets, rank = LAYERS[1]
    slots = batch_slots(gen)
    x = torch.randn(TOKENS, IN_FEATURES, generator=gen).to(DEVICE, torch.bfloat16)
    a, b = (w.float() for w in adapters(gen, part_offsets, rank, torch.bfloat16))
    y0 = torch.randn(TOKENS, part_offsets[-1], generator=gen).to(DEVICE, torch.bfloat16)
    tiles = device_tiles(slots)
    h = torch.empty(TOKENS, a.shape[1], device=DEVICE)
    y = y0.clone()
    lora_shrink(x, a, tiles, h)
    lora_expand(y, h, b, part_offsets, tiles)
    h_ref = lora_shrink_ref(x, a, slots.to(DEVICE))
    used = (slots >= 0).to(DEVICE)
    torch.testing.assert_close(h[used], h_ref[used], **SHRINK_TOL)
    torch.testing.assert_close(y.float(), expanded_ref(y0, h_ref, b, part_offsets, slots), **EXPAND_TOL[torch.bfloat16])


@pytest.mark.parametrize("num_tiles", [None, 4], ids=["no tiles", "padding tiles only"])
def test_a_batch_without_adapters_changes_nothing(num_tiles: int | None, gen: torch.Generator) -> None:
    part_offsets, rank = LAYERS[1]
    slots = np.full(TOKENS, -1, dtype=np.int32)
    tiles = to_device(plan_tiles(slots, BLOCK_M, num_tiles), DEVICE)
    assert tiles.num_tiles == (num_tiles or 0)
    x = torch.randn(TOKENS, IN_FEATURES, generator=gen).to(DEVICE)
    a, b = adapters(gen, part_offsets, rank, torch.float32)
    h = torch.full((TOKENS, a.shape[1]), SENTINEL, device=DEVICE)
    y0 = torch.randn(TOKENS, part_offsets[-1], generator=gen).to(DEVICE)
    y = y0.clone()
    lora_shrink(x, a, tiles, h)
    lora_expand(y, h, b, part_offsets, tiles)
    assert (h == SENTINEL).all() and torch.equal(y, y0)


def test_to_device_holds_the_plan_as_int32() -> None:
    tiles = to_device(plan_tiles(np.array([1, -1, 0, 1]), BLOCK_M), DEVICE)
    assert tiles.sorted_rows.tolist() == [2, 0, 3] and tiles.tile_slot.tolist() == [0, 1]
    assert all(t.dtype == torch.int32 for t in (tiles.sorted_rows, tiles.tile_slot, tiles.tile_start, tiles.tile_end))
