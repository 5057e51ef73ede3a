"""The host tier's scheduler half (`OffloadingConnector`): which host slot holds which block.

Blocks leaving the device's prefix cache (evicted to make room) are copied to host slots keyed by
the same block hashes, least recently used ones evicted in turn; a waiting request whose prefix
continues in the host tier past its device hit has those blocks copied back into freshly
allocated device blocks before the forward reads them. Evicted blocks, not every block as it fills:
only what leaves the device crosses the bus, and host and device together hold more distinct
blocks than if the host also duplicated the blocks the device still caches.

Swap preemption saves a preempted request's computed blocks: full ones under their hashes (shared
with other requests, as any evicted block), its last partial block under a key of its own.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from pagellm.core.hashing import BlockHash
from pagellm.core.kv_connector import KVConnectorMetadata, KVConnectorScheduler
from pagellm.core.request import Request


@dataclass(slots=True)
class OffloadMetadata(KVConnectorMetadata):
    """One step's copies. The workers gather the saved device blocks first (some are reused this
    step, perhaps as load destinations), then load, then write the saves to their host slots."""

    save_device: list[int] = field(default_factory=list)
    save_host: list[int] = field(default_factory=list)
    load_host: list[int] = field(default_factory=list)
    load_device: list[int] = field(default_factory=list)


class HostBlockIndex:
    """Host slots by key, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        self._slots: OrderedDict[Hashable, int] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def take(self, key: Hashable) -> int:
        """The slot of a present key, now the most recently used."""
        self._slots.move_to_end(key)
        return self._slots[key]

    def insert(self, key: Hashable, keep: set[int]) -> int | None:
        """A slot for a new key: a free one, else the least recently used one not in `keep` (its
        key forgotten); None when every slot is kept."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._slots.items() if s not in keep), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
        self._slots[key] = slot
        return slot

    def drop(self, key: Hashable) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)


class OffloadingScheduler(KVConnectorScheduler):
    """Keeps the index of the workers' host pools (`pagellm.worker.kv_offload.OffloadingWorker`),
    which hold the same slots on every rank."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.index = HostBlockIndex(self.num_host_blocks)
        self._pending_saves: list[tuple[Hashable, int]] = []
        """(key, device block) to save at the end of the step; invisible to lookups until then, so a
        block is never loaded in the step that saves it."""
        self._loads = OffloadMetadata()
        self._kept: set[int] = set()
        """Host slots read or written this step: not reused before the step's copies are queued."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.skips_prefix_cache or not self.config.transfer.is_consumer:
            return 0, False
        bs = self.block_size
        request.update_block_hashes(bs)
        start = num_computed_tokens // bs
        end = start
        limit = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        while end < limit and request.block_hashes[end] in self.index:
            end += 1
        matched = (end - start) * bs
        swapped = min(request.num_swapped_tokens, request.num_tokens - 1)
        if swapped > end * bs and swapped // bs == end and _swap_key(request) in self.index:
            matched += swapped - end * bs  # the partial block it was preempted in
        return matched, False

    def update_state_after_alloc(self, request: Request, first_block: int, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        bs = self.block_size
        num_full = num_external_tokens // bs
        keys: list[Hashable] = list(request.block_hashes[first_block:first_block + num_full])
        if num_external_tokens % bs:
            keys.append(_swap_key(request))
        for key, device_block in zip(keys, block_ids):
            slot = self.index.take(key)
            self._kept.add(slot)
            self._loads.load_host.append(slot)
            self._loads.load_device.append(device_block)
        self.stats.host_hit_tokens += num_external_tokens
        if request.num_swapped_tokens:
            self.stats.swaps_in += num_external_tokens > 0
            request.num_swapped_tokens = 0
            self.index.drop(_swap_key(request))  # loaded, or lost: it resumes from here either way

    def blocks_evicted(self, evicted: Sequence[tuple[int, BlockHash]]) -> None:
        if self.config.transfer.is_producer:
            self._pending_saves += [(h, b) for b, h in evicted]

    def request_preempted(self, request: Request, block_ids: Sequence[int]) -> bool:
        if request.skips_prefix_cache or not self.config.transfer.is_producer:
            return False
        bs = self.block_size
        request.update_block_hashes(bs)
        num_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        num_full = num_tokens // bs
        saves: list[tuple[Hashable, int]] = list(zip(request.block_hashes[:num_full], block_ids[:num_full]))
        if num_tokens % bs:
            saves.append((_swap_key(request), block_ids[num_full]))
        self._pending_saves += saves
        request.num_swapped_tokens = num_tokens
        self.stats.swaps_out += 1
        return True

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, dict | None]:
        if request.num_swapped_tokens:
            self.index.drop(_swap_key(request))
        return False, None

    def build_connector_meta(self) -> OffloadMetadata | None:
        meta, self._loads = self._loads, OffloadMetadata()
        for key, device_block in self._pending_saves:
            if key in self.index:  # already held (an earlier copy of the same prefix)
                self.index.take(key)
                continue
            slot = self.index.insert(key, self._kept)
            if slot is None:
                break  # every slot is in use this step: the rest is not kept
            self._kept.add(slot)
            meta.save_device.append(device_block)
            meta.save_host.append(slot)
        self._pending_saves = []
        self._kept = set()
        return meta if meta.save_device or meta.load_device else None


def _swap_key(request: Request) -> tuple[str, str]:
    """The host key of a swapped-out request's partial last block."""
    return ("swap", request.request_id)
