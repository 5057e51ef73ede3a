"""NixlConnector's scheduler half: prefill/decode disaggregation with vLLM's `kv_transfer_params`.

A prefill engine (kv_producer) runs a request that asks `do_remote_decode` as any other (one output
token), then keeps its blocks and answers with where they are (`remote_block_ids`, its engine id and
handshake address). A decode engine (kv_consumer) given those parameters (`do_remote_prefill`)
allocates blocks for the prompt but its last token, has its workers pull the producer's blocks
(`pagellm.worker.nixl_connector`, one-sided reads), and computes the last token itself once they
landed. The producer frees the blocks when its workers learn that the pull ended, or after
`abort_timeout_s`. A pull that fails or is refused (a layout mismatch) leaves the request to
recompute its prompt, counted in `transfer_failures`.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagellm.core.kv_connector import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler
from pagellm.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a producer keeps a prompt's KV: the `kv_transfer_params` of its prefill response."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[int, ...]
    tp_size: int

    @classmethod
    def from_params(cls, params: dict) -> RemotePrefill:
        """Checked parameters; ValueError naming the first bad key."""
        checks = (("remote_engine_id", str), ("remote_host", str), ("remote_port", int),
                  ("remote_request_id", str), ("remote_block_ids", list), ("tp_size", int))
        for key, kind in checks:
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params {key} must be a {kind.__name__}, got {value!r}")
        block_ids = params["remote_block_ids"]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids):
            raise ValueError("kv_transfer_params remote_block_ids must be block numbers (ints >= 0)")
        return cls(params["remote_engine_id"], params["remote_host"], params["remote_port"],
                   params["remote_request_id"], tuple(block_ids), params["tp_size"])


@dataclass(slots=True)
class RemoteLoad:
    """One request's pull: the producer's `remote_block_ids` into this engine's `block_ids`, in order."""

    req_id: str
    remote: RemotePrefill
    block_ids: list[int]
    remote_block_ids: list[int]


@dataclass(slots=True)
class NixlMetadata(KVConnectorMetadata):
    """One step's work for the workers. Sent every step while transfers span steps (even empty),
    so that the workers report their progress."""

    loads: list[RemoteLoad] = field(default_factory=list)
    """Consumer: pulls to start."""
    releases: list[RemotePrefill] = field(default_factory=list)
    """Consumer: producers' blocks it will not pull (its own prefix cache held the prompt, the
    request ended before it was admitted): the producer may free them now."""
    sends: list[str] = field(default_factory=list)
    """Producer: requests whose blocks are kept for a peer from now (until pulled or expired)."""


class NixlScheduler(KVConnectorScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings = self.config.nixl
        self._meta = NixlMetadata()
        self._handled: set[str] = set()
        """Consumer requests whose remote prefill was acted on (pulled, released or refused): a
        request preempted later recomputes, it never pulls again (the producer's blocks are gone)."""
        self._recving: set[str] = set()
        self._sending: set[str] = set()

    def _remote(self, request: Request) -> RemotePrefill | None:
        """The remote prefill a consumer request asks for and that was not acted on yet; raises
        ValueError for bad parameters."""
        params = request.kv_transfer_params
        if (not self.config.transfer.is_consumer or not params or not params.get("do_remote_prefill")
                or request.request_id in self._handled):
            return None
        return RemotePrefill.from_params(params)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        try:
            remote = self._remote(request)
        except ValueError:
            return 0, False  # counted and reported when it is admitted
        if remote is None or len(remote.block_ids) * self.block_size < request.num_tokens - 1:
            return 0, False
        num_tokens = max(request.num_tokens - 1 - num_computed_tokens, 0)
        return num_tokens, num_tokens > 0

    def update_state_after_alloc(self, request: Request, first_block: int, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        try:
            remote = self._remote(request)
        except ValueError as e:
            self._handled.add(request.request_id)
            self.stats.transfer_failures += 1
            logger.warning("request %s recomputes its prompt: %s", request.request_id, e)
            return
        if remote is None:
            return
        self._handled.add(request.request_id)
        if not num_external_tokens:
            if len(remote.block_ids) * self.block_size < request.num_tokens - 1:
                self.stats.transfer_failures += 1
                logger.warning("request %s recomputes its prompt: kv_transfer_params remote_block_ids holds %d "
                               "blocks, fewer than its prompt needs", request.request_id, len(remote.block_ids))
            self._meta.releases.append(remote)  # found in this engine's prefix cache, or refused
            return
        self._recving.add(request.request_id)
        self._meta.loads.append(RemoteLoad(request.request_id, remote, list(block_ids),
                                           list(remote.block_ids[first_block:first_block + len(block_ids)])))

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        try:
            remote = self._remote(request)
        except ValueError:
            remote = None
        if remote is not None:  # ended before it was admitted: the producer need not wait
            self._meta.releases.append(remote)
        self._handled.discard(req_id)
        params = request.kv_transfer_params
        if (not self.config.transfer.is_producer or not params or not params.get("do_remote_decode")
                or request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
                or not block_ids):
            return False, None
        self._sending.add(req_id)
        self._meta.sends.append(req_id)
        settings = self.settings
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": settings.engine_id,
            "remote_block_ids": list(block_ids), "remote_host": settings.side_channel_host,
            "remote_port": settings.side_channel_port, "remote_request_id": req_id, "tp_size": settings.tp_size,
        }

    def has_pending(self) -> bool:
        return bool(self._recving or self._sending)

    def build_connector_meta(self) -> NixlMetadata | None:
        meta, self._meta = self._meta, NixlMetadata()
        return meta if meta.loads or meta.releases or meta.sends or self.has_pending() else None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        self._recving -= output.finished_recving
        self._sending -= output.finished_sending
