"""How many images' placeholder tokens one step may start: the vision encoder runs on a whole image
in the step that first computes one of its placeholders (the worker keeps its features until the
last is computed), so a step that starts many images' chunks encodes all of them at once. The
budget counts each image's placeholders (its encoder output) once per step; an image larger than
the whole budget runs alone in its step, so it is never starved."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.multimodal import MultiModalItem


@dataclass(slots=True)
class EncoderBudget:
    """One step's encoder budget, in placeholder tokens."""

    remaining: int
    _taken: set[str] = field(default_factory=set)
    """Content hashes encoded this step: the same image in two requests is encoded once."""

    def fit(self, items: tuple[MultiModalItem, ...], start: int, num_new: int, resumed: bool) -> int:
        """How many of the `num_new` prompt tokens from `start` this step may compute: up to the first
        image they touch that must be encoded now and does not fit. An image whose placeholders
        began before `start` was encoded in an earlier step, unless the request is `resumed` (newly
        admitted, its prefix-cache hit ending inside the image: the worker holds no features for it)."""
        end = start + num_new
        for item in items:
            if item.offset >= end:
                break
            if item.end <= start or (item.offset < start and not resumed):
                continue
            if not self._take(item):
                return max(0, item.offset - start)
        return num_new

    def _take(self, item: MultiModalItem) -> bool:
        if item.content_hash in self._taken:
            return True
        if item.length > self.remaining and self._taken:
            return False
        self.remaining -= item.length
        self._taken.add(item.content_hash)
        return True
