"""The command line's catalogue of bad input: every command, every bad value that can be found
without a model, each refused with exit status 2 and one stderr line (after the command's usage,
when argparse found it) that names the flag, no traceback, and before any model loads: the
engine's constructors raise if reached. The cases run in-process, `main(argv)`, to stay fast; one
subprocess shows the installed console script doing the same. An error that needs the model (a KV
cache too small for one block) loads a tiny dummy model."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from pagellm.benchmarks.server_process import ServerProcess
from pagellm.cli import main
from pagellm.engine.core import EngineCore
from pagellm.engine.core_client import CoreClient

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
CPU = ("--device", "cpu")


def reads_the_model(argv: list[str], flag: str):
    """A case whose check reads the default model (the real SmolLM2 GGUF) first, cheap as it is:
    slow, as every test that opens the real model (tests/tiers.py)."""
    return pytest.param(argv, flag, marks=pytest.mark.slow)


SMALL_DATASET = ("--num-prompts", "1", "--input-len", "8", "--output-len", "2")
"""So that a bench throughput case whose error comes with the engine's config makes few prompts first."""

ENGINE_CASES = [
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-seqs", "many"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "4"], "--max-num-batched-tokens"),
    (["--block-size", "7"], "--block-size"),
    (["--dtype", "float64"], "--dtype"),
    (["--load-format", "pickle"], "--load-format"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--kv-cache-memory-bytes", "-1"], "--kv-cache-memory-bytes"),
    (["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--max-logprobs", "-1"], "--max-logprobs"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--pipeline-parallel-size", "0"], "--pipeline-parallel-size"),
    (["--data-parallel-size", "0"], "--data-parallel-size"),
    (["--distributed-executor-backend", "slurm"], "--distributed-executor-backend"),
    (["--distributed-executor-backend", "uni", "--tensor-parallel-size", "3"], "--distributed-executor-backend"),
    (["--attention-backend", "flash"], "--attention-backend"),
    (["--runner", "classify"], "--runner"),
    (["--runner", "pooling", "--pooler-config", "{not json"], "--pooler-config"),
    (["--runner", "pooling", "--pooler-config", '{"pooling_type": "MAX"}'], "--pooler-config"),
    (["--pooler-config", "{}"], "--pooler-config"),
    (["--speculative-config", "{not json"], "--speculative-config"),
    (["--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "--speculative-config"),
    (["--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 3}'], "--speculative-config"),
    (["--speculative-config", '{"model": "d.gguf", "num_speculative_tokens": 3, "quantization": "fp4"}'],
     "--speculative-config"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--tensor-parallel-size", "3"],
     "--speculative-config"),
    (["--reasoning-parser", "o1"], "--reasoning-parser"),
    (["--structured-outputs-compile-timeout", "0"], "--structured-outputs-compile-timeout"),
    (["--structured-outputs-max-bytes", "0"], "--structured-outputs-max-bytes"),
    (["--enforce-eager=yes"], "--enforce-eager"),
]
"""Engine flags every command that runs the engine takes; checked before the model is even resolved."""

MODEL_CASES = [
    ([*CPU, "--attention-backend", "triton"], "--attention-backend"),
    ([*CPU, "--tensor-parallel-size", "2"], "--tensor-parallel-size"),  # SmolLM2 has 9 heads
    ([*CPU, "--pipeline-parallel-size", "1000"], "--pipeline-parallel-size"),
    ([*CPU, "--max-model-len", "100000"], "--max-model-len"),
    ([*CPU, "--speculative-config", '{"model": "/no/such/draft.gguf", "num_speculative_tokens": 3}'],
     "--speculative-config"),
]
DEVICE_CASES = [
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:x"], "--device"),
    *([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device")]),
]
CONFIG_CASES = MODEL_CASES + DEVICE_CASES
"""Engine flags checked against the model's shape and the machine: still before any weight loads. The
model's shape is read from the default model, the real SmolLM2 GGUF: MODEL_CASES are slow (tests/tiers.py),
and so are DEVICE_CASES for bench throughput (its prompts come from the model's tokenizer first)."""

ENGINE_COMMANDS = {
    "generate": ["generate", "--prompt", "hi"],
    "serve": ["serve", "--port", "0"],  # any free port: the port is bound before the engine flags are read
    "bench throughput": ["bench", "throughput", *SMALL_DATASET],
    "bench latency": ["bench", "latency", "--batch-sizes", "1", "--input-len", "8", "--output-len", "2"],
}

COMMAND_CASES = [
    # the top level
    ([], "{generate,serve,warmup,router,bench,plan,eval}"),
    (["translate"], "{generate,serve,warmup,router,bench,plan,eval}"),
    (["--bogus-flag"], "{generate,serve,warmup,router,bench,plan,eval}"),
    (["bench"], "{throughput,latency,serve,sweep}"),
    (["bench", "speed"], "{throughput,latency,serve,sweep}"),
    # generate
    (["generate", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--max-tokens", "-5"], "--max-tokens"),
    (["generate", "--max-tokens", "lots"], "--max-tokens"),
    (["generate", "--temperature", "-1"], "--temperature"),
    (["generate", "--temperature", "nan"], "--temperature"),
    (["generate", "--temperature", "inf"], "--temperature"),
    (["generate", "--top-p", "0"], "--top-p"),
    (["generate", "--top-p", "1.5"], "--top-p"),
    (["generate", "--sampling-seed", "0.5"], "--sampling-seed"),
    (["generate", "--prompt"], "--prompt"),
    (["generate", "--bogus-flag"], "--bogus-flag"),
    (["generate", "model-a", "model-b"], "model-b"),
    (["generate", "/no/such/model.gguf", "--prompt", "hi"], "model"),
    (["generate", *CPU, "--data-parallel-size", "2", "--prompt", "hi"], "--data-parallel-size"),
    # serve
    # router (each fails before anything is served)
    (["router", "--port", "99999"], "--port"),
    (["router", "--bogus-flag"], "--bogus-flag"),
    (["router", "--backend", "alpha"], "--backend"),
    (["router", "--config", "/no/such/router.yaml"], "--config"),
    (["router"], "models"),
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--port", "-1"], "--port"),
    (["serve", "--port", "http"], "--port"),
    (["serve", "--bogus-flag"], "--bogus-flag"),
    (["serve", "--port", "0", "/no/such/model.gguf"], "model"),
    (["serve", "--max-waiting-requests", "-1"], "--max-waiting-requests"),
    (["serve", "--request-timeout", "-1"], "--request-timeout"),
    (["serve", "--queue-timeout", "-1"], "--queue-timeout"),
    (["serve", "--max-seqs-in-flight", "0"], "--max-seqs-in-flight"),
    (["serve", "--max-tokens-in-flight", "0"], "--max-tokens-in-flight"),
    (["serve", "--engine-stall-timeout", "-1"], "--engine-stall-timeout"),
    (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["serve", "--uvicorn-log-level", "loud"], "--uvicorn-log-level"),
    (["serve", "--tool-call-parser", "pythonic"], "--tool-call-parser"),
    (["serve", "--served-model-name"], "--served-model-name"),
    (["serve", "--port", "0", "--enable-auto-tool-choice"], "--tool-call-parser"),
    (["serve", "--port", "0", "--chat-template", "no-such-template.jinja"], "--chat-template"),
    (["serve", "--port", "0", "--chat-template", "{% for m in messages %}"], "--chat-template"),
    (["serve", "--port", "0", "--max-request-body-bytes", "0"], "--max-request-body-bytes"),
    (["serve", "--port", "0", "--max-n", "0"], "--max-n"),
    (["serve", "--port", "0", "--max-stop-sequences", "0"], "--max-stop-sequences"),
    (["serve", "--port", "0", "--max-prompts", "0"], "--max-prompts"),
    (["serve", "--port", "0", "--max-request-seqs", "0"], "--max-request-seqs"),
    (["serve", "--port", "0", "--max-request-tokens", "0"], "--max-request-tokens"),
    (["serve", "--lora-modules", "sql"], "--lora-modules"),
    (["serve", "--lora-modules", '{"name": "sql"}'], "--lora-modules"),
    (["serve", "--lora-modules", '{"name": "sql", "path": "/a", "rank": 8}'], "--lora-modules"),
    (["serve", "--port", "0", "--lora-modules", "sql=/adapters/sql"], "--enable-lora"),
    # bench throughput (and the dataset flags bench serve and sweep share)
    (["bench", "throughput", "--num-prompts", "0"], "--num-prompts"),
    (["bench", "throughput", "--input-len", "0"], "--input-len"),
    (["bench", "throughput", "--output-len", "-1"], "--output-len"),
    (["bench", "throughput", "--random-range-ratio", "1"], "--random-range-ratio"),
    (["bench", "throughput", "--prefix-len", "0"], "--prefix-len"),
    (["bench", "throughput", "--num-prefixes", "0"], "--num-prefixes"),
    (["bench", "throughput", "--dataset", "alpaca"], "--dataset"),
    (["bench", "throughput", "--dataset", "sharegpt", "--dataset-path", "/nope.json"], "--dataset-path"),
    reads_the_model(["bench", "throughput", "--dataset", "sharegpt", "--dataset-path", "BAD_JSON"], "--dataset-path"),
    reads_the_model(["bench", "throughput", "--dataset", "sharegpt", "--dataset-path", "EMPTY_ARRAY"], "--num-prompts"),
    (["bench", "throughput", *SMALL_DATASET, "--model", "/no/such/model"], "model"),
    (["bench", "throughput", "--bogus-flag"], "--bogus-flag"),
    (["bench", "throughput", "--output-json", "UNDER_A_FILE"], "--output-json"),
    (["bench", "throughput", "--output-json", "FOLDER"], "--output-json"),
    # bench latency
    (["bench", "latency", "--batch-sizes", "0"], "--batch-sizes"),
    (["bench", "latency", "--batch-sizes"], "--batch-sizes"),
    (["bench", "latency", "--input-len", "0"], "--input-len"),
    (["bench", "latency", "--output-len", "1"], "--output-len"),
    (["bench", "latency", "--num-iters", "0"], "--num-iters"),
    (["bench", "latency", "--num-iters-warmup", "-1"], "--num-iters-warmup"),
    # bench serve
    (["bench", "serve", "--base-url", "localhost:8000"], "--base-url"),
    (["bench", "serve", "--endpoint", "/v1/embeddings"], "--endpoint"),
    (["bench", "serve", "--request-rate", "0"], "--request-rate"),
    (["bench", "serve", "--burstiness", "0"], "--burstiness"),
    (["bench", "serve", "--max-concurrency", "0"], "--max-concurrency"),
    (["bench", "serve", "--num-warmups", "-1"], "--num-warmups"),
    (["bench", "serve", "--goodput", "ttft"], "--goodput"),
    (["bench", "serve", "--goodput", "latency:100"], "--goodput"),
    (["bench", "serve", "--temperature", "-0.5"], "--temperature"),
    (["bench", "serve", "--num-prompts", "0"], "--num-prompts"),
    (["bench", "serve", "--dataset-path", "/nope.json"], "--dataset-path"),
    (["bench", "serve", "--bogus-flag"], "--bogus-flag"),
    # bench sweep
    (["bench", "sweep"], "--values"),
    (["bench", "sweep", "--values", "0"], "--values"),
    (["bench", "sweep", "--values", "4", "2"], "--values"),
    (["bench", "sweep", "--sweep", "max-concurrency", "--values", "1.5"], "--values"),
    (["bench", "sweep", "--sweep", "tokens", "--values", "1"], "--sweep"),
    (["bench", "sweep", "--values", "1", "--slo", "ttft"], "--slo"),
    (["bench", "sweep", "--values", "1", "--slo", "ttft_p99:-5"], "--slo"),
    (["bench", "sweep", "--values", "1", "--min-gain", "1"], "--min-gain"),
    (["bench", "sweep", "--values", "1", "--server-args", '--device "cpu'], "--server-args"),
    (["bench", "sweep", "--values", "1", "--request-rate", "-1"], "--request-rate"),
    # plan
    (["plan", "--input-len", "0"], "--input-len"),
    (["plan", "--output-len", "-1"], "--output-len"),
    (["plan", "--gpu-memory-gib", "-1"], "--gpu-memory-gib"),
    (["plan", "--gpu-memory-gib", "0"], "--gpu-memory-gib"),
    (["plan", "--device", "tpu"], "--device"),
    (["plan", "--quantization", "int2"], "--quantization"),
    (["plan", "--kv-cache-dtype", "fp4"], "--kv-cache-dtype"),
    reads_the_model(["plan", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    reads_the_model(["plan", "--block-size", "7"], "--block-size"),
    reads_the_model(["plan", "--max-num-seqs", "0"], "--max-num-seqs"),
    *([] if torch.cuda.is_available() else [reads_the_model(["plan", "--device", "cuda"], "--gpu-memory-gib")]),
    # (--tensor-parallel-size not dividing the heads: tests/test_plan.py, as it builds the model on the meta device)
    (["plan", "/no/such/model.gguf"], "model"),
    (["plan", "--bogus-flag"], "--bogus-flag"),
    # eval
    (["eval", "--quantization", "none", "fp4"], "--quantization"),
    (["eval", "--reference", "int2"], "--reference"),
    (["eval", "--context", "0"], "--context"),
    (["eval", "--max-tokens", "-5"], "--max-tokens"),
    (["eval", "--context", "1"], "--context"),  # a window of one token predicts nothing
    (["eval", "--text", "/no/such/file.txt"], "--text"),
    (["eval", "--text", "FOLDER"], "--text"),
    reads_the_model(["eval", *CPU, "--text", "NOT_UTF8"], "--text"),
    (["eval", "--output-json", "UNDER_A_FILE"], "--output-json"),
    (["eval", "TINY_CONFIG_DIR", "--load-format", "dummy", "--reference", "gguf"], "--reference"),
    reads_the_model(["eval", "--dtype", "float64"], "--dtype"),
]


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    """The engine's constructors (in-process and in its own process) and the sweep's server fail
    the test if reached; `pagellm serve`'s signal handlers are put back."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the error")

    for cls in (EngineCore, CoreClient, ServerProcess):
        monkeypatch.setattr(cls, "__init__", loaded)
    # conftest.py sets it for the Triton interpreter, which lets the triton backend run on a CPU.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Stand-ins in the argv of the cases: a file that is not JSON, and a JSON array without a conversation."""
    folder = tmp_path_factory.mktemp("cli-errors")
    (folder / "bad.json").write_text("{not json")
    (folder / "empty.json").write_text("[]")
    (folder / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (folder / "tiny").mkdir()
    (folder / "tiny" / "config.json").write_text(json.dumps(TINY_LLAMA))
    return {"BAD_JSON": str(folder / "bad.json"), "EMPTY_ARRAY": str(folder / "empty.json"),
            "UNDER_A_FILE": str(folder / "bad.json" / "out.json"), "FOLDER": str(folder),
            "NOT_UTF8": str(folder / "latin1.txt"), "TINY_CONFIG_DIR": str(folder / "tiny")}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(folder)


def _case_id(value: list[str] | str) -> str:
    return " ".join(value) if isinstance(value, list) else value


def run_cli(argv: list[str]) -> int:
    """`main(argv)`'s exit status, also when argparse exits."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def assert_refused(argv: list[str], flag: str, capsys) -> str:
    """Exit status 2, a last stderr line `pagellm CMD: error: ...` naming `flag` and the only one
    that says error, any usage before it the command's own, and no traceback. Returns that line."""
    code = run_cli(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.rstrip("\n").splitlines()
    prog = "pagellm" + "".join(f" {word}" for word in _command(argv))
    assert re.match(rf"{re.escape(prog)}: error: ", lines[-1]), err
    assert sum(": error: " in line for line in lines) == 1, err
    assert flag in lines[-1], err
    if len(lines) > 1:
        assert lines[0].startswith(f"usage: {prog} "), err
    return lines[-1]


def _command(argv: list[str]) -> list[str]:
    """The (sub)command words that start `argv`, as far as they are real commands."""
    if argv[:1] == ["bench"]:
        return argv[:2] if argv[1:2] and argv[1] in ("throughput", "latency", "serve", "sweep") else argv[:1]
    return argv[:1] if argv[:1] and argv[0] in ("generate", "serve", "router", "plan", "eval") else []


@pytest.mark.parametrize("argv, flag", COMMAND_CASES, ids=_case_id)
def test_command_refuses_bad_input(argv, flag, files, capsys):
    assert_refused([files.get(a, a) for a in argv], flag, capsys)


def _engine_flag_cases() -> list:
    """(command, args, flag) for every command of ENGINE_COMMANDS and every case (ids as two stacked
    parametrizes give them); slow where the check reads the real model first (CONFIG_CASES' docstring)."""
    cases = []
    for command in ENGINE_COMMANDS:
        for args, flag in ENGINE_CASES + CONFIG_CASES:
            reads_model = (args, flag) in MODEL_CASES or ((args, flag) in DEVICE_CASES
                                                          and command == "bench throughput")
            cases.append(pytest.param(command, args, flag, id=f"{command}-{_case_id(args)}-{flag}",
                                      marks=[pytest.mark.slow] if reads_model else []))
    return cases


@pytest.mark.parametrize("command, args, flag", _engine_flag_cases())
def test_engine_flags_are_checked_by_every_command_that_runs_the_engine(command, args, flag, capsys):
    assert_refused([*ENGINE_COMMANDS[command], *args], flag, capsys)


@pytest.mark.slow  # its second check reads the default (real) model
def test_generate_reads_the_prompt_from_stdin(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    assert "stdin is empty" in assert_refused(["generate"], "--prompt", capsys)
    # A prompt on stdin is read before the model loads: the error is about the model, not stdin.
    monkeypatch.setattr(sys, "stdin", io.StringIO("Why is the sky blue?\n"))
    assert_refused(["generate", *CPU, "--attention-backend", "triton"], "--attention-backend", capsys)


def test_help_shows_defaults_and_version(capsys):
    assert run_cli(["--version"]) == 0
    assert re.fullmatch(r"pagellm \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)
    for argv, flags in ((["generate"], ("--max-tokens", "--temperature", "--top-p")),
                        (["bench", "throughput"], ("--num-prompts", "--output-len")),
                        (["bench", "latency"], ("--output-len", "--batch-sizes"))):
        assert run_cli([*argv, "--help"]) == 0
        # One help entry per flag: from the flag to the next line that starts another.
        text = capsys.readouterr().out
        for flag in flags:
            entry = re.search(rf"^  {flag} .*?(?=^  -|^\S|^$)", text, re.M | re.S)
            assert entry and "(default: " in entry.group(), (argv, flag, entry)
    assert run_cli(["generate", "--help"]) == 0
    assert "stdin" in capsys.readouterr().out


def test_kv_cache_too_small_for_one_block_names_the_flag(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.undo()  # this one loads the (tiny) model: the error needs its block size in bytes
    line = assert_refused(["generate", tiny_model_dir, "--load-format", "dummy", *CPU, "--dtype", "float32",
                           "--kv-cache-memory-bytes", "1000", "--prompt", "hi"], "--kv-cache-memory-bytes", capsys)
    assert "no block of 16 tokens" in line


@pytest.mark.slow  # the process reads the default (real) model; starting it takes seconds
def test_the_console_script_exits_2_with_one_line():
    """The installed `pagellm` (whose `sys.exit(main())` turns the status into the exit status), for
    the error that used to end a traceback of 104 lines."""
    script = os.path.join(os.path.dirname(sys.executable), "pagellm")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([script, "generate", *CPU, "--attention-backend", "triton", "--prompt", "hi"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and not done.stdout, done.stderr
    assert done.stderr == ("pagellm generate: error: attention_backend (--attention-backend) triton runs on CUDA "
                           "GPUs only, and the device is cpu: use torch\n")
