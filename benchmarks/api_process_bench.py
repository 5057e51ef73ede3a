"""Capacity of the server's API process: output tokens per second it turns into streamed SSE events.

Per engine step the API process decodes the core's message (msgpack), detokenizes each request's
new tokens, assembles DELTA `RequestOutput`s, hands them to the requests' mailboxes, and each
stream encodes a `/v1/completions` chunk. This runs that path for `--streams` concurrent requests
on this machine's CPU without an engine (synthetic steps of one token per stream, English text
through SmolLM2's tokenizer) and reports microseconds and tokens per second of one core.
`--behind K` reads K engine steps at a time, as the output loop does when it has fallen behind
(`merge_step_outputs`): its per-request work is then done once for K tokens.

    .venv/bin/python -m benchmarks.api_process_bench --streams 256 --steps 64 --behind 1 2 4
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from importlib import resources
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.core.outputs import EngineCoreOutput, SchedulerStats, merge_step_outputs
from pagellm.core.request import EngineCoreRequest
from pagellm.engine.mailbox import OutputMailbox
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.wire import CoreOutputs, encoder, output_decoder
from pagellm.entrypoints.openai.protocol import CompletionChoice, CompletionResponse
from pagellm.loader import default_model_path, resolve_model
from pagellm.metrics.stats import IterationStats
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.tokenizer import load_tokenizer


async def run(streams: int, steps: int, behind: int) -> dict[str, float]:
    """Seconds of API-process work for `streams` x `steps` tokens, read `behind` steps at a time."""
    tokenizer = load_tokenizer(resolve_model(default_model_path()))
    text_ids = tokenizer.encode(resources.files("pagellm.eval").joinpath("sample.txt").read_text(encoding="utf-8"))
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    mailboxes = {}
    for i in range(streams):
        record = EngineCoreRequest(request_id=f"s{i}", prompt_token_ids=text_ids[:16], sampling_params=params,
                                   eos_token_ids=frozenset(), max_tokens=steps)
        processor.add_request(record, None)
        mailboxes[record.request_id] = OutputMailbox(coalesce=True)
    # What the core sends, made up front: one message per step.
    messages = []
    for step in range(steps):
        finish = "length" if step == steps - 1 else None
        outputs = [EngineCoreOutput(f"s{i}", [text_ids[(37 * i + step) % len(text_ids)]], finish)
                   for i in range(streams)]
        messages.append(encoder.encode(CoreOutputs(outputs, SchedulerStats())))
    events = 0
    start = time.perf_counter()
    for first in range(0, steps, behind):
        decoded = [output_decoder.decode(m) for m in messages[first:first + behind]]
        merged = merge_step_outputs([m.outputs for m in decoded])
        for out in processor.process(merged, IterationStats()).request_outputs:
            mailboxes[out.request_id].put(out)
        for req_id, mailbox in mailboxes.items():  # each stream's consumer takes what is waiting
            out = await mailbox.get()
            o = out.outputs[0]
            chunk = CompletionResponse(id=req_id, created=0, model="bench", choices=[CompletionChoice(
                index=0, text=o.text, logprobs=None, finish_reason=o.finish_reason, stop_reason=o.stop_reason)])
            events += len(f"data: {chunk.model_dump_json()}\n\n") > 0
    seconds = time.perf_counter() - start
    tokens = streams * steps
    return {"seconds": seconds, "tokens": tokens, "events": events, "us_per_token": seconds / tokens * 1e6,
            "tokens_per_s": tokens / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--behind", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--output", default=None, help="JSON path; default benchmarks/results/api_process_<UTC time>.json")
    args = p.parse_args()
    results, rows = [], []
    asyncio.run(run(args.streams, 8, 1))  # warm-up: first-use costs (pydantic, the tokenizer) left out
    for behind in args.behind:
        found = asyncio.run(run(args.streams, args.steps, behind))
        results.append({"behind": behind, **found})
        rows.append([behind, found["events"], f"{found['us_per_token']:.1f}", f"{found['tokens_per_s']:,.0f}"])
    print(format_table(["steps read at once", "SSE events", "us per token", "tokens/s (one core)"], rows))
    payload = {"benchmark": "api_process", **run_metadata(), "parameters": vars(args), "results": results}
    print("wrote", write_json(payload, args.output or default_result_path("api_process")))


if __name__ == "__main__":
    main()
