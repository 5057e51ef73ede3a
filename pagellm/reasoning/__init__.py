"""Reasoning parsers: how a model marks its chain of thought, so the engine can enforce structured
output only after it and the server can return it as `reasoning_content` (`parsers.py`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReasoningTags:
    start: str
    """Token that opens the reasoning (may be in the prompt, put there by the chat template)."""
    end: str
    """Token that closes it; what follows is the answer."""
    opens_in_prompt: bool = False
    """The chat template ends the prompt with `start`, so the output is reasoning from its first
    token until `end` (DeepSeek-R1). False: only an output that begins with `start` reasons (Qwen3,
    whose template leaves it to the model, or puts a closed empty block in the prompt when thinking
    is off)."""


REASONING_PARSERS: dict[str, ReasoningTags] = {
    "qwen3": ReasoningTags("<think>", "</think>"),
    "deepseek_r1": ReasoningTags("<think>", "</think>", opens_in_prompt=True),
}
