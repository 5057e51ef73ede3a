"""`kv_transfer_config` as vLLM takes it (a dict in `LLM(...)`, JSON with `--kv-transfer-config`), the
KV connectors its `kv_connector` names (`KV_CONNECTOR_REGISTRY`, `register_kv_connector`), and the
host tier's settings (`--kv-offloading-size`, `--preemption-mode`)."""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pagellm.config.json_flags import json_object
from pagellm.config.registry import Registry, check_ref

FLAG = "kv_transfer_config (--kv-transfer-config)"
_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_connector_module_path", "engine_id",
         "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port")
"""vLLM's keys; those beyond the first three are accepted for compatibility and passed to the connector."""
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
OFFLOADING_CONNECTOR = "OffloadingConnector"
"""The built-in host tier (`--kv-offloading-size` picks it without a `--kv-transfer-config`)."""
NIXL_CONNECTOR = "NixlConnector"
"""The built-in prefill/decode transfer (a `kv_role` given without a `kv_connector` picks it)."""
PREEMPTION_MODES = ("recompute", "swap")
PreemptionMode = Literal["recompute", "swap"]
_GiB = 1 << 30
_EXTRA_SIZE = f"{FLAG} kv_connector_extra_config cpu_bytes_to_use"


@dataclass(frozen=True, slots=True)
class KVConnectorEntry:
    """A `kv_connector` name: its scheduler half (pure Python, in the engine core) and its worker half
    (in every rank, owning tensors)."""

    name: str
    scheduler_cls: Any
    """A `pagellm.core.kv_connector.KVConnectorScheduler` subclass or its "package.module:Class" name."""
    worker_cls: Any
    """A `pagellm.worker.kv_connector.KVConnectorWorker` subclass or its "package.module:Class" name."""
    description: str = ""


KV_CONNECTOR_REGISTRY: Registry[KVConnectorEntry] = Registry("KV connector", f"{FLAG} kv_connector", builtins=(
    KVConnectorEntry(OFFLOADING_CONNECTOR, "pagellm.core.kv_offload:OffloadingScheduler",
                     "pagellm.worker.kv_offload:OffloadingWorker",
                     "evicted prefix blocks kept in host memory (--kv-offloading-size)"),
    KVConnectorEntry(NIXL_CONNECTOR, "pagellm.core.nixl_connector:NixlScheduler",
                     "pagellm.worker.nixl_connector:NixlWorker",
                     "disaggregated prefill/decode: a decode engine pulls a prompt's KV from a prefill engine (NIXL)"),
))
"""Every KV connector, by `kv_connector` name."""


def register_kv_connector(name: str, scheduler_cls: Any, worker_cls: Any, *, description: str = "",
                          override: bool = False) -> None:
    """Make `name` a `kv_connector`: `scheduler_cls` runs beside the scheduler, `worker_cls` in each
    rank (classes or "package.module:Class" names, imported when chosen). A name already registered
    is refused unless `override`."""
    check_ref(scheduler_cls, f"register_kv_connector({name!r}) scheduler_cls")
    check_ref(worker_cls, f"register_kv_connector({name!r}) worker_cls")
    KV_CONNECTOR_REGISTRY.register(KVConnectorEntry(name, scheduler_cls, worker_cls, description), override=override)


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """Which KV connector moves KV blocks in and out of the device cache, and with what settings."""

    kv_connector: str
    """A `KV_CONNECTOR_REGISTRY` name."""
    kv_role: str = "kv_both"
    """kv_producer (saves only) | kv_consumer (loads only) | kv_both. Swap preemption needs both."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """The connector's own settings."""
    extra: dict[str, Any] = field(default_factory=dict)
    """vLLM's other keys (engine_id, kv_ip, ...), as given, for connectors that read them."""

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: "str | dict | KVTransferConfig | None") -> "KVTransferConfig | None":
        """JSON text, a dict or a config -> the config (None: no connector). Fails naming the flag."""
        if value is None or isinstance(value, cls):
            return value
        value = dict(json_object(value, FLAG, _KEYS))
        role = value.pop("kv_role", None)
        if role is not None and role not in KV_ROLES:
            raise ValueError(f"{FLAG} kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
        # A role alone asks for the prefill/decode transfer, as vLLM's default connector.
        name = value.pop("kv_connector", None if role is None else NIXL_CONNECTOR)
        if not isinstance(name, str):
            raise ValueError(f"{FLAG} needs \"kv_connector\": one of {', '.join(KV_CONNECTOR_REGISTRY.names())}")
        KV_CONNECTOR_REGISTRY.get(name)
        role = role or "kv_both"
        extra_config = value.pop("kv_connector_extra_config", None) or {}
        if not isinstance(extra_config, dict):
            raise ValueError(f"{FLAG} kv_connector_extra_config must be a JSON object, got {extra_config!r}")
        return cls(name, role, extra_config, value)


@dataclass(frozen=True, slots=True)
class KVOffloadConfig:
    """The engine's KV connector, resolved: the connector, its host pool, and how preemption works."""

    transfer: KVTransferConfig
    host_bytes: int = 0
    """Bytes of host memory per rank the offloading connector's pool takes (0: other connectors)."""
    preemption_mode: PreemptionMode = "recompute"
    """swap: a preempted request's blocks go to the host pool and come back when it resumes."""
    nixl: NixlSettings | None = None
    """The NixlConnector's settings, resolved once (its engine id is shared by every process)."""


_NIXL_KEYS = ("abort_timeout_s", "side_channel_host", "side_channel_port", "backends")


@dataclass(frozen=True, slots=True)
class NixlSettings:
    """The NixlConnector's settings, from `kv_connector_extra_config` (and vLLM's top-level `engine_id`)."""

    engine_id: str
    """Names this engine to its peers: a consumer checks that the producer it reaches is the one named."""
    abort_timeout_s: float = 120.0
    """A producer frees a prompt's blocks this long after it finished if no consumer pulled them
    (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)."""
    side_channel_host: str = "127.0.0.1"
    """The address the producer's handshake listener binds and advertises (remote_host): this
    node's address as the decode nodes reach it."""
    side_channel_port: int = 5600
    """The handshake listener's port on tensor-parallel rank 0; rank r listens on port + r."""
    backends: tuple[str, ...] = ("UCX",)
    """NIXL backends the agent instantiates."""
    tp_size: int = 1
    """The engine's tensor-parallel size (set from the engine's flags): a peer must have the same."""

    @classmethod
    def parse(cls, transfer: KVTransferConfig) -> NixlSettings:
        """Checked settings; a bad key fails naming it."""
        extra = transfer.kv_connector_extra_config
        where = f"{FLAG} kv_connector_extra_config"
        for key in extra:
            if key not in _NIXL_KEYS:
                raise ValueError(f"{where} has unknown key {key!r} for {NIXL_CONNECTOR}: "
                                 f"expected one of {', '.join(_NIXL_KEYS)}")
        timeout = extra.get("abort_timeout_s", 120.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"{where} abort_timeout_s must be a positive number of seconds, got {timeout!r}")
        host = extra.get("side_channel_host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise ValueError(f"{where} side_channel_host must be a host name or address, got {host!r}")
        port = extra.get("side_channel_port", 5600)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"{where} side_channel_port must be a port number (1-65535), got {port!r}")
        backends = extra.get("backends", ["UCX"])
        if not isinstance(backends, list) or not backends or not all(isinstance(b, str) for b in backends):
            raise ValueError(f"{where} backends must be a list of NIXL backend names, got {backends!r}")
        engine_id = transfer.extra.get("engine_id") or uuid.uuid4().hex
        if not isinstance(engine_id, str):
            raise ValueError(f"{FLAG} engine_id must be a string, got {engine_id!r}")
        return cls(engine_id, float(timeout), host, port, tuple(backends))


def available_host_memory() -> int:
    """Bytes of host memory free for new allocations (Linux's MemAvailable; else all of RAM)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_kv_offload(kv_transfer_config: "str | dict | None", kv_offloading_size: float | None,
                       swap_space: float | None, preemption_mode: str | None,
                       num_ranks: int) -> KVOffloadConfig | None:
    """The engine's connector from its flags (None: none), checked; `num_ranks` processes on this
    machine each hold a host pool of the given size."""
    transfer = KVTransferConfig.parse(kv_transfer_config)
    size = _gib("kv_offloading_size (--kv-offloading-size)", kv_offloading_size)
    alias = _gib("swap_space (--swap-space)", swap_space)
    if size is not None and alias is not None and size != alias:
        raise ValueError(f"kv_offloading_size (--kv-offloading-size) {kv_offloading_size} and its alias swap_space "
                         f"(--swap-space) {swap_space} disagree: give one")
    flag = "kv_offloading_size (--kv-offloading-size)" if size is not None else "swap_space (--swap-space)"
    size = size if size is not None else alias
    if transfer is not None and size is None:  # a host pool sized in the connector's own settings
        flag = _EXTRA_SIZE
        size = _gib(flag, transfer.kv_connector_extra_config.get("cpu_bytes_to_use"), unit=1)
        if size is None and transfer.kv_connector == OFFLOADING_CONNECTOR:
            raise ValueError(f"{FLAG} {OFFLOADING_CONNECTOR} needs a host pool size: --kv-offloading-size GiB "
                             f"(or kv_connector_extra_config cpu_bytes_to_use)")
    if size is not None and transfer is None:
        transfer = KVTransferConfig(OFFLOADING_CONNECTOR)
    elif size is not None and flag != _EXTRA_SIZE and transfer.kv_connector != OFFLOADING_CONNECTOR:
        raise ValueError(f"{flag} sizes the {OFFLOADING_CONNECTOR}'s host pool, but {FLAG} picks "
                         f"{transfer.kv_connector!r}")
    mode = preemption_mode or "recompute"
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode (--preemption-mode) must be one of {', '.join(PREEMPTION_MODES)}, "
                         f"got {preemption_mode!r}")
    if mode == "swap" and size is None:
        raise ValueError("preemption_mode (--preemption-mode) swap saves preempted requests' blocks in the host "
                         "tier: give it memory with --kv-offloading-size GiB (or --swap-space GiB)")
    if transfer is None:
        return None
    if mode == "swap" and transfer.kv_role != "kv_both":
        raise ValueError(f"preemption_mode (--preemption-mode) swap saves and loads: {FLAG} kv_role must be "
                         f"kv_both, got {transfer.kv_role!r}")
    host_bytes = 0 if size is None else int(size)
    nixl = NixlSettings.parse(transfer) if transfer.kv_connector == NIXL_CONNECTOR else None
    if host_bytes:
        free = available_host_memory()
        if host_bytes * num_ranks > free:
            raise ValueError(f"{flag}: {num_ranks} rank(s) x {host_bytes / _GiB:.2f} GiB of host KV cache is more "
                             f"than the {free / _GiB:.2f} GiB of host memory available; lower it")
    return KVOffloadConfig(transfer, host_bytes, mode, nixl)


def _gib(flag: str, value: float | None, unit: int = _GiB) -> float | None:
    """A positive size in `unit`s as bytes (None: not given); ValueError naming `flag` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{flag} must be a positive number, got {value!r}")
    return value * unit
