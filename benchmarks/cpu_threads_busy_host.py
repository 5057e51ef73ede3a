"""A short completion on a busy host: the old thread count (every usable core) against the engine's
default (usable cores less one, shared by the ranks), through `pagellm serve` (issue 53).

For each arm a server starts idle; a 24-token completion is timed idle, then again while one
CPU-burning process per usable core runs beside it. On the CPU, with the embedded model:

    .venv/bin/python -m benchmarks.cpu_threads_busy_host
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.config.cpu_threads import usable_cores

_BURN = "while True: pass"


def start_server(port: int, extra: list[str], log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagellm.cli", "serve", "--device", "cpu", "--dtype", "float32",
               "--port", str(port), "--served-model-name", "m", *extra]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the engine's own default
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    with httpx.Client(timeout=1.0) as http:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                sys.exit(f"server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if http.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    server.kill()
    sys.exit(f"server not healthy in 300 s:\n{log.read_text()[-3000:]}")


def completion_s(port: int, max_tokens: int) -> float:
    body = {"model": "m", "prompt": "Write a short story about a lighthouse keeper.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}
    start = time.perf_counter()
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600.0)
    response.raise_for_status()
    return time.perf_counter() - start


def run_arm(name: str, extra: list[str], args: argparse.Namespace, cores: int) -> dict:
    port = 18000 + os.getpid() % 1000
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        server = start_server(port, extra, log)
        try:
            threads = int(re.search(r"each rank computes with (\d+) CPU thread", log.read_text()).group(1))
            completion_s(port, args.max_tokens)  # warm-up
            idle = [completion_s(port, args.max_tokens) for _ in range(args.repeats)]
            burners = [subprocess.Popen([sys.executable, "-c", _BURN]) for _ in range(cores)]
            try:
                busy = [completion_s(port, args.max_tokens) for _ in range(args.repeats)]
            finally:
                for burner in burners:
                    burner.kill()
                    burner.wait()
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"{name}: {threads} thread(s), idle {idle}, busy {busy}", flush=True)
    return {"threads": threads, "idle_s": idle, "busy_s": busy}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/cpu_threads_busy_host_*.json)")
    args = p.parse_args()

    cores = usable_cores()
    load_before = os.getloadavg()
    results = {
        "old (every usable core)": run_arm("old", ["--cpu-threads", str(cores)], args, cores),
        "new (the default)": run_arm("new", [], args, cores),
    }
    rows = [[name, r["threads"], f"{statistics.median(r['idle_s']):.2f}", f"{statistics.median(r['busy_s']):.2f}",
             f"{max(r['busy_s']):.2f}"] for name, r in results.items()]
    print(f"{cores} usable cores, {cores} burners when busy; {args.max_tokens}-token completion, median of "
          f"{args.repeats}; load average before {load_before[0]:.2f}")
    print(format_table(["threads per rank", "threads", "idle s", "busy s", "busy max s"], rows))
    payload = {"metadata": run_metadata(), "config": {**vars(args), "usable_cores": cores, "burners": cores,
                                                      "load_average_before": load_before},
               "results": results}
    print(f"wrote {write_json(payload, args.out or default_result_path('cpu_threads_busy_host'))}")


if __name__ == "__main__":
    main()
