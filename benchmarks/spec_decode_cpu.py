"""Speculative decoding on the CPU: batch-1 output tokens/s with and without it, in one run, on
input-grounded tasks (rewrite, extract, edit code), where the answer repeats its input.

Each task is one chat request, greedy, run alone (batch 1) by an engine without speculation, by one
with `{"method": "ngram", "num_speculative_tokens": k}` for each k of --ks, and by one with
`{"model": DRAFT, "num_speculative_tokens": k}` for each k of --draft-ks (DRAFT: --draft-model,
by default the target itself, whose acceptance is the upper bound), alternating, median of
--repeats. Reported: decode tok/s (output tokens after the first, over the time after the first
token: what speculation speeds up) and end-to-end tok/s (all output tokens over the whole request,
prompt included), the speed-ups, the acceptance rate (accepted / proposed draft tokens), mean
tokens per step, and whether the greedy text is identical (it must be).

    .venv/bin/python -m benchmarks.spec_decode_cpu
    .venv/bin/python -m benchmarks.spec_decode_cpu --quick --no-save     # smoke test
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json  # noqa: E402
from pagellm.loader import default_model_path  # noqa: E402

PARAGRAPH = ("Our team met on Tuesday to discuss the new release. We agreed that the login page needs a "
             "clearer error message, that the export button should also offer CSV files, and that the "
             "nightly backup must finish before six in the morning. Maria will update the documentation, "
             "and Tom will talk to the support team about the most common questions from customers.")
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total + total * tax_rate
    return total


def cheapest_item(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
TASKS = {
    "rewrite": f"Rewrite the following text in the past tense, changing nothing else:\n\n{PARAGRAPH}",
    "fix spelling": ("Correct the spelling mistakes in this text and return the corrected text only:\n\n"
                     + PARAGRAPH.replace("release", "relase").replace("clearer", "clearrer")
                     .replace("documentation", "documantation").replace("customers", "custommers")),
    "extract": f"Copy every sentence of this text that mentions a person, word for word, one per line:\n\n{PARAGRAPH}",
    "code edit": f"Rename the function total_price to order_total in this code and return the whole code:\n\n{CODE}",
    "code edit (type hints)": f"Add type hints to every function in this Python code and return the whole code:\n\n{CODE}",
}
"""SmolLM2-135M does not do the rename (it comments on the code instead); asked for type hints, it
rewrites the first function and copies the second."""


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = _parse_args(argv)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engines = {"plain": None, **{f"ngram k={k}": {"method": "ngram", "num_speculative_tokens": k,
                                                  "prompt_lookup_min": args.lookup_min,
                                                  "prompt_lookup_max": args.lookup_max} for k in args.ks},
               **{f"draft k={k}": {"model": args.draft_model or args.model or default_model_path(),
                                   "num_speculative_tokens": k} for k in args.draft_ks}}
    llms = {name: LLM(args.model, max_model_len=2048, speculative_config=spec) for name, spec in engines.items()}
    results: dict[str, dict[str, Any]] = {}
    for task, text in TASKS.items():
        conversation = [[{"role": "user", "content": text}]]
        runs: dict[str, list[float]] = {name: [] for name in llms}
        decode_runs: dict[str, list[float]] = {name: [] for name in llms}
        texts, stats = {}, {}
        for name, llm in llms.items():  # warm-up: kernels, caches, and the prompt's prefix-cache entry
            llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        for _ in range(args.repeats):
            for name, llm in llms.items():
                scheduler = llm.llm_engine.engine_core.scheduler
                before = _spec_totals(scheduler)
                start = time.perf_counter()
                result = llm.chat(conversation, params, use_tqdm=False)[0]
                out = result.outputs[0]
                elapsed = time.perf_counter() - start
                runs[name].append(len(out.token_ids) / elapsed)
                m = result.metrics
                decode_runs[name].append((len(out.token_ids) - 1) / (m["finished_time"] - m["first_token_time"]))
                texts[name] = out.text
                after = _spec_totals(scheduler)
                stats[name] = {"output_tokens": len(out.token_ids),
                               **{k: after[k] - before[k] for k in after}}
        plain = statistics.median(runs["plain"])
        plain_decode = statistics.median(decode_runs["plain"])
        results[task] = {name: {"tok_s_runs": r, "tok_s": statistics.median(r),
                                "speedup": statistics.median(r) / plain,
                                "decode_tok_s_runs": decode_runs[name],
                                "decode_tok_s": statistics.median(decode_runs[name]),
                                "decode_speedup": statistics.median(decode_runs[name]) / plain_decode,
                                "identical_text": texts[name] == texts["plain"], **stats[name],
                                **_rates(stats[name])} for name, r in runs.items()}
    payload = {**run_metadata(), "benchmark": "spec_decode_cpu", "parameters": vars(args), "tasks": TASKS,
               "results": results}
    rows = [[task, name, r["decode_tok_s"], r["decode_speedup"], r["tok_s"], r["speedup"],
             r.get("acceptance_rate", "-"), r.get("tokens_per_step", "-"), r["output_tokens"],
             "yes" if r["identical_text"] else "NO"]
            for task, by_engine in results.items() for name, r in by_engine.items()]
    print(format_table(["task", "engine", "decode tok/s", "speed-up", "end-to-end tok/s", "speed-up", "acceptance",
                        "tokens/step", "tokens", "same text"], rows, left=(0, 1)))
    if not args.no_save:
        print(f"wrote {write_json(payload, default_result_path('spec_decode_cpu'))}")
    return payload


def _spec_totals(scheduler) -> dict[str, int]:
    spec = scheduler.spec_stats
    if spec is None:
        return {}
    return {"draft_tokens": spec.num_draft_tokens, "accepted_tokens": spec.num_accepted_tokens,
            "verify_steps": spec.num_drafts}


def _rates(stats: dict[str, int]) -> dict[str, float]:
    if not stats.get("draft_tokens"):
        return {}
    # Every step that samples gives one token, plus its accepted drafts.
    return {"acceptance_rate": stats["accepted_tokens"] / stats["draft_tokens"],
            "tokens_per_step": stats["output_tokens"] / (stats["output_tokens"] - stats["accepted_tokens"])}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--ks", type=lambda s: [int(k) for k in s.split(",")], default=[3, 5],
                        help="comma-separated num_speculative_tokens values")
    parser.add_argument("--draft-ks", type=lambda s: [int(k) for k in s.split(",") if k], default=[3],
                        help="comma-separated num_speculative_tokens values of draft-model engines ('' for none)")
    parser.add_argument("--draft-model", default=None, help="the draft model; default: the target model itself")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens, args.repeats, args.ks, args.draft_ks = 16, 1, args.ks[:1], args.draft_ks[:1]
    return args


if __name__ == "__main__":
    main()
