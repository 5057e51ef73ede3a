"""Start-up: the cache folder, stored kernel choices, phases reported, `pagellm warmup`, and the
start-up benchmark's CPU smoke run."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import triton
import zmq
from engine_utils import TINY_LLAMA
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import startup as startup_bench
from pagellm import LLM
from pagellm.cli.main import main as cli_main
from pagellm.config.cache_dirs import CACHE_ROOT_ENV, TRITON_CACHE_ENV, cache_root, use_cache_for_triton
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.wire import Ready, encoder, output_decoder
from pagellm.entrypoints.openai.api_server import server_startup_phases
from pagellm.metrics import startup
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.ops.choice_cache import ChoiceCache, choice_cache_path
from pagellm.ops.triton import dense_one_row, one_row_tiles

IDENTITY = {"device": "NVIDIA H100 80GB HBM3", "triton": "3.9.0", "pagellm": "0.1.0"}
TINY_KV_BYTES = 1 << 22


@pytest.fixture
def tiny_model_dir(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(tmp_path)


@pytest.fixture
def fresh_choices(tmp_path, monkeypatch):
    """The one-row choices of this process forgotten and the cache folder empty: as a new process
    on a new machine (the previous state comes back after the test)."""
    monkeypatch.setenv(CACHE_ROOT_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(one_row_tiles, "_CHOSEN", {})
    monkeypatch.setattr(one_row_tiles, "_STORES", {})
    monkeypatch.setattr(dense_one_row, "_FASTER", {})
    return tmp_path / "cache"


def forget_choices(monkeypatch) -> None:
    """A new process: nothing chosen in memory, the stored choices read again."""
    monkeypatch.setattr(one_row_tiles, "_CHOSEN", {})
    monkeypatch.setattr(one_row_tiles, "_STORES", {})
    monkeypatch.setattr(dense_one_row, "_FASTER", {})


# -- the cache folder -----------------------------------------------------------------------------

def test_cache_root_from_env_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root({}) == tmp_path / "home" / ".cache" / "pagellm"
    assert cache_root({"XDG_CACHE_HOME": "/xdg"}).as_posix() == "/xdg/pagellm"
    assert cache_root({"XDG_CACHE_HOME": "/xdg", CACHE_ROOT_ENV: "/ship/cache"}).as_posix() == "/ship/cache"


def test_triton_cache_dir_is_set_only_when_the_user_has_not():
    environ = {CACHE_ROOT_ENV: "/ship/cache"}
    assert use_cache_for_triton(environ).as_posix() == "/ship/cache/triton"
    assert environ[TRITON_CACHE_ENV] == "/ship/cache/triton"
    theirs = {CACHE_ROOT_ENV: "/ship/cache", TRITON_CACHE_ENV: "/mine"}
    assert use_cache_for_triton(theirs).as_posix() == "/mine"
    assert theirs[TRITON_CACHE_ENV] == "/mine"


# -- the stored choices ---------------------------------------------------------------------------

def test_choices_round_trip_through_the_file(tmp_path):
    path = choice_cache_path(tmp_path, IDENTITY)
    store = ChoiceCache.load(path, IDENTITY)
    assert store.get("tile", "(4096, 4096)") is None
    store.put("tile", "(4096, 4096)", {"kwargs": {"BLOCK_N": 4}, "num_warps": 4})
    store.put("faster", "(128256, 4096)", True)
    store.save()
    again = ChoiceCache.load(path, IDENTITY)
    assert again.get("tile", "(4096, 4096)") == {"kwargs": {"BLOCK_N": 4}, "num_warps": 4}
    assert again.get("faster", "(128256, 4096)") is True
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_another_identity_gets_its_own_file(tmp_path):
    other = {**IDENTITY, "device": "NVIDIA H200"}
    assert choice_cache_path(tmp_path, IDENTITY) != choice_cache_path(tmp_path, other)


def test_a_save_keeps_what_another_process_stored_meanwhile(tmp_path):
    path = choice_cache_path(tmp_path, IDENTITY)
    first, second = ChoiceCache.load(path, IDENTITY), ChoiceCache.load(path, IDENTITY)
    first.put("tile", "a", 1)
    first.save()
    second.put("tile", "b", 2)
    second.save()
    assert ChoiceCache.load(path, IDENTITY).sections == {"tile": {"a": 1, "b": 2}}


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[]", json.dumps({"format": 99}).encode(),
                                     json.dumps({"format": 1, "identity": IDENTITY, "sections": []}).encode()])
def test_a_corrupt_file_is_ignored_with_a_warning_and_replaced(tmp_path, caplog, content):
    path = choice_cache_path(tmp_path, IDENTITY)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="pagellm.ops.choice_cache"):
        store = ChoiceCache.load(path, IDENTITY)
    assert store.sections == {}
    assert "ignoring the kernel choices" in caplog.text
    store.put("tile", "a", 1)
    store.save()
    assert ChoiceCache.load(path, IDENTITY).get("tile", "a") == 1


def test_a_file_of_another_gpu_is_ignored(tmp_path, caplog):
    path = choice_cache_path(tmp_path, IDENTITY)
    foreign = ChoiceCache(path, {**IDENTITY, "device": "NVIDIA A100"})
    foreign.put("tile", "a", 1)
    foreign.save()  # e.g. a file copied under another name
    with caplog.at_level(logging.WARNING, logger="pagellm.ops.choice_cache"):
        assert ChoiceCache.load(path, IDENTITY).get("tile", "a") is None
    assert "NVIDIA A100" in caplog.text


def test_a_folder_that_cannot_be_written_is_a_warning(tmp_path, caplog):
    (tmp_path / "blocked").write_text("a file where the folder would go")
    store = ChoiceCache.load(choice_cache_path(tmp_path / "blocked", IDENTITY), IDENTITY)
    store.put("tile", "a", 1)
    with caplog.at_level(logging.WARNING, logger="pagellm.ops.choice_cache"):
        store.save()
    assert "could not store kernel choices" in caplog.text
    assert store.dirty


def _key(n: int) -> one_row_tiles.OneRowKey:
    return one_row_tiles.OneRowKey(torch.device("cpu"), n, 64, 64, torch.float32, torch.float32, None,
                                   (("DENSE", True),))


CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": 64}, num_warps=4, num_stages=3) for n in (2, 4, 8)]


def test_a_tile_timed_once_is_read_at_the_next_start_without_timing(fresh_choices, monkeypatch):
    weight = torch.zeros(16, 64)
    timed: list[triton.Config] = []

    def fake_replay_us(product, weights):  # BLOCK_N 4 "fastest"; records what was timed
        config = CONFIGS[len(timed) % len(CONFIGS)]
        timed.append(config)
        return abs(config.kwargs["BLOCK_N"] - 4) + 1.0

    monkeypatch.setattr(one_row_tiles, "timing", lambda: True)
    monkeypatch.setattr(one_row_tiles, "uncached_copies", lambda w: [w])
    monkeypatch.setattr(one_row_tiles, "replay_us", fake_replay_us)
    with one_row_tiles.timing_one_row_products():
        chosen = one_row_tiles.choose(_key(16), CONFIGS, lambda config, w: None, weight)
    assert chosen is CONFIGS[1] and len(timed) == len(CONFIGS)
    assert list(fresh_choices.glob("kernel_choices/*.json"))

    forget_choices(monkeypatch)
    monkeypatch.setattr(one_row_tiles, "replay_us", lambda *a: pytest.fail("a stored tile was timed again"))
    with one_row_tiles.timing_one_row_products():
        assert one_row_tiles.choose(_key(16), CONFIGS, lambda config, w: None, weight) is CONFIGS[1]
    # Another shape was never stored: outside the warm-up it takes the first candidate, untimed.
    monkeypatch.setattr(one_row_tiles, "timing", lambda: False)
    assert one_row_tiles.choose(_key(32), CONFIGS, lambda config, w: None, weight) is CONFIGS[0]


def test_a_stored_tile_no_longer_among_the_candidates_is_timed_again(fresh_choices, monkeypatch):
    store = one_row_tiles.stored_choices(torch.device("cpu"))
    store.put(one_row_tiles.TILE_SECTION, one_row_tiles.choice_key(_key(16)),
              one_row_tiles.config_json(triton.Config({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3)))
    store.save()
    forget_choices(monkeypatch)
    monkeypatch.setattr(one_row_tiles, "timing", lambda: True)
    monkeypatch.setattr(one_row_tiles, "uncached_copies", lambda w: [w])
    monkeypatch.setattr(one_row_tiles, "replay_us", lambda product, weights: 1.0)
    with one_row_tiles.timing_one_row_products():
        chosen = one_row_tiles.choose(_key(16), CONFIGS, lambda config, w: None, torch.zeros(16, 64))
    assert chosen in CONFIGS
    forget_choices(monkeypatch)
    stored = one_row_tiles.stored_choices(torch.device("cpu")).get(one_row_tiles.TILE_SECTION,
                                                                   one_row_tiles.choice_key(_key(16)))
    assert stored == one_row_tiles.config_json(chosen)


@pytest.mark.parametrize("async_compile", [True, False, "callers"], ids=["async-compile", "old-triton", "callers"])
def test_candidates_compile_side_by_side_before_the_first_is_timed(fresh_choices, monkeypatch, async_compile):
    """Where Triton compiles on threads, every candidate is compiled before the first is timed; a
    failed compile is left to the timing; an older Triton, or a caller's compile mode already
    active, leaves every compile to the timing."""
    events: list[tuple[str, int]] = []

    def run(config, w, compile_only=False):
        events.append(("compile" if compile_only else "launch", config.kwargs["BLOCK_N"]))
        if compile_only and config.kwargs["BLOCK_N"] == 8:
            raise RuntimeError("ptxas failed")  # the timing compiles (and reports) it again

    def replay(product, weights):
        product(weights[0])
        return 1.0

    if not async_compile:
        monkeypatch.setattr(one_row_tiles, "_AsyncCompileMode", None)
    monkeypatch.setattr(one_row_tiles, "timing", lambda: True)
    monkeypatch.setattr(one_row_tiles, "uncached_copies", lambda w: [w])
    monkeypatch.setattr(one_row_tiles, "replay_us", replay)
    with contextlib.ExitStack() as stack:
        if async_compile == "callers":
            stack.enter_context(triton.AsyncCompileMode(stack.enter_context(ThreadPoolExecutor(1))))
        stack.enter_context(one_row_tiles.timing_one_row_products())
        one_row_tiles.choose(_key(16), CONFIGS, run, torch.zeros(16, 64))
    launches = [("launch", c.kwargs["BLOCK_N"]) for c in CONFIGS]
    compiles = [("compile", c.kwargs["BLOCK_N"]) for c in CONFIGS] if async_compile is True else []
    assert events == compiles + launches


def test_the_dense_kernel_against_cublas_choice_is_read_when_stored(fresh_choices, monkeypatch):
    x, weight = torch.zeros(1, 64), torch.zeros(16, 64)
    monkeypatch.setattr(dense_one_row, "timing", lambda: False)
    assert dense_one_row.dense_gemv_is_faster(x, weight) is False  # not timed, nothing stored: cuBLAS
    key = (x.device, tuple(weight.shape), weight.stride(0), weight.dtype, x.dtype)
    store = one_row_tiles.stored_choices(x.device)
    store.put(dense_one_row.FASTER_SECTION, one_row_tiles.choice_key(key), True)
    store.save()
    forget_choices(monkeypatch)
    assert dense_one_row.dense_gemv_is_faster(x, weight) is True


# -- phases ---------------------------------------------------------------------------------------

def test_phases_add_up_to_the_wall_time_and_describe_in_one_line():
    phases = startup.StartupPhases()
    phases.add("a", 1.0)
    phases.add("a", 0.5)
    phases.add("b", 2.0)
    merged = startup.with_total(startup.with_remainder(phases.as_dict(), 5.0, "rest"))
    assert merged == {"a": 1.5, "b": 2.0, "rest": 1.5, "total": 5.0}
    assert startup.with_remainder({"a": 3.0}, 2.0, "rest")["rest"] == 0.0
    assert startup.slowest([{"a": 1.0, "b": 3.0}, {"a": 2.0}]) == {"a": 2.0, "b": 3.0}
    assert startup.describe(merged) == "5.00 s (a 1.50 s, b 2.00 s, rest 1.50 s)"


def test_the_ready_message_carries_the_engine_cores_phases_to_the_api_process():
    phases = {startup.LOAD_WEIGHTS: 1.5, startup.CUDA_GRAPH_CAPTURE: 0.25}
    message = output_decoder.decode(encoder.encode(Ready(12, phases)))
    assert isinstance(message, Ready) and message.num_blocks == 12 and message.startup_phases == phases


def test_llm_reports_its_startup_phases(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pagellm.engine.llm_engine"):
        llm = LLM(tiny_model_dir, load_format="dummy", device="cpu", dtype="float32",
                  kv_cache_memory_bytes=TINY_KV_BYTES)
    phases = llm.llm_engine.startup_phases
    for name in (startup.ENGINE_CONFIG, startup.LOAD_WEIGHTS, startup.KV_CACHE_ALLOCATE, startup.START_WORKERS,
                 startup.ENGINE_OTHER, startup.FRONTEND):
        assert phases[name] >= 0.0, name
    assert phases[startup.LOAD_WEIGHTS] > 0.0
    # The CPU has no memory profile, kernel warm-up or graphs.
    assert startup.PROFILE_RUN not in phases and startup.CUDA_GRAPH_CAPTURE not in phases
    assert phases[startup.TOTAL] == pytest.approx(sum(v for k, v in phases.items() if k != startup.TOTAL))
    assert f"engine ready in {startup.describe(phases)}" in caplog.text
    llm.llm_engine.shutdown()


@pytest.mark.slow  # spawns an engine-core process: seconds
def test_engine_phases_end_when_the_core_was_ready_not_when_the_api_process_read_it(tiny_model_dir):
    config = EngineArgs(tiny_model_dir, load_format="dummy", device="cpu", dtype="float32",
                        kv_cache_memory_bytes=TINY_KV_BYTES).create_engine_config()
    spawned = time.perf_counter()
    engine = AsyncLLM(config, wait=False)
    try:
        # The ready message waits unread (poll does not take it) while this process does its own start.
        assert zmq.Socket.shadow(engine._cores[0].output.underlying).poll(120_000)
        ready_seen = time.perf_counter()
        time.sleep(1.0)  # the API process's own start-up work, outlasting the core's
        engine.wait_until_ready()
        engine_s = sum(engine.startup_phases.values())
        assert 0.0 < engine_s <= ready_seen - spawned
        assert engine.startup_phases[startup.ENGINE_PROCESS_START] > 0.0
    finally:
        engine.shutdown()


def test_the_server_reports_its_phases_as_a_gauge():
    phases = server_startup_phases({startup.LOAD_WEIGHTS: 2.0, startup.ENGINE_PROCESS_START: 1.0}, serve_s=0.0)
    # The API process's own share is what its age leaves after the engine's phases (this test's
    # process has lived longer than 3 s of phases).
    assert phases[startup.API_SERVER] > 0.0
    assert phases[startup.TOTAL] == pytest.approx(3.0 + phases[startup.API_SERVER])
    logger = PrometheusStatLogger("tiny")
    logger.record_startup(phases)
    exposed = {s.labels["phase"]: s.value for family in text_string_to_metric_families(logger.render().decode())
               for s in family.samples if s.name == "pagellm:startup_seconds"}
    assert exposed == pytest.approx(phases)


# -- pagellm warmup and the benchmark -------------------------------------------------------------

@pytest.mark.parametrize("runner", ["generate", "pooling"])
def test_warmup_runs_a_request_of_either_runner_and_exits_0(tiny_model_dir, tmp_path, monkeypatch, capsys, runner):
    monkeypatch.setenv(CACHE_ROOT_ENV, str(tmp_path / "cache"))
    code = cli_main(["warmup", tiny_model_dir, "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
                     "--kv-cache-memory-bytes", str(TINY_KV_BYTES), "--runner", runner])
    assert code == 0
    out = capsys.readouterr().out
    assert "engine built in" in out and f"start-up cache: {tmp_path / 'cache'}" in out


@pytest.mark.slow  # a Python subprocess building the CPU kernels into an empty cache folder: seconds
def test_warmup_builds_the_engine_and_fills_the_cache_folder(tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    # A process of its own: this one has loaded its CPU kernels from wherever it found them first.
    done = subprocess.run([sys.executable, "-m", "pagellm.cli", "warmup", tiny_model_dir, "--load-format", "dummy",
                           "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(TINY_KV_BYTES)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, CACHE_ROOT_ENV: str(cache), "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(cache.glob("cpu_kernels-*.so"))
    assert f"start-up cache: {cache}" in done.stdout and "load_weights" in done.stdout


@pytest.mark.slow  # starts `pagellm serve` three times, warmup and LLM in five processes: a minute
def test_startup_benchmark_smoke(tmp_path):
    payload = startup_bench.main(["--smoke", "--out-dir", str(tmp_path)])
    cases = {row["case"]: row for row in payload["cases"]}
    assert set(cases) == {"serve_empty_cache", "serve_filled_cache", "warmup", "serve_after_warmup",
                          "llm_float32_empty_cache", "llm_float32_filled_cache", "llm_bfloat16_empty_cache",
                          "llm_bfloat16_filled_cache"}
    for name, row in cases.items():  # the server's phases come from its /metrics
        if name != "warmup":
            assert row["phases"][startup.TOTAL] > 0 and row["phases"][startup.LOAD_WEIGHTS] > 0
    assert cases["serve_empty_cache"]["phases"][startup.ENGINE_PROCESS_START] > 0
    # The warm-up filled its folder (on the CPU: the C kernels), which the server after it used.
    assert cases["warmup"]["cache_after"]["files"] >= 1
    assert cases["serve_after_warmup"]["cache_after"] == cases["warmup"]["cache_after"]
    written = json.loads((tmp_path / "startup_smoke_cpu.json").read_text())
    assert written["cases"] == payload["cases"] and written["git"]["commit"]


def test_startup_benchmark_serve_cases_need_no_gguf_and_a_cut_run_keeps_finished_cases(tmp_path, monkeypatch):
    def no_gguf() -> str:
        raise AssertionError("the serve and warmup cases must not look for the SmolLM2 GGUF")

    def serve_case(name, model, args, cache):
        if name == "serve_filled_cache":
            raise TimeoutError("the run was cut here")
        return {"case": name, "ready_s": 1.5, "client_ready_s": 1.6, "phases": {startup.TOTAL: 1.5}}

    monkeypatch.setattr(startup_bench, "default_model_path", no_gguf)
    monkeypatch.setattr(startup_bench, "serve_case", serve_case)
    with pytest.raises(TimeoutError):
        startup_bench.main(["--cases", "serve", "warmup", "--out-dir", str(tmp_path)])
    written = json.loads(next(tmp_path.glob("startup_*.json")).read_text())
    assert [row["case"] for row in written["cases"]] == ["serve_empty_cache"]
    assert written["cases"][0]["ready_s"] == 1.5
