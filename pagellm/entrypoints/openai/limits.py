"""Per-request limits the server enforces at the edge, before anything reaches the engine.

Kept free of FastAPI and pydantic imports so that `pagellm serve --help` can show the defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_request_body_bytes: int = 16 << 20
    """Bodies larger than this get a 413, counted while the body streams in (chunked ones too)."""
    max_n: int = 128
    """Most sequences one request may generate (`n`, and `best_of` on completions)."""
    max_stop_sequences: int = 16
    """Most `stop` strings one request may give (each is searched for in every new piece of text)."""
    max_prompts: int = 2048
    """Most prompts one /v1/completions or inputs one /v1/embeddings request may hold (OpenAI's own limit)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{_flag(f.name)} must be a positive integer, got {value!r}")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "ServerLimits":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One `--kebab-case` flag per ServerLimits field (`max_logprobs` is an engine argument)."""
    group = parser.add_argument_group("request limits")
    defaults = ServerLimits()
    group.add_argument("--max-request-body-bytes", type=int, default=defaults.max_request_body_bytes,
                       help="larger request bodies are refused with 413, also when sent chunked")
    group.add_argument("--max-n", type=int, default=defaults.max_n,
                       help="most sequences one request may generate (`n`, and `best_of` on completions)")
    group.add_argument("--max-stop-sequences", type=int, default=defaults.max_stop_sequences,
                       help="most `stop` strings one request may give")
    group.add_argument("--max-prompts", type=int, default=defaults.max_prompts,
                       help="most prompts one /v1/completions (or inputs one /v1/embeddings) request may hold")


def _flag(name: str) -> str:
    return name.replace("_", "-")
