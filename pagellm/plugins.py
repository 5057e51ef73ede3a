"""Plugins: installed packages that add to pagellm's registries (model architectures, quantization
methods, attention backends, executors, speculative proposers, tool and reasoning parsers, KV
connectors), as vLLM's `vllm.general_plugins` do.

A plugin is a function that calls the `register_*` functions, named by an entry point of the group
`pagellm.plugins` in its package's metadata:

    [project.entry-points."pagellm.plugins"]
    my_plugin = "my_package.pagellm_plugin:register"

`load_plugins()` calls each of them once per process. Every kind of process runs it before it
reads a registry (the API process, the engine core, every worker rank), and the registries call it
themselves before any lookup, so a plugin's names are known wherever a name is looked up.
`PAGELLM_PLUGINS` (comma-separated entry point names) restricts which plugins load; unset, all do.

This module imports nothing of pagellm: it sits below every layer that registers or looks up.
"""
from __future__ import annotations

import logging
import os
import threading
from importlib.metadata import EntryPoint, entry_points

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "pagellm.plugins"
"""The entry point group a plugin package declares its function in."""
PLUGINS_ENV = "PAGELLM_PLUGINS"
"""Comma-separated names of the plugins to load (the entry points' names); unset: every installed
one; empty: none."""


class PluginError(RuntimeError):
    """A plugin could not be loaded; the message names it."""


_lock = threading.RLock()
_loaded: list[str] | None = None
"""The plugins this process loaded (None: not yet). Set before the plugins run, so that a plugin
that looks a name up while registering does not load the plugins again."""
_failure: PluginError | None = None
"""Why loading failed: every later call raises it again rather than going on without the plugin."""


def load_plugins() -> list[str]:
    """Call every selected plugin's function, once per process; returns the names of those loaded.
    A plugin that fails to import or raises is a PluginError naming it (and so is every later call)."""
    global _loaded, _failure
    with _lock:
        if _failure is not None:
            raise _failure
        if _loaded is not None:
            return _loaded
        _loaded = []
        try:
            for ep in selected_plugins(entry_points(group=PLUGIN_GROUP), os.environ.get(PLUGINS_ENV)):
                call_plugin(ep)
                _loaded.append(ep.name)
        except PluginError as e:
            _failure = e
            raise
        if _loaded:
            logger.info("pagellm plugins loaded: %s", ", ".join(_loaded))
        return _loaded


def selected_plugins(installed: list[EntryPoint] | tuple[EntryPoint, ...], allowed: str | None) -> list[EntryPoint]:
    """The installed plugins that `allowed` (the value of PAGELLM_PLUGINS; None: all) selects, in
    name order (a stable order whatever the order of the path)."""
    by_name = {ep.name: ep for ep in sorted(installed, key=lambda ep: ep.name)}
    if allowed is None:
        return list(by_name.values())
    wanted = [name.strip() for name in allowed.split(",") if name.strip()]
    missing = [name for name in wanted if name not in by_name]
    if missing:
        raise PluginError(f"{PLUGINS_ENV} names {', '.join(map(repr, missing))}, which no installed package "
                          f"declares in the entry point group {PLUGIN_GROUP!r}; installed plugins: "
                          f"{', '.join(by_name) or 'none'}")
    return [by_name[name] for name in sorted(set(wanted))]


def call_plugin(ep: EntryPoint) -> None:
    """Import plugin `ep`'s function and call it; a PluginError naming it on any failure."""
    where = f"pagellm plugin {ep.name!r} ({ep.value}"
    where += f", from the package {ep.dist.name})" if getattr(ep, "dist", None) is not None else ")"
    hint = f"; uninstall it, or set {PLUGINS_ENV} to the plugins to load"
    try:
        register = ep.load()
    except Exception as e:
        raise PluginError(f"{where} failed to import: {type(e).__name__}: {e}{hint}") from e
    if not callable(register):
        raise PluginError(f"{where} names {type(register).__name__} {register!r}, not a function to call{hint}")
    try:
        register()
    except Exception as e:
        raise PluginError(f"{where} failed: {type(e).__name__}: {e}{hint}") from e
