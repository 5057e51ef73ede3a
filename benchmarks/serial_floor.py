"""The serial floor of a `gpu_fast_path` run's throughput phases, recomputed on the CPU.

`pagellm/benchmarks/roofline.py`'s `serial_floor` follows the scheduler's policy step by step and
charges each step max(weights, matmul FLOPs) plus its attention: the least time an engine whose
attention runs after its projections within a step can take. Given a results JSON, this script
takes the ceilings it measured, the model and the limits each phase ran with, rebuilds the same
requests (random: fixed lengths; ShareGPT: the requests file the run used) and prints each phase's
floors against what it achieved, so a target can be checked against what the design allows.

It also prints what fp8 weights could gain over the run's 16-bit ones at most, with the KV cache
kept in 16 bits: the serial floor again with half the weight bytes and matmuls `--fp8-speedup`
times faster (2, the H200 datasheet's fp8 / bf16 ratio, unless told otherwise), as the ratio of the
two floors. An engine at the same fraction of both floors gains exactly that.

    .venv/bin/python -m benchmarks.serial_floor benchmarks/results/gpu_fast_path_h200_..._a707125.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagellm.benchmarks.datasets import load_requests
from pagellm.benchmarks.results import REPO_ROOT, default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.roofline import Ceilings, ModelCost, run_floor, serial_floor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a gpu_fast_path results JSON")
    parser.add_argument("--fp8-speedup", type=float, default=2.0,
                        help="fp8 matmul rate over the measured bf16 one (default 2: the datasheet's)")
    parser.add_argument("--output-json", type=Path, default=None,
                        help="default: benchmarks/results/serial_floor_<date>.json")
    ns = parser.parse_args(argv)
    source = json.loads(ns.results.read_text())
    phases, params = source["phases"], source["parameters"]
    ceilings = Ceilings(**{k: phases["ceilings"]["result"][k] for k in ("copy_bytes_per_s", "matmul_flops_per_s")})
    cost = ModelCost(**source["model_cost"])
    workloads = {"random": [(params["input_len"], params["output_len"])] * params["num_prompts"]}
    requests_path = Path(params["sharegpt_requests"])
    if not requests_path.exists():  # a path on the GPU machine: the same file in this checkout
        requests_path = REPO_ROOT / requests_path.relative_to(requests_path.parents[2])
    workloads["sharegpt"] = [(len(r.prompt_token_ids), r.output_len) for r in load_requests(str(requests_path))[0]]
    rows, records = [], {}
    for name, work in workloads.items():
        run = phases.get(f"engine.{name}", {})
        if run.get("status") != "ok":
            continue
        engine = (phases.get(f"engine.reload_for_{name}") or phases["engine.load"])["result"]
        limits = (engine["max_num_seqs"], engine["max_num_batched_tokens"])
        achieved = run["result"]["elapsed_s"]
        floor, serial = run_floor(cost, ceilings, work, *limits), serial_floor(cost, ceilings, work, *limits)
        fp8 = serial_floor(dataclasses.replace(cost, step_weight_bytes=cost.step_weight_bytes // 2),
                           dataclasses.replace(ceilings, matmul_flops_per_s=ceilings.matmul_flops_per_s * ns.fp8_speedup),
                           work, *limits)
        records[name] = {"max_num_seqs": limits[0], "max_num_batched_tokens": limits[1], "achieved_s": achieved,
                         "achieved_steps": run["result"]["num_steps"], "floor": floor, "serial_floor": serial,
                         "fp8_weights_serial_floor": {**fp8, "fp8_matmul_speedup": ns.fp8_speedup,
                                                      "max_gain": serial["serial_s"] / fp8["serial_s"]}}
        rows.append([name, f"{achieved:.2f}", run["result"]["num_steps"], f"{floor['floor_s']:.2f}",
                     f"{serial['serial_s']:.2f}", serial["steps"], f"{serial['matmul_s']:.2f}",
                     f"{serial['attention_s']:.2f}", f"{serial['serial_s'] / achieved:.2f}", f"{fp8['serial_s']:.2f}",
                     f"{serial['serial_s'] / fp8['serial_s']:.3f}"])
    print(format_table(["phase", "achieved s", "steps", "floor s", "serial floor s", "steps", "matmuls s",
                        "attention s", "serial / achieved", "fp8 weights: serial floor s", "max gain"], rows,
                       left=[0]))
    payload = {"benchmark": "serial_floor", **run_metadata(), "source": str(ns.results),
               "source_commit": source["git"]["commit"], "ceilings": dataclasses.asdict(ceilings), "phases": records}
    print("wrote", write_json(payload, ns.output_json or default_result_path("serial_floor")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
