"""A pull's block runs and their NIXL descriptors (pagellm/worker/nixl_runs.py), against a block-by-block
walk written here and against the block-for-block mapping the pull must keep."""
from __future__ import annotations

import random

import numpy as np
import pytest

from pagellm.worker.nixl_runs import block_runs, run_descriptors


def walk_runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """The reference: extend a run while both ids take the run's step (+1 or -1), one block at a time."""
    runs: list[list[int]] = []  # [first local, first remote, length, step]
    for lo, re in zip(local, remote):
        if runs:
            first_lo, first_re, length, step = runs[-1]
            for candidate in ([step] if length > 1 else [1, -1]):
                if lo == first_lo + candidate * length and re == first_re + candidate * length:
                    runs[-1][2:] = [length + 1, candidate]
                    break
            else:
                runs.append([lo, re, 1, 0])
            continue
        runs.append([lo, re, 1, 0])
    # A descending run is copied from its lowest ids.
    return [(lo, re, n) if step >= 0 else (lo - n + 1, re - n + 1, n) for lo, re, n, step in runs]


def as_tuples(runs) -> list[tuple[int, int, int]]:
    return list(zip(runs.local_first.tolist(), runs.remote_first.tolist(), runs.lengths.tolist()))


def block_pairs(runs) -> set[tuple[int, int]]:
    """Every (local block, remote block) the runs copy."""
    return {(lo + i, re + i) for lo, re, n in as_tuples(runs) for i in range(n)}


@pytest.mark.parametrize("local, remote, expected", [
    ([3, 4, 5, 9, 10], [7, 8, 9, 2, 3], [(3, 7, 3), (9, 2, 2)]),
    ([9, 8, 7], [4, 3, 2], [(7, 2, 3)]),  # both descending: one run from the lowest ids
    ([1, 2, 3], [5, 4, 3], [(1, 5, 1), (2, 4, 1), (3, 3, 1)]),  # opposite directions: no run
    ([0, 1, 5, 6], [0, 1, 2, 3], [(0, 0, 2), (5, 2, 2)]),  # a gap on one side only
    ([4], [11], [(4, 11, 1)]),
    ([], [], []),
])
def test_runs_of_small_pulls(local, remote, expected):
    runs = block_runs(local, remote)
    assert as_tuples(runs) == expected == walk_runs(local, remote)


def test_runs_keep_the_block_mapping_of_random_pulls():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(1, 40)
        # Stretches of consecutive ids (either way) from a shuffled pool, as a reused allocator hands out.
        local, remote = [], []
        while len(local) < n:
            length = rng.randrange(1, 8)
            step = rng.choice([1, -1])
            lo, re = rng.randrange(100, 10_000), rng.randrange(100, 10_000)
            local += [lo + step * i for i in range(length)]
            remote += [re + (step if rng.random() < 0.8 else -step) * i for i in range(length)]
        runs = block_runs(local, remote)
        assert block_pairs(runs) == set(zip(local, remote))
        assert int(runs.lengths.sum()) == len(local)
        assert as_tuples(runs) == walk_runs(local, remote)


def test_mismatched_lengths_name_the_field():
    with pytest.raises(ValueError, match="remote_block_ids"):
        block_runs([1, 2, 3], [1, 2])


def test_descriptors_pair_up_tensor_by_tensor():
    runs = block_runs([3, 4, 5, 9, 10], [7, 8, 9, 2, 3])
    bases, block_bytes = [1 << 20, 5 << 20], 256
    rows = run_descriptors(bases, block_bytes, runs.local_first, runs.lengths, device_id=2)
    expected = [(base + first * block_bytes, n * block_bytes, 2) for base in bases for first, n in [(3, 3), (9, 2)]]
    assert [tuple(r) for r in rows.tolist()] == expected
    assert rows.dtype == np.int64
