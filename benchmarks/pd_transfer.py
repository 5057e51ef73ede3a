"""Disaggregated prefill/decode's KV transfer (NixlConnector) on one device, in the same run:

- `pull`: two NixlConnector worker halves over caches of the model's KV shapes on the same device
  (a producer's and a consumer's), the consumer pulling `--copy-blocks` blocks of every layer (one
  NIXL READ), consecutive on both sides (what a fresh allocator hands out: one descriptor per cache
  tensor) and scattered (random block ids: one descriptor per block and tensor), against a plain
  device-to-device copy of as many bytes and a gather/scatter of the scattered blocks with torch:
  GB/s, descriptors per pull and each pull's fraction of the plain copy.
- `engines`: a prefill engine and a decode engine sharing the device (`--kv-cache-gib` of KV each,
  dummy weights), `--num-prompts` prompts of `--prompt-len` tokens prefilled on the first and decoded
  on the second (`--output-len` tokens), against the decode engine computing the prompts itself: the
  engine-observed pull rate (bytes over the time from a pull's start to the step that saw it end)
  and the decode engine's time to first token with the pull and with recompute. One device runs
  both engines' compute: the figures are the transfer's mechanics, not a two-GPU deployment's.

    python -m benchmarks.pd_transfer --out-dir "$OUT" --commit SHA           # one GPU, Llama-3.1-8B shapes
    python -m benchmarks.pd_transfer --model DIR --device cpu --smoke        # the CPU, tiny sizes

Prints a table and writes JSON under benchmarks/results/ (hardware, date, command, commit).
"""
from __future__ import annotations

import argparse
import random
import socket
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.phases import PhaseRunner, best_seconds
from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, summarize, write_json
from pagellm.core.nixl_connector import NixlMetadata, RemoteLoad, RemotePrefill
from pagellm.worker.nixl_connector import NixlWorker
from pagellm.worker.nixl_runs import block_runs

_SMOKE = {"copy_blocks": 8, "copy_reps": 2, "num_prompts": 2, "prompt_len": 48, "output_len": 4,
          "kv_cache_gib": 0.01, "max_model_len": 128, "budget_s": 300.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _transfer_config(role: str) -> dict[str, Any]:
    return {"kv_role": role, "kv_connector_extra_config": {"side_channel_port": _free_port()}}


def pull(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """One consumer's pull of `--copy-blocks` blocks against plain copies of the same bytes."""
    def config(role: str):
        return EngineArgs(model=args.model or None, load_format=args.load_format, block_size=args.block_size,
                          max_model_len=args.max_model_len, kv_transfer_config=_transfer_config(role),
                          **({"device": args.device} if args.device else {})).create_engine_config()

    producer_config, consumer_config = config("kv_producer"), config("kv_consumer")
    arch, device = producer_config.model.source.arch, producer_config.device
    dtype = producer_config.cache.kv_cache_dtype
    n = args.copy_blocks
    shape = (2 * n, args.block_size, arch.num_key_value_heads, arch.head_dim)

    def caches():
        return [(torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype))
                for _ in range(arch.num_hidden_layers)]

    producer = NixlWorker(producer_config, caches())
    consumer = NixlWorker(consumer_config, caches())
    settings = producer.settings
    rng = random.Random(args.seed)
    size = n * producer.block_bytes * producer.num_tensors
    flat_src = torch.empty(size, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    src_start, dst_start = rng.randrange(n + 1), rng.randrange(n + 1)
    patterns = {"consecutive": (list(range(src_start, src_start + n)), list(range(dst_start, dst_start + n))),
                "scattered": (rng.sample(range(2 * n), n), rng.sample(range(2 * n), n))}
    src_blocks, dst_blocks = (torch.tensor(ids, device=device) for ids in patterns["scattered"])
    reps = 0

    def timed(fn) -> float:
        return best_seconds(fn, args.copy_reps, deadline, device)

    def nixl_pull(src: list[int], dst: list[int]) -> None:
        nonlocal reps
        reps += 1
        req_id = f"bench-{reps}"
        remote = RemotePrefill(settings.engine_id, settings.side_channel_host, settings.side_channel_port, req_id,
                               tuple(src), settings.tp_size)
        consumer.start_load_kv(NixlMetadata(loads=[RemoteLoad(req_id, remote, dst, src)]))
        while True:
            report = consumer.get_finished()
            if report is not None and req_id in report.finished_recving:
                if report.failed_block_ids:
                    raise RuntimeError("the pull failed (see the log)")
                return

    def measure_pull(src: list[int], dst: list[int]) -> dict[str, Any]:
        nixl_pull(src, dst)  # a warm-up, outside the timing (the very first one shakes hands)
        src_ids, dst_ids = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for (pk, pv), (ck, cv) in zip(producer.kv_caches, consumer.kv_caches):
            if not (torch.equal(ck[dst_ids], pk[src_ids]) and torch.equal(cv[dst_ids], pv[src_ids])):
                raise RuntimeError("the pull did not copy the blocks")
        return {"nixl_pull_GBps": size / timed(lambda: nixl_pull(src, dst)) / 1e9,
                "descriptors_per_pull": block_runs(dst, src).lengths.size * producer.num_tensors}

    def torch_gather_scatter() -> None:
        for (pk, pv), (ck, cv) in zip(producer.kv_caches, consumer.kv_caches):
            ck.index_copy_(0, dst_blocks, pk.index_select(0, src_blocks))
            cv.index_copy_(0, dst_blocks, pv.index_select(0, src_blocks))

    pulls = {name: measure_pull(src, dst) for name, (src, dst) in patterns.items()}
    plain = size / timed(lambda: flat_dst.copy_(flat_src)) / 1e9
    producer.listener.close()
    for record in pulls.values():
        record["fraction_of_plain_copy"] = record["nixl_pull_GBps"] / plain
    return {"blocks": n, "bytes": size, "block_bytes": producer.block_bytes, "memory": producer.mem_type,
            "plain_copy_GBps": plain, "torch_gather_scatter_GBps": size / timed(torch_gather_scatter) / 1e9, **pulls}


def engines(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """A prefill and a decode engine on one device: pulled prompts against recomputed ones."""
    common = dict(model=args.model or None, load_format=args.load_format, block_size=args.block_size,
                  max_model_len=args.max_model_len, kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
                  **({"device": args.device} if args.device else {}))
    producer = LLM(**common, kv_transfer_config=_transfer_config("kv_producer"))
    consumer = LLM(**common, kv_transfer_config=_transfer_config("kv_consumer"), enable_prefix_caching=False)
    rng = random.Random(args.seed)
    vocab = producer.llm_engine.engine_core.config.model.source.arch.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)]}
               for _ in range(args.num_prompts)]

    def decode(transfers: list[dict | None]) -> list[float]:
        """Time to first token of each prompt on the decode engine, one at a time."""
        ttfts = []
        for prompt, transfer in zip(prompts, transfers):
            extra = None if transfer is None else {"kv_transfer_params": transfer}
            out = consumer.generate([prompt], SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                                             ignore_eos=True, extra_args=extra), use_tqdm=False)[0]
            ttfts.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
        return ttfts

    decode([None])  # warm-up
    before = consumer.llm_engine.engine_core.stats().kv_transfer
    prefilled = producer.generate(prompts, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
        "do_remote_decode": True}}), use_tqdm=False)
    pulled = decode([out.kv_transfer_params for out in prefilled])
    after = consumer.llm_engine.engine_core.stats().kv_transfer
    recomputed = decode([None] * len(prompts)) if time.perf_counter() < deadline else []
    num_bytes = after.transfer_bytes - before.transfer_bytes
    seconds = after.transfer_seconds - before.transfer_seconds
    return {"prompts": len(prompts), "prompt_len": args.prompt_len,
            "pulls": after.transfers - before.transfers, "failures": after.transfer_failures - before.transfer_failures,
            "bytes": num_bytes, "engine_pull_GBps": num_bytes / seconds / 1e9 if seconds else None,
            "ttft_pulled_s": summarize(pulled), "ttft_recomputed_s": summarize(recomputed)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    if args.smoke:
        for key, value in _SMOKE.items():
            setattr(args, key, value)
    phases = PhaseRunner(args.budget_s, {})
    results = {}
    for name, fn in (("pull", pull), ("engines", engines)):
        results[name] = phases.run(name, lambda deadline, fn=fn: fn(args, deadline))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the phase's caches go back before the engines take their share
    payload = {"benchmark": "pd_transfer", **run_metadata(args.commit),
               "parameters": {k: v for k, v in vars(args).items() if k not in ("out_dir", "commit")},
               "phases": phases.records, "results": results}
    print(_table(payload))
    if not args.smoke:
        write_json(payload, default_result_path("pd_transfer"))
    if args.out_dir:
        write_json(payload, Path(args.out_dir) / default_result_path("pd_transfer").name)
    return payload


def _table(payload: dict[str, Any]) -> str:
    rows = []
    copy = payload["results"]["pull"]
    if copy is not None:
        rows += [["plain device copy", f"{copy['plain_copy_GBps']:.2f}", "100%", ""],
                 ["torch gather/scatter (scattered blocks)", f"{copy['torch_gather_scatter_GBps']:.2f}",
                  f"{copy['torch_gather_scatter_GBps'] / copy['plain_copy_GBps']:.0%}", ""]]
        rows += [[f"NIXL pull, {name} blocks", f"{copy[name]['nixl_pull_GBps']:.2f}",
                  f"{copy[name]['fraction_of_plain_copy']:.0%}", str(copy[name]["descriptors_per_pull"])]
                 for name in ("consecutive", "scattered")]
    run = payload["results"]["engines"]
    if run is not None and run["engine_pull_GBps"] is not None:
        rows.append(["engines: pull seen by the decode engine", f"{run['engine_pull_GBps']:.2f}", "", ""])
    table = format_table(["transfer", "GB/s", "of plain copy", "descriptors"], rows, left=[0])
    if run is not None:
        pulled, recomputed = run["ttft_pulled_s"], run["ttft_recomputed_s"]
        table += (f"\ndecode engine TTFT p50 for {run['prompt_len']}-token prompts: pulled "
                  f"{pulled.get('p50', float('nan')):.3f} s, recomputed {recomputed.get('p50', float('nan')):.3f} s")
    return table


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct",
                   help="model path or dummy preset; '': SmolLM2")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--copy-blocks", type=int, default=2048, help="blocks of every layer in one pull")
    p.add_argument("--copy-reps", type=int, default=5)
    p.add_argument("--kv-cache-gib", type=float, default=12.0, help="KV cache of each of the two engines")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=900.0, help="seconds for all phases together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes: {_SMOKE}")
    p.add_argument("--out-dir", default=None, help="also write the JSON here (e.g. $OUT)")
    p.add_argument("--commit", default=None, help="the code's commit, for a copy without git history")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
