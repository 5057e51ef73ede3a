"""The three rotary positions (temporal, height, width) of a prompt's tokens for a model with
multimodal rotary positions (Qwen2-VL's M-RoPE), as transformers' `get_rope_index` lays them out."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagellm.core.multimodal import MultiModalItem


@dataclass(slots=True, frozen=True)
class MRopePositions:
    """A prompt's positions and what the tokens after it add to their own."""

    prompt: np.ndarray
    """[3, prompt length] int64."""
    delta: int
    """A token at index p past the prompt (output) is at position p + delta on all three axes; so
    is every prompt token from `end` on."""
    start: int
    """The first image placeholder's index: the tokens before it are at their own index on all axes."""
    end: int
    """The index after the last image placeholder."""


def mrope_positions(num_tokens: int, items: Sequence[MultiModalItem], merge_size: int) -> MRopePositions:
    """A text run continues one past the previous run's highest position on all axes; an image's
    placeholders (its merged grid, row-major) start there, its row on the height axis and its
    column on the width axis, and the text after it continues from start + max(rows, columns)."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    next_pos, text_start = 0, 0
    for item in items:
        if item.grid_thw is None:
            raise ValueError("an image for a model with M-RoPE needs its patch grid (image_grid_thw)")
        text_len = item.offset - text_start
        positions[:, text_start:item.offset] = next_pos + np.arange(text_len)
        next_pos += text_len
        t, h, w = item.grid_thw[0], item.grid_thw[1] // merge_size, item.grid_thw[2] // merge_size
        if t * h * w != item.length:
            raise ValueError(f"an image of grid {item.grid_thw} has {item.length} placeholder tokens, not the "
                             f"{t * h * w} its merged grid holds")
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        positions[:, item.offset:item.end] = grid + next_pos
        next_pos += max(h, w)
        text_start = item.end
    positions[:, text_start:] = next_pos + np.arange(num_tokens - text_start)
    delta = int(positions.max()) + 1 - num_tokens
    return MRopePositions(positions, delta, items[0].offset, items[-1].end)


def mrope_merge_size(hf_config: dict) -> int | None:
    """The vision `spatial_merge_size` of a model with M-RoPE (its config.json's rope_scaling or
    rope_parameters give `mrope_section`); None for any other model."""
    if not any("mrope_section" in (hf_config.get(key) or {}) for key in ("rope_scaling", "rope_parameters")):
        return None
    return (hf_config.get("vision_config") or {}).get("spatial_merge_size", 2)
