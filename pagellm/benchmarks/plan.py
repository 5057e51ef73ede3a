"""`pagellm plan MODEL`: the memory ledger of a deployment (`benchmarks/memory.py`) as a table or JSON,
with what to change when the workload does not fit."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

import torch

from pagellm.benchmarks.memory import Ledger, PlanSpec, compute_ledger
from pagellm.benchmarks.plan_args import PLAN_ENGINE_ARGS
from pagellm.benchmarks.results import format_table
from pagellm.config import EngineConfig
from pagellm.config.arch import ModelArchConfig
from pagellm.core.kv_cache_groups import block_slots
from pagellm.engine.arg_utils import EngineArgs, default_max_num_batched_tokens, resolve_dtype
from pagellm.loader import resolve_model
from pagellm.loader.source import read_json
from pagellm.quantization import (
    QUANTIZATION_REGISTRY,
    check_experts_dense,
    checkpoint_quantization,
    compressed_tensors_weights,
    experts_request,
    resolve_quantization,
)
from pagellm.quantization.gguf import GGUFConfig

_GiB = 1 << 30


def run_cli(ns: argparse.Namespace) -> int:
    name, arch, path = resolve_arch(ns.model)
    ledger = compute_ledger(spec_from_args(ns, arch, path))
    tips = advice(ledger)
    if ns.json:
        print(json.dumps(ledger_json(name, ledger, tips), indent=2))
    else:
        print(format_plan(name, ledger, tips))
    return 0


def resolve_arch(model: str | None) -> tuple[str, ModelArchConfig, str | None]:
    """(name, architecture, path) of a model path (GGUF file, Hugging Face directory), a
    config.json file or a preset name (path None); None: the embedded default model. Only the
    shape is read, never the weights."""
    if model is not None and model.endswith(".json") and os.path.isfile(model):
        return model, ModelArchConfig.from_hf_dict(read_json(model)), None
    source = resolve_model(model, "dummy")
    return model or os.path.basename(source.path), source.arch, source.path


def spec_from_args(ns: argparse.Namespace, arch: ModelArchConfig, path: str | None = None) -> PlanSpec:
    """The plan's inputs from the command line: the device and its memory, dtype and defaults as
    the engine would resolve them (a GGUF file's blocks kept where the engine keeps them)."""
    # The engine's own checks, with its messages (which name the flag).
    EngineArgs(**{name: getattr(ns, name) for name in PLAN_ENGINE_ARGS}).validate()
    device = ns.device
    if device == "auto":
        device = "cuda" if ns.gpu_memory_gib is not None or torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if ns.gpu_memory_gib is not None:
            total = int(ns.gpu_memory_gib * _GiB)
        elif torch.cuda.is_available():
            total = torch.cuda.mem_get_info(0)[1]
        else:
            raise ValueError("--device cuda on a machine without a GPU needs --gpu-memory-gib")
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    max_model_len = ns.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(f"--max-model-len ({max_model_len}) is larger than the model's max_position_embeddings "
                         f"({arch.max_position_embeddings})")
    torch_device = torch.device(device)
    is_gguf = path is not None and path.endswith(".gguf")
    requested = experts_request(ns.quantization, "gguf" if is_gguf else "safetensors", arch)
    quantization, gguf_types = _quantization(requested, arch, path, torch_device)
    check_experts_dense(arch, None if quantization == "none" else quantization, "--quantization")
    return PlanSpec(
        arch=arch, device=device, dtype_bytes=resolve_dtype(ns.dtype, torch_device, arch.torch_dtype).itemsize,
        max_model_len=max_model_len, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens or default_max_num_batched_tokens(torch_device,
                                                                                           ns.max_num_seqs),
        input_len=ns.input_len, output_len=ns.output_len, total_memory_bytes=total,
        gpu_memory_utilization=ns.gpu_memory_utilization, block_size=ns.block_size, quantization=quantization,
        gguf_types=gguf_types, kv_cache_dtype=ns.kv_cache_dtype, tensor_parallel_size=ns.tensor_parallel_size,
        expert_parallel=ns.enable_expert_parallel and bool(arch.num_experts),
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes, cpu_kv_cache_bytes=EngineConfig.default_cpu_kv_cache_bytes(),
        enforce_eager=ns.enforce_eager, host_kv_bytes=_host_kv_bytes(ns.kv_offloading_size))


def _host_kv_bytes(kv_offloading_size: float | None) -> int:
    if kv_offloading_size is None:
        return 0
    if not kv_offloading_size > 0:
        raise ValueError(f"kv_offloading_size (--kv-offloading-size) must be a positive number of GiB, "
                         f"got {kv_offloading_size!r}")
    return int(kv_offloading_size * _GiB)


def _quantization(requested: str | None, arch: ModelArchConfig, path: str | None,
                  device) -> tuple[str, dict[str, int] | None]:
    """(method, a GGUF file's block types) as the engine resolves --quantization (None: its default,
    a quantized checkpoint's own method). A dense model may be planned at any method's size (what
    its fp8 or GPTQ checkpoint would take); a quantized checkpoint only as the engine loads it.
    compressed-tensors is planned as the storage its weights have: fp8, int8 or gptq's int4."""
    is_gguf = path is not None and path.endswith(".gguf")
    if requested == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf plans a .gguf model's blocks; this model is not one")
    if is_gguf and requested in (None, "gguf") and resolve_quantization(requested, "gguf", path, device) == "gguf":
        return "gguf", GGUFConfig.from_file(path).qtypes
    stored = checkpoint_quantization(arch.hf_config)
    if stored is not None and requested not in (None, stored):
        raise ValueError(f"--quantization {requested}: the checkpoint holds {stored} weights (its "
                         f"quantization_config), which the engine loads only as {stored}: leave the flag out")
    method = requested or stored or "none"
    if QUANTIZATION_REGISTRY.get(method).build is None:  # the engine's layers are dense (mxfp4: dequantized)
        return "none", None
    if method != "compressed-tensors":
        return method, None
    if stored is None:
        raise ValueError("--quantization compressed-tensors plans a checkpoint's own quantization_config; for the "
                         "size of a dense model's, pass fp8, int8 or gptq")
    weights = compressed_tensors_weights(arch.hf_config["quantization_config"])
    return ("gptq" if weights["num_bits"] == 4 else "fp8" if weights.get("type") == "float" else "int8"), None


def advice(ledger: Ledger) -> list[str]:
    """What does not fit, and what each usual remedy would give (each computed, one change at a time)."""
    spec = ledger.spec
    problems = []
    if ledger.num_kv_blocks == 0:
        fixed = ledger.weights_bytes + ledger.buffers_bytes + ledger.activation_peak_bytes + ledger.non_torch_bytes
        problems.append(f"nothing is left for the KV cache: weights, activations and the CUDA context take "
                        f"{_gib(fixed):.2f} GiB of the {_budget_gib(spec):.2f} GiB allowed")
    elif not ledger.max_model_len_fits:
        longest = _longest_fitting(ledger)
        problems.append(f"one request of --max-model-len {spec.max_model_len} tokens does not fit the KV cache "
                        f"({ledger.num_kv_blocks} blocks of {spec.block_size} tokens): lower --max-model-len to "
                        f"{longest} or less")
    if 0 < ledger.kv_limited_seqs < spec.max_num_seqs:
        problems.append(f"the KV cache holds {ledger.kv_limited_seqs} sequences of {ledger.tokens_per_seq} tokens, "
                        f"fewer than --max-num-seqs {spec.max_num_seqs}: past that the engine preempts; "
                        f"--max-num-seqs {ledger.kv_limited_seqs} avoids it")
    if spec.device == "cpu" and spec.total_memory_bytes and ledger.peak_bytes > spec.total_memory_bytes:
        problems.append(f"weights, KV cache and activations ({_gib(ledger.peak_bytes):.2f} GiB) exceed the "
                        f"machine's {_gib(spec.total_memory_bytes):.2f} GiB: lower --kv-cache-memory-bytes")
    if not problems:
        return []
    return problems + [f"what-if {change}: {_capacity(other)}" for change, other in _what_ifs(spec)]


def _longest_fitting(ledger: Ledger) -> int:
    """The longest --max-model-len whose request fits the ledger's blocks (bisected)."""
    fits, too_long = 0, ledger.spec.max_model_len
    while too_long - fits > 1:
        middle = (fits + too_long) // 2
        shorter = dataclasses.replace(ledger, spec=dataclasses.replace(ledger.spec, max_model_len=middle))
        fits, too_long = (middle, too_long) if shorter.max_model_len_fits else (fits, middle)
    return fits


def _what_ifs(spec: PlanSpec) -> list[tuple[str, Ledger]]:
    changes: list[tuple[str, dict[str, Any]]] = []
    if spec.kv_cache_dtype == "auto":
        changes.append(("--kv-cache-dtype fp8", {"kv_cache_dtype": "fp8"}))
    if spec.device == "cpu":
        # The CPU's budget is fixed: only a larger one or smaller entries buy more KV.
        budget = spec.kv_cache_memory_bytes or spec.cpu_kv_cache_bytes
        changes.append((f"--kv-cache-memory-bytes {2 * budget}", {"kv_cache_memory_bytes": 2 * budget}))
        return _ledgers(spec, changes)
    if spec.quantization == "none" and not spec.arch.num_experts:  # experts load only dense
        changes.append(("--quantization fp8", {"quantization": "fp8"}))
    changes.append((f"--tensor-parallel-size {2 * spec.tensor_parallel_size}",
                    {"tensor_parallel_size": 2 * spec.tensor_parallel_size}))
    if spec.kv_cache_memory_bytes is None and spec.gpu_memory_utilization < 0.95:
        changes.append(("--gpu-memory-utilization 0.95", {"gpu_memory_utilization": 0.95}))
    if spec.max_num_batched_tokens // 2 >= max(2048, spec.max_num_seqs):
        half = spec.max_num_batched_tokens // 2
        changes.append((f"--max-num-batched-tokens {half}", {"max_num_batched_tokens": half}))
    return _ledgers(spec, changes)


def _ledgers(spec: PlanSpec, changes: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, Ledger]]:
    """The ledger of each change that fits more sequences, one change at a time."""
    now = compute_ledger(spec).kv_limited_seqs
    ledgers = []
    for change, fields in changes:
        try:
            ledger = compute_ledger(dataclasses.replace(spec, **fields))
        except ValueError:  # e.g. the model's heads cannot be split that way
            continue
        if ledger.kv_limited_seqs > now:
            ledgers.append((change, ledger))
    return ledgers


def _capacity(ledger: Ledger) -> str:
    return (f"{ledger.num_kv_blocks} blocks, {ledger.kv_cache_tokens} tokens, "
            f"{ledger.kv_limited_seqs} sequences of {ledger.tokens_per_seq} tokens")


def _experts_read(spec: PlanSpec) -> str:
    """Which experts a one-token step reads on a rank (the busiest, under expert parallelism)."""
    arch = spec.arch
    if not arch.num_experts:
        return ""
    if spec.expert_parallel:
        local = arch.num_experts // spec.tensor_parallel_size
        return f", {min(arch.num_experts_per_tok, local)} of the rank's {local} experts a layer at most"
    return f", {arch.num_experts_per_tok} of {arch.num_experts} experts a layer"


def _group_note(ledger: Ledger) -> str:
    """How a sequence's blocks split over KV cache groups of different windows ('' for one group)."""
    groups = ledger.kv_groups
    if len(groups) == 1 and groups[0].sliding_window is None:
        return ""
    counts: dict[int | None, list[int]] = {}  # window -> [groups, layers, blocks per group]
    for group, blocks in zip(groups, ledger.group_blocks_per_seq(ledger.tokens_per_seq)):
        entry = counts.setdefault(group.sliding_window, [0, 0, blocks])
        entry[0] += 1
        entry[1] += len(group.layers)
    parts = [f"{n} group{'s' if n > 1 else ''} ({layers} layers) of "
             f"{'full attention' if w is None else f'window {w}'}: {blocks} each"
             for w, (n, layers, blocks) in counts.items()]
    return f" of {block_slots(groups)} layers: " + "; ".join(parts)


def _gib(num_bytes: float) -> float:
    return num_bytes / _GiB


def _budget_gib(spec: PlanSpec) -> float:
    return _gib((spec.total_memory_bytes or 0) * spec.gpu_memory_utilization)


def ledger_json(model: str, ledger: Ledger, tips: list[str]) -> dict[str, Any]:
    spec = ledger.spec
    inputs = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "arch"}
    return {
        "model": model, "architecture": spec.arch.architecture, **inputs,
        "weights_bytes": ledger.weights_bytes, "decode_weights_bytes": ledger.decode_weights_bytes,
        "buffers_bytes": ledger.buffers_bytes,
        "activation_peak_bytes": ledger.activation_peak_bytes, "encoder_peak_bytes": ledger.encoder_peak_bytes,
        "encoder_cache_bytes": ledger.encoder_cache_bytes, "non_torch_bytes": ledger.non_torch_bytes,
        "cuda_graph_bytes": ledger.cuda_graph_bytes, "kv_budget_bytes": ledger.kv_budget_bytes,
        "kv_bytes_per_token": ledger.kv_bytes_per_token, "kv_bytes_per_block": ledger.kv_bytes_per_block,
        "num_kv_blocks": ledger.num_kv_blocks, "kv_cache_tokens": ledger.kv_cache_tokens,
        "kv_cache_bytes": ledger.kv_cache_bytes, "tokens_per_seq": ledger.tokens_per_seq,
        "blocks_per_seq": ledger.blocks_per_seq,
        "kv_cache_groups": [{"sliding_window": g.sliding_window, "layers": list(g.layers), "blocks_per_seq": n}
                            for g, n in zip(ledger.kv_groups, ledger.group_blocks_per_seq(ledger.tokens_per_seq))],
        "kv_limited_seqs": ledger.kv_limited_seqs, "max_concurrent_seqs": ledger.max_concurrent_seqs,
        "staging_bytes": ledger.staging_bytes, "num_host_kv_blocks": ledger.num_host_kv_blocks,
        "host_kv_tokens": ledger.host_kv_tokens,
        "fits": not tips, "advice": tips,
    }


def format_plan(model: str, ledger: Ledger, tips: list[str]) -> str:
    spec = ledger.spec
    on_gpu = spec.device == "cuda"
    where = f"GPU of {_gib(spec.total_memory_bytes):.2f} GiB" if on_gpu else "CPU"
    lines = [f"{model} ({spec.arch.architecture}) on a {where}, {spec.dtype_bytes} bytes per element, "
             f"tensor parallel {spec.tensor_parallel_size}{' with expert parallel' if spec.expert_parallel else ''} "
             f"(per rank); quantization {spec.quantization}, "
             f"KV cache dtype {spec.kv_cache_dtype}", ""]
    if spec.kv_cache_memory_bytes is not None:
        budget_row = ["KV budget", _gib(spec.kv_cache_memory_bytes), "--kv-cache-memory-bytes"]
    elif on_gpu:
        budget_row = ["allowed", _gib(spec.total_memory_bytes * spec.gpu_memory_utilization),
                      f"--gpu-memory-utilization {spec.gpu_memory_utilization}"]
    else:
        budget_row = ["KV budget", _gib(spec.cpu_kv_cache_bytes // spec.tensor_parallel_size),
                      "min(4 GiB, RAM / 4), shared by the ranks; the rest is not deducted on the CPU"]
    rows = [budget_row,
            ["weights", _gib(ledger.weights_bytes), f"quantization {spec.quantization}"],
            ["  read per decode step", _gib(ledger.decode_weights_bytes),
             f"one token: not the embedding's other rows{_experts_read(spec)} (part of the weights)"],
            ["buffers", _gib(ledger.buffers_bytes), "rotary table" + (", allocator rounding" if on_gpu else "")],
            ["activation peak", _gib(ledger.activation_peak_bytes),
             f"largest step: {spec.max_num_batched_tokens} tokens, "
             f"{min(spec.max_num_seqs, spec.max_num_batched_tokens)} sequences sampled"
             + (", or the vision encoder, and its features" if ledger.encoder_peak_bytes else "")]]
    if ledger.encoder_peak_bytes:
        rows += [["  vision encoder", _gib(ledger.encoder_peak_bytes),
                  f"the images of {spec.max_num_batched_tokens} placeholder tokens at once (part of the peak)"],
                 ["  encoder cache", _gib(ledger.encoder_cache_bytes),
                  "their features, kept through the step's forward pass (part of the peak)"]]
    if on_gpu:
        rows.append(["CUDA context", _gib(ledger.non_torch_bytes), "memory outside PyTorch"])
    rows.append(["KV cache", _gib(ledger.kv_cache_bytes), f"{ledger.num_kv_blocks} blocks of {spec.block_size} tokens"])
    if ledger.staging_bytes:
        rows.append(["KV staging", _gib(ledger.staging_bytes), "the host tier's copy buffers, from the KV budget"])
    if spec.host_kv_bytes:
        rows.append(["host KV tier", _gib(spec.host_kv_bytes), "--kv-offloading-size, in host memory"])
    if on_gpu:
        rows.append(["CUDA graphs", _gib(ledger.cuda_graph_bytes),
                     "after sizing, in the activation peak's room (estimate)" if ledger.cuda_graph_bytes else
                     "--enforce-eager"])
    lines.append(format_table(["memory", "GiB", "notes"], rows, left=(0, 2)))
    lines.append("")
    capacity = [["KV bytes per token", ledger.kv_bytes_per_token, f"KV cache dtype {spec.kv_cache_dtype}"],
                ["KV cache tokens", ledger.kv_cache_tokens, f"{ledger.num_kv_blocks} blocks"],
                ["tokens per sequence", ledger.tokens_per_seq, f"--input-len {spec.input_len} + --output-len "
                                                               f"{spec.output_len}, at most --max-model-len"],
                ["sequences in the KV cache", ledger.kv_limited_seqs, f"{ledger.blocks_per_seq} blocks each"
                 + _group_note(ledger)],
                ["max concurrent sequences", ledger.max_concurrent_seqs, f"--max-num-seqs {spec.max_num_seqs}"]]
    if spec.host_kv_bytes:
        capacity.append(["host KV tier tokens", ledger.host_kv_tokens,
                         f"{ledger.num_host_kv_blocks} blocks of evicted prefixes, beside the device's"])
    lines.append(format_table(["capacity", "value", "notes"], capacity, left=(0, 2)))
    lines += ["", *(f"- {tip}" for tip in tips)] if tips else ["", "fits: every --max-num-seqs sequence runs at once"]
    return "\n".join(lines)
