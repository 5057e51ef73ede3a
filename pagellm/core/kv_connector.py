"""The KV connector seam, scheduler half: what moves KV blocks between the device cache and a store
outside it (a host tier, another engine). The shape of vLLM's v1 connector.

Each step, the scheduler asks the connector how many more tokens of a waiting request's prefix
the store holds beyond the device's prefix-cache hit (`get_num_new_matched_tokens`), allocates
device blocks for them as if computed, and tells the connector where they landed
(`update_state_after_alloc`); blocks that leave the device's prefix cache and requests preempted in
swap mode are reported too. `build_connector_meta` then packs the step's transfers into the
`SchedulerOutput`, and the worker half (`pagellm.worker.kv_connector`) runs them before the forward
reads the blocks. What the workers report back (`KVConnectorOutput`: blocks whose load failed,
bytes moved) returns through `update_connector_output`; a request whose load failed is recomputed.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagellm.core.hashing import BlockHash

if TYPE_CHECKING:
    from pagellm.config.kv_transfer import KVOffloadConfig
    from pagellm.core.request import Request


class KVConnectorMetadata:
    """One step's transfers, from the scheduler half to every worker half (each connector subclasses it)."""

    __slots__ = ()


@dataclass(slots=True)
class KVConnectorOutput:
    """What a worker half reports for one step."""

    failed_block_ids: set[int] = field(default_factory=set)
    """Device blocks whose load failed: their KV is garbage and the requests holding them recompute."""
    bytes_to_host: int = 0
    bytes_to_device: int = 0


@dataclass(slots=True)
class KVTransferStats:
    """Running totals of a connector (the metrics read them; bytes are the driver rank's)."""

    host_hit_tokens: int = 0
    """Prompt tokens loaded from the store instead of computed."""
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    failed_loads: int = 0
    """Requests that recomputed because a load failed."""

    @classmethod
    def total(cls, parts: list[KVTransferStats]) -> KVTransferStats | None:
        """Several engines' counters together (None when none has a connector)."""
        if not parts:
            return None
        return cls(*(sum(getattr(p, f) for p in parts) for f in cls.__slots__))


class KVConnectorScheduler(ABC):
    """The scheduler half of a KV connector: pure Python, in the engine core."""

    def __init__(self, config: KVOffloadConfig, block_size: int, num_host_blocks: int) -> None:
        """`num_host_blocks`: the blocks the smallest rank's worker half holds (0 when it keeps none)."""
        self.config = config
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.stats = KVTransferStats()

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` (the device's hit, whole blocks) that the store
        can load, never the request's last token (it must run to give logits). Free of side effects:
        called again while the request waits."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, first_block: int, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """The request was admitted: its blocks `first_block`, ... (`block_ids` on the device) are
        to receive its `num_external_tokens` matched tokens (0: nothing to load)."""

    def blocks_evicted(self, evicted: Sequence[tuple[int, BlockHash]]) -> None:
        """Device blocks (id, prefix-cache hash) leaving the prefix cache this step, before anything
        overwrites them: the workers can still copy them out."""

    def request_preempted(self, request: Request, block_ids: Sequence[int]) -> bool:
        """Swap preemption: save the request's computed blocks (`block_ids`, in order) so that it
        resumes without recomputing; whether they will be saved."""
        return False

    def request_finished(self, request: Request) -> None:
        """The request ended (finished or aborted): forget what the connector keeps for it alone."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """The step's transfers for the workers (None: nothing to do); resets the step's state."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """A step's report from the workers."""
        self.stats.bytes_to_host += output.bytes_to_host
        self.stats.bytes_to_device += output.bytes_to_device

