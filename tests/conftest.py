"""Session fixtures shared across the test suite: the bundled SmolLM2 GGUF and its HF reference; and the
test tiers' guard (tests/tiers.py): a test that uses one of these fixtures, opens the real model or
starts a server must be marked `slow`, so that `pytest -m "not slow"` stays quick."""
from __future__ import annotations

import os
import sys

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's CPU interpreter. The flag is read when a kernel
# is defined, so it must be set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagellm.loader import default_model_path  # noqa: E402
import tiers  # noqa: E402

# pytester: tests/test_tiers.py runs the guard on a suite of its own. router_utils: the router tests'
# fake backends and in-process router (fixtures `fakes`, `router`).
pytest_plugins = ("pytester", "router_utils")


def pytest_configure(config: pytest.Config) -> None:
    # The tiers' hooks: the slow fixtures below (tiers.SLOW_FIXTURES) and the runtime guard.
    if not config.pluginmanager.is_registered(tiers):
        config.pluginmanager.register(tiers, "tiers")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF file (a test that requests it, directly or
    through another fixture, must be marked slow: tiers.SLOW_FIXTURES)."""
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_path: str) -> torch.nn.Module:
    """Hugging Face's float32 model dequantized from the same GGUF file, in eval mode (~15 s)."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path: str):
    """Hugging Face's tokenizer converted from the GGUF metadata (slow: only for equivalence tests)."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(smollm2_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def stop_ray_after_module():
    """For modules whose Ray tests start a local Ray instance in this process: its daemons would
    take CPU from every later test on a 2-core machine."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


SHARED_SERVER_NAME = "smollm2"
SHARED_SERVER_MAX_LEN = 1024
SHARED_SERVER_KV_BYTES = 96 << 20
SHARED_SERVER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(SHARED_SERVER_KV_BYTES),
                       "--max-model-len", str(SHARED_SERVER_MAX_LEN), "--served-model-name", SHARED_SERVER_NAME)


@pytest.fixture(scope="session")
def smollm2_server(smollm2_path: str):
    """One plain `pagellm serve` of SmolLM2 for the modules that need nothing else of it (each server
    start loads the model in two processes: seconds of CI time)."""
    from server_utils import RemoteServer

    remote = RemoteServer(smollm2_path, *SHARED_SERVER_FLAGS)
    yield remote
    assert remote.stop() == 0, "the server did not shut down cleanly"

