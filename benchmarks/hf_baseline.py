"""The Hugging Face baseline: `model.generate` over static batches of exactly the benchmark's requests.

Each batch is left-padded with an attention mask and decoded greedily. HF's `generate` gives
every row of a batch the same number of new tokens, so a batch runs to its longest requested
`output_len` (with `min_new_tokens` set to it too, so EOS cannot end it early, which matches
pagellm's `ignore_eos`). Only the requested tokens count as output: rows of a batch with mixed
output lengths compute extra tokens that are reported separately (`generated_tokens`) and not
credited to HF's throughput. With equal output lengths, as in the offline CPU benchmark, the two
counts are the same. Works on CPU and CUDA.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagellm.benchmarks.datasets import BenchRequest


@dataclass(slots=True)
class HFRunResult:
    """Timing and token counts of one `run_hf_generate` call."""

    elapsed_s: float
    """Wall time of all batches, from building the first batch's tensors to the last batch's output."""
    num_requests: int
    batch_size: int
    output_tokens: int
    """Sum of the requested output lengths: the tokens credited to HF."""
    generated_tokens: int
    """Tokens HF actually produced, counting each batch's padding up to its longest output_len."""
    output_token_ids: list[list[int]]
    """Per request, in input order, the first `output_len` generated ids (for agreement checks)."""

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


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


def run_hf_generate(model: torch.nn.Module, requests: Sequence[BenchRequest], batch_size: int) -> HFRunResult:
    """Greedy `generate` over `requests` in order, `batch_size` at a time; see the module docstring."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    if not requests:
        raise ValueError("no requests to run")
    pad_id = _pad_token_id(model)
    outputs: list[list[int]] = []
    generated = 0
    _synchronize(model)
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        new_tokens = max(r.output_len for r in batch)
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
        if any(len(row) != new_tokens for row in new_ids):
            raise RuntimeError(f"HF generate returned {len(new_ids[0])} new tokens per row, expected {new_tokens}")
        outputs.extend(row[:r.output_len] for row, r in zip(new_ids, batch))
        generated += new_tokens * len(batch)
    elapsed = time.perf_counter() - start
    return HFRunResult(
        elapsed_s=elapsed,
        num_requests=len(requests),
        batch_size=batch_size,
        output_tokens=sum(r.output_len for r in requests),
        generated_tokens=generated,
        output_token_ids=outputs,
    )


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
