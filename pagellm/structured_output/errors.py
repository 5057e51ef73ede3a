"""The error of a structured-output spec that cannot be used (no xgrammar import here)."""
from __future__ import annotations

_PREFIX = "structured_outputs."


class GrammarError(ValueError):
    """A request's structured-output spec cannot be used: invalid, too large, or too slow to compile.
    The message names the kind (`structured_outputs.json`, ...); the server names its own field."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{_PREFIX}{kind}: {reason}")
        self.kind = kind
        self.reason = reason

    @staticmethod
    def describes(message: str) -> bool:
        """Whether an error message that crossed the process boundary is one of these."""
        return message.startswith(_PREFIX)

    @classmethod
    def from_message(cls, message: str) -> "GrammarError":
        """Rebuilt from its message on the other side of the process boundary."""
        prefix, _, reason = message.partition(": ")
        return cls(prefix.removeprefix(_PREFIX), reason)


class LimitExceeded(Exception):
    """A spec is more complex than the `GrammarLimits` field `limit` allows; `reason` says how (the
    check wraps it in a GrammarError naming the spec's kind)."""

    def __init__(self, reason: str, limit: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.limit = limit


class UnsupportedSchema(Exception):
    """A JSON schema xgrammar would compile to something other than what it says (a `$ref` outside the
    schema becomes "any value"); `reason` says what (the check wraps it in a GrammarError naming the
    spec's kind)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
