"""Per-request limits the server enforces at the edge, before anything reaches the engine, and the
defaults of its timeouts.

Kept free of FastAPI and pydantic imports so that `pagellm serve --help` can show the defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

DEFAULT_REQUEST_TIMEOUT_S = 600.0
"""`--request-timeout`: the openai client's own default timeout, after which its caller has gone anyway."""
DEFAULT_QUEUE_TIMEOUT_S = 30.0
"""`--queue-timeout`: long enough to ride out a burst, short enough that a client can go elsewhere."""


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_request_body_bytes: int = 2 << 20
    """Bodies larger than this get a 413, counted while the body streams in (chunked ones too). The
    server parses a body on its event loop, about 50 ms a MiB of token ids on a CPU core, so a
    larger bound would hold up every other request (and /health); 2 MiB holds a 128k-token prompt."""
    max_n: int = 128
    """Most sequences one request may generate (`n`, and `best_of` on completions)."""
    max_stop_sequences: int = 16
    """Most `stop` strings one request may give (each is searched for in every new piece of text)."""
    max_prompts: int = 2048
    """Most prompts one /v1/completions or inputs one /v1/embeddings request may hold (OpenAI's own limit)."""
    max_request_seqs: int = 2048
    """Most sequences one request may ask for: its prompts times `n` (or `best_of`)."""
    max_request_tokens: int | None = None
    """Most tokens one request's sequences may reach in all: prompt + max_tokens for each (None: no
    bound of its own). Off by default: a sequence without max_tokens counts as max_model_len, so on a
    long-context model a bound would refuse plain chat requests with a few choices."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
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
    group.add_argument("--max-request-seqs", type=int, default=defaults.max_request_seqs,
                       help="most sequences one request may ask for: its prompts times `n` (or `best_of`)")
    group.add_argument("--max-request-tokens", type=int, default=defaults.max_request_tokens,
                       help="most tokens one request's sequences may reach in all: prompt + max_tokens for each "
                            "(max_model_len when max_tokens is not given). None: no bound")


def _flag(name: str) -> str:
    return name.replace("_", "-")
