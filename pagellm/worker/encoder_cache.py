"""The images whose placeholder tokens a step computes, and their encoder output kept until every
placeholder of theirs is computed (a prompt chunked across steps encodes each image once)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.core.multimodal import MultiModalItem
from pagellm.core.request import RecordFields


@dataclass(slots=True, frozen=True)
class ScheduledImage:
    """Placeholder tokens of one image that this step computes."""

    req_id: str
    item: MultiModalItem
    first_row: int
    """The flat batch row of the first of them."""
    first_feature: int
    """The image's feature row the first of them takes."""
    count: int
    completes: bool
    """Whether its last placeholder is among them (its features are no longer needed after)."""


def scheduled_images(states: Sequence[RecordFields], starts: np.ndarray, query_lens: np.ndarray,
                     query_start_loc: np.ndarray) -> list[ScheduledImage]:
    """The image placeholders among the tokens [starts[i], starts[i] + query_lens[i]) that request
    i computes at flat batch rows from query_start_loc[i]."""
    images = []
    for i, state in enumerate(states):
        items = state.record.multi_modal
        start, end = int(starts[i]), int(starts[i] + query_lens[i])
        if not items or start >= items[-1].end:  # no image, or past the last one (decoding)
            continue
        for item in items:
            lo, hi = max(item.offset, start), min(item.end, end)
            if lo < hi:
                images.append(ScheduledImage(state.request_id, item, int(query_start_loc[i]) + lo - start,
                                             lo - item.offset, hi - lo, hi == item.end))
    return images


@dataclass(slots=True)
class EncoderTimes:
    """Images encoded and the encoder's time since the last `take`. On a GPU the time is read off CUDA
    events once the device has passed them (the host never waits for it)."""

    images: int = 0
    seconds: float = 0.0
    pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def run(self, encode: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], pixels: torch.Tensor,
            grids: torch.Tensor | None) -> torch.Tensor:
        self.images += len(pixels)
        if pixels.device.type != "cuda":
            start = time.perf_counter()
            features = encode(pixels, grids)
            self.seconds += time.perf_counter() - start
            return features
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        features = encode(pixels, grids)
        events[1].record()
        self.pending.append(events)
        return features

    def take(self) -> tuple[int, float]:
        """(images, seconds) since the previous take; timings the device has not reached yet come later."""
        done = [pair for pair in self.pending if pair[1].query()]
        self.pending = [pair for pair in self.pending if not pair[1].query()]
        seconds = self.seconds + sum(start.elapsed_time(end) for start, end in done) / 1000
        images, self.images, self.seconds = self.images, 0, 0.0
        return images, seconds


class EncoderCache:
    """Each image's features by content hash, from the step that first needs them until every
    request using them has computed all its placeholders (or was freed). It holds only images
    partly computed, so it is bounded by the running requests' images."""

    def __init__(self) -> None:
        self._features: dict[str, torch.Tensor] = {}
        self._holders: dict[str, set[str]] = {}
        """Per content hash, the requests whose placeholders still need its features."""
        self._held_by: dict[str, set[str]] = {}
        """Per request, the content hashes it holds."""
        self.times = EncoderTimes()

    def __len__(self) -> int:
        return len(self._features)

    def embeds(self, images: list[ScheduledImage],
               encode: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat batch rows, their features) of this step's placeholders, running `encode` (the
        model's `encode_images`) on the images not cached, batched by pixel shape and grid."""
        missing: dict[str, MultiModalItem] = {}
        for image in images:
            if image.item.content_hash not in self._features:
                missing.setdefault(image.item.content_hash, image.item)
        by_shape: dict[tuple, list[MultiModalItem]] = {}
        for item in missing.values():
            by_shape.setdefault((item.shape, item.grid_thw), []).append(item)
        for (shape, grid), items in by_shape.items():
            pixels = torch.stack([torch.frombuffer(bytearray(item.data), dtype=torch.float32).view(shape)
                                  for item in items]).to(device)
            grids = None if grid is None else torch.tensor([grid] * len(items), dtype=torch.int64, device=device)
            for item, features in zip(items, self.times.run(encode, pixels, grids)):
                self._features[item.content_hash] = features
        rows = np.concatenate([np.arange(image.first_row, image.first_row + image.count) for image in images])
        features = torch.cat([self._features[image.item.content_hash][
            image.first_feature:image.first_feature + image.count] for image in images])
        # Holders first: an image another request of this step still needs outlives one that completes.
        for image in images:
            if not image.completes:
                self._holders.setdefault(image.item.content_hash, set()).add(image.req_id)
                self._held_by.setdefault(image.req_id, set()).add(image.item.content_hash)
        for image in images:
            if image.completes:
                self._drop(image.req_id, image.item.content_hash)
        return torch.from_numpy(rows).to(device), features

    def release(self, freed_req_ids: Iterable[str]) -> None:
        """Freed requests (finished, aborted, preempted) need their images no more."""
        if not self._held_by:
            return
        for req_id in freed_req_ids:
            for key in list(self._held_by.get(req_id, ())):
                self._drop(req_id, key)

    def _drop(self, req_id: str, key: str) -> None:
        """`req_id` needs `key`'s features no more; they go once no request needs them."""
        keys = self._held_by.get(req_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._held_by[req_id]
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(req_id)
        if not holders:
            self._holders.pop(key, None)
            self._features.pop(key, None)
