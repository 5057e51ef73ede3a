"""A structured-output spec as the text xgrammar compiles, and the frontend's check of it.

The check (size limit, complexity limits and references outside a schema (`limits.py`), then
xgrammar parses the spec into a grammar: milliseconds, no vocabulary involved) refuses an invalid or
too complex schema, regex or grammar before the request reaches the engine core; what is left for
the core is the compile against the vocabulary, which cannot fail on a parsed spec, only take long.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagellm.config import StructuredOutputsConfig
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.errors import GrammarError, LimitExceeded, UnsupportedSchema
from pagellm.structured_output.limits import check_limits

_MAX_REASON_CHARS = 400
_CHECKED_ENTRIES = 1024


@dataclass(frozen=True, slots=True)
class GrammarSource:
    """What xgrammar compiles for one spec."""

    kind: str
    text: str
    """A JSON schema or structural tag as JSON text, a regex, or an EBNF grammar (choices become one)."""
    any_whitespace: bool

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.any_whitespace}\0{self.text}".encode()).hexdigest()

    @classmethod
    def of(cls, params: StructuredOutputsParams) -> "GrammarSource":
        try:
            return cls._of(params)
        except RecursionError:  # json.loads / dumps of a spec nested thousands of levels deep
            raise GrammarError(params.kind, "is nested too deeply") from None

    @classmethod
    def _of(cls, params: StructuredOutputsParams) -> "GrammarSource":
        kind = params.kind
        if kind in ("json", "structural_tag"):
            value = getattr(params, kind)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise GrammarError(kind, f"is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise GrammarError(kind, f"must be a JSON object, got {type(value).__name__}")
            text = json.dumps(value, ensure_ascii=False)
        elif kind == "choice":
            # JSON string literals are EBNF string literals (same escapes), so any choice text is safe.
            text = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(params, kind)
        return cls(kind, text, not params.disable_any_whitespace)

    def parse(self) -> Any:
        """xgrammar's Grammar of this spec; a GrammarError (with xgrammar's reason) if there is none."""
        import xgrammar as xgr

        try:
            if self.kind == "json":
                return xgr.Grammar.from_json_schema(self.text, any_whitespace=self.any_whitespace)
            if self.kind == "json_object":  # OpenAI's json_object: an object, any keys (not any JSON value)
                return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                                    any_whitespace=self.any_whitespace)
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.text)
            if self.kind in ("grammar", "choice"):
                return xgr.Grammar.from_ebnf(self.text)
            tag = json.loads(self.text)
            if "structures" in tag:  # vLLM's first format: {"structures": [{begin, schema, end}], "triggers"}
                items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                         for s in tag["structures"]]
                return xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))
            return xgr.Grammar.from_structural_tag(tag)
        except Exception as e:  # xgrammar raises RuntimeError, ValueError, TypeError or its own errors
            raise GrammarError(self.kind, f"is not supported: {_reason(e)}") from None


class GrammarChecker:
    """The frontend's check of each spec, remembered (a client sends the same schema again and again)."""

    def __init__(self, config: StructuredOutputsConfig) -> None:
        self.max_bytes = config.max_bytes
        self.limits = config.limits
        self._lock = threading.Lock()
        self._checked: OrderedDict[str, str | None] = OrderedDict()
        """Spec key -> None if it parses, else the reason it does not."""

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise a GrammarError naming the kind if the spec is too large, too complex or does not parse."""
        source = GrammarSource.of(params)
        size = len(source.text.encode())
        if size > self.max_bytes:
            raise GrammarError(source.kind, f"is {size} bytes, more than the limit of {self.max_bytes} "
                                            "(--structured-outputs-max-bytes)")
        key = source.key
        with self._lock:
            known = key in self._checked
            reason = self._checked.get(key)
        if not known:
            try:
                check_limits(params, self.limits)
                source.parse()
                reason = None
            except LimitExceeded as e:
                reason = f"{e.reason} ({e.limit} of --structured-outputs-limits)"
            except UnsupportedSchema as e:
                reason = e.reason
            except GrammarError as e:
                reason = e.reason
            except RecursionError:  # only with a max_depth raised far beyond its default
                reason = "is nested too deeply"
            with self._lock:
                self._checked[key] = reason
                if len(self._checked) > _CHECKED_ENTRIES:
                    self._checked.popitem(last=False)
        if reason is not None:
            raise GrammarError(source.kind, reason)


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/file.cc:42: ")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
        head, sep, rest = text.partition(": ")
        if sep and ".cc:" in head:
            text = rest
    return text[:_MAX_REASON_CHARS]
