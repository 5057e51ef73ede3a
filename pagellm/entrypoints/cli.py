"""`pagellm` command line. Engine flags are generated from EngineArgs with vLLM's names."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Sequence

from pagellm.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--kebab-case` flag per EngineArgs field (the model is positional), help from its docs."""
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        kind = _base_type(hints[f.name])
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=f.default, help=help_text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = EngineArgs.field_names()
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})


def _base_type(hint) -> type:
    """int | None -> int."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _generate(ns: argparse.Namespace) -> int:
    from pagellm import LLM, SamplingParams

    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens, seed=ns.sampling_seed)
    prompts = ns.prompt or ["Tell me a short story about a robot who learns to paint."]
    if ns.raw:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        print(f">>> {prompt}\n{out.outputs[0].text}\n[{out.outputs[0].finish_reason}, "
              f"{len(out.outputs[0].token_ids)} tokens]\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="pagellm: paged-KV-cache LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation for a few prompts (chat template applied)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("model", nargs="?", default=None, help="model path; default: the embedded SmolLM2-135M-Instruct")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    gen.add_argument("--raw", action="store_true", help="send prompts as-is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(handler=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.handler(ns)
    except ValueError as e:
        print(f"pagellm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
