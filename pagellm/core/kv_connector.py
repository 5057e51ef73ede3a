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

Transfers may span steps (prefill/decode disaggregation), as in vLLM: `get_num_new_matched_tokens`
says whether its load is asynchronous (the request then waits, holding its blocks, until a worker
reports it in `finished_recving`); `request_finished` may ask the scheduler to keep a finished
request's blocks until a worker reports it in `finished_sending` (a peer pulled them, or they
expired), and returns the `kv_transfer_params` its output carries.
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
    finished_sending: set[str] = field(default_factory=set)
    """Finished requests whose blocks the scheduler kept for a peer and may now free."""
    finished_recving: set[str] = field(default_factory=set)
    """Requests whose asynchronous load ended (failed if they hold a block of `failed_block_ids`)."""
    num_transfers: int = 0
    """Remote transfers completed (pulls on a consumer, pulled requests on a producer)."""
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0

    @property
    def is_empty(self) -> bool:
        return not (self.failed_block_ids or self.bytes_to_host or self.bytes_to_device or self.finished_sending
                    or self.finished_recving or self.num_transfers)


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
    remote_hit_tokens: int = 0
    """Prompt tokens pulled from a remote engine instead of computed."""
    transfers: int = 0
    """Remote transfers completed (pulls on a consumer; requests pulled or expired on a producer)."""
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    """Seconds from a pull's start to its end, summed (consumer)."""
    transfer_failures: int = 0
    """Remote pulls refused or failed: the request recomputed its prompt."""
    held_requests: int = 0
    """Now: finished requests whose blocks wait for a peer, and requests waiting for their KV."""

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
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the first `num_computed_tokens` (the device's hit, whole blocks) that the store
        can load, never the request's last token (it must run to give logits), and whether the load
        is asynchronous (the request then waits across steps until `finished_recving` names it).
        Free of side effects: called again while the request waits."""

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

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, dict | None]:
        """The request ended (finished or aborted; `block_ids` its blocks, first group): forget what
        the connector keeps for it alone. Returns whether the scheduler must keep its blocks until a
        worker names it in `finished_sending`, and the `kv_transfer_params` of its output (None)."""
        return False, None

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """The step's transfers for the workers (None: nothing to do); resets the step's state."""

    def has_pending(self) -> bool:
        """Whether transfers span steps now: the workers must be stepped to report them."""
        return False

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """A step's report from the workers."""
        stats = self.stats
        stats.bytes_to_host += output.bytes_to_host
        stats.bytes_to_device += output.bytes_to_device
        stats.transfers += output.num_transfers
        stats.transfer_bytes += output.transfer_bytes
        stats.transfer_seconds += output.transfer_seconds

