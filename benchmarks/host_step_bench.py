"""Host time of one decode step without the model: what async scheduling must hide under the GPU's step.

For each batch size, that many requests with `--context-len`-token prompts are admitted and
prefilled (untimed); then each timed decode step runs what the host does around the forward:
`Scheduler.schedule`, the worker's `RequestStates.update` and `build` (flat batch, block table,
slot mapping, copies to the device), the logits processors and sampling metadata, and `Scheduler.update_from_output` with
one sampled token per request. Greedy requests with ignore_eos, as in `pagellm bench throughput`.

    .venv/bin/python -m benchmarks.host_step_bench --batch-sizes 1 64 256 384
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.core.outputs import ModelRunnerOutput
from pagellm.core.request import Request
from pagellm.core.scheduler import Scheduler, SchedulerLimits
from pagellm.sample.logits_processors import LogitsProcessors
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sampling_params import SamplingParams
from pagellm.worker.batch import RequestStates

BLOCK_SIZE = 16
VOCAB = 128256


def host_step_ms(batch: int, context_len: int, steps: int, device: torch.device) -> list[float]:
    """Per decode step, milliseconds of host work at `batch` running requests."""
    # Room for the timed steps plus the tokens early requests decode while later ones prefill.
    max_model_len = context_len + 2 * steps + batch
    blocks = batch * (-(-max_model_len // BLOCK_SIZE)) + 1
    scheduler = Scheduler(SchedulerLimits(max_num_batched_tokens=max(8192, batch), max_num_seqs=batch,
                                          max_model_len=max_model_len, block_size=BLOCK_SIZE, num_blocks=blocks,
                                          enable_prefix_caching=True))
    states = RequestStates(BLOCK_SIZE, device)
    max_tokens = max_model_len - context_len
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [(i * 7919 + j) % (VOCAB - 1) + 1 for j in range(context_len)]
        scheduler.add_request(Request(f"r{i}", prompt, params, frozenset({0}), max_tokens=max_tokens))

    def step() -> int:
        so = scheduler.schedule()
        states.update(so)
        flat = states.build(so)
        rows = [states.states[r] for r in flat.sampling_req_ids]
        row_params = [s.sampling_params for s in rows]
        processors = LogitsProcessors.build(row_params, [s.token_ids for s in rows], [s.num_prompt_tokens for s in rows],
                                            [s.eos_token_ids for s in rows], VOCAB, device)
        SamplingMetadata.build(row_params, flat.num_generated, VOCAB, device, None, processors)
        sampled = [[1] for _ in flat.sampling_req_ids]
        states.append_sampled(flat.sampling_req_ids, sampled)
        scheduler.update_from_output(ModelRunnerOutput(flat.sampling_req_ids, sampled))
        return so.total_num_scheduled_tokens

    while scheduler.waiting or any(r.num_tokens == r.num_prompt_tokens for r in scheduler.running):
        step()  # prefill until every request has its first token, untimed
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        num_tokens = step()
        times.append((time.perf_counter() - start) * 1e3)
        if num_tokens != batch:
            raise RuntimeError(f"a timed step scheduled {num_tokens} tokens, not one per request ({batch})")
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256, 384])
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--device", default="cpu", help="where the step's input tensors go")
    p.add_argument("--output", default=None, help="JSON path; default: benchmarks/results/host_step_<UTC time>.json")
    args = p.parse_args()
    device = torch.device(args.device)
    rows, results = [], []
    for batch in args.batch_sizes:
        times = host_step_ms(batch, args.context_len, args.steps, device)
        median = statistics.median(times)
        results.append({"batch": batch, "median_ms": median, "p90_ms": sorted(times)[int(0.9 * len(times))],
                        "us_per_request": median * 1e3 / batch})
        rows.append([batch, f"{median:.2f}", f"{results[-1]['p90_ms']:.2f}", f"{median * 1e3 / batch:.1f}"])
    payload = {"benchmark": "host_step", **run_metadata(), "parameters": vars(args), "results": results}
    print(format_table(["batch", "host ms / step (median)", "p90", "us per request"], rows))
    print("wrote", write_json(payload, args.output or default_result_path("host_step")))


if __name__ == "__main__":
    main()
