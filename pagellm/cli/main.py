"""The `pagellm` command: one subcommand per module, each registering its own flags and handler."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pagellm.benchmarks import cli as bench_cli
from pagellm.cli import generate, router, serve, warmup
from pagellm.entrypoints.arg_types import Parser
from pagellm.eval import cli as eval_cli
from pagellm.plugins import PluginError, load_plugins
from pagellm.version import __version__

COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    generate.register, serve.register, warmup.register, router.register, bench_cli.register_bench,
    bench_cli.register_plan, eval_cli.register)
"""Each adds its subcommand (flags, handler) to the `pagellm` parser, in `--help`'s order."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pagellm", description="pagellm: paged-KV-cache LLM inference")
    parser.add_argument("--version", action="version", version=f"pagellm {__version__}")
    # No dest: a missing command is then reported by its choices, not by an attribute name.
    sub = parser.add_subparsers(required=True)
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command: 0 on success; 2, with one line on stderr naming the flag, on a bad flag; 1,
    with one line naming the plugin, when an installed plugin fails to load."""
    try:
        load_plugins()  # before the parser: plugins' names are flag choices (--tool-call-parser)
    except PluginError as e:
        print(f"pagellm: error: {e}", file=sys.stderr)
        return 1
    ns = build_parser().parse_args(argv)
    try:
        return ns.handler(ns)
    except ValueError as e:
        # Our checks raise ValueError naming the flag, also those that need the model or the machine
        # (a KV cache too small for one block), which argparse cannot make; its exit status, no usage.
        print(f"{ns.prog}: error: {e}", file=sys.stderr)
        return 2
