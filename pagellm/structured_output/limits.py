"""The static check of a structured-output spec against `GrammarLimits`, before xgrammar parses or
compiles it: milliseconds for the largest spec `max_bytes` lets through, so that one whose compile
or matching would run long is refused at once rather than after seconds of a compile thread."""
from __future__ import annotations

import json
from typing import Any

from pagellm.config import GrammarLimits
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.complexity import Ambiguity, expansion
from pagellm.structured_output.errors import LimitExceeded, UnsupportedSchema
from pagellm.structured_output.syntax import Node, parse_grammar, parse_regex

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose value maps names to subschemas."""
_SCHEMA_KEYWORDS = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames", "not", "if",
                    "then", "else", "unevaluatedItems", "unevaluatedProperties")
"""Keywords whose value is a subschema (`items` may also be a list of them)."""
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_POINTER_CHARS = 80


def check_limits(params: StructuredOutputsParams, limits: GrammarLimits) -> None:
    """LimitExceeded if the spec is more complex than `limits` allow; UnsupportedSchema, found on the
    same walk, if one of its JSON schemas refers outside itself."""
    kind = params.kind
    if kind == "json":
        _Budget(limits).schema(_loaded(params.json))
    elif kind == "structural_tag":
        _Budget(limits).structural_tag(_loaded(params.structural_tag))
    elif kind == "regex":
        _Budget(limits).regex(params.regex, "")
    elif kind == "grammar":
        _Budget(limits).grammar(params.grammar)
    elif kind == "choice" and len(params.choice) > limits.max_enum_values:
        raise LimitExceeded(f"has {len(params.choice)} choices, more than the limit of {limits.max_enum_values}",
                            "max_enum_values")


class _Budget:
    """What one spec has used of the limits that count over the whole of it."""

    def __init__(self, limits: GrammarLimits) -> None:
        self.limits = limits
        self.schema_nodes = 0
        self.enum_values = 0
        self.expansion = 0

    def schema(self, root: Any) -> None:
        """A JSON schema, walked in place: `$ref`s are not followed (xgrammar makes each definition
        one rule, so references cost nothing more, recursive ones included)."""
        limits = self.limits
        stack: list[tuple[Any, int, tuple[str, ...]]] = [(root, 1, ())]
        while stack:
            node, depth, path = stack.pop()
            if not isinstance(node, dict):
                continue
            self.schema_nodes += 1
            if self.schema_nodes > limits.max_schema_nodes:
                raise LimitExceeded(f"has more than {limits.max_schema_nodes} subschemas", "max_schema_nodes")
            if depth > limits.max_depth:
                raise LimitExceeded(f"nests subschemas more than {limits.max_depth} levels deep (at "
                                    f"{_pointer(path)})", "max_depth")
            self._enum_values(node, path)
            _local_ref(node, path)
            properties = node.get("properties")
            if isinstance(properties, dict) and len(properties) > limits.max_object_properties:
                raise LimitExceeded(f"has {len(properties)} properties in one object (at {_pointer(path)}), more "
                                    f"than the limit of {limits.max_object_properties}", "max_object_properties")
            if isinstance(node.get("pattern"), str):
                self.regex(node["pattern"], f"the pattern at {_pointer((*path, 'pattern'))} ")
            pattern_properties = node.get("patternProperties")
            for name in pattern_properties if isinstance(pattern_properties, dict) else ():
                self.regex(name, f"the patternProperties name at {_pointer((*path, 'patternProperties'))} ")
            stack.extend(_subschemas(node, depth, path))

    def structural_tag(self, tag: Any) -> None:
        """xgrammar's structural tag (formats within formats) or vLLM's first format (`structures`
        of begin, schema, end): the schemas, regexes and grammars in it, and its nesting."""
        limits = self.limits
        stack: list[tuple[Any, int]] = [(tag, 1)]
        while stack:
            node, depth = stack.pop()
            if isinstance(node, list):
                stack.extend((item, depth) for item in node)
                continue
            if not isinstance(node, dict):
                continue
            if depth > limits.max_depth:
                raise LimitExceeded(f"nests formats more than {limits.max_depth} levels deep", "max_depth")
            kind = node.get("type")
            if kind == "json_schema" or "begin" in node and "schema" in node:
                self.schema(node.get("json_schema", node.get("schema")))
            elif kind == "regex" and isinstance(node.get("pattern"), str):
                self.regex(node["pattern"], "the regex format ")
            elif kind == "grammar" and isinstance(node.get("grammar"), str):
                self.grammar(node["grammar"])
            else:
                if kind == "repeat":
                    self._count(node.get("max"), node.get("min"))
                stack.extend((value, depth + 1) for value in node.values())

    def regex(self, text: str, where: str) -> None:
        """A regex (`where` names it within the spec, "" for the spec itself)."""
        node = parse_regex(text, self.limits.max_depth)
        self._unambiguous(Ambiguity(), node, where)
        self._expand(expansion(node))

    def grammar(self, text: str) -> None:
        rules = parse_grammar(text, self.limits.max_depth)
        ambiguity = Ambiguity(rules)
        for name, body in rules.items():
            self._unambiguous(ambiguity, body, f"rule {name!r} ")
            self._expand(expansion(body))

    def _unambiguous(self, ambiguity: Ambiguity, node: Node, where: str) -> None:
        if self.limits.allow_ambiguous_repetition:
            return
        reason = ambiguity.find(node)
        if reason:
            raise LimitExceeded(f"{where}{reason}: it matches one text in many ways, and matching it slows down "
                                "with every token (make each repetition's end unambiguous, e.g. ([^,]*,)* rather "
                                "than (.*,)*)", "allow_ambiguous_repetition")

    def _expand(self, size: int) -> None:
        self.expansion += size
        if self.expansion > self.limits.max_regex_expansion:
            raise LimitExceeded(f"has counted repetitions that write out to {self.expansion} or more characters, "
                                f"more than the limit of {self.limits.max_regex_expansion} (use + or * for an "
                                "unbounded count, maxLength for a string's length)", "max_regex_expansion")

    def _count(self, high: Any, low: Any) -> None:
        """A structural tag's repeat format, as a counted repetition of one character."""
        counts = [c for c in (high, low) if isinstance(c, int) and not isinstance(c, bool)]
        self._expand(max(counts, default=1))

    def _enum_values(self, node: dict, path: tuple[str, ...]) -> None:
        enum = node.get("enum")
        self.enum_values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
        if self.enum_values > self.limits.max_enum_values:
            raise LimitExceeded(f"has more than {self.limits.max_enum_values} enum values and consts (the limit "
                                f"was reached at {_pointer(path)})", "max_enum_values")


def _local_ref(node: dict, path: tuple[str, ...]) -> None:
    """xgrammar resolves only references within the schema; it reads a `$ref` to a file or a URL as "any
    value" (with a warning on stderr), which would leave the output unconstrained: refused instead."""
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        shown = ref if len(ref) <= _POINTER_CHARS else ref[:_POINTER_CHARS - 3] + "..."
        raise UnsupportedSchema(f"has a $ref to {shown!r} (at {_pointer(path)}): only references within the "
                                "schema ('#' or '#/...') are supported; nothing is fetched")


def _subschemas(node: dict, depth: int, path: tuple[str, ...]) -> list[tuple[Any, int, tuple[str, ...]]]:
    found = []
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            found.extend((sub, depth + 1, (*path, key, name)) for name, sub in node[key].items())
    for key in _SCHEMA_KEYWORDS:
        if isinstance(node.get(key), dict):
            found.append((node[key], depth + 1, (*path, key)))
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            found.extend((sub, depth + 1, (*path, key, str(i))) for i, sub in enumerate(node[key]))
    return found


def _loaded(value: str | dict) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _pointer(path: tuple[str, ...]) -> str:
    """The JSON pointer of a place in the schema, shortened for a message."""
    text = "".join("/" + part.replace("~", "~0").replace("/", "~1") for part in path) or "the root"
    return text if len(text) <= _POINTER_CHARS else text[:_POINTER_CHARS - 3] + "..."
