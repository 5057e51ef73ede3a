"""The two test tiers, and the guard that keeps the quick one honest.

`pytest -m "not slow"` is the developer's loop (under 3 minutes on 2 CPU cores): unit tests, tiny
engines on dummy weights, tiny random models, Triton kernels under the interpreter at small sizes.
`slow` marks every test that
* loads the real SmolLM2 model: the bundled GGUF, through the `smollm2_path` fixture or
  `default_model_path()` (an engine, LLM, tokenizer or config read from it, `LLM()` with no model);
* starts a server process (`pagellm serve`: `RemoteServer`, the `smollm2_server` fixture, a sweep);
* builds the Hugging Face reference of it (`hf_smollm2_model`, `hf_smollm2_tokenizer`);
* or costs seconds a case on 2 CPU cores, beyond the quick loop's budget: ranks in processes of
  their own, a Python subprocess, the larger cases of an interpreted Triton kernel (a comment at
  each such mark says so; one small case of such a test stays quick where it can).
CI (scripts/test.sh) runs both tiers.

A test that is not marked slow and uses the real model, a server or the reference fails, with a
message that says to mark it:
* before its set-up (so nothing is loaded for nothing), if it requests a fixture of
  `SLOW_FIXTURES`, directly or through other fixtures (`slow_fixture_problem`): every model, server
  and reference fixture of tests/ requests `smollm2_path`;
* at run time, if it opens the real model file or starts a process that serves or is given it
  (`RuntimeGuard`, an audit hook, `sys.addaudithook`: it sees the file opened however its path
  was found, `LLM()` with the default model too). The hook raises at the offending call, and the
  test fails even when the code under test swallows that error.
A child process is judged by its command line only (what it opens is not seen): a test whose child
loads the default model without naming it must be marked by hand.

conftest.py registers this module as a plugin; tests/test_tiers.py shows the guard at work.
"""
from __future__ import annotations

import os
import sys

import pytest

SLOW_MARK = "slow"
MARKER_LINE = (f"{SLOW_MARK}: loads the real SmolLM2 model, starts a server process or builds the Hugging Face "
               "reference (deselect with -m 'not slow' for the quick loop)")

SLOW_FIXTURES = frozenset({
    "smollm2_path",          # the real GGUF: every model, tokenizer and server fixture of tests/ requests it
    "hf_smollm2_model",      # the Hugging Face reference model
    "hf_smollm2_tokenizer",  # the Hugging Face reference tokenizer
    "smollm2_server",        # the shared `pagellm serve`
})
"""A test whose fixture closure holds one of these must be marked slow."""

HOW_TO_MARK = ("Mark it slow: `@pytest.mark.slow` on the test (or `pytest.param(..., marks=pytest.mark.slow)`), or "
               "`pytestmark = pytest.mark.slow` for the whole module. `pytest -m 'not slow'` must stay quick "
               "(see tests/tiers.py).")


def is_slow(item: pytest.Item) -> bool:
    return item.get_closest_marker(SLOW_MARK) is not None


def slow_fixture_problem(item: pytest.Item) -> str | None:
    """Why `item` must be marked slow and is not (it requests a slow fixture), or None."""
    if is_slow(item):
        return None
    used = sorted(SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())))
    if not used:
        return None
    return (f"{item.nodeid} is not marked slow but uses the slow fixture(s) {', '.join(used)} (the real SmolLM2 "
            f"model, a server or the Hugging Face reference). {HOW_TO_MARK}")


def real_model_files() -> tuple[str, ...]:
    """The real model's file(s) the runtime guard watches: the bundled GGUF, when installed."""
    from pagellm.loader import default_model_path

    try:
        return (os.path.realpath(default_model_path()),)
    except ValueError:  # not installed: nothing can load it
        return ()


class SlowResourceError(RuntimeError):
    """Raised where a test that is not marked slow opens the real model or starts a server."""


class RuntimeGuard:
    """An audit hook that fails the running test, unless it is marked slow, where it opens one of
    `model_files` or starts a process that serves (`pagellm serve`) or is given one of them.

    Python's audit hooks cannot be removed: one hook per process (`install`), which does nothing
    outside a test (collection, between tests) or within a slow one. The running tests are a stack,
    so that a test run inside a test (pytester) is guarded as itself and its outer test after it."""

    def __init__(self, model_files: tuple[str, ...]) -> None:
        self.model_files = model_files
        self._names = {os.path.basename(f) for f in model_files}
        self._running: list[pytest.Item] = []
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            sys.addaudithook(self._audit)
            self._installed = True

    # -- the running test --------------------------------------------------------------------------
    def enter(self, item: pytest.Item) -> None:
        self._running.append(item)

    def leave(self, item: pytest.Item) -> None:
        if self._running and self._running[-1] is item:
            self._running.pop()

    def guarded_item(self) -> pytest.Item | None:
        """The running test if it is not marked slow (the guard applies), else None."""
        if not self._running:
            return None
        item = self._running[-1]
        return None if is_slow(item) else item

    # -- what counts as using the real model or a server -------------------------------------------
    def is_model_file(self, path) -> bool:
        if isinstance(path, int) or path is None:
            return False
        try:
            path = os.fsdecode(path)
        except TypeError:
            return False
        # The name first: this runs for every file any test opens.
        if os.path.basename(path) not in self._names and not path.endswith(".gguf"):
            return False
        try:
            return any(os.path.samefile(path, f) for f in self.model_files)
        except OSError:
            return False

    def process_problem(self, argv) -> str | None:
        """What is slow about a child process `argv` (a server, the real model), or None."""
        if isinstance(argv, (str, bytes, os.PathLike)):
            argv = [argv]
        words = []
        for arg in argv or ():
            try:
                words.extend(os.fsdecode(arg).split())
            except TypeError:
                continue
        for i, word in enumerate(words[:-1]):
            # The console script (`.../bin/pagellm serve`) or its module (`python -m pagellm....cli serve`).
            name = os.path.basename(word)
            if (name == "pagellm" or name.startswith("pagellm.")) and words[i + 1] == "serve":
                return "starts a server process (`pagellm serve`)"
        for word in words:
            if self.is_model_file(word.split("=", 1)[-1]):
                return f"starts a process on the real model ({word})"
        return None

    def _audit(self, event: str, args: tuple) -> None:
        # Called for every audited event of the process (imports open files too): the cheap tests first.
        if event == "open":
            item = self.guarded_item()
            if item is None or not self.is_model_file(args[0]):
                return
            what = f"opened the real SmolLM2 model ({os.fsdecode(args[0])})"
        elif event == "subprocess.Popen":
            item = self.guarded_item()
            what = None if item is None else self.process_problem(args[1])
        else:
            return
        if what is not None:
            message = (f"{item.nodeid} is not marked slow but {what}: tests that load the real model, start a "
                       f"server or use the Hugging Face reference belong to the slow tier. {HOW_TO_MARK}")
            item.stash.setdefault(VIOLATIONS, []).append(message)
            raise SlowResourceError(message)


VIOLATIONS = pytest.StashKey[list]()
"""The runtime guard's messages for one test (it fails the test even if the code swallowed the error)."""

GUARD = RuntimeGuard(real_model_files())


# -- pytest hooks (this module is registered as a plugin by conftest.py) ---------------------------------

def pytest_configure(config: pytest.Config) -> None:
    if not any(line.split(":", 1)[0].strip() == SLOW_MARK for line in config.getini("markers")):
        config.addinivalue_line("markers", MARKER_LINE)
    GUARD.install()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture is set up: a test that requests a slow fixture must be marked slow."""
    problem = slow_fixture_problem(item)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    GUARD.enter(item)
    try:
        yield
    finally:
        GUARD.leave(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A phase in which the runtime guard fired fails, even if the code under test caught its error."""
    outcome = yield
    report = outcome.get_result()
    violations = item.stash.get(VIOLATIONS, [])
    if violations:
        item.stash[VIOLATIONS] = []
        if not report.failed:
            report.outcome = "failed"
            report.longrepr = "\n".join(violations)
