"""pagellm.ray_serve on a local Ray: one replica of SmolLM2 behind Ray Serve's HTTP proxy, called with the
openai SDK, against LLM.generate on the same model; and the autoscaling Ray Serve was given."""
from __future__ import annotations

import time

import httpx
import psutil
import pytest
from server_utils import free_port

pytest.importorskip("ray.serve", reason='pagellm.ray_serve needs Ray Serve: pip install "pagellm[ray-serve]"')

import openai  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.context import _get_global_client  # noqa: E402
from ray.serve.schema import DeploymentDetails, ServeInstanceDetails  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.ray_serve import app_builder, autoscaling_config, build_app  # noqa: E402

NAME = "smollm2"
ENGINE_ARGS = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 16 << 20,
               "max_num_seqs": 4}
SCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 3}
MAX_ONGOING = 6
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8
REPLACEMENT_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def ray_serve_url(smollm2_path: str):
    """One deployment, one replica (the autoscaling's floor; a few sequential requests never raise it), made
    from `serve run`'s string arguments as `serve run pagellm.ray_serve:app_builder ...` would."""
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        flags = {"model": smollm2_path, **ENGINE_ARGS, **SCALING, "served-model-name": NAME,
                 "max-ongoing-requests": MAX_ONGOING, "num-cpus": 1}
        serve.run(app_builder({key.replace("_", "-"): str(value) for key, value in flags.items()}),
                  name="pagellm", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def client(ray_serve_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{ray_serve_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_greedy_completions_equal_llm_generate(client: openai.OpenAI, smollm2_path: str) -> None:
    served = [client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
              for p in PROMPTS]
    llm = LLM(model=smollm2_path, **ENGINE_ARGS)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    assert served == expected
    assert all(served)


@pytest.mark.slow
def test_chat_streaming_equals_the_whole_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 1, "the answer came in one piece: not streamed"
    assert "".join(deltas) == whole.choices[0].message.content


@pytest.mark.slow
def test_models_health_and_metrics_routes(client: openai.OpenAI, ray_serve_url: str) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{ray_serve_url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{ray_serve_url}/metrics")
    assert metrics.status_code == 200
    assert "pagellm:num_requests_running" in metrics.text


@pytest.mark.slow
def test_deployment_autoscales_as_asked(ray_serve_url: str) -> None:
    config = _deployment().deployment_config
    assert config.max_ongoing_requests == MAX_ONGOING
    asked = config.autoscaling_config
    assert {key: asked[key] for key in SCALING} == SCALING


@pytest.mark.slow
def test_a_replica_whose_engine_died_is_replaced(client: openai.OpenAI, ray_serve_url: str) -> None:
    """Last of the module's served tests: it costs a second model load."""
    (replica,) = _deployment().replicas
    # The replica's other children: multiprocessing's resource tracker.
    (engine_core,) = [p for p in psutil.Process(replica.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    engine_core.kill()
    engine_core.wait(timeout=30)
    assert httpx.get(f"{ray_serve_url}/health").status_code == 503
    deadline = time.monotonic() + REPLACEMENT_TIMEOUT_S
    while not any(r.pid != replica.pid and r.state == "RUNNING" for r in _deployment().replicas):
        assert time.monotonic() < deadline, f"no new replica within {REPLACEMENT_TIMEOUT_S:.0f} s"
        time.sleep(0.5)
    assert client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=2, temperature=0).choices[0].text


def _deployment() -> DeploymentDetails:
    details = ServeInstanceDetails(**_get_global_client().get_serve_details())
    return details.applications["pagellm"].deployments["pagellm"]


def test_autoscaling_defaults_to_a_full_batch_per_replica() -> None:
    assert autoscaling_config(max_num_seqs=16)["target_ongoing_requests"] == 16
    assert autoscaling_config(max_num_seqs=16, target_ongoing_requests=5)["target_ongoing_requests"] == 5


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"min_replicas": -1}, "min_replicas"),
    ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
    ({"target_ongoing_requests": 0}, "target_ongoing_requests"),
])
def test_bad_autoscaling_names_the_argument(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        autoscaling_config(max_num_seqs=8, **kwargs)


def test_build_app_checks_its_arguments_before_any_replica_starts() -> None:
    with pytest.raises(ValueError, match="max_ongoing_requests"):
        build_app({"max_num_seqs": 8}, max_ongoing_requests=4)
    with pytest.raises(ValueError, match="not_a_field"):
        build_app({"not_a_field": 1})


def test_serve_run_arguments_are_the_flags() -> None:
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-flag"):
        app_builder({"no-such-flag": "1"})
    with pytest.raises(ValueError, match="enforce-eager takes true or false"):
        app_builder({"enforce-eager": "maybe"})
    with pytest.raises(ValueError, match="max_replicas"):
        app_builder({"max-num-seqs": "8", "min-replicas": "2", "max_replicas": "1"})
