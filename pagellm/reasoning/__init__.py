"""Reasoning parsers: how a model marks its chain of thought, so the engine can enforce structured
output only after it and the server can return it as `reasoning_content` (`parsers.py`).
`REASONING_PARSER_REGISTRY` lists the `--reasoning-parser` names; `register_reasoning_parser` adds one."""
from __future__ import annotations

from dataclasses import dataclass

from pagellm.config.registry import Registry


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


@dataclass(frozen=True, slots=True)
class ReasoningParserEntry:
    """A `--reasoning-parser`: the tags a model family puts around its reasoning."""

    name: str
    tags: ReasoningTags
    description: str = ""
    """What `--help` says of it."""


REASONING_PARSER_REGISTRY: Registry[ReasoningParserEntry] = Registry(
    "reasoning parser", "reasoning_parser (--reasoning-parser)", builtins=(
        ReasoningParserEntry("qwen3", ReasoningTags("<think>", "</think>"), "<think>...</think>"),
        ReasoningParserEntry("deepseek_r1", ReasoningTags("<think>", "</think>", opens_in_prompt=True),
                             "<think> in the prompt, ...</think> in the output"),
    ))
"""Every `--reasoning-parser`, by name."""


def register_reasoning_parser(name: str, tags: ReasoningTags, *, description: str = "",
                              override: bool = False) -> None:
    """Make `name` a `--reasoning-parser` for models that put their reasoning between `tags`. A name
    already registered is refused unless `override`."""
    if not isinstance(tags, ReasoningTags):
        raise ValueError(f"register_reasoning_parser({name!r}): tags must be a pagellm.reasoning.ReasoningTags, "
                         f"got {tags!r}")
    REASONING_PARSER_REGISTRY.register(ReasoningParserEntry(name, tags, description), override=override)


def get_reasoning_tags(name: str) -> ReasoningTags:
    """The tags of `--reasoning-parser name`."""
    return REASONING_PARSER_REGISTRY.get(name).tags
