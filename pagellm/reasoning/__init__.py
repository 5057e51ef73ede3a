"""Reasoning parsers: how a model marks its chain of thought, so the engine can enforce structured
output only after it and the server can return it as `reasoning_content`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReasoningTags:
    start: str
    """Token that opens the reasoning (may be in the prompt, put there by the chat template)."""
    end: str
    """Token that closes it; what follows is the answer."""


REASONING_PARSERS: dict[str, ReasoningTags] = {
    "qwen3": ReasoningTags("<think>", "</think>"),
    "deepseek_r1": ReasoningTags("<think>", "</think>"),
}
