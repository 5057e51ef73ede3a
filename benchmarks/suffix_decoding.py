"""Suffix decoding on the CPU: a repeated-task workload (one agent-style prompt template, varying
inputs, requests one after another), plain decoding, n-gram prompt lookup and suffix decoding side
by side.

Each of --requests requests asks, with the same template, for the fields of a different short
text as JSON (a tool call); greedy, batch 1. Each request runs on every engine in turn (so that a
busy host slows all alike): plain, n-gram, and suffix decoding with each suffix_decoding_min_token_prob
of --suffix-min-probs, whose global trees learn from the outputs of the requests before. Reported
per engine: decode tokens/s (the tokens after the first, over the time after the first: what
speculation speeds up) and end-to-end tokens/s, over all requests and over the second half (more
outputs cached), the speed-ups over plain decoding, acceptance rate, tokens per step, the
proposer's host time per call, and whether every greedy text is identical to plain decoding's (it
must be).

    .venv/bin/python -m benchmarks.suffix_decoding
    .venv/bin/python -m benchmarks.suffix_decoding --requests 4 --no-save     # smoke test
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json  # noqa: E402

TEMPLATE = ("You are an agent that files contacts. Read the text and call the tool add_contact by answering with "
            "this JSON, filled in, and nothing else:\n"
            '{{"tool": "add_contact", "arguments": {{"name": "...", "city": "...", "age": ..., "job": "..."}}}}'
            "\n\nText: {text}\nJSON:")
FIRST_NAMES = ["Maria", "Tom", "Aiko", "Samuel", "Lena", "Omar", "Julia", "Pavel", "Grace", "Daniel"]
LAST_NAMES = ["Lopez", "Becker", "Tanaka", "Okafor", "Fischer", "Haddad", "Rossi", "Novak", "Kim", "Moreau"]
CITIES = ["Lisbon", "Hamburg", "Osaka", "Lagos", "Vienna", "Cairo", "Turin", "Prague", "Seoul", "Lyon"]
JOBS = ["nurse", "carpenter", "teacher", "software engineer", "baker", "pilot", "architect", "journalist",
        "pharmacist", "electrician"]
SENTENCES = ["{name} is a {age}-year-old {job} who lives in {city}.",
             "Born {age} years ago, {name} now works as a {job} in {city}.",
             "In {city}, {name} ({age}) has been a {job} for many years.",
             "{name}, {age}, moved to {city} last spring to work as a {job}."]


def texts(count: int) -> list[str]:
    """`count` inputs (up to 100), each about a different person; cities, jobs and sentence shapes
    recur, as they would in real traffic."""
    if count > len(FIRST_NAMES) * len(LAST_NAMES):
        raise ValueError(f"--requests must be <= {len(FIRST_NAMES) * len(LAST_NAMES)}")
    return [SENTENCES[i % 4].format(name=f"{FIRST_NAMES[i % 10]} {LAST_NAMES[(i + i // 10) % 10]}",
                                    city=CITIES[(i * 3 + i // 10) % 10], job=JOBS[(i * 7 + i // 10) % 10],
                                    age=23 + (i * 13) % 40)
            for i in range(count)]


class TimedProposer:
    """Wraps a scheduler's proposer to add up the host time of its calls."""

    def __init__(self, proposer) -> None:
        self.proposer, self.calls, self.seconds = proposer, 0, 0.0

    def propose(self, *args, **kwargs) -> list[int]:
        start = time.perf_counter()
        try:
            return self.proposer.propose(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def forget(self, req_id: str) -> None:
        start = time.perf_counter()
        self.proposer.forget(req_id)
        self.seconds += time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engines = {"plain": None,
               f"ngram k={args.ngram_k}": {"method": "ngram", "num_speculative_tokens": args.ngram_k},
               **{f"suffix k={args.suffix_k} p={p}": {"method": "suffix", "num_speculative_tokens": args.suffix_k,
                                                      "suffix_decoding_min_token_prob": p}
                  for p in args.suffix_min_probs}}
    llms = {name: LLM(args.model, dtype=args.dtype, max_model_len=2048, speculative_config=spec)
            for name, spec in engines.items()}
    timers = {}
    for name, llm in llms.items():
        scheduler = llm.llm_engine.engine_core.scheduler
        if scheduler.proposer is not None:
            timers[name] = scheduler.proposer = TimedProposer(scheduler.proposer)
        llm.chat([[{"role": "user", "content": "Say hello."}]], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)  # warm-up: kernels and buffers
    inputs = texts(args.requests)
    per_request: dict[str, list[dict[str, Any]]] = {name: [] for name in llms}
    for text in inputs:
        conversation = [[{"role": "user", "content": TEMPLATE.format(text=text)}]]
        for name, llm in llms.items():
            before = _spec_totals(llm)
            start = time.perf_counter()
            result = llm.chat(conversation, params, use_tqdm=False)[0]
            elapsed = time.perf_counter() - start
            out, after = result.outputs[0], _spec_totals(llm)
            per_request[name].append({"seconds": elapsed, "output_tokens": len(out.token_ids), "text": out.text,
                                      "decode_seconds": result.metrics["finished_time"] - result.metrics[
                                          "first_token_time"], **{k: after[k] - before[k] for k in after}})
    half = len(inputs) // 2
    results = {}
    for name, runs in per_request.items():
        results[name] = {**_summary(runs), "second_half": _summary(runs[half:]),
                         "identical_text": all(r["text"] == p["text"] for r, p in zip(runs, per_request["plain"]))}
        if name in timers:
            timer = timers[name]
            results[name]["proposer_us_per_call"] = 1e6 * timer.seconds / max(timer.calls, 1)
            results[name]["proposer_share_of_time"] = timer.seconds / sum(r["seconds"] for r in runs)
    plain = results["plain"]
    for r in results.values():
        for summary, base in ((r, plain), (r["second_half"], plain["second_half"])):
            summary["speedup"] = summary["tok_s"] / base["tok_s"]
            summary["decode_speedup"] = summary["decode_tok_s"] / base["decode_tok_s"]
    command = " ".join(["python -m benchmarks.suffix_decoding", *(sys.argv[1:] if argv is None else argv)])
    payload = {**run_metadata(), "benchmark": "suffix_decoding", "command": command,
               "parameters": vars(args), "template": TEMPLATE, "inputs": inputs, "results": results,
               "outputs": {name: [r["text"] for r in runs] for name, runs in per_request.items()}}
    rows = [[name, r["decode_tok_s"], r["decode_speedup"], r["tok_s"], r["speedup"],
             r["second_half"]["decode_speedup"], r.get("acceptance_rate", "-"), r.get("tokens_per_step", "-"),
             r.get("proposer_us_per_call", "-"), r["output_tokens"], "yes" if r["identical_text"] else "NO"]
            for name, r in results.items()]
    print(format_table(["engine", "decode tok/s", "speed-up", "end-to-end tok/s", "speed-up",
                        "decode speed-up (2nd half)", "acceptance", "tokens/step", "proposer us/call", "tokens",
                        "same text"], rows, left=(0,)))
    if not args.no_save:
        print(f"wrote {write_json(payload, default_result_path('suffix_decoding_cpu'))}")
    if not all(r["identical_text"] for r in results.values()):
        raise SystemExit("greedy text differs from plain decoding's")
    return payload


def _spec_totals(llm: LLM) -> dict[str, int]:
    spec = llm.llm_engine.engine_core.scheduler.spec_stats
    if spec is None:
        return {}
    return {"draft_tokens": spec.num_draft_tokens, "accepted_tokens": spec.num_accepted_tokens}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["output_tokens"] for r in runs)
    summary: dict[str, Any] = {"tok_s": tokens / sum(r["seconds"] for r in runs), "output_tokens": tokens,
                               "requests": len(runs),
                               # what speculation speeds up: the tokens after the first, after the first
                               "decode_tok_s": (tokens - len(runs)) / sum(r["decode_seconds"] for r in runs)}
    drafts = sum(r.get("draft_tokens", 0) for r in runs)
    if drafts:
        accepted = sum(r["accepted_tokens"] for r in runs)
        # Every step that samples gives one token, plus its accepted drafts.
        summary.update(acceptance_rate=accepted / drafts, tokens_per_step=tokens / (tokens - accepted))
    return summary


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--ngram-k", type=int, default=5)
    parser.add_argument("--suffix-k", type=int, default=8)
    parser.add_argument("--suffix-min-probs", type=lambda s: [float(p) for p in s.split(",")], default=[0.1, 0.3],
                        help="suffix_decoding_min_token_prob of each suffix engine (0.1: vLLM's default)")
    parser.add_argument("--dtype", default="float32",
                        help="activations; float32 keeps verification's several rows bit-identical to one-row decoding")
    parser.add_argument("--no-save", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
