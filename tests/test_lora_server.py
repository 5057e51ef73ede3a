"""LoRA adapters on `pagellm serve`: --lora-modules served under their names (the same tokens as offline),
listed by /v1/models, loaded and unloaded at run time behind the API key, bad adapters refused with a 400
(at start-up: exit status 2 and one line), and the LoRA metrics. Adapters are made here with PEFT from
Hugging Face's copy of the model, with random (non-zero) weights so that they change the output."""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from conftest import SHARED_SERVER_FLAGS, SHARED_SERVER_KV_BYTES, SHARED_SERVER_MAX_LEN, SHARED_SERVER_NAME
from peft import LoraConfig, get_peft_model
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from server_utils import RemoteServer, metric_samples

from pagellm import LLM, SamplingParams
from pagellm.entrypoints.openai.cli_args import RUNTIME_LORA_UPDATING_ENV, runtime_lora_updating_allowed
from pagellm.lora_request import LoRARequest

pytestmark = pytest.mark.slow

API_KEY = "lora-test-key"
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "16", "--max-loras", "2")
PROMPT = "The capital of France is"
MAX_TOKENS = 8
TIMEOUT_S = 120.0
"""Per HTTP call: generous, because the CPU may be shared with other test processes."""
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model: torch.nn.Module, folder: Path, rank: int, target_modules: list[str], seed: int) -> str:
    """A PEFT adapter of `hf_model` (left untouched: a copy is adapted) with random A and B, saved in `folder`."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target_modules, init_lora_weights=False)
    get_peft_model(copy.deepcopy(hf_model), config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def adapters(hf_smollm2_model, tmp_path_factory) -> dict[str, str]:
    """Folders: `static` and `runtime` (good ones), `rank32` (above --max-lora-rank), `malformed`
    (adapter_config.json is not JSON), `misshapen` (a tensor of another model's shape)."""
    root = tmp_path_factory.mktemp("adapters")
    folders = {"static": make_adapter(hf_smollm2_model, root / "static", 8, ALL_MODULES, seed=0),
               "runtime": make_adapter(hf_smollm2_model, root / "runtime", 8, ["q_proj", "v_proj"], seed=1),
               "rank32": make_adapter(hf_smollm2_model, root / "rank32", 32, ["q_proj"], seed=2)}
    malformed = shutil.copytree(folders["runtime"], root / "malformed")
    (malformed / "adapter_config.json").write_text("{not json")
    misshapen = shutil.copytree(folders["runtime"], root / "misshapen")
    tensors = load_file(misshapen / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0] + 64, tensors[key].shape[1])
    save_file(tensors, misshapen / "adapter_model.safetensors")
    return {**folders, "malformed": str(malformed), "misshapen": str(misshapen)}


@pytest.fixture(scope="module")
def server(smollm2_path, adapters):
    """Serves `static` from start-up, lets clients load more, and wants the API key."""
    remote = RemoteServer(smollm2_path, *SHARED_SERVER_FLAGS, *LORA_FLAGS, "--lora-modules",
                          f"static={adapters['static']}", "--allow-runtime-lora-updating", "--api-key", API_KEY)
    yield remote
    assert remote.stop() == 0, "the server did not shut down cleanly"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=TIMEOUT_S) as http:
        yield http


def complete(client: openai.OpenAI, model: str, **kwargs) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                     extra_body={"return_token_ids": True}, **kwargs)


def load(http: httpx.Client, name: str, path: str) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def unload(http: httpx.Client, name: str) -> httpx.Response:
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def lora_info(server: RemoteServer) -> list[dict[str, str]]:
    """The label sets of pagellm:lora_requests_info on the server's /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT_S).text
    return [sample.labels for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "pagellm:lora_requests_info"]


def test_a_static_adapter_matches_offline_and_changes_the_output(client, adapters, smollm2_path):
    served = complete(client, "static")
    base = complete(client, SHARED_SERVER_NAME)
    assert served.model == "static" and base.model == SHARED_SERVER_NAME
    llm = LLM(smollm2_path, device="cpu", dtype="float32", kv_cache_memory_bytes=SHARED_SERVER_KV_BYTES,
              max_model_len=SHARED_SERVER_MAX_LEN, enable_lora=True, max_lora_rank=16, max_loras=2)
    [offline] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False,
                             lora_request=LoRARequest("static", 1, adapters["static"]))
    llm.llm_engine.shutdown()
    choice = served.choices[0]
    assert (choice.text, choice.model_extra["token_ids"]) == (offline.outputs[0].text, offline.outputs[0].token_ids)
    assert choice.model_extra["token_ids"] != base.choices[0].model_extra["token_ids"]
    chat = client.chat.completions.create(model="static", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0.0)
    assert chat.model == "static"


def test_models_lists_adapters_after_the_base_model(client, adapters):
    models = client.models.list().data
    assert [m.id for m in models][:2] == [SHARED_SERVER_NAME, "static"]
    base, static = models[0], models[1]
    assert base.model_extra["parent"] is None
    assert (static.model_extra["root"], static.model_extra["parent"]) == (adapters["static"], SHARED_SERVER_NAME)
    assert client.models.retrieve("static").model_extra["root"] == adapters["static"]
    with pytest.raises(openai.NotFoundError, match="LoRA adapters: static"):
        complete(client, "no-such-adapter")


def test_runtime_load_use_unload(client, http, adapters, server):
    response = load(http, "runtime", adapters["runtime"])
    assert response.status_code == 200 and "runtime" in response.text, response.text
    assert complete(client, "runtime").model == "runtime"
    assert "runtime" in [m.id for m in client.models.list().data]
    again = load(http, "runtime", adapters["static"])
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]

    assert unload(http, "runtime").status_code == 200
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(client, "runtime")
    missing = unload(http, "runtime")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"
    assert metric_samples(server.url)["pagellm:lora_adapter_loads_total"] >= 1


@pytest.mark.parametrize("name, message", [
    ("missing", "the folder does not exist"),
    ("malformed", "adapter_config.json is not valid JSON"),
    ("rank32", "rank 32 is larger than max_lora_rank"),
    ("misshapen", "do not fit the base model's layer"),
])
def test_a_bad_adapter_is_a_400_naming_the_problem(client, http, adapters, name, message):
    path = adapters.get(name, "/no/such/adapter")
    response = load(http, name, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "BadRequestError", error
    assert name not in [m.id for m in client.models.list().data]
    assert complete(client, "static").model == "static"  # still serving


def test_an_adapter_the_engine_fails_to_load_is_a_400(client, http, adapters, tmp_path):
    """Checked at load, broken before its first request: the engine core's rejection reaches the client."""
    folder = shutil.copytree(adapters["runtime"], tmp_path / "breaks")
    assert load(http, "breaks", str(folder)).status_code == 200
    (folder / "adapter_config.json").write_text(json.dumps({"r": 0}))
    with pytest.raises(openai.BadRequestError, match="r must be a positive integer"):
        complete(client, "breaks")
    assert unload(http, "breaks").status_code == 200


def test_the_routes_want_the_api_key(server, adapters):
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["runtime"]}),
                       ("/v1/unload_lora_adapter", {"lora_name": "static"})):
        assert httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT_S).status_code == 401


def test_unloading_lets_a_running_stream_finish(client, http, adapters, server):
    assert load(http, "streamed", adapters["runtime"]).status_code == 200
    stream = client.completions.create(model="streamed", prompt=PROMPT, max_tokens=48, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    deadline = time.monotonic() + TIMEOUT_S
    while not any("streamed" in labels["running_lora_adapters"] for labels in lora_info(server)):
        assert time.monotonic() < deadline, "the adapter never showed as running in pagellm:lora_requests_info"
        time.sleep(0.2)
    assert unload(http, "streamed").status_code == 200
    chunks += list(stream)
    assert all(c.model == "streamed" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len("".join(c.choices[0].text for c in chunks)) > 0


def test_without_runtime_updating_the_routes_do_not_exist(smollm2_server):
    response = httpx.post(f"{smollm2_server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"},
                          timeout=TIMEOUT_S)
    assert response.status_code == 404
    assert "pagellm:lora_requests_info" not in httpx.get(f"{smollm2_server.url}/metrics", timeout=TIMEOUT_S).text


@pytest.mark.parametrize("module, message", [
    ("bad=/no/such/adapter", "--lora-modules: LoRA adapter 'bad' (/no/such/adapter): the folder does not exist"),
    (f"{SHARED_SERVER_NAME}=ADAPTER", f"--lora-modules: `{SHARED_SERVER_NAME}` is the base model's name"),
])
def test_a_bad_lora_module_stops_start_up_with_one_line(smollm2_path, adapters, module, message):
    done = subprocess.run([sys.executable, "-m", "pagellm.cli", "serve", smollm2_path, "--port", "0",
                           *SHARED_SERVER_FLAGS, *LORA_FLAGS, "--lora-modules",
                           module.replace("ADAPTER", adapters["static"])],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"pagellm serve: error: {message}") and done.stderr.count("\n") == 1, done.stderr


def test_runtime_updating_is_also_allowed_by_the_environment():
    flag_off = argparse.Namespace(allow_runtime_lora_updating=False)
    assert not runtime_lora_updating_allowed(flag_off, {})
    assert runtime_lora_updating_allowed(flag_off, {RUNTIME_LORA_UPDATING_ENV: "true"})
    assert runtime_lora_updating_allowed(flag_off, {RUNTIME_LORA_UPDATING_ENV: "1"})
    with pytest.raises(ValueError, match=RUNTIME_LORA_UPDATING_ENV):
        runtime_lora_updating_allowed(flag_off, {RUNTIME_LORA_UPDATING_ENV: "yes"})
