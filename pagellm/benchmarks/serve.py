"""`pagellm bench serve`: load-test any OpenAI-compatible server (pagellm, vLLM, ...) as vLLM's serving
benchmark does: a dataset's prompts as text, streamed, on an arrival schedule, and the latency and
throughput numbers under vLLM's result keys (`serve_metrics.py`).

Prompts are built from token ids (random, shared-prefix or ShareGPT) and decoded with --tokenizer, so
the server tokenizes them again; prompt and output token counts are the server's own (`usage`).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx

from pagellm.benchmarks.datasets import dataset_requests
from pagellm.benchmarks.results import run_metadata, write_json
from pagellm.benchmarks.serve_client import ENDPOINTS, arrival_gaps, fill_missing_counts, request_payload, run_load
from pagellm.benchmarks.serve_metrics import format_summary, parse_goodput, summarize
from pagellm.loader import resolve_model
from pagellm.tokenizer import load_tokenizer

_PREFLIGHT_TIMEOUT_S = 10.0
_WARMUP_PROMPT = "Warming up: say hello."


@dataclass(slots=True, frozen=True)
class ServeConfig:
    """One `bench serve` run; the fields are the command's flags."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    """The model name sent in requests; None: the first the server lists on /v1/models."""
    tokenizer: str | None = None
    """Model path whose tokenizer makes the prompts; None: the embedded SmolLM2's."""
    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int | None = None
    random_range_ratio: float = 0.0
    prefix_len: int = 256
    num_prefixes: int = 10
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    goodput: tuple[str, ...] = ()
    seed: int = 0
    num_warmups: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None
    disable_tqdm: bool = False

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServeConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(ns).items() if k in names}
        values["goodput"] = tuple(values.get("goodput") or ())
        return cls(**values)

    def validate(self) -> None:
        """Fail on a bad flag with a message that names it."""
        url = urlparse(self.base_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"--base-url must look like http://HOST:PORT, got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        for flag in ("num_prompts", "input_len", "prefix_len", "num_prefixes"):
            _check_positive(flag, getattr(self, flag))
        for flag in ("output_len", "max_concurrency"):
            if getattr(self, flag) is not None:
                _check_positive(flag, getattr(self, flag))
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be positive (or inf), got {self.request_rate}")
        if not 0 < self.burstiness < math.inf:
            raise ValueError(f"--burstiness must be a positive number, got {self.burstiness}")
        parse_goodput(list(self.goodput))

    @property
    def root_url(self) -> str:
        """The server's root: without a trailing slash or a trailing /v1 (both are common in base URLs)."""
        return self.base_url.rstrip("/").removesuffix("/v1")


@dataclass(slots=True, frozen=True)
class Workload:
    """The prompts of a run, made once (a sweep reuses them for every rung)."""

    prompts: list[str]
    prompt_lens: list[int]
    """Tokens per prompt as the dataset made it (the server's count may differ slightly)."""
    output_lens: list[int]
    dataset: dict[str, Any]
    tokenizer_id: str
    count_tokens: Callable[[str], int]
    """text -> number of tokens, for a server that reports no usage."""


def run_cli(ns: argparse.Namespace) -> int:
    """`pagellm bench serve`: print the numbers; with --output-json also write them."""
    config = ServeConfig.from_namespace(ns)
    metadata = run_metadata()
    result = run_serve(config)
    print(format_summary(result))
    if ns.output_json:
        print("wrote", write_json({**metadata, **result}, ns.output_json))
    return 0


def run_serve(config: ServeConfig, workload: Workload | None = None) -> dict[str, Any]:
    """One run: check the server, make the prompts (unless given), warm up, send the load, and
    return vLLM's result keys plus what was run."""
    config.validate()
    headers = _headers(config)
    listed = served_model(config.root_url, headers)  # also fails early, naming --base-url, on no server
    model = config.model or listed
    if model is None:
        raise ValueError(f"--base-url {config.base_url}: GET /v1/models lists no model; pass --model")
    workload = workload or make_workload(config)
    payloads = [request_payload(config.endpoint, model, prompt, output_len, config.ignore_eos, config.temperature)
                for prompt, output_len in zip(workload.prompts, workload.output_lens)]
    url = config.root_url + config.endpoint
    if config.num_warmups:
        # A prompt of its own: a timed prompt warmed up would then be served from the prefix cache.
        warmup = request_payload(config.endpoint, model, _WARMUP_PROMPT, 4, config.ignore_eos, config.temperature)
        warmups = run_load(url, [warmup] * config.num_warmups, [0.0] * config.num_warmups, 1, headers,
                           progress=False)
        failed = [r.error for r in warmups.results if not r.success]
        if failed:
            raise ValueError(f"--base-url {config.base_url}: the warm-up request failed: {failed[0]}")
    gaps = arrival_gaps(len(payloads), config.request_rate, config.burstiness, config.seed)
    load = run_load(url, payloads, gaps, config.max_concurrency, headers, progress=not config.disable_tqdm)
    fill_missing_counts(load.results, workload.prompt_lens, workload.count_tokens)
    result = summarize(load, parse_goodput(list(config.goodput)))
    return {
        "benchmark": "serve", "backend": "openai", "endpoint": config.endpoint, "base_url": config.base_url,
        "model_id": model, "tokenizer_id": workload.tokenizer_id, "num_prompts": config.num_prompts,
        "request_rate": config.request_rate if config.request_rate < math.inf else "inf",
        "burstiness": config.burstiness, "max_concurrency": config.max_concurrency,
        "goodput_limits_ms": parse_goodput(list(config.goodput)) or None,
        "parameters": {k: v for k, v in dataclasses.asdict(config).items() if k != "api_key"},
        "dataset": workload.dataset, **result,
    }


def make_workload(config: ServeConfig) -> Workload:
    """The dataset's requests, decoded to text with the tokenizer."""
    source = resolve_model(config.tokenizer, "dummy")
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise ValueError(f"--tokenizer {config.tokenizer!r} has no tokenizer files; pass a model path that has")
    requests, info = dataset_requests(config.dataset, config.num_prompts, source, config.seed, config.input_len,
                                      config.output_len, config.random_range_ratio, config.dataset_path,
                                      prefix_len=config.prefix_len, num_prefixes=config.num_prefixes)
    return Workload(
        prompts=[tokenizer.decode(r.prompt_token_ids) for r in requests],
        prompt_lens=[len(r.prompt_token_ids) for r in requests],
        output_lens=[r.output_len for r in requests],
        dataset=info,
        tokenizer_id=source.path,
        count_tokens=lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
    )


def served_model(root_url: str, headers: dict[str, str]) -> str | None:
    """The first model the server lists on /v1/models (None if it lists none); raises ValueError
    naming --base-url if no server answers or it wants an API key."""
    try:
        response = httpx.get(f"{root_url}/v1/models", headers=headers, timeout=_PREFLIGHT_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise ValueError(f"--base-url {root_url}: no server answers ({type(e).__name__}: {e})") from None
    if response.status_code == 401:
        raise ValueError(f"--base-url {root_url} asks for an API key: pass --api-key or set $OPENAI_API_KEY")
    try:
        models = response.json().get("data") if response.status_code == 200 else None
    except ValueError:  # not JSON: some other kind of server
        models = None
    return models[0]["id"] if models else None


def _headers(config: ServeConfig) -> dict[str, str]:
    key = config.api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _check_positive(flag: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {value!r}")
