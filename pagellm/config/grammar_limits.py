"""`structured_outputs_limits`: how complex a structured-output spec may be before it is refused
unseen (a dict in `LLM(...)`, JSON with `--structured-outputs-limits`). The checks themselves are
`pagellm.structured_output.limits`; docs/structured-output.md#limits says what each one prevents."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from pagellm.config.json_flags import json_object

FLAG = "structured_outputs_limits (--structured-outputs-limits)"


@dataclass(slots=True, frozen=True)
class GrammarLimits:
    """Bounds on a spec, checked before xgrammar parses or compiles it."""

    max_depth: int = 32
    """Levels of subschemas within one another in a JSON schema (the root is level 1), of groups
    within groups in a regex, of parentheses in a grammar rule, of formats in a structural tag."""
    max_schema_nodes: int = 5000
    """Subschemas in one JSON schema, all levels together."""
    max_object_properties: int = 512
    """`properties` of one object schema: xgrammar's compile time grows faster than the square of
    the number of optional ones (1,000 took 8.7 s, 400 0.9 s)."""
    max_enum_values: int = 2048
    """`enum` members plus `const`s in one JSON schema, or entries of a choice list."""
    max_regex_expansion: int = 2000
    """Length of a regex with every counted repetition written out: `[a-z]{1,60000}` is 60,000,
    `(x{1000}){100}` 100,000 (counts multiply through nesting), `\\d{3}-\\d{4}` 8. For a JSON schema,
    the sum over its `pattern`s (xgrammar's conversion of a pattern grows with the square of its
    counts); for a grammar, over its rules."""
    allow_ambiguous_repetition: bool = False
    """Whether a repetition may repeat a part that ends in an unbounded repetition of what the part
    can start with (`(a+)+`, `(\\w+\\s?)*`, `([a-z]+ ?){1,5}`) or that can match nothing (`(a?)*`): such
    a pattern matches one text in many ways, and the matcher's work per token grows with the
    output (1.8 s a token after 120 tokens of `(a*)*b`)."""

    @classmethod
    def parse(cls, value: "str | dict | GrammarLimits | None") -> "GrammarLimits":
        """The defaults with the keys `value` (JSON text, a dict, or limits) sets; a ValueError
        naming the flag for an unknown key or a value out of range."""
        if value is None or isinstance(value, cls):
            return value or cls()
        known = [f.name for f in fields(cls)]
        value = json_object(value, FLAG, known)
        for name, setting in value.items():
            if name == "allow_ambiguous_repetition":
                if not isinstance(setting, bool):
                    raise ValueError(f"{FLAG} {name} must be true or false, got {setting!r}")
            elif isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
                raise ValueError(f"{FLAG} {name} must be an integer >= 1, got {setting!r}")
        return replace(cls(), **value)
