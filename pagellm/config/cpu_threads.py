"""How many threads each rank computes with on the host (PyTorch's intra-op threads, which the C
kernels' OpenMP loops share).

By default: the cores this process may use (its CPU affinity, capped by its cgroup's CPU quota),
less one left to the engine's other processes (the API process, the engine core, the OS), shared
among the ranks on this machine. Every OpenMP loop waits for its slowest thread: a thread that
has to share its core with another busy process stalls each of the thousands of loops in a step,
so more threads than free cores costs far more than one core left idle (issue 53: a 24-token
completion took 35-49 s with 2 threads on a busy 2-core host, 2.3-2.6 s with 1).
`--cpu-threads`, else OMP_NUM_THREADS, overrides the default.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path


def resolve_cpu_threads(requested: int | None, num_ranks: int, environ: Mapping[str, str] = os.environ,
                        root: Path = Path("/")) -> tuple[int, str]:
    """Threads per rank and why: `requested` (--cpu-threads), else OMP_NUM_THREADS, else
    `default_cpu_threads` for `num_ranks` ranks on this machine (all replicas' together)."""
    if requested is not None:
        return requested, "cpu_threads (--cpu-threads)"
    omp = _positive_int(environ.get("OMP_NUM_THREADS", "").split(",")[0])
    if omp is not None:
        return omp, "OMP_NUM_THREADS"
    cores = usable_cores(root)
    return (default_cpu_threads(cores, num_ranks),
            f"{cores} usable core(s) less one for the engine's other processes, shared by {num_ranks} rank(s)")


def default_cpu_threads(cores: int, num_ranks: int) -> int:
    """One core left to the processes besides the ranks, the rest shared evenly; at least one each."""
    return max(1, (cores - 1) // num_ranks)


def usable_cores(root: Path = Path("/")) -> int:
    """Cores this process may run on: its CPU affinity, capped by its cgroup CPU quota (rounded
    down: a thread throttled for part of every period stalls the others as a busy core does)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(root)
    return cores if quota is None else max(1, min(cores, math.floor(quota)))


def cgroup_cpu_quota(root: Path = Path("/")) -> float | None:
    """The tightest CPU quota, in cores, of this process's cgroup and its ancestors (cgroup v2
    cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us); None: no quota."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            base, read = root / "sys/fs/cgroup", _v2_quota
        elif "cpu" in controllers.split(","):
            base, read = root / "sys/fs/cgroup" / controllers, _v1_quota
            if not base.is_dir():  # mounted under one controller's name, e.g. "cpu" for "cpu,cpuacct"
                base = root / "sys/fs/cgroup/cpu"
        else:
            continue
        # In a container the path may be the host's, absent here; the mount is then the container's own group.
        directory = base / path.lstrip("/")
        for d in (directory, *directory.parents):
            if d.is_relative_to(base):
                quotas.append(read(d))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def _positive_int(text: str) -> int | None:
    return int(text) if text.strip().isdigit() and int(text) > 0 else None
