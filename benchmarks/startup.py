"""Start-up time, cold and with the cache a previous start filled, with the engine's own phases.

Cases, each in a fresh process:
  serve_empty_cache   `pagellm serve` of dummy Llama-3.1-8B shapes with an empty cache folder
                      (PAGELLM_CACHE_ROOT, Triton's cache in it): compiles and times everything
  serve_filled_cache  the same again on the folder the first case filled (a "shipped cache")
  warmup              `pagellm warmup` with the same flags into an empty folder (the documented
                      way to fill a cache to ship), timed as a whole
  serve_after_warmup  `pagellm serve` on the folder `pagellm warmup` filled
  llm_<dtype>_empty_cache / llm_<dtype>_filled_cache
                      `LLM(model=<SmolLM2 GGUF>, dtype=<dtype>)` for float32 and bfloat16, on an
                      empty cache folder, then on the one it filled
Each row: seconds to ready (the server: as its client saw /health/ready answer, polled every
CLIENT_POLL_S, and as its own report counts from its process's start; LLM: from its process's start to LLM()
returning), then the engine's phases (`pagellm.metrics.startup`: pagellm:startup_seconds for the
server, `llm.llm_engine.startup_phases` for LLM), and what the cache folder holds after it.
Goals (issue 52): serve <= 20 s with an empty cache, <= 10 s with a filled one; SmolLM2 <= 15 s in
any dtype. `--cases` runs some of the groups (serve, warmup, llm); only `llm` needs the SmolLM2 GGUF.
The JSON is rewritten after every case, so a run cut short keeps the cases it finished.

On the GPU machine, from the repository root (a fresh machine: nothing compiled before):
    python3 -m benchmarks.startup --out-dir "$OUT" --commit SHA
On the CPU, a tiny dummy Llama through the same path (the test of this script):
    python3 -m benchmarks.startup --smoke --out-dir /tmp/startup
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.server_process import ServerProcess
from pagellm.config.cache_dirs import CACHE_ROOT_ENV, TRITON_CACHE_ENV
from pagellm.loader.source import default_model_path
from pagellm.metrics.startup import TOTAL

SERVE_MODEL = "llama-3.1-8b"
CLIENT_POLL_S = 0.05
"""How often the client asks /health/ready during a start: a coarser poll would add up to its period
to the time measured."""
SMOKE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
"""config.json of the --smoke model: a one-layer Llama on dummy weights."""
SMOKE_ENGINE = {"load_format": "dummy", "device": "cpu", "kv_cache_memory_bytes": 1 << 22}
LLM_DTYPES = ("float32", "bfloat16")
_LLM_CHILD = """
import json, sys
from pagellm import LLM
from pagellm.metrics.startup import process_age_s
llm = LLM(**json.loads(sys.argv[1]))
ready_s = process_age_s()
print("STARTUP " + json.dumps({"ready_s": ready_s, "phases": llm.llm_engine.startup_phases}), flush=True)
"""
"""A fresh process that builds LLM(**kwargs) and prints its start-up report."""


def serve_case(name: str, model: str, args: list[str], cache: Path) -> dict[str, Any]:
    """`pagellm serve` to /health/ready with `cache` as its cache folder, and its reported phases."""
    start = time.perf_counter()
    with _cache_env(cache), ServerProcess(model, args, startup_timeout_s=600.0, poll_s=CLIENT_POLL_S) as server:
        client_ready_s = time.perf_counter() - start
        metrics = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    phases = {s.labels["phase"]: s.value for family in text_string_to_metric_families(metrics)
              for s in family.samples if s.name == "pagellm:startup_seconds"}
    return {"case": name, "ready_s": phases.get(TOTAL), "client_ready_s": client_ready_s, "phases": phases}


def warmup_case(name: str, model: str, args: list[str], cache: Path) -> dict[str, Any]:
    """`pagellm warmup` into `cache`, timed from its start to its exit."""
    start = time.perf_counter()
    with _cache_env(cache):
        done = subprocess.run([sys.executable, "-m", "pagellm.cli", "warmup", model, *args], capture_output=True,
                              text=True, timeout=900, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"pagellm warmup failed (exit code {done.returncode}): {done.stderr[-2000:]}")
    return {"case": name, "ready_s": time.perf_counter() - start, "phases": {}}


def cache_contents(folder: Path) -> dict[str, int]:
    """What a cache folder holds: files and bytes in all, Triton's compiled kernels (its folders,
    one per kernel variant), and the kernel choices stored."""
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    triton = folder / "triton"
    choices = 0
    for path in folder.glob("kernel_choices/*.json"):
        try:
            choices += sum(len(section) for section in json.loads(path.read_text())["sections"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            pass
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "triton_kernels": sum(1 for p in triton.iterdir() if p.is_dir()) if triton.is_dir() else 0,
            "kernel_choices": choices}


def llm_case(name: str, kwargs: dict[str, Any], cache: Path) -> dict[str, Any]:
    """LLM(**kwargs) in a fresh process with `cache` as its cache folder, and its reported phases."""
    with _cache_env(cache):
        done = subprocess.run([sys.executable, "-c", _LLM_CHILD, json.dumps(kwargs)], capture_output=True, text=True,
                              timeout=900, env=dict(os.environ))
    report = next((line for line in done.stdout.splitlines() if line.startswith("STARTUP ")), None)
    if done.returncode != 0 or report is None:
        raise RuntimeError(f"LLM({kwargs}) failed (exit code {done.returncode}): {done.stderr[-2000:]}")
    return {"case": name, **json.loads(report.removeprefix("STARTUP "))}


class _cache_env:
    """PAGELLM_CACHE_ROOT set to a folder and TRITON_CACHE_DIR unset (so that it follows) while the
    block runs; child processes inherit both."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for key in (CACHE_ROOT_ENV, TRITON_CACHE_ENV):
            self.saved[key] = os.environ.pop(key, None)
        os.environ[CACHE_ROOT_ENV] = str(self.folder)

    def __exit__(self, *exc: object) -> None:
        for key, value in self.saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


CASE_GROUPS = ("serve", "warmup", "llm")


def run_cases(smoke: bool, serve_args: list[str], work: Path, groups: list[str],
              on_row: Callable[[list[dict[str, Any]]], None] = lambda rows: None) -> list[dict[str, Any]]:
    """The cases of `groups`, in order; `on_row` gets the rows so far after each case."""
    if smoke:
        folder = work / "tiny-llama"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(SMOKE_CONFIG))
        serve_model = str(folder)
        serve_args = ["--load-format", "dummy", "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes",
                      str(SMOKE_ENGINE["kv_cache_memory_bytes"]), *serve_args]
        llm_extra: dict[str, Any] = SMOKE_ENGINE
    else:
        serve_model = SERVE_MODEL
        serve_args = ["--load-format", "dummy", *serve_args]
        llm_extra = {}
    rows = []

    def add(row: dict[str, Any], cache: Path) -> None:
        row["cache_after"] = cache_contents(cache)
        rows.append(row)
        print(f"{row['case']}: ready in {row['ready_s']:.2f} s; phases {json.dumps(_rounded(row['phases']))}; "
              f"cache {json.dumps(row['cache_after'])}", flush=True)
        on_row(rows)

    if "serve" in groups:
        for cache_name in ("empty", "filled"):
            add(serve_case(f"serve_{cache_name}_cache", serve_model, serve_args, work / "serve-cache"),
                work / "serve-cache")
    if "warmup" in groups:
        add(warmup_case("warmup", serve_model, serve_args, work / "warmup-cache"), work / "warmup-cache")
        add(serve_case("serve_after_warmup", serve_model, serve_args, work / "warmup-cache"), work / "warmup-cache")
    if "llm" in groups:
        # Only these cases load a real model: the embedded SmolLM2 GGUF (its package), unless --smoke.
        llm_model = str(folder) if smoke else default_model_path()
        for dtype in LLM_DTYPES:
            for cache_name in ("empty", "filled"):
                kwargs = {"model": llm_model, "dtype": dtype, **llm_extra}
                cache = work / f"llm-{dtype}-cache"
                add(llm_case(f"llm_{dtype}_{cache_name}_cache", kwargs, cache), cache)
    return rows


def _rounded(phases: dict[str, float]) -> dict[str, float]:
    return {name: round(seconds, 2) for name, seconds in phases.items()}


def table(rows: list[dict[str, Any]]) -> str:
    names = list(dict.fromkeys(name for row in rows for name in row["phases"] if name != TOTAL))
    body = [[row["case"], row["ready_s"], *(row["phases"].get(name, 0.0) for name in names)] for row in rows]
    return format_table(["case", "ready s", *names], body, left=[0])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny dummy Llama on the CPU (tests this script)")
    p.add_argument("--serve-args", default="", help="extra `pagellm serve` flags, one string (e.g. "
                                                     "'--max-model-len 8192')")
    p.add_argument("--cases", nargs="+", choices=CASE_GROUPS, default=list(CASE_GROUPS),
                   help="which groups of cases to run")
    p.add_argument("--out-dir", default=None, help="where the JSON goes; default benchmarks/results/")
    p.add_argument("--commit", default=None)
    args = p.parse_args(argv)
    payload = {"benchmark": "startup", **run_metadata(args.commit), "parameters": vars(args), "cases": []}
    gpus = payload["hardware"].get("gpus") or [{"name": "cpu"}]
    prefix = "startup_" + ("smoke_" if args.smoke else "") + re.sub(r"[^a-z0-9]+", "_", gpus[0]["name"].lower())
    out = Path(args.out_dir) / f"{prefix}.json" if args.out_dir else default_result_path(prefix)

    def write(rows: list[dict[str, Any]]) -> None:
        payload["cases"] = rows
        write_json(payload, out)

    with tempfile.TemporaryDirectory(prefix="pagellm-startup-") as work:
        rows = run_cases(args.smoke, args.serve_args.split(), Path(work), args.cases, on_row=write)
    write(rows)
    print(table(rows))
    print(f"wrote {out}")
    return payload


if __name__ == "__main__":
    main()
