"""What every benchmark result records besides its numbers: hardware, date, command, commit, versions.

A result file has to say where and how it was produced, or nobody can compare it with the next run.
Also the plain-text table every benchmark prints, and percentile summaries.
"""
from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
"""The checkout this package runs from (an editable install); git answers None elsewhere."""
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
_VERSIONED_PACKAGES = ("pagellm", "torch", "transformers", "accelerate", "tokenizers", "gguf", "numpy", "triton")
_MAX_DIRTY_PATHS = 100


def run_metadata(commit: str | None = None) -> dict[str, Any]:
    """Date, command line, git state, hardware and library versions of the current process.

    `commit`: the commit the code came from, for a copy without git history (a GPU machine);
    default: $PAGELLM_COMMIT.
    """
    commit = commit or os.environ.get("PAGELLM_COMMIT")
    # A copy without our history cannot say whether it differs from that commit.
    git = {"commit": commit, "commit_source": "given by the caller", "dirty": None} if commit else git_state()
    return {
        "date_utc": utc_now().isoformat(timespec="seconds"),
        # orig_argv, not argv: under `python -m` argv[0] is the module's file path, not what was typed.
        "command": shlex.join(sys.orig_argv),
        "python_executable": sys.executable,
        "cwd": os.getcwd(),
        "git": git,
        "hardware": hardware_info(),
        "versions": library_versions(),
    }


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def git_state() -> dict[str, Any]:
    """HEAD commit and whether the tree differs from it (the changed paths, so a reader can judge how much)."""
    commit = _git("rev-parse", "HEAD")
    porcelain = _git("status", "--porcelain")
    changed = porcelain.splitlines() if porcelain else []
    return {
        "commit": commit,
        "dirty": None if porcelain is None else bool(changed),  # None: git could not tell
        "changed_paths": changed[:_MAX_DIRTY_PATHS],
        "num_changed_paths": len(changed),
    }


def hardware_info() -> dict[str, Any]:
    """CPU model and core counts, torch's thread count, and the GPUs torch sees."""
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [
            {"name": torch.cuda.get_device_name(i),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / (1 << 30), 1)}
            for i in range(torch.cuda.device_count())
        ]
        info["cuda"] = torch.version.cuda
    return info


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def default_result_path(prefix: str) -> Path:
    """`benchmarks/results/<prefix>_<UTC date and time>.json`; the time keeps same-day runs apart."""
    return RESULTS_DIR / f"{prefix}_{utc_now().strftime('%Y%m%dT%H%M%SZ')}.json"


def write_json(payload: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path


def format_table(header: list[str], rows: list[list[Any]], left: Collection[int] = ()) -> str:
    """A plain-text table with right-aligned columns (floats to two decimals), except the column
    indices in `left` (text)."""
    cells = [header] + [[f"{v:.2f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
    return "\n".join(lines)


def summarize(values: list[float]) -> dict[str, float | int]:
    """Count, mean, p50 and p99 (linear interpolation between samples, as numpy's default)."""
    if not values:
        return {"count": 0}
    p50, p99 = np.percentile(values, [50, 99]).tolist()
    return {"count": len(values), "mean": float(np.mean(values)), "p50": p50, "p99": p99}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()
