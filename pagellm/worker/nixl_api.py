"""NIXL's agent API from whichever build is installed: the `nixl` package (which picks the build of
the machine's CUDA major), or one build alone, `nixl_cu13` or `nixl_cu12` (the test extra installs
nixl-cu12 only: it runs on host memory without a GPU)."""
from __future__ import annotations

import importlib
from types import ModuleType

_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def _load() -> ModuleType:
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("NixlConnector needs NIXL: `pip install nixl` (or one build: nixl-cu12, nixl-cu13)")


_api = _load()
nixl_agent = _api.nixl_agent
nixl_agent_config = _api.nixl_agent_config
