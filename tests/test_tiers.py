"""The test tiers' guard (tests/tiers.py): a test that is not marked slow and requests a slow fixture,
opens the real model or starts a server fails, with a message that says to mark it slow; a slow test
may do all of that. Nothing here loads a model or starts a process: the guard stops both first."""
from __future__ import annotations

import sys

import pytest

import tiers

MODEL = tiers.GUARD.model_files[0] if tiers.GUARD.model_files else None
needs_model = pytest.mark.skipif(MODEL is None, reason="the bundled SmolLM2 GGUF is not installed")


class FakeItem:
    """What the checks read of a pytest item."""

    def __init__(self, fixturenames: list[str], slow: bool = False) -> None:
        self.nodeid = "tests/test_fake.py::test_fake"
        self.fixturenames = fixturenames
        self._slow = slow

    def get_closest_marker(self, name: str):
        return pytest.mark.slow.mark if self._slow and name == "slow" else None


@pytest.mark.parametrize("fixture", sorted(tiers.SLOW_FIXTURES))
def test_a_slow_fixture_needs_the_slow_mark(fixture):
    problem = tiers.slow_fixture_problem(FakeItem(["request", fixture, "tmp_path"]))
    assert problem is not None
    assert "tests/test_fake.py::test_fake is not marked slow" in problem and fixture in problem
    assert "@pytest.mark.slow" in problem and "pytestmark = pytest.mark.slow" in problem
    assert tiers.slow_fixture_problem(FakeItem(["request", fixture], slow=True)) is None


def test_other_fixtures_need_no_mark():
    assert tiers.slow_fixture_problem(FakeItem(["request", "tmp_path", "monkeypatch"])) is None
    assert tiers.slow_fixture_problem(FakeItem([])) is None


@needs_model
def test_processes_that_serve_or_are_given_the_model_are_slow():
    problem = tiers.GUARD.process_problem
    assert "server" in problem([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", "0"])
    assert "server" in problem([sys.executable, "-m", "pagellm.cli", "serve"])  # wherever the CLI module lives
    assert "server" in problem(["/venv/bin/pagellm", "serve", "some/model"])
    assert "server" in problem("pagellm serve --port 8000")  # a shell command line
    assert "real model" in problem([sys.executable, "-m", "pagellm.entrypoints.cli", "generate", MODEL])
    assert "real model" in problem(["tool", f"--model={MODEL}"])
    assert problem(["/venv/bin/pagellm", "bench", "serve", "--base-url", "http://127.0.0.1:8000"]) is None
    assert problem(["/venv/bin/pagellm", "generate", "/tmp/tiny", "--load-format", "dummy"]) is None
    assert problem(["git", "status", "--porcelain"]) is None
    assert tiers.GUARD.is_model_file(MODEL) and not tiers.GUARD.is_model_file("/tmp/other.gguf")


@needs_model
def test_the_guard_is_on_in_this_run(request):
    """This test is not slow: opening the real model raises here, and would fail the test even if the
    error were swallowed (the violation recorded on the item is cleared for this demonstration)."""
    try:
        with pytest.raises(tiers.SlowResourceError, match="is not marked slow but opened the real SmolLM2 model"):
            open(MODEL, "rb").close()
        assert len(request.node.stash[tiers.VIOLATIONS]) == 1
    finally:
        request.node.stash[tiers.VIOLATIONS] = []


SUITE = '''
import subprocess
import sys

import pytest

MODEL = {model!r}


@pytest.fixture(scope="session")
def smollm2_path():
    return MODEL


def test_requests_the_model(smollm2_path):
    pass


def test_requests_the_model_through_a_fixture(model_dir):
    pass


@pytest.fixture
def model_dir(smollm2_path):
    return smollm2_path


def test_opens_the_model():
    open(MODEL, "rb").close()


def test_swallows_the_guards_error():
    try:
        open(MODEL, "rb").close()
    except Exception:
        pass


def test_starts_a_server():
    # Harmless if the guard let it start: `python -c pass` ignores its arguments.
    subprocess.run([sys.executable, "-c", "pass", "pagellm", "serve"], check=True)


@pytest.mark.slow
def test_marked_slow(smollm2_path):
    open(MODEL, "rb").close()
    subprocess.run([sys.executable, "-c", "pass", "pagellm", "serve"], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("x", [1])
def test_marked_slow_parametrized(smollm2_path, x):
    open(MODEL, "rb").close()


@pytest.mark.parametrize("x", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_one_slow_case(x):
    if x == 1:
        open(MODEL, "rb").close()


def test_cheap():
    pass
'''

PLUGIN = ("-p", "tiers", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning")
"""The guard as the plugin of a suite of its own (tiers is imported already: not rewritten)."""


@needs_model
def test_the_guard_fails_unmarked_tests_of_a_suite(pytester):
    """The guard as a plugin of a suite of its own: each way of using the real model or a server
    without the mark fails, with the message; the marked and the cheap tests pass."""
    pytester.makepyfile(test_suite=SUITE.format(model=MODEL))
    result = pytester.runpytest_inprocess(*PLUGIN, "-rA")
    result.assert_outcomes(passed=5, failed=3, errors=2)
    result.stdout.fnmatch_lines_random([
        "ERROR test_suite.py::test_requests_the_model - *",
        "ERROR test_suite.py::test_requests_the_model_through_a_fixture - *",
        "FAILED test_suite.py::test_opens_the_model - *",
        "FAILED test_suite.py::test_swallows_the_guards_error*",
        "FAILED test_suite.py::test_starts_a_server - *",
        "PASSED test_suite.py::test_marked_slow",
        "PASSED test_suite.py::test_marked_slow_parametrized[[]1[]]",
        "PASSED test_suite.py::test_one_slow_case[[]1[]]",
        "PASSED test_suite.py::test_one_slow_case[[]2[]]",
        "PASSED test_suite.py::test_cheap",
    ])
    out = result.stdout.str()
    for test, what in [("test_requests_the_model", "uses the slow fixture(s) smollm2_path"),
                       ("test_requests_the_model_through_a_fixture", "uses the slow fixture(s) smollm2_path"),
                       ("test_opens_the_model", "opened the real SmolLM2 model"),
                       ("test_swallows_the_guards_error", "opened the real SmolLM2 model"),
                       ("test_starts_a_server", "starts a server process (`pagellm serve`)")]:
        assert f"test_suite.py::{test} is not marked slow but {what}" in out, (test, out)
    assert "Mark it slow: `@pytest.mark.slow` on the test" in result.stdout.str()


@needs_model
def test_deselecting_slow_leaves_the_quick_tier(pytester):
    """`-m "not slow"`: the slow tests are not run at all (the slow marker is declared by the plugin)."""
    pytester.makepyfile(test_suite=SUITE.format(model=MODEL))
    result = pytester.runpytest_inprocess(*PLUGIN, "-m", "not slow", "-W", "error::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=2, failed=3, errors=2, deselected=3)
