"""`pagellm eval`'s run: the methods' models built, evaluated over one text and compared (see `quality`)."""
from __future__ import annotations

import argparse
import sys
import time
from importlib import resources
from typing import Any

import torch
from tqdm import tqdm

from pagellm.benchmarks.datasets import load_sharegpt_pairs, sharegpt_path
from pagellm.benchmarks.results import format_table, run_metadata, write_json
from pagellm.engine.arg_utils import EngineArgs
from pagellm.eval.flags import EVAL_ENGINE_ARGS, SHAREGPT_CHARS, SHAREGPT_MIN_CHARS
from pagellm.eval.quality import bind_window_cache, evaluate, windows
from pagellm.layers.linear import _ParallelLinear
from pagellm.loader import resolve_model
from pagellm.quantization import QUANTIZATION_REGISTRY, checkpoint_quantization
from pagellm.tokenizer.tokenizer import load_tokenizer
from pagellm.worker.loading import build_model


def run_cli(ns: argparse.Namespace) -> int:
    for method in ns.quantization or ():
        if method not in QUANTIZATION_REGISTRY:
            raise ValueError(f"--quantization: {method!r} is not one of {', '.join(QUANTIZATION_REGISTRY.names())}")
    stored = checkpoint_quantization(resolve_model(ns.model, ns.load_format).arch.hf_config)
    reference = ns.reference or stored or "none"
    kv8 = ns.kv_cache_dtype != "auto"
    compared = ns.quantization or ([] if stored else ["fp8", "int8"])
    # (method, KV-cache dtype): the reference in the model's dtype; the others in --kv-cache-dtype,
    # and with a float8 cache the reference's weights too, so that the cache's own cost shows.
    runs = list(dict.fromkeys([(reference, "auto"), *((m, ns.kv_cache_dtype) for m in compared),
                               *([(reference, ns.kv_cache_dtype)] if kv8 else [])]))
    engine = {name: getattr(ns, name) for name in EVAL_ENGINE_ARGS if name != "kv_cache_dtype"}
    configs = {}
    for run in runs:
        try:
            configs[run] = EngineArgs(model=ns.model, quantization=run[0], kv_cache_dtype=run[1],
                                      **engine).create_engine_config()
        except ValueError as e:  # a method only --reference asked for is that flag's
            if run[0] != ns.reference or run[0] in (ns.quantization or ()):
                raise
            raise ValueError(f"--reference {ns.reference}: {e}") from None
    first = configs[(reference, "auto")]
    tokenizer = load_tokenizer(first.model.source)
    if tokenizer is None:
        raise ValueError("eval needs the model's tokenizer, and a dummy preset has none: pass a model directory "
                         "with tokenizer.json or a GGUF file")
    if ns.context > first.model.source.arch.max_position_embeddings:
        raise ValueError(f"--context {ns.context} exceeds the model's max_position_embeddings "
                         f"({first.model.source.arch.max_position_embeddings})")
    if ns.text is None:
        text = resources.files("pagellm.eval").joinpath("sample.txt").read_text(encoding="utf-8")
    elif ns.text == "sharegpt":
        text = sharegpt_text()
    else:
        try:
            with open(ns.text, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"--text {ns.text!r} is not UTF-8 text: {e}") from None
    token_ids = tokenizer.encode(text)[: ns.max_tokens]
    if not windows(token_ids, ns.context):
        raise ValueError("the text has fewer than 2 tokens: nothing to predict")

    models, weight_bytes, load_s = {}, {}, {}
    for i, ((method, _), config) in enumerate(configs.items()):
        start = time.perf_counter()
        label = _label(method, config)
        # Loading (and calibrating, for the methods that quantize at load) takes seconds to minutes.
        print(f"loading {label} ({i + 1}/{len(configs)})", file=sys.stderr, flush=True)
        models[label] = build_model(config.model.source, config.model.quantization, config.model.dtype, config.device,
                                    config.model.attention_backend, ns.seed)
        if config.cache.kv_cache_dtype != config.model.dtype:
            bind_window_cache(models[label], ns.context, config.cache.kv_cache_dtype, config.device)
        load_s[label] = time.perf_counter() - start
        weight_bytes[label] = _linear_weight_bytes(models[label])
    reference_label = _label(reference, first)
    total = sum(len(w) - 1 for w in windows(token_ids, ns.context))
    with tqdm(total=total, unit="tok", desc="eval", file=sys.stderr) as bar:
        results = evaluate(models, reference_label, token_ids, ns.context, first.device, bar.update)

    ref_ppl = results[reference_label].perplexity
    rows = [[label, f"{weight_bytes[label] / 2**20:.1f}", f"{r.perplexity:.4f}",
             f"{100 * (r.perplexity / ref_ppl - 1):+.2f}%", f"{100 * r.top1_agreement:.2f}%", f"{r.mean_kl:.5f}"]
            for label, r in results.items()]
    print(format_table(["method", "linear weights MiB", "perplexity", "vs reference", "top-1 agreement",
                        "mean KL"], rows, left=[0]))
    print(f"{total} tokens predicted in windows of {ns.context}, reference {reference_label}, "
          f"{first.device}, {first.model.dtype}")
    if ns.output_json:
        payload: dict[str, Any] = {
            "metadata": run_metadata(),
            "model": first.model.source.path, "device": str(first.device), "dtype": str(first.model.dtype),
            "context": ns.context, "tokens": total, "text": ns.text or "built-in sample", "reference": reference_label,
            "results": {label: {"perplexity": r.perplexity, "perplexity_vs_reference": r.perplexity / ref_ppl,
                                "top1_agreement": r.top1_agreement, "mean_kl": r.mean_kl,
                                "linear_weight_bytes": weight_bytes[label], "load_s": load_s[label]}
                        for label, r in results.items()},
        }
        print(f"wrote {write_json(payload, ns.output_json)}")
    return 0


def sharegpt_text() -> str:
    """The `--text sharegpt` text: a larger one than the sample, for differences of a fraction of
    a percent in perplexity."""
    answers, size = [], 0
    for _, answer in load_sharegpt_pairs(sharegpt_path()):
        if size >= SHAREGPT_CHARS:
            break
        if len(answer) >= SHAREGPT_MIN_CHARS and answer.isascii():
            answers.append(answer)
            size += len(answer)
    return "\n\n".join(answers)


def _label(method: str, config) -> str:
    """A row's name: the method (for none the dtype the weights are in), and a float8 KV cache."""
    name = str(config.model.dtype).removeprefix("torch.") if config.model.quantization is None else method
    return name + (", fp8 KV" if config.cache.kv_cache_dtype != config.model.dtype else "")


def _linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the linear layers' weights take (scales, zero points included; not the embedding, the
    LM head or the norms, which every method keeps the same)."""
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, _ParallelLinear)
               for name, p in m.named_parameters() if name != "bias")
