"""Storms against a live `pagellm serve` whose KV cache is tiny: clients cutting streams at random points
leave nothing running and no KV block held, and 16 concurrent greedy requests that keep preempting
each other get exactly the texts they get one at a time."""
from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from engine_utils import wait_for
from server_utils import RemoteServer, is_idle, metric_samples

pytestmark = pytest.mark.slow  # a `pagellm serve` of the real model

MODEL_NAME = "smollm2"
NUM_BLOCKS = 48
BLOCK_SIZE = 8
"""48 blocks x 8 tokens: room for a handful of short requests at once, and short blocks, so that a
crowd fills the cache at admission and preempts as soon as its requests grow."""
MAX_LEN = 256
ENGINE_FLAGS = ("--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", str(NUM_BLOCKS),
                "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_LEN), "--served-model-name", MODEL_NAME)
TOPICS = ("the sun", "a river", "music", "a library", "rain", "a bridge", "a volcano", "a violin", "winter",
          "a desert", "a lighthouse", "chess", "a glacier", "bread", "a comet", "a forest", "a harbor", "a poem",
          "thunder", "a clock", "a garden", "an island", "a mountain", "a telescope", "a train", "coffee", "a map",
          "the moon", "a kite", "snow", "a castle", "a whale")
IDLE_TIMEOUT_S = 60.0
ABORTED = "pagellm:request_success_total{abort}"


@pytest.fixture(scope="module")
def server(smollm2_path):
    remote = RemoteServer(smollm2_path, *ENGINE_FLAGS)
    yield remote
    assert remote.stop() == 0, "the server did not shut down cleanly"


def async_client(server: RemoteServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def chat_body(topic: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
            "temperature": 0.0, "max_tokens": max_tokens, **extra}


def completion_body(topic: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": f"A short story about {topic}:", "temperature": 0.0,
            "max_tokens": max_tokens, **extra}


def greedy_request(i: int, max_tokens: int) -> tuple[bool, dict]:
    """(chat?, body) of the i-th of a set of greedy requests: chat and completions in turn."""
    chat = i % 2 == 0
    return chat, (chat_body if chat else completion_body)(TOPICS[i // 2], max_tokens)


async def greedy_text(client: openai.AsyncOpenAI, chat: bool, body: dict) -> tuple[str, str]:
    """The text and finish reason of one non-streamed request."""
    if chat:
        choice = (await client.chat.completions.create(**body)).choices[0]
        return choice.message.content, choice.finish_reason
    choice = (await client.completions.create(**body)).choices[0]
    return choice.text, choice.finish_reason


async def wait_until_idle(server: RemoteServer, num_aborted: float, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Until /metrics shows `num_aborted` aborts in all, nothing running or waiting and no KV block held."""
    def done() -> bool:
        samples = metric_samples(server.url)
        return samples[ABORTED] == num_aborted and is_idle(samples)

    await wait_for(done, timeout_s)


def test_preemption_storm_gives_the_texts_of_requests_run_alone(server):
    """16 greedy requests at once on a tiny KV cache (12 did not always preempt), preempted and recomputed:
    each still gets exactly the text (and finish reason) it gets running alone on the same server
    (alone, none is preempted: one request fits)."""
    requests = [greedy_request(i, 16 + i % 5) for i in range(16)]

    async def run() -> tuple[list, list]:
        client = async_client(server)
        alone = [await greedy_text(client, chat, body) for chat, body in requests]
        together = await asyncio.gather(*[greedy_text(client, chat, body) for chat, body in requests])
        return alone, together

    before = metric_samples(server.url)
    alone, together = asyncio.run(run())
    after = metric_samples(server.url)
    assert after["pagellm:num_preemptions_total"] > before["pagellm:num_preemptions_total"], \
        "the KV cache was not small enough to force preemptions"
    assert [i for i in range(len(requests)) if together[i] != alone[i]] == []
    asyncio.run(wait_until_idle(server, after[ABORTED]))


STORM_SEED = 5
NUM_RAW_CUTS = 20
NUM_OPENAI_CUTS = 8
MAX_EVENTS_BEFORE_CUT = 8
"""Cuts come after 1 to 8 events: after the first one the request is surely in the engine, so every cut
must show up as one abort (a connection closed before that may never reach the engine)."""
LONG = 200
"""Tokens asked of every cut request (EOS ignored): far more than it can produce before the cut."""
NUM_SURVIVORS = 8
SURVIVOR_TOKENS = 16


async def cut_raw_stream(http: httpx.AsyncClient, chat: bool, body: dict, num_events: int) -> None:
    """Read `num_events` server-sent events, then close the connection."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                assert line != "data: [DONE]", "the stream ended before its cut"
                seen += 1
                if seen == num_events:
                    break
    # Leaving the block mid-body closes the connection.


async def cut_openai_stream(client: openai.AsyncOpenAI, chat: bool, body: dict, num_events: int) -> None:
    create = client.chat.completions.create if chat else client.completions.create
    stream = await create(**body, stream=True)
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == num_events:
            break
    await stream.close()
    assert seen == num_events, "the stream ended before its cut"


def test_abort_storm_leaves_nothing_running_and_no_block_held(server):
    """56 streams cut by their clients after a random number of events (40 raw httpx streams, 16
    openai ones) while 8 other requests run to the end, on a cache that keeps preempting: every cut
    is an abort, the server ends idle with no KV block held, and the survivors, and a greedy request
    after the storm, get the texts they got before it."""
    rng = random.Random(STORM_SEED)
    survivors = [greedy_request(i, SURVIVOR_TOKENS) for i in range(NUM_SURVIVORS)]

    def cut_request(**ignore_eos) -> tuple[bool, dict, int]:
        """(chat?, body, events before the cut), drawn from the seeded RNG."""
        chat, topic = rng.random() < 0.5, rng.choice(TOPICS)
        body = (chat_body if chat else completion_body)(topic, LONG, **ignore_eos)
        return chat, body, rng.randint(1, MAX_EVENTS_BEFORE_CUT)

    def cuts(http: httpx.AsyncClient, client: openai.AsyncOpenAI) -> list:
        jobs = [cut_raw_stream(http, *cut_request(ignore_eos=True)) for _ in range(NUM_RAW_CUTS)]
        jobs += [cut_openai_stream(client, *cut_request(extra_body={"ignore_eos": True}))
                 for _ in range(NUM_OPENAI_CUTS)]
        rng.shuffle(jobs)
        return jobs

    async def run() -> tuple[list, list, list, dict, dict]:
        client = async_client(server)
        before = [await greedy_text(client, chat, body) for chat, body in survivors]
        start = metric_samples(server.url)
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as http:
            during = await asyncio.gather(*[greedy_text(client, chat, body) for chat, body in survivors],
                                          *cuts(http, client))
        await wait_until_idle(server, start[ABORTED] + NUM_RAW_CUTS + NUM_OPENAI_CUTS)
        end = metric_samples(server.url)
        after = [await greedy_text(client, *survivors[0])]
        return before, during[:NUM_SURVIVORS], after, start, end

    before, during, after, start, end = asyncio.run(run())
    assert end["pagellm:num_preemptions_total"] > start["pagellm:num_preemptions_total"]
    assert during == before
    assert after == before[:1]
