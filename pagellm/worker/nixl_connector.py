"""NixlConnector's worker half: this rank's KV cache registered with a NIXL agent; a consumer reads a
producer's blocks with one-sided NIXL READs (UCX: host memory on a CPU, device memory on a GPU).

Every cache tensor (keys and values of each layer) is one registered region. A pull is one NIXL READ
of a request's blocks of every layer, its descriptor lists built for it: one descriptor per cache
tensor and run of blocks consecutive on both sides (`nixl_runs`). A consumer rank first fetches the
producer rank's layout and agent metadata through the side channel (`nixl_handshake`, once per
producer), refuses a producer laid out differently (naming the key), then starts its pulls and polls
them each step; a pull's completion notifies the producer (the request id rides on the READ), whose
blocks are then freed. Each tensor-parallel rank pulls its own shard from the producer's rank of the
same number; a pull (or a send) is reported only once every rank has seen it end (one all-reduce of
flags per step while any is in flight), so no rank's blocks are reused while another rank's transfer
still touches them.

Loads are asynchronous across steps, not per layer: the request waits (WAITING_FOR_REMOTE_KVS) while
other requests run, and is scheduled once every layer has landed.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pagellm.config import EngineConfig
from pagellm.core.kv_connector import KVConnectorOutput
from pagellm.core.nixl_connector import NixlMetadata, RemoteLoad, RemotePrefill
from pagellm.distributed import get_tp_rank, tensor_parallel_all_reduce
from pagellm.worker.kv_connector import KVCaches, KVConnectorWorker
from pagellm.worker.nixl_api import nixl_agent, nixl_agent_config
from pagellm.worker.nixl_handshake import HandshakeListener, KVLayout, fetch_handshake
from pagellm.worker.nixl_runs import block_runs, run_descriptors

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Producer:
    """A producer rank this rank has shaken hands with."""

    layout: KVLayout
    agent_name: str
    refused: str | None
    """Why its KV cannot be pulled (a layout mismatch, naming the key); None: it can."""


_PENDING, _DONE, _FAILED = 0, 1, 2
"""How a transfer stands on this rank."""


@dataclass(slots=True)
class _Pull:
    handle: object | None
    """None once it ended on this rank (or never started)."""
    block_ids: list[int]
    started: float
    deadline: float
    num_bytes: int
    state: int = _PENDING
    ended: float = 0.0


@dataclass(slots=True)
class _Send:
    deadline: float
    ended_here: bool = False


class NixlWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, kv_caches: KVCaches) -> None:
        super().__init__(config, kv_caches)
        self.settings = config.kv_transfer.nixl
        transfer = config.kv_transfer.transfer
        tensors = [t for pair in kv_caches for t in pair]
        first = tensors[0]
        self.num_blocks = first.shape[0]
        self.block_bytes = first[0].numel() * first.element_size()
        self.num_tensors = len(tensors)
        rank = get_tp_rank()
        device_id = first.device.index or 0
        self.mem_type = "VRAM" if first.is_cuda else "DRAM"
        self.agent = nixl_agent(f"{self.settings.engine_id}-{rank}",
                                nixl_agent_config(backends=list(self.settings.backends)))
        self._registered = self.agent.register_memory(tensors)
        addrs = [t.data_ptr() for t in tensors]
        arch = config.model.source.arch
        self.layout = KVLayout(
            engine_id=self.settings.engine_id, agent_name=self.agent.name,
            model=f"{arch.architecture}/{arch.vocab_size}", block_size=first.shape[1], dtype=str(first.dtype),
            num_layers=len(kv_caches), num_kv_heads=first.shape[2], head_dim=first.shape[3],
            tp_size=self.settings.tp_size, tp_rank=rank, num_blocks=self.num_blocks,
            block_bytes=self.block_bytes, base_addrs=addrs, mem_type=self.mem_type, device_id=device_id)
        self.rank = rank
        self.device = first.device
        self._producers: dict[str, _Producer] = {}
        self._pulls: dict[str, _Pull] = {}
        """Consumer: pulls not reported yet, in the order every rank started them."""
        self._sends: OrderedDict[str, _Send] = OrderedDict()
        """Producer: requests whose blocks wait for a pull, in the order every rank registered them."""
        self._early: OrderedDict[str, float] = OrderedDict()
        """Producer: pull notices that came before their request's send was registered -> when."""
        self._report = KVConnectorOutput()
        self.listener = None
        if transfer.is_producer:
            self.listener = HandshakeListener(self.settings.side_channel_host, self.settings.side_channel_port + rank,
                                              self.layout, self.agent.get_agent_metadata())

    # -- the step --------------------------------------------------------------------------------

    def start_load_kv(self, metadata: NixlMetadata) -> None:
        now = time.monotonic()
        for req_id in metadata.sends:
            # A pull notice may come before we heard of the send.
            self._sends[req_id] = _Send(now + self.settings.abort_timeout_s, self._early.pop(req_id, None) is not None)
        for remote in metadata.releases:
            self._release(remote)
        for load in metadata.loads:
            self._start_pull(load, now)

    def _start_pull(self, load: RemoteLoad, now: float) -> None:
        try:
            producer = self._producer(load.remote)
            if producer.refused is not None:
                raise ValueError(producer.refused)
            if max(load.remote_block_ids, default=0) >= producer.layout.num_blocks:
                raise ValueError(f"kv_transfer_params remote_block_ids go past the producer's "
                                 f"{producer.layout.num_blocks} blocks")
            runs = block_runs(load.block_ids, load.remote_block_ids)
            theirs = producer.layout
            local = self.agent.get_xfer_descs(run_descriptors(
                self.layout.base_addrs, self.block_bytes, runs.local_first, runs.lengths, self.layout.device_id),
                self.mem_type)
            remote = self.agent.get_xfer_descs(run_descriptors(
                theirs.base_addrs, theirs.block_bytes, runs.remote_first, runs.lengths, theirs.device_id),
                theirs.mem_type)
            handle = self.agent.initialize_xfer("READ", local, remote, producer.agent_name,
                                                load.remote.request_id.encode())
            if self.agent.transfer(handle) == "ERR":
                self.agent.release_xfer_handle(handle)
                raise RuntimeError("NIXL refused the transfer")
        # Whatever the transport raises (NIXL's own errors, a dead producer's socket), the request
        # recomputes its prompt: a failed pull must never fail the engine.
        except Exception as e:  # noqa: BLE001
            logger.warning("NixlConnector: request %s recomputes its prompt, its pull from %s:%d failed: %s",
                           load.req_id, load.remote.host, load.remote.port + self.rank, e)
            self._release(load.remote)
            self._pulls[load.req_id] = _Pull(None, load.block_ids, now, now, 0, _FAILED, now)
            return
        self._pulls[load.req_id] = _Pull(handle, load.block_ids, now, now + self.settings.abort_timeout_s,
                                         len(load.block_ids) * self.block_bytes * self.num_tensors)

    def _producer(self, remote: RemotePrefill) -> _Producer:
        """The producer rank to pull from, shaken hands with once."""
        producer = self._producers.get(remote.engine_id)
        if producer is not None:
            return producer
        layout, metadata = fetch_handshake(remote.host, remote.port + self.rank)
        if layout.engine_id != remote.engine_id:
            raise ValueError(f"kv_transfer_params remote_engine_id is {remote.engine_id!r}, but the engine at "
                             f"{remote.host}:{remote.port + self.rank} is {layout.engine_id!r}")
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        refused = self.layout.mismatch(layout)
        if refused is None and remote.tp_size != self.settings.tp_size:
            refused = f"the producer's tp_size is {remote.tp_size}, this engine's is {self.settings.tp_size}"
        if refused is not None:
            refused = f"refused at handshake: {refused}"
            logger.error("NixlConnector: producer %s %s; its requests recompute here", remote.engine_id, refused)
        producer = _Producer(layout, name, refused)
        self._producers[remote.engine_id] = producer
        return producer

    def _release(self, remote: RemotePrefill) -> None:
        """Tell a producer that its blocks for `remote.request_id` will not be pulled."""
        try:
            producer = self._producer(remote)
            self.agent.send_notif(producer.agent_name, remote.request_id.encode())
        except Exception as e:  # noqa: BLE001 - the producer frees them on its timeout instead
            logger.warning("NixlConnector: could not tell %s:%d to free request %s: %s", remote.host,
                           remote.port + self.rank, remote.request_id, e)

    def _count_ranks(self, flags: list[bool]) -> list[int]:
        """For each flag, how many tensor-parallel ranks raise it (every rank calls this in the same
        step with flags about the same transfers, in the same order)."""
        if self.settings.tp_size == 1:
            return [int(f) for f in flags]
        return tensor_parallel_all_reduce(torch.tensor(flags, dtype=torch.int32, device=self.device)).tolist()

    def get_finished(self) -> KVConnectorOutput | None:
        report, self._report = self._report, KVConnectorOutput()
        now = time.monotonic()
        if self._pulls:
            self._poll_pulls(report, now)
        if self.listener is not None:
            self._poll_sends(report, now)
        return None if report.is_empty else report

    def _poll_pulls(self, report: KVConnectorOutput, now: float) -> None:
        for req_id, pull in self._pulls.items():
            if pull.state != _PENDING:
                continue
            state = self.agent.check_xfer_state(pull.handle)
            if state == "PROC" and now < pull.deadline:
                continue
            pull.state, pull.ended = (_DONE if state == "DONE" else _FAILED), now
            if pull.state == _FAILED:
                logger.warning("NixlConnector: request %s recomputes its prompt: its pull ended %s", req_id,
                               "in error" if state == "ERR" else "past abort_timeout_s")
            try:
                self.agent.release_xfer_handle(pull.handle)
            except Exception as e:  # noqa: BLE001 - a handle NIXL will not release is only leaked
                logger.warning("NixlConnector: releasing request %s's transfer: %s", req_id, e)
            pull.handle = None
        pulls = list(self._pulls.items())
        ended = self._count_ranks([p.state != _PENDING for _, p in pulls] + [p.state == _FAILED for _, p in pulls])
        for i, (req_id, pull) in enumerate(pulls):
            if ended[i] < self.settings.tp_size:
                continue
            if ended[len(pulls) + i]:  # failed on some rank: its blocks hold garbage
                report.failed_block_ids.update(pull.block_ids)
            else:
                report.num_transfers += 1
                report.transfer_bytes += pull.num_bytes
                report.transfer_seconds += pull.ended - pull.started
            report.finished_recving.add(req_id)
            del self._pulls[req_id]

    def _poll_sends(self, report: KVConnectorOutput, now: float) -> None:
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                req_id = message.decode()
                send = self._sends.get(req_id)
                if send is not None:
                    send.ended_here = True
                else:
                    self._early[req_id] = now
        for req_id, send in self._sends.items():
            if send.deadline > now:
                break  # in order of expiry
            if not send.ended_here:
                send.ended_here = True
                logger.warning("NixlConnector: request %s's blocks were not pulled within abort_timeout_s "
                               "(%.0f s); freed", req_id, self.settings.abort_timeout_s)
        sends = list(self._sends.items())
        ended = self._count_ranks([s.ended_here for _, s in sends]) if sends else []
        for (req_id, _), count in zip(sends, ended):
            if count == self.settings.tp_size:
                report.finished_sending.add(req_id)
                report.num_transfers += 1
                del self._sends[req_id]
        while self._early and next(iter(self._early.values())) < now - self.settings.abort_timeout_s:
            self._early.popitem(last=False)  # a notice for blocks already freed (a late release)
