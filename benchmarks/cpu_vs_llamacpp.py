"""pagellm against llama.cpp on the CPU, on the same GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1).

Each engine runs in its own fresh subprocess, one after the other (never both at once), with the
same number of threads, greedy decoding, EOS ignored, and the same prompt token ids (the chat
template applied with pagellm's tokenizer; whether llama.cpp tokenizes the text the same way is
recorded). Measured per engine, and per pagellm variant (`LLM(quantization=...)` for each of
--pagellm-variants; auto: the default, None):

  batch 1      decode output tokens/s over --output-len tokens (after the first token) and time to
               first token (prompt + first token) of a ~100-token prompt; median of --repeats runs
  concurrent   total output tokens/s of --concurrency requests in one `LLM.generate` call (pagellm).
               llama.cpp is batch 1 only: llama-cpp-python has no parallel slots (its server
               serializes requests behind a lock), so the target is pagellm concurrent vs llama.cpp batch 1
  start-up     import time, in-process `LLM(...)` / `Llama(...)` seconds, and process start (the
               parent's clock before spawning) to ready; pagellm's KV cache (its default size
               unless --kv-cache-gib) is allocated at start-up and counts here and in the RSS
  memory       peak RSS (ru_maxrss) after loading, after the first tokens, and at the end
  agreement    common prefix of the first 32 greedy tokens (a sanity signal: llama.cpp quantizes
               activations, so they may differ)

llama.cpp comes from llama-cpp-python, a benchmark-only dependency: `pip install 'pagellm[bench-cpu]'`
(building it from PyPI compiles llama.cpp: about 11 minutes on 2 cores).

    .venv/bin/python -m benchmarks.cpu_vs_llamacpp
    .venv/bin/python -m benchmarks.cpu_vs_llamacpp --quick --no-save     # smoke test
"""
import time

_START_WALL = time.time()  # before anything else: a worker's "process start to ready" starts at the spawn

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

PROMPT_TEXT = ("Here are my notes from a trip to the mountains. We left early in the morning, drove for three "
               "hours, hiked up to a lake above the tree line, ate lunch by the water, saw two marmots and an eagle, "
               "and came back down before the afternoon storm. Write a short story based on these notes.")
GREEDY_CHECK_LEN = 32
SERVER_FINDING = ("llama-cpp-python 0.3.x has no parallel slots: Llama decodes one sequence, and llama_cpp.server "
                  "holds llama_outer_lock/llama_inner_lock for a whole request, so it serves one request at a time; "
                  "llama.cpp is measured at batch 1 only")
SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")
TARGETS = {"batch1_ratio_min": 0.6, "concurrent_over_llamacpp_batch1_min": 2.0, "startup_s_max": 5.0}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = _parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker[0]).read_text())
        Path(args.worker[1]).write_text(json.dumps(_WORKERS[spec["engine"]](spec)))
        return None
    from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
    from pagellm.loader import default_model_path, resolve_model
    from pagellm.tokenizer.tokenizer import load_tokenizer

    metadata = run_metadata()
    model = args.model or default_model_path()
    tokenizer = load_tokenizer(resolve_model(model))
    chat = lambda text: tokenizer.apply_chat_template([{"role": "user", "content": text}])  # noqa: E731
    single_text = chat(PROMPT_TEXT)
    concurrent = [tokenizer.encode(chat(f"Request {i}. {PROMPT_TEXT}")) for i in range(args.concurrency)]
    spec = {"model": model, "threads": args.threads or metadata["hardware"]["torch_threads"],
            "prompt_text": single_text, "prompt_ids": tokenizer.encode(single_text), "concurrent_ids": concurrent,
            "output_len": args.output_len, "repeats": args.repeats, "greedy_len": min(GREEDY_CHECK_LEN, args.output_len),
            "kv_cache_bytes": None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30))}
    # One context length for both: llama.cpp's n_ctx, pagellm's max_model_len.
    needed = max(len(p) for p in [spec["prompt_ids"], *concurrent]) + args.output_len + 1
    spec["context_len"] = max(512, -(-needed // 256) * 256)

    results = {"llama.cpp": _spawn({**spec, "engine": "llama.cpp"})}
    for variant in args.pagellm_variants.split(","):
        results[f"pagellm[{variant}]"] = _spawn({**spec, "engine": "pagellm", "variant": variant})
    ref = results["llama.cpp"]
    for name, res in results.items():
        if name.startswith("pagellm") and "greedy_ids" in res and "greedy_ids" in ref:
            res["greedy_common_prefix_with_llamacpp"] = _common_prefix(res["greedy_ids"], ref["greedy_ids"])
    targets = _targets(results)

    payload = {"benchmark": "cpu_vs_llamacpp", **metadata,
               "parameters": {**{k: v for k, v in spec.items() if k not in ("concurrent_ids", "prompt_text")},
                              "concurrency": args.concurrency, "prompt_len": len(spec["prompt_ids"]),
                              "concurrent_prompt_lens": [len(p) for p in concurrent], "greedy": True,
                              "ignore_eos": True, "pagellm_prefix_caching": False, "quick": args.quick},
               "llamacpp_concurrency_note": SERVER_FINDING,
               "llamacpp_server_modules_missing": [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None],
               "results": results, "targets": targets}
    print(format_table(["metric", *results, *(f"{n}/llama.cpp" for n in results if n != "llama.cpp")],
                       _table_rows(results), left={0}))
    for name, checks in targets.items():
        print(f"{name}: " + ", ".join(f"{k} {'PASS' if c['pass'] else 'FAIL'}" for k, c in checks.items()))
    for name, res in results.items():
        for key in ("error",):
            if res.get(key):
                print(f"{name}: {res[key]}")
    if not args.no_save:
        print("wrote", write_json(payload, default_result_path("cpu_vs_llamacpp")))
    return payload


def _spawn(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one engine's measurements in a fresh interpreter; its result, or the error it died of."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps({**spec, "spawn_wall": time.time()}))
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), str(out_path)],
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not out_path.exists():
            return {"error": f"worker exited {proc.returncode}: {proc.stderr[-2000:]}"}
        return json.loads(out_path.read_text())


def _run_pagellm(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch
    torch.set_num_threads(spec["threads"])
    from pagellm import LLM, SamplingParams
    t1 = time.perf_counter()
    # "auto": pagellm's default for the device (GGUF blocks kept quantized on a CPU where the kernels build).
    kwargs: dict[str, Any] = {"seed": 0, "enable_prefix_caching": False, "max_model_len": spec["context_len"],
                              "quantization": None if spec["variant"] == "auto" else spec["variant"]}
    if spec["kv_cache_bytes"] is not None:
        kwargs["kv_cache_memory_bytes"] = spec["kv_cache_bytes"]
    llm = LLM(spec["model"], **kwargs)
    ready = time.time()
    startup = _startup(spec, t1 - t0, time.perf_counter() - t1, ready)
    engine = llm.llm_engine
    info = {"variant": spec["variant"], "quantization": engine.config.model.quantization,
            "attention_backend": engine.config.model.attention_backend, "dtype": str(engine.config.model.dtype), "threads": torch.get_num_threads(),
            "kv_cache_tokens": getattr(engine.engine_core, "num_blocks", 0) * engine.config.cache.block_size}

    def generate(prompts: list[list[int]], n: int) -> tuple[list, float]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return outs, time.perf_counter() - start

    def batch1() -> tuple[float, float]:
        (out,), _ = generate([spec["prompt_ids"]], spec["output_len"])
        m = out.metrics
        return m["first_token_time"] - m["arrival_time"], (spec["output_len"] - 1) / (m["finished_time"] - m["first_token_time"])

    (greedy,), _ = generate([spec["prompt_ids"]], spec["greedy_len"])  # also the warm-up
    rss_first = _rss_mib()
    res = _batch1_summary([batch1() for _ in range(spec["repeats"])])
    generate(spec["concurrent_ids"], 2)  # warm-up at the concurrent batch size
    rates = []
    for _ in range(spec["repeats"]):
        outs, elapsed = generate(spec["concurrent_ids"], spec["output_len"])
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    return {**info, **startup, **res, "concurrent_tok_s_runs": rates, "concurrent_tok_s": statistics.median(rates),
            "rss_mib_after_first_tokens": rss_first, "rss_mib_end": _rss_mib(),
            "greedy_ids": list(greedy.outputs[0].token_ids)}


def _run_llamacpp(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install 'pagellm[bench-cpu]' "
                 "(it compiles llama.cpp from source: about 11 minutes on 2 cores)")
    t1 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=spec["context_len"], n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], seed=0, verbose=False)
    ready = time.time()
    startup = _startup(spec, t1 - t0, time.perf_counter() - t1, ready)
    own_ids = llm.tokenize(spec["prompt_text"].encode(), add_bos=True, special=True)

    def generate(n: int) -> tuple[list[int], list[float], float]:
        llm.reset()  # no reuse of the previous run's prompt KV
        tokens, times = [], []
        start = time.perf_counter()
        gen = llm.generate(spec["prompt_ids"], temp=0.0, repeat_penalty=1.0)
        for token in gen:  # the iterator never stops at EOS itself: take exactly n tokens
            tokens.append(token)
            times.append(time.perf_counter())
            if len(tokens) == n:
                break
        gen.close()
        return tokens, times, start

    def batch1() -> tuple[float, float]:
        _, times, start = generate(spec["output_len"])
        return times[0] - start, (spec["output_len"] - 1) / (times[-1] - times[0])

    greedy, _, _ = generate(spec["greedy_len"])  # also the warm-up
    rss_first = _rss_mib()
    res = _batch1_summary([batch1() for _ in range(spec["repeats"])])
    return {"version": llama_cpp.__version__, "threads": spec["threads"], "use_mmap": True,
            **startup, **res, "concurrent_tok_s": None, "rss_mib_after_first_tokens": rss_first,
            "rss_mib_end": _rss_mib(), "greedy_ids": greedy,
            "tokenization_agrees_with_pagellm": list(own_ids) == spec["prompt_ids"]}


_WORKERS = {"pagellm": _run_pagellm, "llama.cpp": _run_llamacpp}


def _startup(spec: dict[str, Any], import_s: float, construct_s: float, ready_wall: float) -> dict[str, float]:
    return {"import_s": import_s, "construct_s": construct_s,
            "interpreter_start_s": _START_WALL - spec["spawn_wall"],
            "process_start_to_ready_s": ready_wall - spec["spawn_wall"], "rss_mib_after_load": _rss_mib()}


def _batch1_summary(runs: list[tuple[float, float]]) -> dict[str, Any]:
    ttft, rate = zip(*runs)
    return {"ttft_s_runs": list(ttft), "ttft_s": statistics.median(ttft),
            "batch1_tok_s_runs": list(rate), "batch1_tok_s": statistics.median(rate)}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _targets(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pass/fail per measured pagellm variant; RSS is compared with the dequantized variant (none)."""
    ref, none = results["llama.cpp"], results.get("pagellm[none]", {})
    out = {}
    for name, res in results.items():
        if name == "llama.cpp" or "batch1_tok_s" not in res:
            continue
        checks: dict[str, Any] = {"startup_s": {"value": res["process_start_to_ready_s"], "max": TARGETS["startup_s_max"]}}
        if "batch1_tok_s" in ref:
            checks["batch1_vs_llamacpp"] = {"value": res["batch1_tok_s"] / ref["batch1_tok_s"], "min": TARGETS["batch1_ratio_min"]}
            checks["concurrent_vs_llamacpp_batch1"] = {"value": res["concurrent_tok_s"] / ref["batch1_tok_s"],
                                                        "min": TARGETS["concurrent_over_llamacpp_batch1_min"]}
        if name != "pagellm[none]" and "rss_mib_after_first_tokens" in none:
            checks["rss_vs_dequantized"] = {"value": res["rss_mib_after_first_tokens"],
                                            "max": none["rss_mib_after_first_tokens"]}
        for c in checks.values():
            c["pass"] = c["value"] >= c["min"] if "min" in c else c["value"] <= c["max"]
        out[name] = checks
    return out


_ROWS = [("batch-1 decode tok/s", "batch1_tok_s", 1), ("TTFT ms (batch 1)", "ttft_s", 1e3),
         ("concurrent total tok/s (ratio: vs llama.cpp batch 1)", "concurrent_tok_s", 1),
         ("import s", "import_s", 1), ("LLM()/Llama() s", "construct_s", 1),
         ("process start to ready s", "process_start_to_ready_s", 1),
         ("peak RSS MiB after load", "rss_mib_after_load", 1),
         ("peak RSS MiB after first tokens", "rss_mib_after_first_tokens", 1), ("peak RSS MiB at end", "rss_mib_end", 1),
         ("greedy common prefix tokens", "greedy_common_prefix_with_llamacpp", 1)]


def _table_rows(results: dict[str, dict[str, Any]]) -> list[list[Any]]:
    ref = results["llama.cpp"]
    rows = []
    for label, key, scale in _ROWS:
        values = [res.get(key) for res in results.values()]
        row: list[Any] = [label, *("-" if v is None else float(v * scale) for v in values)]
        ref_value = ref.get("batch1_tok_s" if key == "concurrent_tok_s" else key)
        for name, value in zip(results, values):
            if name != "llama.cpp":
                ok = value is not None and ref_value and key != "greedy_common_prefix_with_llamacpp"
                row.append(float(value / ref_value) if ok else "-")
        rows.append(row)
    return rows


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file; default: the embedded SmolLM2-135M-Instruct Q4_1")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="both engines; default: torch's thread count")
    parser.add_argument("--pagellm-variants", default="auto,none", help="comma-separated LLM(quantization=...) values")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="pagellm's KV cache; default: pagellm's default")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.output_len, args.concurrency, args.repeats = min(args.output_len, 8), min(args.concurrency, 2), 1
    return args


if __name__ == "__main__":
    main()
