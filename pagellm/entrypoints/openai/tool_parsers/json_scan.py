"""Where the parts of a JSON object are in text that may still be growing (a streamed tool call).

Tool parsers need, from an object like `{"name": "f", "arguments": {...}}` that may be cut off
anywhere, each member's key and the span of its raw value text, and whether the value (and the
object) is complete. Raw spans only grow as text is appended, which is what makes the streamed
arguments a prefix of the final ones. Strings and brackets are skipped with regular expressions,
so scanning costs C speed per character.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*')
"""The inside of a JSON string: anything but a quote or backslash, or an escape."""
_STRUCTURE = re.compile(r'["{}\[\]]')
"""The characters that matter when matching brackets (a quote starts a string to skip)."""
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SCALAR_END = re.compile(r"[,}\] \t\n\r]")


class MalformedJSON(ValueError):
    """The text cannot be the start of the JSON expected there."""


@dataclass(slots=True)
class Member:
    """One `"key": value` of an object; the value is `text[start:end]`."""

    key: str
    start: int
    end: int | None
    """After the value's last character; None while the value is incomplete."""


@dataclass(slots=True)
class ScannedObject:
    start: int
    """The opening brace."""
    end: int | None = None
    """After the closing brace; None while the object is open."""
    members: list[Member] = field(default_factory=list)

    def member(self, *keys: str) -> Member | None:
        """The first member named by one of `keys`."""
        return next((m for m in self.members if m.key in keys), None)


def skip_whitespace(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def string_end(text: str, pos: int) -> int | None:
    """After the string that opens at `pos` (a quote); None if the text ends inside it."""
    end = _STRING_BODY.match(text, pos + 1).end()
    return end + 1 if end < len(text) else None


def value_end(text: str, pos: int) -> int | None:
    """After the JSON value that starts at `pos`; None if the text ends first (scalars included:
    `12` may become `123`). Values are not checked here; json.loads checks a complete one."""
    if pos >= len(text):
        return None
    first = text[pos]
    if first == '"':
        return string_end(text, pos)
    if first not in "{[":
        match = _SCALAR_END.search(text, pos)
        return match.start() if match else None
    depth, i = 0, pos
    while True:
        match = _STRUCTURE.search(text, i)
        if match is None:
            return None
        char, i = match.group(), match.end()
        if char == '"':
            end = string_end(text, match.start())
            if end is None:
                return None
            i = end
        elif char in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return i


def scan_object(text: str, pos: int) -> ScannedObject:
    """The object that starts at `pos` (a brace), as far as the text goes."""
    if text[pos] != "{":
        raise MalformedJSON(f"expected an object at {pos}")
    obj = ScannedObject(pos)
    i = skip_whitespace(text, pos + 1)
    if text.startswith("}", i):
        obj.end = i + 1
        return obj
    while i < len(text):
        if text[i] != '"':
            raise MalformedJSON(f"expected a key at {i}")
        key_end = string_end(text, i)
        if key_end is None:
            return obj
        key = json.loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i == len(text):
            return obj
        if text[i] != ":":
            raise MalformedJSON(f"expected ':' at {i}")
        start = skip_whitespace(text, i + 1)
        if start == len(text):
            return obj
        end = value_end(text, start)
        obj.members.append(Member(key, start, end))
        if end is None:
            return obj
        i = skip_whitespace(text, end)
        if i == len(text):
            return obj
        if text[i] == "}":
            obj.end = i + 1
            return obj
        if text[i] != ",":
            raise MalformedJSON(f"expected ',' or '}}' at {i}")
        i = skip_whitespace(text, i + 1)
    return obj


def scan_objects(text: str, pos: int, separator: str) -> tuple[list[ScannedObject], int | None]:
    """Objects one after another from `pos`, separated by `separator` (`,` in an array, `;` for
    Llama 3), up to the first character that is neither: (the objects, where that character is, or
    None if the text ends first)."""
    objects: list[ScannedObject] = []
    i = skip_whitespace(text, pos)
    while i < len(text):
        if text[i] != "{":
            return objects, i
        obj = scan_object(text, i)
        objects.append(obj)
        if obj.end is None:
            return objects, None
        i = skip_whitespace(text, obj.end)
        if i == len(text):
            return objects, None
        if text[i] != separator:
            return objects, i
        i = skip_whitespace(text, i + 1)
    return objects, None
