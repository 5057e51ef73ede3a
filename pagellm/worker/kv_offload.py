"""The host tier's worker half (`OffloadingConnector`): a pool of KV blocks in host memory and the
copies between it and this rank's device cache.

The pool holds, per host slot, one block of every cache tensor of this rank (its layers' keys and
values, its share of the KV heads) as raw bytes, so any cache dtype (float8 included) copies
exactly: [num_host_blocks, num_cache_tensors, bytes per block of one tensor]. On a GPU it is pinned
memory and every copy runs on a stream of its own: the step's saved blocks are gathered on the
device (one index_select per cache tensor), the loads are copied in (one DMA per run of consecutive
host slots) and scattered (one index_copy per cache tensor), then the saves are copied out. The
forward waits for the gather and the loads on the device (an event), not on the host, and the copies
out overlap it. On a CPU the same copies run in order on plain tensors.
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


class OffloadingWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, kv_caches: KVCaches) -> None:
        super().__init__(config, kv_caches)
        self.device = kv_caches[0][0].device
        self._tensors = [t.view(torch.uint8).view(t.shape[0], -1) for pair in kv_caches for t in pair]
        """Every cache tensor of this rank as [num_blocks, bytes per block] bytes."""
        self.block_bytes = sum(t.shape[1] for t in self._tensors)
        self._host_blocks = config.kv_transfer.host_bytes // self.block_bytes
        on_gpu = self.device.type == "cuda"
        self.host = torch.empty((self._host_blocks, len(self._tensors), self._tensors[0].shape[1]),
                                dtype=torch.uint8, pin_memory=on_gpu)
        self._stream = torch.cuda.Stream(self.device) if on_gpu else None
        self._ready = torch.cuda.Event() if on_gpu else None
        self._waiting = False
        self._report = KVConnectorOutput()
        logger.info("KV host tier: %d blocks (%.2f GiB%s)", self._host_blocks, self.host.nbytes / _GiB,
                    ", pinned" if on_gpu else "")

    @property
    def num_host_blocks(self) -> int:
        return self._host_blocks

    def start_load_kv(self, metadata: OffloadMetadata) -> None:
        if self._stream is None:
            self._copy(metadata)
            return
        # Earlier steps' KV writes (launched on the compute stream) come before the gather.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._copy(metadata)
        self._waiting = True

    def _copy(self, meta: OffloadMetadata) -> None:
        # Gathered first: a block saved this step may also be reused, as a load destination or by the forward.
        saved = self._gather(meta.save_device) if meta.save_device else None
        if meta.load_device:
            self._load(meta.load_host, meta.load_device)
        if self._ready is not None:
            self._ready.record(self._stream)
        if saved is not None:
            self._write_host(saved, meta.save_host)
        self._report.bytes_to_host += len(meta.save_device) * self.block_bytes
        self._report.bytes_to_device += len(meta.load_device) * self.block_bytes

    def _gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' bytes, [n, num_cache_tensors, bytes per block of one tensor], on the device."""
        index = torch.tensor(block_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        return torch.stack([t.index_select(0, index) for t in self._tensors], dim=1)

    def _write_host(self, blocks: torch.Tensor, host_slots: Sequence[int]) -> None:
        if self._stream is None:
            self.host.index_copy_(0, torch.tensor(host_slots, dtype=torch.int64), blocks)
            return
        for start, slot, n in _runs(host_slots):
            self.host[slot:slot + n].copy_(blocks[start:start + n], non_blocking=True)

    def _load(self, host_slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy host slots into device blocks."""
        if self._stream is None:
            blocks = self.host.index_select(0, torch.tensor(host_slots, dtype=torch.int64))
        else:
            blocks = torch.empty((len(host_slots), *self.host.shape[1:]), dtype=torch.uint8, device=self.device)
            for start, slot, n in _runs(host_slots):
                blocks[start:start + n].copy_(self.host[slot:slot + n], non_blocking=True)
        self._scatter(blocks, block_ids)

    def _scatter(self, blocks: torch.Tensor, block_ids: Sequence[int]) -> None:
        index = torch.tensor(block_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        for j, t in enumerate(self._tensors):
            t.index_copy_(0, index, blocks[:, j])

    def wait_for_layer_load(self, layer: int | None = None) -> None:
        if self._waiting:
            torch.cuda.current_stream(self.device).wait_event(self._ready)
            self._waiting = False

    def get_finished(self) -> KVConnectorOutput | None:
        report, self._report = self._report, KVConnectorOutput()
        return report if report.bytes_to_host or report.bytes_to_device else None


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(position, first slot, length) of each run of consecutive slots: one DMA each."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, slots[start], i - start
            start = i
