"""Real clients against a live `pagellm serve`, each on its DEFAULT code path: langchain-openai (chat and the
legacy completions LLM, whose `.batch` sends several prompts in one request; structured output and tools,
with the tool-capable Hermes template of examples/), the openai SDK's `parse` and stream assembly, litellm,
lm-evaluation-harness (`local-completions`, which finds the server's tokenizer through /tokenizer_info and /tokenize and scores
batches of token prompts with `echo`) and guidellm (streaming chat with synthetic prompts).

Nothing may reach the Hugging Face hub or the internet: the offline switches are set before any client is
imported, lm-eval runs a local task (tests/data/clients/) and guidellm's tokenizer is built from the GGUF.
Every client request is also counted in the server's access log, so a client that silently fell back to one
request per prompt would fail here."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Before any client library is imported: no hub, no remote cost map, no telemetry.
for _name, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                      "HF_HUB_DISABLE_TELEMETRY": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                      "LITELLM_TELEMETRY": "False", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ[_name] = _value

import openai  # noqa: E402
import pydantic  # noqa: E402
import pytest  # noqa: E402

from server_utils import RemoteServer  # noqa: E402

pytestmark = pytest.mark.slow  # real clients against a `pagellm serve` of the real model

MODEL_NAME = "smollm2"
ENGINE_FLAGS = ("--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(96 << 20),
                "--max-model-len", "1024", "--served-model-name", MODEL_NAME)
MAX_TOKENS = 6
STRUCTURED_MAX_TOKENS = 32
"""Room for a small constrained answer (a JSON object of one string) to finish."""
HERMES_TEMPLATE = Path(__file__).resolve().parent.parent / "examples" / "tool_chat_template_hermes.jinja"
TOOL_FLAGS = ("--chat-template", str(HERMES_TEMPLATE), "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
REPO_ROOT = Path(__file__).resolve().parent.parent
CLIENTS_DATA = Path(__file__).resolve().parent / "data" / "clients"
QUESTION = "What is the capital of France?"
PROMPTS = ["The capital of France is", "Once upon a time, there was a"]
LM_EVAL_TASK = "pagellm_tiny_mc"
LM_EVAL_DOCS = 8  # tests/data/clients/tiny_mc.jsonl
LM_EVAL_CHOICES = 2  # per document: one loglikelihood request each
LM_EVAL_SINGLE_DOCS = 2  # re-scored with batch_size 1


def build_hf_tokenizer(gguf_path: str, out: Path) -> str:
    from transformers import AutoTokenizer

    folder, name = os.path.split(gguf_path)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def background(smollm2_path, tmp_path_factory):
    """Slow preparations done while the server starts: importing litellm and langchain-openai (seconds each)
    and converting the GGUF's tokenizer to a Hugging Face folder for guidellm's synthetic prompts (tens of
    seconds). `background["tokenizer_dir"].result()` waits for the folder."""
    with ThreadPoolExecutor(1) as pool:
        jobs = {"imports": pool.submit(lambda: (__import__("litellm"), __import__("langchain_openai"))),
                "tokenizer_dir": pool.submit(build_hf_tokenizer, smollm2_path,
                                             tmp_path_factory.mktemp("smollm2-tokenizer"))}
        yield jobs


@pytest.fixture(scope="module")
def server(smollm2_path, background):
    remote = RemoteServer(smollm2_path, *ENGINE_FLAGS, *TOOL_FLAGS)
    background["imports"].result()
    yield remote
    assert remote.stop() == 0, "the server did not shut down cleanly"


def posts(server: RemoteServer, path: str) -> int:
    """How many POSTs to `path` the server has answered so far (uvicorn's access log: a line is written before
    the response's body, so every response a client has read is counted)."""
    return server.log_tail(1 << 30).count(f'"POST {path} HTTP/1.1"')


def legacy_llm(server: RemoteServer):
    from langchain_openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="x", model=MODEL_NAME, temperature=0,
                  max_tokens=MAX_TOKENS, max_retries=0)


@pytest.fixture(scope="module")
def reference_texts(server) -> list[str]:
    """Greedy completions of PROMPTS by langchain's legacy `OpenAI(...).invoke`, one prompt per request (the two
    requests in flight together)."""
    llm = legacy_llm(server)
    before = posts(server, "/v1/completions")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(llm.invoke, PROMPTS))
    assert posts(server, "/v1/completions") == before + len(PROMPTS)
    assert all(texts) and texts[0] != texts[1], texts
    return texts


# ---------------------------------------------------------------------------------------------- langchain-openai

def test_langchain_chat_invoke_stream_batch(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{server.url}/v1", api_key="x", model=MODEL_NAME, temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0)
    message = chat.invoke(QUESTION)
    assert message.content
    assert message.response_metadata["model_name"] == MODEL_NAME
    assert 0 < message.usage_metadata["output_tokens"] <= MAX_TOKENS

    chunks = list(chat.stream(QUESTION))
    assert len(chunks) > 2, "not streamed"
    assert "".join(c.content for c in chunks) == message.content

    other = "Name a primary color."
    answers = chat.batch([QUESTION, other])
    assert [a.content for a in answers][0] == message.content
    assert answers[1].content and answers[1].content != message.content


def test_langchain_chat_on_the_responses_api(server):
    """ChatOpenAI(use_responses_api=True) sends /v1/responses: the same greedy text as chat completions."""
    from langchain_openai import ChatOpenAI

    kwargs = dict(base_url=f"{server.url}/v1", api_key="x", model=MODEL_NAME, temperature=0, max_tokens=MAX_TOKENS,
                  max_retries=0)
    before = posts(server, "/v1/responses")
    message = ChatOpenAI(**kwargs, use_responses_api=True).invoke(QUESTION)
    assert posts(server, "/v1/responses") == before + 1
    assert message.text == ChatOpenAI(**kwargs).invoke(QUESTION).content
    assert 0 < message.usage_metadata["output_tokens"] <= MAX_TOKENS


def test_langchain_legacy_completions_batch_is_one_request(server, reference_texts):
    llm = legacy_llm(server)
    before = posts(server, "/v1/completions")
    assert llm.batch(PROMPTS) == reference_texts
    assert posts(server, "/v1/completions") == before + 1, "both prompts should travel in one request"


# ------------------------------------------------------------------- structured output and tool calling
# The grammar makes every constrained answer valid whatever SmolLM2 "thinks": these tests check validity
# and plumbing, never what the model chose to say.

class City(pydantic.BaseModel):
    city: str


def get_weather(city: str) -> str:
    """The current weather in a city."""
    raise AssertionError("not called: only its signature is sent")


def get_time(timezone: str) -> str:
    """The current time in a timezone."""
    raise AssertionError("not called: only its signature is sent")


WEATHER_QUESTION = "What is the weather in Paris?"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}}
"""get_weather as LangChain sends it: the same parameters schema as City's, key for key, so that the
server compiles its grammar once for all these tests (a compile takes seconds on a CPU)."""


def structured_chat(server: RemoteServer):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{server.url}/v1", api_key="x", model=MODEL_NAME, temperature=0,
                      max_tokens=STRUCTURED_MAX_TOKENS, max_retries=0)


def test_openai_sdk_parse_into_a_pydantic_model(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    completion = client.chat.completions.parse(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}],
                                               response_format=City, temperature=0, max_tokens=STRUCTURED_MAX_TOKENS)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", "the grammar ends the answer once the object is complete"
    assert isinstance(choice.message.parsed, City), choice.message


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(server, method):
    structured = structured_chat(server).with_structured_output(City, method=method, include_raw=True)
    result = structured.invoke(f"{QUESTION} Answer in JSON with the key city.")
    if method == "json_mode":  # any JSON object: the keys are the model's choice
        assert isinstance(json.loads(result["raw"].content), dict), result["raw"].content
        return
    assert result["parsing_error"] is None and isinstance(result["parsed"], City), result
    if method == "function_calling":
        [call] = result["raw"].tool_calls
        assert call["name"] == "City" and call["id"].startswith("chatcmpl-tool-")


def test_langchain_bind_tools_streamed_and_required(server):
    """A named tool_choice streamed (LangChain assembles tool_call_chunks), and "any" (OpenAI's "required")
    with parallel_tool_calls=False: one call to either tool, valid for its schema. (A named choice not
    streamed is what with_structured_output(method="function_calling") sends.)"""
    chat = structured_chat(server)
    chunks = list(chat.bind_tools([get_weather, get_time], tool_choice="get_weather").stream(WEATHER_QUESTION))
    assert len(chunks) > 2, "not streamed"
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    [call] = streamed.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str), streamed.tool_call_chunks

    message = chat.bind_tools([get_weather, get_time], tool_choice="any", parallel_tool_calls=False).invoke(
        WEATHER_QUESTION)
    [call] = message.tool_calls
    assert (call["name"], sorted(call["args"])) in (("get_weather", ["city"]), ("get_time", ["timezone"])), call
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_streamed_tool_calls_assemble_into_the_non_streamed_ones(server):
    """The openai SDK's own stream assembly gives the tool calls a response holds (greedy, same request);
    then the calls and their result go back as history, through the chat template."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": WEATHER_QUESTION}], tools=[WEATHER_TOOL],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
                  max_tokens=STRUCTURED_MAX_TOKENS)
    response = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert response.finish_reason == streamed.finish_reason == "tool_calls"
    assert response.message.content is None and not streamed.message.content
    [call], [streamed_call] = response.message.tool_calls, streamed.message.tool_calls
    assert (streamed_call.function.name, streamed_call.function.arguments) == ("get_weather", call.function.arguments)
    assert isinstance(json.loads(call.function.arguments)["city"], str)

    history = [*kwargs["messages"], response.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    answer = client.chat.completions.create(**{**kwargs, "messages": history, "tool_choice": "none",
                                               "max_tokens": MAX_TOKENS}).choices[0]
    assert answer.message.content and not answer.message.tool_calls


# ------------------------------------------------------------------------------------------------------- litellm

def test_litellm_chat_completion_and_stream(server):
    import litellm

    kwargs = dict(model=f"openai/{MODEL_NAME}", api_base=f"{server.url}/v1", api_key="x",
                  messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, temperature=0)
    response = litellm.completion(**kwargs)
    text = response.choices[0].message.content
    assert text and response.choices[0].finish_reason in ("stop", "length")
    assert 0 < response.usage.completion_tokens <= MAX_TOKENS

    chunks = list(litellm.completion(**kwargs, stream=True))
    assert len(chunks) > 2, "not streamed"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_litellm_text_completion_several_prompts(server, reference_texts):
    import litellm

    before = posts(server, "/v1/completions")
    response = litellm.text_completion(model=f"openai/{MODEL_NAME}", api_base=f"{server.url}/v1", api_key="x",
                                       prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert posts(server, "/v1/completions") == before + 1, "both prompts should travel in one request"
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == reference_texts


# ------------------------------------------------------------------------------------------ lm-evaluation-harness

def run_lm_eval(server: RemoteServer, batch_size: int, limit: int | None = None):
    """`local-completions` with its default tokenizer choice (auto: remote when the server has
    /tokenizer_info and /tokenize); returns (the LM, simple_evaluate's results)."""
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    lm = get_model("local-completions").create_from_arg_string(
        f"base_url={server.url}/v1/completions,model={MODEL_NAME}", {"batch_size": batch_size})
    results = simple_evaluate(model=lm, tasks=[LM_EVAL_TASK], limit=limit, log_samples=True,
                              task_manager=TaskManager(include_path=str(CLIENTS_DATA), include_defaults=False))
    return lm, results


def loglikelihoods(results) -> dict[tuple[int, int], tuple[float, bool]]:
    """(document, choice) -> (loglikelihood, is_greedy) from the logged samples."""
    return {(sample["doc_id"], i): tuple(resp[0]) for sample in results["samples"][LM_EVAL_TASK]
            for i, resp in enumerate(sample["resps"])}


def test_lm_eval_local_completions_remote_tokenizer_batched(server, monkeypatch):
    from lm_eval.utils import RemoteTokenizer

    monkeypatch.chdir(REPO_ROOT)  # the task's data_files path is relative to the repository root

    before = posts(server, "/v1/completions")
    lm, results = run_lm_eval(server, batch_size=4)
    batched_posts = posts(server, "/v1/completions") - before
    assert isinstance(lm.tokenizer, RemoteTokenizer), "lm-eval did not pick the server's tokenizer"
    assert lm.tokenizer_backend == "remote"

    assert results["n-samples"][LM_EVAL_TASK] == {"original": LM_EVAL_DOCS, "effective": LM_EVAL_DOCS}
    acc = results["results"][LM_EVAL_TASK]["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0 and not math.isnan(acc)
    scores = loglikelihoods(results)
    assert len(scores) == LM_EVAL_DOCS * LM_EVAL_CHOICES
    assert all(ll < 0.0 and math.isfinite(ll) for ll, _ in scores.values()), scores
    # 16 loglikelihood requests in batches of 4: four HTTP requests, each with four token prompts.
    assert batched_posts == math.ceil(LM_EVAL_DOCS * LM_EVAL_CHOICES / 4), batched_posts

    # One prompt per request for the first documents: the same scores (batching prompts of different
    # lengths into one request changed nothing).
    before = posts(server, "/v1/completions")
    _, single = run_lm_eval(server, batch_size=1, limit=LM_EVAL_SINGLE_DOCS)
    assert posts(server, "/v1/completions") - before == LM_EVAL_SINGLE_DOCS * LM_EVAL_CHOICES
    unbatched = loglikelihoods(single)
    assert len(unbatched) == LM_EVAL_SINGLE_DOCS * LM_EVAL_CHOICES
    for key, (ll, greedy) in unbatched.items():
        assert scores[key][0] == pytest.approx(ll, abs=1e-3), key
        assert scores[key][1] == greedy, key


# ------------------------------------------------------------------------------------------------------ guidellm

GUIDELLM_REQUESTS = 4
GUIDELLM_OUTPUT_TOKENS = 4


def test_guidellm_streaming_synthetic(server, background, tmp_path):
    tokenizer_dir = background["tokenizer_dir"].result()
    out = tmp_path / "benchmarks.json"
    before = posts(server, "/v1/chat/completions")
    command = [str(Path(sys.executable).with_name("guidellm")), "run",
               "--backend", f"kind=openai_http,target={server.url}",
               "--profile", f"kind=concurrent,streams={GUIDELLM_REQUESTS}",
               "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}",
               "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={GUIDELLM_OUTPUT_TOKENS}",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
               "--output", f"kind=json,path={out}", "--disable-console"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=150,
                          env={**os.environ, "GUIDELLM__DEFAULT_RESULTS_DIR": str(tmp_path),
                               "GUIDELLM__MAX_WORKER_PROCESSES": "1"})
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    benchmarks = json.loads(out.read_text())["benchmarks"]
    assert len(benchmarks) == 1
    metrics = benchmarks[0]["metrics"]
    assert metrics["request_totals"] == {"successful": GUIDELLM_REQUESTS, "errored": 0, "incomplete": 0,
                                         "total": GUIDELLM_REQUESTS}, metrics["request_totals"]
    # It asks for exactly GUIDELLM_OUTPUT_TOKENS (ignore_eos) and counts them from the streamed usage.
    assert metrics["output_token_count"]["successful"]["total_sum"] == GUIDELLM_REQUESTS * GUIDELLM_OUTPUT_TOKENS
    assert metrics["output_token_count"]["errored"]["count"] == 0
    # Its default: streamed chat completions (several stream iterations per request).
    assert metrics["request_streaming_iterations_count"]["successful"]["min"] > 1
    assert posts(server, "/v1/chat/completions") - before >= GUIDELLM_REQUESTS
