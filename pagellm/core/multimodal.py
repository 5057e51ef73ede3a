"""The decoded, preprocessed inputs other than text that a request carries (images), and where
their placeholder tokens sit in its prompt."""
from __future__ import annotations

import msgspec


class MultiModalItem(msgspec.Struct, frozen=True, kw_only=True):
    """One image, as the model's own Hugging Face processor prepared it: its pixel values and the
    run of placeholder tokens in the prompt that its features replace."""

    modality: str
    """"image" (the only kind for now)."""
    content_hash: str
    """SHA-256 (hex) of the preprocessed pixel values, their shape and grid: the same image, prepared the
    same way, has the same hash. It joins the block hashes of the blocks holding its placeholders
    and keys the worker's encoder cache."""
    offset: int
    """The prompt position of its first placeholder token."""
    length: int
    """Its placeholder tokens (the features the encoder gives it)."""
    data: bytes
    """The pixel values, float32 in C order (bytes: the record stays free of torch and numpy)."""
    shape: tuple[int, ...]
    """The pixel values' shape, e.g. (3, 336, 336), or (patches, channels x patch size) for a
    dynamic-resolution vision transformer (Qwen2-VL)."""
    grid_thw: tuple[int, int, int] | None = None
    """Its patch grid (temporal, height, width) where the image's size sets its patch count
    (Qwen2-VL's `image_grid_thw`); None for a fixed-size tower (LLaVA's CLIP)."""

    @property
    def end(self) -> int:
        """The prompt position after its last placeholder token."""
        return self.offset + self.length


def block_content_keys(items: tuple[MultiModalItem, ...], start: int, end: int) -> tuple[str, ...]:
    """The content hashes of the items with a placeholder among prompt positions [start, end): what
    a block of those positions chains into its hash besides its tokens."""
    return tuple(item.content_hash for item in items if item.offset < end and start < item.end)
