"""The package's shape: its import-linter contracts hold with nothing ignored, the layers picture in
the docs is current, and the scheduler's layer stays free of torch."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_import_contracts_hold_without_ignored_imports() -> None:
    """`lint-imports` checks every import, those inside functions too: the layers (each package
    imports only from layers below it), no cycle between the modules of any package, and the
    router's distance from the engine (it reaches engines by HTTP only)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert {c["type"] for c in contracts} == {"layers", "acyclic_siblings", "forbidden"}
    assert not any("ignore_imports" in c for c in contracts)
    done = _run(str(Path(sys.executable).with_name("lint-imports")))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_the_layers_picture_is_current() -> None:
    done = _run(sys.executable, "scripts/layers_diagram.py", "--check")
    assert done.returncode == 0, done.stderr


def test_core_imports_without_torch() -> None:
    """The scheduler, block pool and request types are pure Python: they load (and are unit-tested)
    without torch."""
    code = ("import sys, pagellm.core.scheduler, pagellm.core.request, pagellm.core.outputs; "
            "sys.exit('torch' in sys.modules)")
    done = _run(sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr or "pagellm.core imported torch"
