"""The host tier's worker half (`OffloadingConnector`): a pool of KV blocks in host memory and the
copies between it and this rank's device cache.

The pool holds, per host slot, one block of every cache tensor of this rank (its layers' keys and
values, its share of the KV heads) as raw bytes, so any cache dtype (float8 included) copies
exactly: [num_host_blocks, num_cache_tensors, bytes per block of one tensor]. On a GPU it is pinned
memory and every copy runs on a stream of its own, through two device staging buffers: the step's
saved blocks are gathered (one index_select per cache tensor) and copied out (one DMA per run of
consecutive host slots), the loads copied in (likewise) and scattered (one index_copy per cache
tensor). The forward waits for them on the device (an event), not on the host; the last chunk of
saves is copied out while it runs. On a CPU the same copies run in order on plain tensors.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch

from pagellm.config import EngineConfig
from pagellm.core.kv_connector import KVConnectorOutput
from pagellm.core.kv_offload import OffloadMetadata
from pagellm.worker.kv_connector import KVCaches, KVConnectorWorker

logger = logging.getLogger(__name__)
_GiB = 1 << 30


STAGING_BLOCKS = 64
"""Blocks each of the two device staging buffers (saves, loads) holds: copies go through them in
chunks of this many. The forward waits for all but the last chunk of saves to reach the host: more
blocks overlap more, and take KV-cache memory (128 MiB a buffer for Llama-3.1-8B at block size 16)."""


class OffloadingWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, kv_caches: KVCaches) -> None:
        super().__init__(config, kv_caches)
        self.device = kv_caches[0][0].device
        self._tensors = [t.view(torch.uint8).view(t.shape[0], -1) for pair in kv_caches for t in pair]
        """Every cache tensor of this rank as [num_blocks, bytes per block] bytes."""
        self.block_bytes = sum(t.shape[1] for t in self._tensors)
        self._host_blocks = config.kv_transfer.host_bytes // self.block_bytes
        on_gpu = self.device.type == "cuda"
        layout = (len(self._tensors), self._tensors[0].shape[1])
        self.host = torch.empty((self._host_blocks, *layout), dtype=torch.uint8, pin_memory=on_gpu)
        chunk = min(STAGING_BLOCKS, self._tensors[0].shape[0])
        self._save_staging = torch.empty((chunk, *layout), dtype=torch.uint8, device=self.device)
        self._load_staging = torch.empty((chunk, *layout), dtype=torch.uint8, device=self.device)
        self._stream = torch.cuda.Stream(self.device) if on_gpu else None
        self._ready = torch.cuda.Event() if on_gpu else None
        self._waiting = False
        self._report = KVConnectorOutput()
        logger.info("KV host tier: %d blocks (%.2f GiB%s)", self._host_blocks, self.host.nbytes / _GiB,
                    ", pinned" if on_gpu else "")

    @classmethod
    def device_bytes(cls, block_bytes: int) -> int:
        return 2 * STAGING_BLOCKS * block_bytes

    @property
    def num_host_blocks(self) -> int:
        return self._host_blocks

    def start_load_kv(self, metadata: OffloadMetadata) -> None:
        if self._stream is None:
            self._copy(metadata)
            return
        # Earlier steps' KV writes and reads (launched on the compute stream) come first: a saved
        # block must be written, and a load's destination may have been a finished request's.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._copy(metadata)
        self._waiting = True

    def _copy(self, meta: OffloadMetadata) -> None:
        """Saves gathered before loads scatter (a saved block may be a load's destination, or written
        by this step's forward); the forward waits for `_ready`, and the last chunk of saves reaches
        the host while it runs."""
        chunk = self._save_staging.shape[0]
        saves = [(meta.save_device[i:i + chunk], meta.save_host[i:i + chunk])
                 for i in range(0, len(meta.save_device), chunk)]
        for device_blocks, host_slots in saves[:-1]:
            self._gather(device_blocks)
            self._to_host(len(device_blocks), host_slots)
        if saves:
            self._gather(saves[-1][0])
        for i in range(0, len(meta.load_device), chunk):
            self._load(meta.load_host[i:i + chunk], meta.load_device[i:i + chunk])
        if self._ready is not None:
            self._ready.record(self._stream)
        if saves:
            self._to_host(len(saves[-1][0]), saves[-1][1])
        self._report.bytes_to_host += len(meta.save_device) * self.block_bytes
        self._report.bytes_to_device += len(meta.load_device) * self.block_bytes

    def _gather(self, block_ids: Sequence[int]) -> None:
        """Device blocks into the save staging buffer: one index_select per cache tensor."""
        index = self._index(block_ids)
        for j, t in enumerate(self._tensors):
            self._save_staging[:len(block_ids), j] = t.index_select(0, index)

    def _to_host(self, n: int, host_slots: Sequence[int]) -> None:
        """The save staging buffer's first `n` blocks to their host slots: one copy per run of slots."""
        for start, slot, length in _runs(host_slots):
            self.host[slot:slot + length].copy_(self._save_staging[start:start + length], non_blocking=True)

    def _load(self, host_slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Host slots into device blocks, through the load staging buffer."""
        for start, slot, length in _runs(host_slots):
            self._load_staging[start:start + length].copy_(self.host[slot:slot + length], non_blocking=True)
        self._scatter(self._load_staging[:len(block_ids)], block_ids)

    def _scatter(self, blocks: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Blocks' bytes into the device cache: one index_copy per cache tensor."""
        index = self._index(block_ids)
        for j, t in enumerate(self._tensors):
            t.index_copy_(0, index, blocks[:, j])

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64).to(self.device, non_blocking=True)

    def wait_for_layer_load(self, layer: int | None = None) -> None:
        if self._waiting:
            torch.cuda.current_stream(self.device).wait_event(self._ready)
            self._waiting = False

    def synchronize(self) -> None:
        """Until every copy queued has landed (benchmarks)."""
        if self._stream is not None:
            self._stream.synchronize()

    def get_finished(self) -> KVConnectorOutput | None:
        report, self._report = self._report, KVConnectorOutput()
        return None if report.is_empty else report


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(position, first slot, length) of each run of consecutive slots: one DMA each."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, slots[start], i - start
            start = i
