"""Attention backends, chosen by name from `ATTENTION_BACKEND_REGISTRY`; each is imported only when
asked for, so a CPU-only install never imports GPU kernels. `register_attention_backend` adds one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from pagellm.config.registry import Registry, check_ref, resolve


@dataclass(frozen=True, slots=True)
class AttentionBackendEntry:
    """An attention backend (`--attention-backend NAME`) and what the engine checks before choosing it."""

    name: str
    cls: Any
    """An `AttentionBackend` subclass (constructed without arguments), or its "package.module:Class" name."""
    description: str = ""
    """What `--help` says of it."""
    devices: tuple[str, ...] = ("cpu", "cuda")
    """The device types it runs on."""
    float8_kv_cache: bool = False
    """It reads a float8 KV cache (--kv-cache-dtype fp8)."""
    cuda_graphs: bool = False
    """Its decode steps can be captured in CUDA graphs (it plans on the device, not on the host)."""
    triton_kernels: bool = False
    """Its kernels are Triton's, which Triton's interpreter also runs on a CPU (TRITON_INTERPRET=1, for tests)."""


ATTENTION_BACKEND_REGISTRY: Registry[AttentionBackendEntry] = Registry(
    "attention backend", "attention_backend (--attention-backend)", builtins=(
        AttentionBackendEntry("torch", "pagellm.attention.torch_backend:TorchAttentionBackend",
                              "pure PyTorch, any device; the oracle the others are tested against",
                              float8_kv_cache=True),
        AttentionBackendEntry("triton", "pagellm.attention.triton_backend:TritonAttentionBackend",
                              "Triton kernels: paged decode with split-K, prefill over a cached prefix",
                              devices=("cuda",), float8_kv_cache=True, cuda_graphs=True, triton_kernels=True),
        AttentionBackendEntry("cpu", "pagellm.attention.cpu_backend:CPUAttentionBackend",
                              "C kernels, each query attended alone, so results never depend on the batch; "
                              "float32 on x86-64 CPUs", devices=("cpu",)),
    ))
"""Every attention backend, by `--attention-backend` name."""


def register_attention_backend(name: str, backend_cls: type[AttentionBackend] | str, *, description: str = "",
                               devices: tuple[str, ...] = ("cpu", "cuda"), float8_kv_cache: bool = False,
                               cuda_graphs: bool = False, triton_kernels: bool = False,
                               override: bool = False) -> None:
    """Make `name` an `--attention-backend`: `backend_cls` (an `AttentionBackend` subclass, or its
    "package.module:Class" name, imported when chosen); the other arguments say where it can run
    (`AttentionBackendEntry`). A name already registered is refused unless `override`."""
    check_ref(backend_cls, f"register_attention_backend({name!r})")
    if not isinstance(backend_cls, str):
        _check_backend_class(backend_cls, name)
    if not devices or any(d not in ("cpu", "cuda") for d in devices):
        raise ValueError(f"register_attention_backend({name!r}): devices must name cpu and/or cuda, got {devices!r}")
    ATTENTION_BACKEND_REGISTRY.register(AttentionBackendEntry(
        name, backend_cls, description, tuple(devices), float8_kv_cache, cuda_graphs, triton_kernels),
        override=override)


def get_attn_backend(name: str) -> AttentionBackend:
    """A new instance of the attention backend called `name`."""
    return _check_backend_class(resolve(ATTENTION_BACKEND_REGISTRY.get(name).cls), name)()


def _check_backend_class(cls: Any, name: str) -> type[AttentionBackend]:
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise ValueError(f"attention backend {name!r} must be a subclass of "
                         f"pagellm.attention.backend.AttentionBackend, got {cls!r}")
    return cls


__all__ = ["ATTENTION_BACKEND_REGISTRY", "AttentionBackend", "AttentionBackendEntry", "AttentionMetadata", "KVCache",
           "get_attn_backend", "register_attention_backend"]
