"""`pagellm generate`: offline generation for a few prompts, with the chat template applied."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.arg_types import non_negative_float, positive_int, probability, set_handler
from pagellm.entrypoints.llm import LLM
from pagellm.sampling_params import SamplingParams

DEMO_PROMPT = "Tell me a short story about a robot who learns to paint."
"""`pagellm generate`'s prompt without --prompt when stdin is a terminal."""


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="offline generation for a few prompts (chat template applied)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("model", nargs="?", default=None, help="model path; default: the embedded SmolLM2-135M-Instruct")
    gen.add_argument("--prompt", action="append",
                     help="a prompt (repeat for several); without --prompt, all of stdin is the prompt, or, when "
                          f"stdin is a terminal, the demo prompt {DEMO_PROMPT!r}")
    gen.add_argument("--raw", action="store_true", help="send prompts as-is, without the chat template")
    gen.add_argument("--max-tokens", type=positive_int, default=128, help="most tokens generated per prompt")
    gen.add_argument("--temperature", type=non_negative_float, default=0.0, help="sampling temperature; 0: greedy")
    gen.add_argument("--top-p", type=probability, default=None,
                     help="sample from the most likely tokens whose probabilities add up to this; None: all")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    EngineArgs.add_cli_args(gen)
    set_handler(gen, _generate)


def _generate(ns: argparse.Namespace) -> int:
    args = EngineArgs.from_cli_args(ns)
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens, seed=ns.sampling_seed)
    prompts = ns.prompt or [_prompt_from_stdin()]
    llm = LLM(**dataclasses.asdict(args))
    if ns.raw:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        print(f">>> {prompt}\n{out.outputs[0].text}\n[{out.outputs[0].finish_reason}, "
              f"{len(out.outputs[0].token_ids)} tokens]\n")
    return 0


def _prompt_from_stdin() -> str:
    """All of stdin, unless it is a terminal (nobody typing a prompt there knows to end it with
    Ctrl-D): then the demo prompt."""
    if sys.stdin is None or sys.stdin.isatty():
        return DEMO_PROMPT
    prompt = sys.stdin.read().strip()
    if not prompt:
        raise ValueError("stdin is empty: give a prompt with --prompt or on stdin")
    return prompt
