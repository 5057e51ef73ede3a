"""The host KV tier (`--kv-offloading-size`) and swap preemption, in the same run: a multi-turn
workload whose working set is several times the device KV pool, with and without the host tier
(TTFT p50 / p99, throughput); swap against recompute under preemption pressure (throughput, TPOT
p99); and the tier's device <-> host copy bandwidth as a fraction of a plain pinned-memory copy.

Multi-turn: `--num-conversations` conversations of `--turns` turns, at most `--concurrency` at a
time; turn 1 sends `--first-len` random tokens, each later turn resends the whole history (earlier
prompts and answers) plus `--turn-len` new tokens, and every answer is `--output-len` tokens. The
device pool holds 1 / `--working-set-ratio` of all conversations' final histories (blocks fixed with
num_gpu_blocks_override), so without the host tier most turns find their history evicted.

Dummy weights with real shapes (a preset name such as meta-llama/Llama-3.1-8B-Instruct) measure
speed without a download:

    python -m benchmarks.kv_offload --out-dir "$OUT" --commit SHA                 # one GPU
    python -m benchmarks.kv_offload --model '' --load-format auto --smoke         # the CPU, SmolLM2

Prints a table and writes JSON under benchmarks/results/ (hardware, date, command, commit).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.phases import PhaseRunner, best_seconds
from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.benchmarks.datasets import random_requests
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, summarize, write_json
from pagellm.core.kv_offload import OffloadMetadata
from pagellm.worker.kv_offload import OffloadingWorker

_SMOKE = {"num_conversations": 4, "turns": 3, "first_len": 48, "turn_len": 24, "output_len": 8, "concurrency": 2,
          "kv_offloading_size": 0.05, "preempt_requests": 6, "preempt_input_len": 40, "preempt_output_len": 24,
          "preempt_device_tokens": 160, "copy_blocks": 8, "budget_s": 600.0}
_GiB = 1 << 30


def _engine(args: argparse.Namespace, device_tokens: int, **extra: Any) -> LLM:
    engine_args = dict(model=args.model or None, load_format=args.load_format, seed=args.seed,
                       max_model_len=args.max_model_len, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       num_gpu_blocks_override=-(-device_tokens // args.block_size), **extra)
    if args.device is not None:
        engine_args["device"] = args.device
    return LLM(**engine_args)


def _final_history(args: argparse.Namespace) -> int:
    """Tokens of a conversation's last prompt and answer."""
    return args.first_len + (args.turns - 1) * args.turn_len + args.turns * args.output_len


def multi_turn(args: argparse.Namespace, host_tier: bool, deadline: float) -> dict[str, Any]:
    """Run the conversations closed-loop (a turn is sent once the previous answer is known)."""
    device_tokens = max(args.num_conversations * _final_history(args) // args.working_set_ratio, args.max_model_len)
    llm = _engine(args, device_tokens, **({"kv_offloading_size": args.kv_offloading_size} if host_tier else {}))
    engine = llm.llm_engine
    vocab = engine.config.model.source.arch.vocab_size
    rng = random.Random(args.seed)
    turns = [[[rng.randrange(vocab) for _ in range(args.first_len if t == 0 else args.turn_len)]
              for t in range(args.turns)] for _ in range(args.num_conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    history: list[list[int]] = [[] for _ in turns]
    next_turn = [0] * len(turns)
    ready = deque(range(len(turns)))
    active: dict[str, tuple[int, list[int]]] = {}
    ttft, prompt_tokens, output_tokens = [], 0, 0
    start = time.perf_counter()
    while (ready or active) and time.perf_counter() < deadline:
        while ready and len(active) < args.concurrency:
            c = ready.popleft()
            prompt = history[c] + turns[c][next_turn[c]]
            request_id = f"c{c}t{next_turn[c]}"
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            active[request_id] = (c, prompt)
        for out in engine.step():
            if not out.finished:
                continue
            c, prompt = active.pop(out.request_id)
            ttft.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
            answer = list(out.outputs[0].token_ids)
            prompt_tokens += len(prompt)
            output_tokens += len(answer)
            history[c] = prompt + answer
            next_turn[c] += 1
            if next_turn[c] < args.turns:
                ready.append(c)
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    engine.shutdown()
    transfer = stats.kv_transfer
    return {"device_kv_tokens": device_tokens, "turns_done": len(ttft), "elapsed_s": elapsed,
            "ttft_s": summarize(ttft), "turns_per_s": len(ttft) / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "prefix_cache_hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
            "host_hit_rate": transfer.host_hit_tokens / max(stats.prefix_cache_queries, 1) if transfer else 0.0,
            "bytes_to_host": transfer.bytes_to_host if transfer else 0,
            "bytes_to_device": transfer.bytes_to_device if transfer else 0,
            "num_preemptions": stats.num_preemptions}


def preemption(args: argparse.Namespace, mode: str, deadline: float) -> dict[str, Any]:
    """Every request at once into a device pool far smaller than their KV: the scheduler preempts."""
    llm = _engine(args, args.preempt_device_tokens, kv_offloading_size=args.kv_offloading_size,
                  preemption_mode=mode)
    engine = llm.llm_engine
    vocab = engine.config.model.source.arch.vocab_size
    requests = random_requests(args.preempt_requests, args.preempt_input_len, args.preempt_output_len, vocab,
                               args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.preempt_output_len, ignore_eos=True)
    for i, request in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": request.prompt_token_ids}, params)
    tpot, output_tokens = [], 0
    start = time.perf_counter()
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        for out in engine.step():
            if out.finished:
                n = len(out.outputs[0].token_ids)
                output_tokens += n
                if n > 1:
                    tpot.append((out.metrics["finished_time"] - out.metrics["first_token_time"]) / (n - 1))
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    engine.shutdown()
    return {"requests_done": len(tpot), "elapsed_s": elapsed, "output_tokens_per_s": output_tokens / elapsed,
            "tpot_s": summarize(tpot), "num_preemptions": stats.num_preemptions,
            "swaps_out": stats.kv_transfer.swaps_out, "swaps_in": stats.kv_transfer.swaps_in,
            "tokens_computed": stats.num_scheduled_tokens_total}


def copy_bandwidth(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """The tier's copies of `--copy-blocks` blocks of the model's KV each way, against one plain copy
    of as many bytes between pinned host memory and the device (a CPU: plain memory)."""
    engine_args = EngineArgs(model=args.model or None, load_format=args.load_format, block_size=args.block_size,
                             max_model_len=args.max_model_len, kv_offloading_size=args.kv_offloading_size,
                             **({"device": args.device} if args.device else {}))
    config = engine_args.create_engine_config()
    arch, device, dtype = config.model.source.arch, config.device, config.cache.kv_cache_dtype
    num_blocks = 2 * args.copy_blocks
    shape = (num_blocks, args.block_size, arch.num_key_value_heads, arch.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(arch.num_hidden_layers)]
    n = args.copy_blocks
    block_bytes = 2 * arch.num_hidden_layers * math.prod(shape[1:]) * dtype.itemsize
    # A pool of just the blocks copied: the engine phases' pool may not fit host memory twice.
    pool = dataclasses.replace(config.kv_transfer, host_bytes=n * block_bytes)
    config = dataclasses.replace(config, kv_transfer=pool)
    worker = OffloadingWorker(config, caches)
    size = n * worker.block_bytes
    on_gpu = device.type == "cuda"
    host = torch.empty(size, dtype=torch.uint8, pin_memory=on_gpu)
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    order = list(range(num_blocks))
    random.Random(args.seed).shuffle(order)  # blocks scattered over the cache, host slots in a row

    def timed(fn) -> float:
        return best_seconds(fn, args.copy_reps, deadline, device)

    def save() -> None:
        worker.start_load_kv(OffloadMetadata(save_device=order[:n], save_host=list(range(n))))
        worker.synchronize()  # the last copies out run past the event the forward waits for

    def load() -> None:
        worker.start_load_kv(OffloadMetadata(load_host=list(range(n)), load_device=order[:n]))
        worker.wait_for_layer_load()

    rates = {"plain_to_host_GBps": size / timed(lambda: host.copy_(flat, non_blocking=True)) / 1e9,
             "plain_to_device_GBps": size / timed(lambda: flat.copy_(host, non_blocking=True)) / 1e9,
             "tier_to_host_GBps": size / timed(save) / 1e9,
             "tier_to_device_GBps": size / timed(load) / 1e9}
    return {"blocks": n, "bytes": size, "pinned": on_gpu, **rates,
            "to_host_fraction": rates["tier_to_host_GBps"] / rates["plain_to_host_GBps"],
            "to_device_fraction": rates["tier_to_device_GBps"] / rates["plain_to_device_GBps"]}


def _isolated(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`fn(*args)` in a fresh process: an engine's device memory and its pinned host pool (which
    PyTorch keeps cached once freed, so the next pool would not find the host memory available) go
    back when it exits. The phase's deadline (an argument) stops it in time."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    if args.smoke:
        for key, value in _SMOKE.items():
            setattr(args, key, value)
        args.max_model_len = max(_final_history(args) + 16, args.preempt_input_len + args.preempt_output_len + 16)
    phases = PhaseRunner(args.budget_s, {})
    plan = {"multi_turn_without_host": (multi_turn, False), "multi_turn_with_host": (multi_turn, True),
            "preemption_recompute": (preemption, "recompute"), "preemption_swap": (preemption, "swap"),
            "copy_bandwidth": (copy_bandwidth,)}
    results = {name: phases.run(name, lambda deadline, fn=fn, extra=extra: _isolated(fn, args, *extra, deadline))
               for name, (fn, *extra) in plan.items()}
    payload = {"benchmark": "kv_offload", **run_metadata(args.commit),
               "parameters": {k: v for k, v in vars(args).items() if k not in ("out_dir", "commit")},
               "phases": phases.records, "results": results, "ratios": _ratios(results)}
    print(_table(payload))
    if not args.smoke:
        write_json(payload, default_result_path("kv_offload"))
    if args.out_dir:
        write_json(payload, Path(args.out_dir) / default_result_path("kv_offload").name)
    return payload


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    """With the host tier over without it (TTFT: the speed-up), swap over recompute."""
    off, on = results["multi_turn_without_host"], results["multi_turn_with_host"]
    recompute, swap = results["preemption_recompute"], results["preemption_swap"]
    ratios = {}
    if off and on and on["ttft_s"].get("count") and off["ttft_s"].get("count"):
        ratios.update(ttft_p50_speedup=off["ttft_s"]["p50"] / on["ttft_s"]["p50"],
                      ttft_p99_speedup=off["ttft_s"]["p99"] / on["ttft_s"]["p99"],
                      throughput=on["total_tokens_per_s"] / off["total_tokens_per_s"])
    if recompute and swap:
        ratios["swap_throughput"] = swap["output_tokens_per_s"] / recompute["output_tokens_per_s"]
    return ratios


def _table(payload: dict[str, Any]) -> str:
    rows = []
    for name, r in payload["results"].items():
        if r is None or name == "copy_bandwidth":
            continue
        if name.startswith("multi_turn"):
            ttft = r["ttft_s"]
            rows.append([name, f"{ttft.get('p50', float('nan')):.3f}", f"{ttft.get('p99', float('nan')):.3f}", "",
                         f"{r['total_tokens_per_s']:.0f}", f"{r['host_hit_rate']:.1%}", r["num_preemptions"]])
        else:
            rows.append([name, "", "", f"{r['tpot_s'].get('p99', float('nan')) * 1000:.1f}",
                         f"{r['output_tokens_per_s']:.0f}", "", r["num_preemptions"]])
    table = format_table(["phase", "TTFT p50 s", "TTFT p99 s", "TPOT p99 ms", "tok/s", "host hits", "preemptions"],
                         rows, left=[0])
    copy = payload["results"]["copy_bandwidth"]
    if copy is not None:
        table += (f"\ncopies of {copy['blocks']} blocks: to host {copy['tier_to_host_GBps']:.2f} GB/s "
                  f"({copy['to_host_fraction']:.0%} of a plain copy), to device {copy['tier_to_device_GBps']:.2f} GB/s "
                  f"({copy['to_device_fraction']:.0%})")
    return table + "\n" + "  ".join(f"{k}: {v:.2f}" for k, v in payload["ratios"].items())


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct",
                   help="model path or dummy preset; '': SmolLM2")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-offloading-size", type=float, default=80.0, help="GiB of host memory for the tier")
    p.add_argument("--num-conversations", type=int, default=256)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-len", type=int, default=2048)
    p.add_argument("--turn-len", type=int, default=768)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=256,
                   help="conversations in flight at once: all, so a history comes back after every other one")
    p.add_argument("--working-set-ratio", type=int, default=5,
                   help="all conversations' final histories over the device KV pool")
    p.add_argument("--preempt-requests", type=int, default=256)
    p.add_argument("--preempt-input-len", type=int, default=1024)
    p.add_argument("--preempt-output-len", type=int, default=512)
    p.add_argument("--preempt-device-tokens", type=int, default=131072,
                   help="device KV pool of the preemption phase (a third of its requests' KV)")
    p.add_argument("--copy-blocks", type=int, default=2048)
    p.add_argument("--copy-reps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=1500.0, help="seconds for all phases together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes: {_SMOKE}")
    p.add_argument("--out-dir", default=None, help="also write the JSON here (e.g. $OUT)")
    p.add_argument("--commit", default=None, help="the code's commit, for a copy without git history")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
