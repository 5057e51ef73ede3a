"""Flags whose value is a JSON object (`--pooler-config`, `--speculative-config`): text or a dict."""
from __future__ import annotations

import json
from collections.abc import Collection


def json_object(value: str | dict, flag: str, known: Collection[str]) -> dict:
    """`value` (JSON text, or a dict as `LLM(...)` takes it) as a dict whose keys are all in `known`;
    a ValueError naming `flag` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    unknown = set(value) - set(known)
    if unknown:
        raise ValueError(f"{flag} has unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    return value
