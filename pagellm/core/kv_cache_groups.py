"""KV cache groups: layers that keep their KV in the same blocks, under the same rule.

Full-attention layers keep every block of a sequence; a sliding-window layer only the blocks its
window still reaches. Layers of one window form groups; each group has its own block table per
request, and all groups draw their blocks from one pool. A block is a page of the KV cache holding
`slots` layers' keys and values: the layer at position j of its group stores in slot j, so every
group is as many layers as the largest (the smaller ones leave slots unused), and a block of any
group costs the same memory. The scheduler, the workers and the planner read it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NEAR_EQUAL_LAYER_COUNTS = 1.25
"""Layer kinds whose counts are within this ratio share one group size, the largest (a few unused
slots beat multiplying the groups); otherwise groups are as large as the smallest kind."""


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers whose blocks are allocated, freed and prefix-cached together."""

    sliding_window: int | None
    """How many keys each query of these layers sees, itself included; None: full attention."""
    layers: tuple[int, ...]
    """The model's decoder layers in the group; layer `layers[j]` stores in slot j of a block."""

    def describe(self) -> str:
        kind = "full attention" if self.sliding_window is None else f"sliding window {self.sliding_window}"
        return f"{len(self.layers)} layer{'s' if len(self.layers) != 1 else ''} of {kind}"


def kv_cache_groups(layer_windows: Sequence[int | None], max_model_len: int | None = None) -> tuple[KVCacheGroup, ...]:
    """The groups of a model whose layer i attends with `layer_windows[i]` (None: full attention):
    layers of one window in order, cut into groups of one size; full-attention groups first. A
    window that reaches a whole sequence of `max_model_len` tokens is full attention."""
    if not layer_windows:
        raise ValueError("a model needs at least one attention layer")
    kinds: dict[int | None, list[int]] = {}
    for i, window in enumerate(layer_windows):
        if max_model_len is not None and window is not None and window >= max_model_len:
            window = None
        kinds.setdefault(window, []).append(i)
    counts = [len(layers) for layers in kinds.values()]
    size = max(counts) if max(counts) <= NEAR_EQUAL_LAYER_COUNTS * min(counts) else min(counts)
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    return tuple(KVCacheGroup(window, tuple(kinds[window][start:start + size]))
                 for window in order for start in range(0, len(kinds[window]), size))


def block_slots(groups: Sequence[KVCacheGroup]) -> int:
    """Layers one block holds: the size of the largest group."""
    return max(len(g.layers) for g in groups)


def layer_slots(groups: Sequence[KVCacheGroup]) -> dict[int, tuple[int, int]]:
    """Layer -> (its group, its slot in that group's blocks)."""
    return {layer: (g, slot) for g, group in enumerate(groups) for slot, layer in enumerate(group.layers)}


def window_blocks(window: int, block_size: int, num_new_tokens: int = 1) -> int:
    """The most blocks a sliding group holds for a step of `num_new_tokens` tokens, however long
    the sequence: those the positions from the window of the step's first token to its last span
    (window + num_new_tokens - 1 positions)."""
    return -(-(window + num_new_tokens - 2) // block_size) + 1


def max_blocks_held(window: int | None, num_tokens: int, block_size: int, num_new_tokens: int = 1) -> int:
    """The most blocks one group holds for a sequence of `num_tokens` tokens computed at most
    `num_new_tokens` a step: all of them without a window, else at most `window_blocks`."""
    every = -(-num_tokens // block_size)
    return every if window is None else min(every, window_blocks(window, block_size, num_new_tokens))
