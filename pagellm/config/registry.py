"""The table behind each seam's registry: names -> entries, each name listed once.

A seam (model architectures, quantization methods, attention backends, executors, proposers, tool
and reasoning parsers) keeps one `Registry` of entries that say what its callers need to know of
each name (a quantization method's bytes per weight, an architecture's GGUF name, ...), and one
`register_*` function that adds to it, from pagellm or from a plugin (`pagellm.plugins`). Flag
validation, help and choices, and every lookup read the table; nothing lists the names again.

An entry names its implementation by the object itself or by a "package.module:Name" string,
imported on first use (`resolve`), so that listing a backend never imports its kernels. Each
lookup loads the installed plugins first (once per process).
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable
from typing import Any, Generic, Protocol, TypeVar

from pagellm.plugins import load_plugins


class Entry(Protocol):
    """What a registry needs of its entries: a name, and optionally names that also find it."""

    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=Entry)


class Registry(Generic[E]):
    """Entries of one seam by name, in registration order (built-ins first)."""

    def __init__(self, kind: str, flag: str | None = None, builtins: Iterable[E] = ()) -> None:
        self.kind = kind
        """What an entry is, for messages: "model architecture", "attention backend", ..."""
        self.flag = flag
        """The setting that takes these names, for messages: "quantization (--quantization)"."""
        self._entries: dict[str, E] = {}
        self._aliases: dict[str, str] = {}
        for entry in builtins:
            self.register(entry)

    def register(self, entry: E, *, override: bool = False) -> E:
        """Add `entry`; a name (or alias) already taken is refused unless `override`, which replaces
        the entry holding it."""
        names = (entry.name, *getattr(entry, "aliases", ()))
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"a {self.kind} needs a non-empty string as its name, got {name!r}")
            taken = self._entries.get(self._aliases.get(name, name))
            if taken is not None and not override:
                raise ValueError(f"{self.kind} {name!r} is already registered ({describe(taken)}); pass "
                                 f"override=True to replace it")
        for name in names:
            held = self._aliases.pop(name, name)
            if held in self._entries:
                self.unregister(held)
        self._entries[entry.name] = entry
        self._aliases.update((alias, entry.name) for alias in getattr(entry, "aliases", ()))
        return entry

    def unregister(self, name: str) -> E:
        """Remove the entry called `name` (and its aliases); KeyError if there is none."""
        entry = self._entries.pop(name)
        self._aliases = {alias: target for alias, target in self._aliases.items() if target != name}
        return entry

    def get(self, name: str) -> E:
        """The entry called `name` (or one of its aliases); ValueError naming the setting and
        listing the registered names if there is none."""
        load_plugins()
        entry = self._entries.get(self._aliases.get(name, name)) if isinstance(name, str) else None
        if entry is None:
            raise ValueError(self.unknown(name))
        return entry

    def unknown(self, name: object) -> str:
        """The message for a name that is not registered."""
        names = ", ".join(self.names())
        if self.flag is not None:
            return f"{self.flag} must be one of {names}, got {name!r}"
        return f"{self.kind} {name!r} is not supported; supported: {names}"

    def names(self) -> tuple[str, ...]:
        load_plugins()
        return tuple(self._entries)

    def describe(self, separator: str = " | ") -> str:
        """Every name with its entry's description, for `--help`: "a (what a is) | b"."""
        described = (f"{e.name} ({e.description})" if getattr(e, "description", "") else e.name
                     for e in self.entries())
        return separator.join(described)

    def entries(self) -> tuple[E, ...]:
        load_plugins()
        return tuple(self._entries.values())

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return isinstance(name, str) and self._aliases.get(name, name) in self._entries


def resolve(ref: Any) -> Any:
    """A registered implementation: `ref` itself, or for a "package.module:Name" string (Name may
    be dotted: "module:Class.method") the object it names, imported on first use."""
    return _import(ref) if isinstance(ref, str) else ref


def check_ref(ref: Any, what: str) -> None:
    """ValueError unless `ref` is an object or a well-formed "package.module:Name" string."""
    if isinstance(ref, str):
        module, sep, attr = ref.partition(":")
        if not (sep and module and attr):
            raise ValueError(f"{what}: {ref!r} is neither an object nor a 'package.module:Name' string")
    elif ref is None:
        raise ValueError(f"{what}: None is neither an object nor a 'package.module:Name' string")


def describe(entry: Any) -> str:
    """Where an entry's implementation lives, for messages."""
    for field in ("cls", "build", "tags"):
        ref = getattr(entry, field, None)
        if isinstance(ref, str):
            return ref
        if hasattr(ref, "__qualname__"):
            return f"{ref.__module__}:{ref.__qualname__}"
        if ref is not None:
            return repr(ref)
    return repr(entry)


@functools.cache
def _import(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
