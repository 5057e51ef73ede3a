"""`pagellm` command line. Engine flags are generated from EngineArgs with vLLM's names."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Collection, Sequence

from pagellm import __version__
from pagellm.benchmarks.cli import add_bench_parser, add_plan_parser
from pagellm.config import EngineArgs
from pagellm.engine.liveness import DEFAULT_STALL_TIMEOUT_S
from pagellm.eval.cli import add_eval_parser
from pagellm.entrypoints.cli_args import (
    Parser,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    probability,
    set_handler,
)
from pagellm.entrypoints.openai.limits import add_limit_args
from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS

API_KEY_ENV = "PAGELLM_API_KEY"
"""`pagellm serve` reads its API key from here when --api-key is not given."""
DEMO_PROMPT = "Tell me a short story about a robot who learns to paint."
"""`pagellm generate`'s prompt without --prompt when stdin is a terminal."""


def add_engine_args(parser: argparse.ArgumentParser, names: Collection[str] | None = None) -> None:
    """One `--kebab-case` flag per EngineArgs field (the model is positional), or per field in `names`,
    help from its docs."""
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model" or (names is not None and f.name not in names):
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        kind = _base_type(hints[f.name])
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=f.default, help=help_text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The engine flags, checked (ValueError naming the flag), so that a bad one fails before the model loads."""
    names = EngineArgs.field_names()
    args = EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})
    args.validate()
    return args


def _base_type(hint) -> type:
    """int | None -> int."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _generate(ns: argparse.Namespace) -> int:
    from pagellm import LLM, SamplingParams

    args = engine_args_from(ns)
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


def _serve(ns: argparse.Namespace) -> int:
    from pagellm.entrypoints.openai.api_server import run_server

    try:
        return run_server(ns)
    except RuntimeError as e:  # the engine process failed to start
        print(f"{ns.prog}: error: {e}", file=sys.stderr)
        return 1


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("model", nargs="?", default=None, help="model path; default: the embedded SmolLM2-135M-Instruct")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for every interface")
    serve.add_argument("--port", type=port, default=8000, help="TCP port to listen on; 0: any free one")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients pass as `model`; the first is reported in responses and metrics. "
                            "None: the model argument, or SmolLM2-135M-Instruct for the embedded model")
    serve.add_argument("--chat-template", default=None,
                       help="Jinja chat template replacing the model's own: a file path or the template itself")
    serve.add_argument("--api-key", default=None,
                       help=f"require `Authorization: Bearer KEY` on every path but /health, /health/live, "
                            f"/health/ready, /version and /metrics; also read from ${API_KEY_ENV}, which is "
                            f"safer (a command line is visible to every user of the machine)")
    serve.add_argument("--protect-metrics", action="store_true",
                       help="with an API key, require it on /metrics too")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="log level of the HTTP server (uvicorn), access log included")
    tools = serve.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let requests use tool_choice "auto" (the default with tools): the model decides, '
                            "and --tool-call-parser reads its calls out of the text")
    tools.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Hermes, "
                            "Qwen2.5, Qwen3), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS][...])")
    add_limit_args(serve)
    _add_reliability_args(serve)
    add_engine_args(serve)
    set_handler(serve, _serve)


def _add_reliability_args(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("overload, timeouts and shutdown")
    group.add_argument("--max-waiting-requests", type=non_negative_int, default=None,
                       help="generation requests that may wait beyond the --max-num-seqs the engine runs; past "
                            "that, new ones get 503 with Retry-After at once. None: 4 per --max-num-seqs")
    group.add_argument("--request-timeout", type=positive_float, default=None,
                       help="seconds after which an unfinished generation request is aborted with a 504 (a stream "
                            "gets an error event); None: no limit. A client may set a shorter limit for one "
                            "request with the header X-Request-Timeout: <seconds>")
    group.add_argument("--engine-stall-timeout", type=non_negative_float, default=DEFAULT_STALL_TIMEOUT_S,
                       help="seconds one engine step may run before the engine counts as stalled and the server "
                            "exits with status 1 (a dead or frozen engine is noticed within about a second "
                            "regardless); 0: never")
    group.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds that requests in flight may take to finish before the "
                            "server closes them and exits")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pagellm", description="pagellm: paged-KV-cache LLM inference")
    parser.add_argument("--version", action="version", version=f"pagellm {__version__}")
    # No dest: a missing command is then reported by its choices, not by an attribute name.
    sub = parser.add_subparsers(required=True)
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
    add_engine_args(gen)
    set_handler(gen, _generate)
    _add_serve_parser(sub)
    add_bench_parser(sub, add_engine_args)
    add_plan_parser(sub, add_engine_args)
    add_eval_parser(sub, add_engine_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command: 0 on success; 2, with one line on stderr naming the flag, on a bad flag."""
    ns = build_parser().parse_args(argv)
    try:
        return ns.handler(ns)
    except ValueError as e:
        # Our checks raise ValueError naming the flag, also those that need the model or the machine
        # (a KV cache too small for one block), which argparse cannot make; its exit status, no usage.
        print(f"{ns.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
