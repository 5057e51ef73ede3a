"""The KV connector seam, worker half: runs the transfers the scheduler half planned
(`pagellm.core.kv_connector`) on this rank's shard of the KV cache.

The model runner calls, each step: `start_load_kv` with the step's metadata (before the forward;
transfers queued, not waited for), `wait_for_layer_load` before the forward reads the cache (on a
GPU the compute stream waits for the copy stream, the host does not block; the runner waits for
every layer at once, outside CUDA graphs), then `get_finished` for the step's report to the
scheduler. Saves are planned by the scheduler half (blocks leaving the device cache) and run in
`start_load_kv`, before anything overwrites them: there is no per-layer save from the forward.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagellm.config import EngineConfig
from pagellm.config.kv_transfer import KV_CONNECTOR_REGISTRY
from pagellm.config.registry import resolve
from pagellm.core.kv_connector import KVConnectorMetadata, KVConnectorOutput

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
"""This rank's cache: keys and values per slot, each [num_blocks, block_size, num_kv_heads, head_dim]."""


class KVConnectorWorker(ABC):
    """The worker half of a KV connector, one per rank."""

    def __init__(self, config: EngineConfig, kv_caches: KVCaches) -> None:
        self.config = config
        self.kv_caches = kv_caches

    @classmethod
    def device_bytes(cls, block_bytes: int) -> int:
        """Device memory it takes beside the KV cache (staging buffers), for blocks of `block_bytes`
        on this rank: the cache is sized without it."""
        return 0

    @property
    def num_host_blocks(self) -> int:
        """Blocks this rank keeps outside the device (0: none)."""
        return 0

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Queue the step's transfers into (and out of) the device cache."""

    def wait_for_layer_load(self, layer: int | None = None) -> None:
        """Make the forward's reads of `layer` (None: every layer) wait for its loads."""

    def get_finished(self) -> KVConnectorOutput | None:
        """The step's report (failed loads, bytes moved); None: nothing to report."""
        return None


def kv_connector_worker_class(config: EngineConfig) -> type[KVConnectorWorker] | None:
    """The configured connector's worker half (None: no connector)."""
    if config.kv_transfer is None:
        return None
    entry = KV_CONNECTOR_REGISTRY.get(config.kv_transfer.transfer.kv_connector)
    cls = resolve(entry.worker_cls)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorWorker)):
        raise ValueError(f"KV connector {entry.name!r}: worker_cls must be a subclass of "
                         f"pagellm.worker.kv_connector.KVConnectorWorker, got {cls!r}")
    return cls


def build_kv_connector_worker(config: EngineConfig, kv_caches: KVCaches) -> KVConnectorWorker | None:
    """The worker half of the configured connector on this rank's cache (None: no connector)."""
    cls = kv_connector_worker_class(config)
    return None if cls is None else cls(config, kv_caches)
