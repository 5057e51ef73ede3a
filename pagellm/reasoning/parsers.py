"""Splitting a model's output into its reasoning and its answer (`--reasoning-parser NAME`).

Like the tool parsers, a split reads the whole text so far and keeps no state, and the split of a
longer text extends the split of a shorter one (a tag cut off at the end of the text is held back),
so that the same code serves finished outputs and streams.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagellm.reasoning import ReasoningTags, get_reasoning_tags


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    reasoning: str | None
    """The text between the tags; None when the output does not reason."""
    content: str
    """The text after the reasoning."""


class ReasoningParser:
    def __init__(self, tags: ReasoningTags) -> None:
        self.tags = tags

    @classmethod
    def named(cls, name: str) -> "ReasoningParser":
        return cls(get_reasoning_tags(name))

    def split(self, text: str, final: bool) -> ReasoningSplit:
        """`text`'s reasoning and content; `final`: the text is complete, hold nothing back. A
        reasoning the output never closes (cut off by max_tokens) is all reasoning."""
        start, end = self.tags.start, self.tags.end
        i = len(text) - len(text.lstrip())
        if text.startswith(start, i):
            body = i + len(start)
        elif not final and start.startswith(text[i:]):
            return ReasoningSplit(None if not self.tags.opens_in_prompt else "", "")  # perhaps the tag, cut off
        elif self.tags.opens_in_prompt:
            body = 0
        else:
            return ReasoningSplit(None, text)
        close = text.find(end, body)
        if close >= 0:
            return ReasoningSplit(text[body:close], text[close + len(end):])
        reasoning = text[body:]
        if not final:
            reasoning = reasoning[:len(reasoning) - held_back(reasoning, end)]
        return ReasoningSplit(reasoning, "")


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (to hold back while
    streaming, until the next text says whether the marker follows)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
