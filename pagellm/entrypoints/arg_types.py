"""argparse pieces shared by `pagellm`'s commands.

The `type=` checks make a bad value fail while the command line is parsed, before anything loads,
as `pagellm CMD: error: argument --FLAG: must be ..., got ...` with exit status 2.
"""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subcommands report unrecognized arguments themselves, with their own
    usage: argparse leaves them to the top-level parser, whose usage names only the subcommands."""

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def set_handler(parser: argparse.ArgumentParser, handler: Handler) -> None:
    """Run `handler` for this (sub)command; `prog` names the command in errors found while it runs."""
    parser.set_defaults(handler=handler, prog=parser.prog)


def positive_int(text: str) -> int:
    return _int(text, "a positive integer", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    return _int(text, "an integer >= 0", lambda v: v >= 0)


def port(text: str) -> int:
    return _int(text, "a TCP port from 0 to 65535 (0: any free one)", lambda v: 0 <= v <= 65535)


def positive_float(text: str) -> float:
    return _float(text, "a number > 0", lambda v: v > 0)


def non_negative_float(text: str) -> float:
    return _float(text, "a number >= 0", lambda v: v >= 0)


def probability(text: str) -> float:
    """In (0, 1], as top_p."""
    return _float(text, "a number in (0, 1]", lambda v: 0 < v <= 1)


def fraction(text: str) -> float:
    """In [0, 1)."""
    return _float(text, "a number in [0, 1)", lambda v: 0 <= v < 1)


def existing_file(text: str) -> str:
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def output_file(text: str) -> str:
    """A file that can be written (missing folders are made then): checked before a long run, not
    after it. Not a folder, and its nearest existing ancestor a folder this user may write to."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    ancestor = os.path.dirname(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {ancestor!r} is a file, not a folder")
    if not os.access(ancestor if not os.path.exists(path) else path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer >= low."""
    return lambda text: _int(text, f"an integer >= {low}", lambda v: v >= low)


def _int(text: str, accepted: str, ok: Callable[[int], bool]) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _bad(text, accepted) from None
    if not ok(value):
        raise _bad(text, accepted)
    return value


def _float(text: str, accepted: str, ok: Callable[[float], bool]) -> float:
    """A finite float that passes `ok`: no flag means nan or inf."""
    try:
        value = float(text)
    except ValueError:
        raise _bad(text, accepted) from None
    if not (math.isfinite(value) and ok(value)):
        raise _bad(text, accepted)
    return value


def _bad(text: str, accepted: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"must be {accepted}, got {text!r}")
