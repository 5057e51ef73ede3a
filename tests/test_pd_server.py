"""Disaggregated prefill/decode between real `pagellm serve` processes of the embedded SmolLM2 (the
test plays the router: prefill server first, then decode server), against one server doing both:
greedy text, streamed and not, with chunked prefill on both sides; concurrent requests, some cut
mid-flight, leave no block held on either server."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from engine_utils import wait_for
from server_utils import RemoteServer, free_port, is_idle, metric_samples

pytestmark = pytest.mark.slow

FLAGS = ("--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20), "--max-model-len",
         "2048", "--max-num-batched-tokens", "256", "--served-model-name", "smol")
SHORT = "The capital of France is"
LONG = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(110))
"""About 1,500 tokens."""


def role(name: str) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_role": name, "kv_connector_extra_config": {
        "side_channel_port": free_port(), "abort_timeout_s": 60}})


@pytest.fixture(scope="module")
def servers(smollm2_path):
    started = []
    try:
        for args in ((), role("kv_producer"), role("kv_consumer")):
            started.append(RemoteServer(smollm2_path, *FLAGS, *args))
        yield started
    finally:
        for server in started:
            server.stop()


def body(prompt: str, stream: bool, max_tokens: int = 12) -> dict:
    return {"model": "smol", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}


async def completion_text(http: httpx.AsyncClient, url: str, request: dict) -> str:
    if not request["stream"]:
        response = await http.post(f"{url}/v1/completions", json=request)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]
    text = ""
    async with http.stream("POST", f"{url}/v1/completions", json=request) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


async def prefill(http: httpx.AsyncClient, url: str, request: dict) -> dict:
    """The router's first leg: one token on the prefill server; its transfer parameters."""
    first = dict(request, max_tokens=1, stream=False,
                 kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    response = await http.post(f"{url}/v1/completions", json=first)
    response.raise_for_status()
    params = response.json()["kv_transfer_params"]
    assert params is not None and params["do_remote_prefill"]
    return params


CONCURRENT = 200


def test_greedy_text_as_one_server_and_nothing_held_after_cuts(servers):
    single, producer, consumer = servers

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as http:
            for prompt in (SHORT, LONG, LONG + " And"):  # the last one hits the producer's prefix cache
                for stream in (False, True):
                    request = body(prompt, stream)
                    expected = await completion_text(http, single.url, request)
                    params = await prefill(http, producer.url, request)
                    got = await completion_text(http, consumer.url, dict(request, kv_transfer_params=params))
                    assert got == expected
            loaded = metric_samples(consumer.url)
            assert loaded["pagellm:kv_transfer_hit_tokens_total"] > 1500
            assert loaded["pagellm:kv_transfer_failures_total"] == 0

            async def one(i: int) -> None:
                request = body(f"{SHORT} {i} " * (1 + i % 5), stream=True, max_tokens=40)
                params = await prefill(http, producer.url, request)
                if i % 4 == 0:  # cut mid-flight: the client hangs up after the decode server's first chunk
                    async with http.stream("POST", f"{consumer.url}/v1/completions",
                                           json=dict(request, kv_transfer_params=params)) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                break
                    return
                await completion_text(http, consumer.url, dict(request, kv_transfer_params=params))

            aborted = metric_samples(consumer.url).get("pagellm:request_success_total{abort}", 0)
            await asyncio.gather(*(one(i) for i in range(CONCURRENT)))  # a quarter of them cut
            for server in (producer, consumer):
                await wait_for(lambda s=server: _nothing_held(s.url), timeout_s=60)
            cut = CONCURRENT // 4
            # The cut streams were aborted on the decode server (one may end before its hang-up arrives).
            assert metric_samples(consumer.url)["pagellm:request_success_total{abort}"] - aborted >= cut // 2

    asyncio.run(run())


def _nothing_held(url: str) -> bool:
    samples = metric_samples(url)
    return is_idle(samples) and samples["pagellm:kv_transfer_held_requests"] == 0
