"""`kv_transfer_config` as vLLM takes it (a dict in `LLM(...)`, JSON with `--kv-transfer-config`), the
KV connectors its `kv_connector` names (`KV_CONNECTOR_REGISTRY`, `register_kv_connector`), and the
host tier's settings (`--kv-offloading-size`, `--preemption-mode`)."""
from __future__ import annotations

import os
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
        name = value.pop("kv_connector", None)
        if not isinstance(name, str):
            raise ValueError(f"{FLAG} needs \"kv_connector\": one of {', '.join(KV_CONNECTOR_REGISTRY.names())}")
        KV_CONNECTOR_REGISTRY.get(name)
        role = value.pop("kv_role", "kv_both")
        if role not in KV_ROLES:
            raise ValueError(f"{FLAG} kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
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
    if host_bytes:
        free = available_host_memory()
        if host_bytes * num_ranks > free:
            raise ValueError(f"{flag}: {num_ranks} rank(s) x {host_bytes / _GiB:.2f} GiB of host KV cache is more "
                             f"than the {free / _GiB:.2f} GiB of host memory available; lower it")
    return KVOffloadConfig(transfer, host_bytes, mode)


def _gib(flag: str, value: float | None, unit: int = _GiB) -> float | None:
    """A positive size in `unit`s as bytes (None: not given); ValueError naming `flag` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{flag} must be a positive number, got {value!r}")
    return value * unit
