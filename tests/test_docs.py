"""The README and docs/: MkDocs builds the docs with --strict, the README stays a short guide whose links
resolve, and every code block marked runnable in README.md and docs/*.md runs.

A runnable block is a fenced `bash` or `python` block right after an HTML comment line:

    <!-- runnable -->                 run the block as it is
    <!-- runnable: server -->         start `pagellm serve` first; the block talks to 127.0.0.1:8000
    <!-- runnable: server FLAGS -->   the same with `pagellm serve FLAGS`

docs/development.md#runnable-blocks says how the blocks run. Running them loads the real model and
starts servers, so those tests are `slow`; the build and the checks of the markers are not.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from server_utils import RemoteServer

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = REPO / ".venv" / "bin"
README = REPO / "README.md"
README_MAX_LINES = 400

MARKER = re.compile(r"^<!--\s*runnable(?::\s*(?P<spec>.*?))?\s*-->\s*$")
FENCE_OPEN = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
LANGUAGES = ("bash", "python")
# A server block's address as written; the test substitutes the address of the server it started.
DOC_ADDRESSES = ("127.0.0.1:8000", "localhost:8000")
# The server the blocks get: the embedded model on the CPU in float32 (the C kernels' fast path, as
# the suite's shared server runs it), a small KV cache (a default-sized one is a quarter of RAM) and a
# context that fits in it. A marker's flags come after these.
SERVER_BASE_FLAGS = ("--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20),
                     "--max-model-len", "2048")
SERVER_START_TIMEOUT_S = 180.0
BLOCK_TIMEOUT_S = 300.0
# As in tests/test_clients.py: no client library reaches for the network.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
               "LITELLM_TELEMETRY": "False", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
# Prepended to every bash block: an HTTP error status fails the block, and no progress meter.
BASH_PRELUDE = 'curl() { command curl --silent --show-error --fail-with-body "$@"; }\n'


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    server_flags: tuple[str, ...] | None  # None: no server

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


def parse_blocks(path: Path) -> tuple[list[Block], list[str]]:
    """The runnable blocks of one Markdown file, and what is wrong with its markers."""
    blocks: list[Block] = []
    errors: list[str] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    marker: tuple[int, str | None] | None = None  # (line, spec) of a marker awaiting its fence
    fence: str | None = None  # the open fence, while inside a block
    start = 0
    info = ""
    body: list[str] = []
    for number, line in enumerate(lines, start=1):
        if fence is not None:
            stripped = line.strip()
            if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
                if marker is not None:
                    spec = marker[1]
                    lang = info.split()[0] if info.split() else ""
                    server = None
                    if spec is not None:
                        words = shlex.split(spec)
                        if not words or words[0] != "server":
                            errors.append(f"{path.name}:{marker[0]}: unknown runnable spec {spec!r}")
                        server = tuple(words[1:])
                    if lang not in LANGUAGES:
                        errors.append(f"{path.name}:{start}: a runnable block must be one of {LANGUAGES}, not {lang!r}")
                    blocks.append(Block(path, start, lang, "\n".join(body) + "\n", server))
                    marker = None
                fence = None
            else:
                body.append(line)
            continue
        match = MARKER.match(line.strip())
        if match:
            if marker is not None:
                errors.append(f"{path.name}:{marker[0]}: runnable marker not followed by a code block")
            marker = (number, match.group("spec"))
            continue
        opening = FENCE_OPEN.match(line)
        if opening:
            fence, info, start, body = opening.group("fence"), opening.group("info").strip(), number, []
            if marker is not None and marker[0] != number - 1:
                errors.append(f"{path.name}:{marker[0]}: runnable marker must be the line just before its block")
                marker = None
            continue
        if marker is not None and line.strip():
            errors.append(f"{path.name}:{marker[0]}: runnable marker not followed by a code block")
            marker = None
    if marker is not None:
        errors.append(f"{path.name}:{marker[0]}: runnable marker at the end of the file")
    if fence is not None:
        errors.append(f"{path.name}:{start}: code block never closed")
    return blocks, errors


def all_blocks() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    errors: list[str] = []
    for path in doc_files():
        found, wrong = parse_blocks(path)
        blocks += found
        errors += wrong
    return blocks, errors


def _block_order(block: Block) -> tuple:
    # Blocks without a server first, then grouped by server flags, so that each server starts once.
    return (block.server_flags is not None, block.server_flags or (), str(block.path), block.line)


BLOCKS = sorted(all_blocks()[0], key=_block_order)


# -- fast: the build and the markers ------------------------------------------------------------------


def test_mkdocs_build_is_strict_clean(tmp_path):
    """A page missing from the nav, a link to a missing page or to a missing heading fails the build."""
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("mkdocs is not installed: pip install -e '.[test]'")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_a_short_guide_that_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md is over {README_MAX_LINES} lines: move reference to docs/"
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert "bash scripts/setup.sh && .venv/bin/pagellm serve" in first_block
    assert "bash scripts/test.sh" in first_block
    # The README's test command is what CI runs, and the fast loop's marker is registered.
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    assert 'pytest -m "not slow"' in text
    assert re.search(r'"slow\b', (REPO / "pyproject.toml").read_text()), "the slow marker is not registered"


def test_readme_links_resolve():
    """GitHub shows the README; MkDocs does not build it, so its relative links are checked here."""
    text = README.read_text(encoding="utf-8")
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (REPO / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"README.md links to missing files: {missing}"


def test_runnable_markers_are_well_formed():
    blocks, errors = all_blocks()
    assert not errors, "\n".join(errors)
    assert any(b.path == README and b.server_flags is None for b in blocks), "no runnable block in README.md"
    assert any(b.path == README and b.server_flags is not None for b in blocks), "no server block in README.md"
    for block in blocks:
        # The set-up commands are not rerun: the test suite runs inside what they made.
        assert "scripts/setup.sh" not in block.code and "scripts/test.sh" not in block.code, block.name
        if block.server_flags is not None:
            assert any(address in block.code for address in DOC_ADDRESSES), \
                f"{block.name}: a server block that never talks to {DOC_ADDRESSES[0]}"
            assert "pagellm serve" not in block.code, f"{block.name}: the test starts the server itself"


# -- slow: running the blocks ------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {**os.environ, **OFFLINE_ENV}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    # This checkout's package, also where the venv's editable install points at another one.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


class Servers:
    """At most one server at a time: a block asking for other flags stops the one running, and a server
    that has exited is started afresh."""

    def __init__(self) -> None:
        self.current: RemoteServer | None = None
        self.flags: tuple[str, ...] = ()

    def get(self, flags: tuple[str, ...]) -> RemoteServer:
        """`pagellm serve` of the embedded model with `flags`, as a reader would start it (the venv's
        console script), on a free port."""
        if self.current is not None and (self.flags != flags or self.current.process.poll() is not None):
            self.stop()
        if self.current is None:
            self.current = RemoteServer(None, *SERVER_BASE_FLAGS, *flags, program=[str(VENV_BIN / "pagellm")],
                                        cwd=str(REPO), env=_env(), startup_timeout_s=SERVER_START_TIMEOUT_S)
            self.flags = flags
        return self.current

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


@pytest.fixture(scope="module")
def doc_servers():
    servers = Servers()
    yield servers
    servers.stop()


def _command(block: Block, code: str, tmp_path: Path) -> list[str]:
    if block.lang == "bash":
        return ["bash", "-euo", "pipefail", "-c", BASH_PRELUDE + code]
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    return [str(VENV_BIN / "python"), str(script)]


def _run(block: Block, command: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{block.name} ran past {BLOCK_TIMEOUT_S:.0f} s:\n{error.stdout}\n{error.stderr}")


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_runnable_block(block: Block, doc_servers: Servers, tmp_path):
    if not (VENV_BIN / "pagellm").exists():
        pytest.skip(f"the blocks run the venv of scripts/setup.sh, and {VENV_BIN / 'pagellm'} is missing")
    code = block.code
    server = None
    if block.server_flags is not None:
        server = doc_servers.get(block.server_flags)
        for address in DOC_ADDRESSES:
            code = code.replace(address, server.address)
    command = _command(block, code, tmp_path)
    run = _run(block, command)
    if server is not None and server.process.poll() is not None:
        # The server died under the block (on a machine short of CPU, the engine core's heartbeat can
        # miss its one-second deadline and the server exits 1 by design): once, with a fresh server.
        died = f"the server exited with {server.process.returncode} during the block:\n{server.log_tail()}"
        warnings.warn(f"{block.name}: {died}\nrunning the block again with a fresh server")
        doc_servers.stop()
        server = doc_servers.get(block.server_flags)
        code = block.code
        for address in DOC_ADDRESSES:
            code = code.replace(address, server.address)
        command = _command(block, code, tmp_path)
        run = _run(block, command)
    detail = f"{block.name} exited with {run.returncode}\n--- stdout\n{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}"
    if server is not None:
        detail += f"\n--- server log\n{server.log_tail()}"
    assert run.returncode == 0, detail
