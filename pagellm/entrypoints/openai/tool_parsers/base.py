"""What every tool parser returns, and the pieces the parsers share.

A parser reads the whole text generated so far and says which part is message content and which
tool calls it holds, as far as they go. It keeps no state: the same call works on a finished
output (non-streamed responses) and, text chunk after text chunk, on a stream (`streaming.py`
turns successive parses into OpenAI's deltas). For that, a parse of a longer text only ever
extends a parse of a shorter one: content that might turn out to be the start of a tool-call
marker is held back, a call's name appears once it is known, and its arguments are the raw JSON
text as far as it goes.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from pagellm.entrypoints.openai.tool_parsers.json_scan import ScannedObject
from pagellm.reasoning.parsers import held_back


@dataclass(slots=True)
class ParsedCall:
    """One tool call in the text, possibly unfinished."""

    name: str | None
    """The function's name; None until it is known for sure."""
    arguments: str
    """The arguments' raw JSON text so far ("" before it starts)."""
    complete: bool
    """The call's JSON is complete and valid, and its arguments are an object."""


@dataclass(slots=True)
class ParsedOutput:
    content: str
    """The message text outside the tool calls (held back where it might start a marker)."""
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(ABC):
    """How one model family writes tool calls in its output (`--tool-call-parser NAME`)."""

    needs_special_tokens: ClassVar[bool] = False
    """Its marker is a special token, which the output text must keep (skip_special_tokens=False)."""

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """`text`'s content and calls; `final`: the text is complete, hold nothing back."""

    def extract(self, text: str) -> ParsedOutput:
        """The finished output's content and calls. If any call is unfinished or malformed (the
        output was cut off, or the model wrote something else), there are no calls: the whole text
        is content, so that nothing the model wrote is lost."""
        parsed = self.parse(text, final=True)
        if any(not call.complete for call in parsed.calls):
            return ParsedOutput(text)
        return parsed


def call_from_object(text: str, obj: ScannedObject, argument_keys: tuple[str, ...]) -> ParsedCall:
    """The call an object like `{"name": "f", "arguments": {...}}` describes, as far as it goes.

    The name is reported once the arguments have started (or the object is complete): only then is
    the object known to be a call rather than some other JSON that happens to have a `name`."""
    name_member = obj.member("name")
    arguments_member = obj.member(*argument_keys)
    name = None
    if name_member is not None and name_member.end is not None:
        value = json.loads(text[name_member.start:name_member.end])
        name = value if isinstance(value, str) else None
    arguments = ""
    if arguments_member is not None:
        arguments = text[arguments_member.start:arguments_member.end]
    elif obj.end is not None:
        arguments = "{}"  # a function without parameters
    complete = obj.end is not None and name is not None and is_json_object(arguments)
    if arguments_member is None and obj.end is None:
        name = None
    return ParsedCall(name, arguments, complete)


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def content_before(text: str, marker: str, final: bool) -> tuple[str, int]:
    """(the content before `marker`, where the marker starts or -1). Without the marker, all of
    `text` is content, less what could be the marker's start unless `final`."""
    position = text.find(marker)
    if position >= 0:
        return text[:position], position
    return (text if final else text[:len(text) - held_back(text, marker)]), -1
