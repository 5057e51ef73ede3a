"""Host time of one decode step, the whole engine path but the model: what async scheduling must hide.

The real `LLMEngine` (scheduler, worker batch, sampling, token update, output processing) runs a
tiny dummy Llama whose forward is replaced by a stub that returns zero hidden states, so what is
timed is the Python and numpy around the forward, on this machine's CPU. For each batch size,
that many greedy requests (ignore_eos) of `--context-len` tokens are prefilled (untimed); each
timed step is one `LLMEngine.step()` with every request decoding, split into phases:
`schedule`, `launch_step` (worker batch and sampling, the stub forward excluded),
`update_from_output` and `process_outputs`.

    .venv/bin/python -m benchmarks.host_step_bench --batch-sizes 1 64 256 512
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from pagellm import LLM, SamplingParams
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json

VOCAB = 512
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": VOCAB,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
PHASES = ("schedule", "launch_step", "update_from_output", "process_outputs")


class PhaseClock:
    """Accumulates the wall time of wrapped calls by phase name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
        return timed


def stub_engine(max_num_seqs: int, max_model_len: int) -> tuple[LLM, PhaseClock]:
    """The engine around a tiny model whose forward returns zeros, its phases on a clock (the
    stub's own time is counted as `forward` and left out of `launch_step`)."""
    folder = Path(tempfile.mkdtemp(prefix="host-step-"))
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    llm = LLM(str(folder), load_format="dummy", device="cpu", dtype="float32", max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=max(8192, max_num_seqs),
              kv_cache_memory_bytes=256 << 20)
    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.executor.worker.runner
    clock = PhaseClock()

    def stub_forward(input_ids, positions, md, *rest):
        return torch.zeros((md.num_tokens, TINY_LLAMA["hidden_size"]))

    runner._run_stage = clock.wrap("forward", stub_forward)
    runner.model.compute_logits = clock.wrap("forward", runner.model.compute_logits)
    core.scheduler.schedule = clock.wrap("schedule", core.scheduler.schedule)
    core.scheduler.update_from_output = clock.wrap("update_from_output", core.scheduler.update_from_output)
    engine.output_processor.process = clock.wrap("process_outputs", engine.output_processor.process)
    runner.launch_step = clock.wrap("launch_step", runner.launch_step)
    return llm, clock


def host_step_ms(llm: LLM, clock: PhaseClock, batch: int, context_len: int, steps: int) -> dict[str, float]:
    """Median milliseconds per decode step of `batch` requests: the whole step and each phase."""
    engine = llm.llm_engine
    # Room for the tokens early requests decode while later ones prefill, then for the timed steps.
    max_tokens = engine.config.model.max_model_len - context_len
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [(i * 7919 + j) % (VOCAB - 3) + 3 for j in range(context_len)]
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": prompt}, params)
    scheduler = engine.engine_core.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()  # prefill until every request has its first token, untimed
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        clock.seconds.clear()
        before = sum(r.num_output_tokens for r in scheduler.running)
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        if sum(r.num_output_tokens for r in scheduler.running) - before != batch:
            raise RuntimeError(f"a timed step did not decode one token for each of the {batch} requests")
        forward = clock.seconds["forward"]
        samples["step"].append((wall - forward) * 1e3)
        samples["launch_step"].append((clock.seconds["launch_step"] - forward) * 1e3)
        for name in PHASES[:1] + PHASES[2:]:
            samples[name].append(clock.seconds[name] * 1e3)
    engine.abort_request([f"b{batch}-{i}" for i in range(batch)])
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256, 512])
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--output", default=None, help="JSON path; default: benchmarks/results/host_step_<UTC time>.json")
    args = p.parse_args()
    prefill_steps = max(args.batch_sizes) * args.context_len // 8192 + 2
    llm, clock = stub_engine(max(args.batch_sizes), args.context_len + args.steps + prefill_steps)
    rows, results = [], []
    for batch in args.batch_sizes:
        host_step_ms(llm, clock, batch, args.context_len, 5)  # warm-up
        found = host_step_ms(llm, clock, batch, args.context_len, args.steps)
        results.append({"batch": batch, "step_ms": found["step"], "us_per_request": found["step"] * 1e3 / batch,
                        "phase_ms": {name: found[name] for name in PHASES}})
        rows.append([batch, f"{found['step']:.3f}", f"{found['step'] * 1e3 / batch:.1f}",
                     *(f"{found[name]:.3f}" for name in PHASES)])
    payload = {"benchmark": "host_step", **run_metadata(), "parameters": vars(args), "results": results}
    print(format_table(["batch", "host ms / step", "us / request", *(f"{name} ms" for name in PHASES)], rows))
    print("wrote", write_json(payload, args.output or default_result_path("host_step")))


if __name__ == "__main__":
    main()
