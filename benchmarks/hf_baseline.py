"""The Hugging Face baseline: `model.generate` over static batches of exactly the benchmark's requests.

Each batch is left-padded with an attention mask and decoded greedily. HF's `generate` gives
every row of a batch the same number of new tokens, so a batch runs to its longest requested
`output_len` (with `min_new_tokens` set to it too, so EOS cannot end it early, which matches
pagellm's `ignore_eos`). Only the requested tokens count as output: rows of a batch with mixed
output lengths compute extra tokens that are reported separately (`generated_tokens`) and not
credited to HF's throughput. With equal output lengths, as in the offline CPU benchmark, the two
counts are the same. Works on CPU and CUDA.

`run_hf_largest_batch` gives HF its best static batching: requests sorted by length (less padding
and fewer wasted tokens per batch) and the largest batch that fits the GPU, found by halving the
batch size whenever a batch runs out of memory.
"""
from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagellm.benchmarks.datasets import BenchRequest
from pagellm.loader import ModelSource
from pagellm.loader.presets import get_preset


@dataclass(slots=True)
class HFRunResult:
    """Timing and token counts of one `run_hf_generate` call."""

    elapsed_s: float
    """Wall time of the batches that completed (each timed from building its tensors to its output);
    attempts that ran out of memory are not counted."""
    num_requests: int
    batch_size: int
    """The batch size every batch ran at (after any halving)."""
    output_tokens: int
    """Sum of the requested output lengths: the tokens credited to HF."""
    generated_tokens: int
    """Tokens HF actually produced, counting each batch's padding up to its longest output_len."""
    output_token_ids: list[list[int]]
    """Per request, in input order, the first `output_len` generated ids (for agreement checks)."""
    sorted_by_length: bool = False
    """Whether batches were formed from the requests sorted by (output_len, prompt length), longest first."""
    oom_batch_sizes: list[int] = field(default_factory=list)
    """Batch sizes that ran out of GPU memory before `batch_size` fitted."""

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def summary(self) -> dict:
        """The JSON-ready numbers (no token ids)."""
        return {"elapsed_s": self.elapsed_s, "num_requests": self.num_requests, "batch_size": self.batch_size,
                "output_tokens": self.output_tokens, "generated_tokens": self.generated_tokens,
                "output_tokens_per_s": self.output_tokens_per_s, "sorted_by_length": self.sorted_by_length,
                "oom_batch_sizes": self.oom_batch_sizes}


def load_hf_model(model_path: str, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, float]:
    """The Hugging Face causal LM for a `.gguf` file or a model directory, in eval mode, and its load seconds."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    if os.path.isfile(model_path):
        folder, name = os.path.split(os.path.abspath(model_path))
        # Loaded in float32 and cast: newer transformers keep a GGUF's weights packed for any
        # other dtype and dequantize them inside every matmul, which is not what is compared.
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model = model.to(device).eval()
    _synchronize(model)
    return model, time.perf_counter() - start


def load_hf_like(source: ModelSource, device: str | torch.device,
                 dtype: torch.dtype) -> tuple[torch.nn.Module, float]:
    """HF's model for what pagellm runs: random weights built on `device` for a dummy preset or a
    config-only folder (speed does not depend on the values), else the checkpoint itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if source.load_format != "dummy" or os.path.isfile(source.path):
        return load_hf_model(source.path, device, dtype)
    start = time.perf_counter()
    if os.path.isdir(source.path):
        config = AutoConfig.from_pretrained(source.path)
    else:
        preset, _ = get_preset(source.path)
        config = AutoConfig.for_model(preset.pop("model_type"), **preset)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    _synchronize(model)
    return model, time.perf_counter() - start


def run_hf_largest_batch(model: torch.nn.Module, requests: Sequence[BenchRequest],
                         max_batch_size: int) -> HFRunResult:
    """Greedy `generate` over `requests` sorted by length, in batches of at most `max_batch_size`,
    halved until a batch fits in GPU memory; see the module docstring."""
    return run_hf_generate(model, requests, min(max_batch_size, len(requests)), sort_by_length=True,
                           halve_on_oom=True)


def run_hf_generate(model: torch.nn.Module, requests: Sequence[BenchRequest], batch_size: int,
                    sort_by_length: bool = False, halve_on_oom: bool = False) -> HFRunResult:
    """Greedy `generate` over `requests`, `batch_size` at a time (in input order unless
    `sort_by_length`); with `halve_on_oom`, a batch that runs out of GPU memory is retried at half
    the size, which then holds for the rest of the run. See the module docstring."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    if not requests:
        raise ValueError("no requests to run")
    order = list(range(len(requests)))
    if sort_by_length:
        # Longest first: the batch most likely to run out of memory comes first, before time is spent.
        order.sort(key=lambda i: (requests[i].output_len, len(requests[i].prompt_token_ids)), reverse=True)
    pad_id = _pad_token_id(model)
    outputs: list[list[int] | None] = [None] * len(requests)
    generated, elapsed, ooms, first = 0, 0.0, [], 0
    while first < len(order):
        batch_ids = order[first:first + batch_size]
        try:
            seconds, new_ids = _generate_batch(model, [requests[i] for i in batch_ids], pad_id)
        except torch.cuda.OutOfMemoryError:
            if not halve_on_oom or batch_size == 1:
                raise
            new_ids = None
        if new_ids is None:
            # Out of the except block: its traceback no longer pins the failed batch's tensors.
            ooms.append(batch_size)
            batch_size //= 2
            gc.collect()
            torch.cuda.empty_cache()
            continue
        for i, row in zip(batch_ids, new_ids):
            outputs[i] = row[:requests[i].output_len]
        generated += len(new_ids[0]) * len(batch_ids)
        elapsed += seconds
        first += len(batch_ids)
    return HFRunResult(
        elapsed_s=elapsed,
        num_requests=len(requests),
        batch_size=batch_size,
        output_tokens=sum(r.output_len for r in requests),
        generated_tokens=generated,
        output_token_ids=outputs,
        sorted_by_length=sort_by_length,
        oom_batch_sizes=ooms,
    )


def _generate_batch(model: torch.nn.Module, batch: list[BenchRequest], pad_id: int) -> tuple[float, list[list[int]]]:
    """Seconds of one left-padded greedy `generate` call, and each row's new token ids."""
    new_tokens = max(r.output_len for r in batch)
    _synchronize(model)
    start = time.perf_counter()
    input_ids, attention_mask = _left_padded(batch, pad_id, model.device)
    with torch.inference_mode():
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
    new_ids = sequences[:, input_ids.shape[1]:].tolist()  # .tolist() also waits for the GPU
    seconds = time.perf_counter() - start
    if any(len(row) != new_tokens for row in new_ids):
        raise RuntimeError(f"HF generate returned {len(new_ids[0])} new tokens per row, expected {new_tokens}")
    return seconds, new_ids


def _left_padded(batch: Sequence[BenchRequest], pad_id: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, longest prompt] ids and mask, padded on the left so every row's new tokens line up."""
    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        n = len(request.prompt_token_ids)
        input_ids[row, width - n:] = torch.tensor(request.prompt_token_ids, dtype=torch.long)
        attention_mask[row, width - n:] = 1
    return input_ids.to(device), attention_mask.to(device)


def _pad_token_id(model: torch.nn.Module) -> int:
    """The model's pad id, else its (first) EOS id: masked out either way, the value only has to be valid."""
    config = model.generation_config
    for candidate in (config.pad_token_id, model.config.pad_token_id, config.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def _synchronize(model: torch.nn.Module) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
