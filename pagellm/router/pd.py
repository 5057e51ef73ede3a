"""Disaggregated prefill/decode (vLLM's protocol): a generation request goes to a prefill engine
for one token, then with the KV-transfer parameters it answered to a decode engine, whose response
the client gets.

The prefill request is the client's body with one output token, no stream and
`kv_transfer_params: {do_remote_decode: true}`; the producer answers with the parameters that let a
consumer pull the prompt's KV (its engine id, host, port, block ids). The decode request is the
client's body plus those parameters. When the prefill pool does not answer, answers an error, or
answers no parameters, or the request asks for several sequences (`n` > 1, which a transfer does
not carry), the decode engine gets the body alone and prefills itself: the same answer, later
(counted as a fallback).
"""
from __future__ import annotations

import json
import time
from typing import Any

from pagellm.entrypoints.openai.errors import APIError
from pagellm.router.balance import ModelRoute
from pagellm.router.client import UPSTREAM_ERRORS
from pagellm.router.proxy import Upstream, finish, open_upstream, release_load
from pagellm.router.state import PDPools, RouterState

KV_TRANSFER_FIELD = "kv_transfer_params"
PREFILL_REQUEST_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
DROPPED_FOR_PREFILL = ("stream_options", "min_tokens")
"""Fields that one non-streamed output token contradicts (the engine would refuse the request)."""


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill engine gets: the prompt and sampling fields, one output token, the transfer request."""
    out = {k: v for k, v in body.items() if k not in DROPPED_FOR_PREFILL}
    out.update(max_tokens=1, stream=False, **{KV_TRANSFER_FIELD: dict(PREFILL_REQUEST_PARAMS)})
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


async def open_disaggregated(state: RouterState, pools: PDPools, path: str, body: dict[str, Any],
                             client_headers: dict[str, str], hashes: list[int], input_tokens: int,
                             load_tokens: int) -> Upstream:
    """The decode engine's response (headers read), after the prefill round trip; APIError 503 when
    no decode engine answered."""
    n = body.get("n")
    if isinstance(n, int) and n > 1:  # a transfer carries one sequence's KV: the engines refuse it with n > 1
        params = _fallback(state, "n_above_1")
    else:
        params = await _prefill(state, pools.prefill, path, body, client_headers, hashes, input_tokens)
    state.metrics.pd_requests.labels("fallback" if params is None else "transferred").inc()
    # The client's own kv_transfer_params never reach an engine: they would name another producer.
    decode_body = {k: v for k, v in body.items() if k != KV_TRANSFER_FIELD}
    if params is not None:
        decode_body[KV_TRANSFER_FIELD] = params
    return await open_upstream(state, pools.decode, path, decode_body, client_headers, hashes, None, load_tokens)


async def _prefill(state: RouterState, route: ModelRoute, path: str, body: dict[str, Any],
                   client_headers: dict[str, str], hashes: list[int], input_tokens: int) -> dict[str, Any] | None:
    """The producer's kv_transfer_params, or None (counted by reason) when there are none to use."""
    load = input_tokens + 1
    try:
        up = await open_upstream(state, route, path, prefill_body(body), client_headers, hashes, None, load)
    except APIError:
        return _fallback(state, "prefill_unavailable")
    try:
        content = await up.response.read()
    except UPSTREAM_ERRORS as e:
        finish(state, up, route.config.name, load, error=type(e).__name__)
        return _fallback(state, "prefill_error")
    except BaseException:  # the client went away: closing the connection aborts the prefill
        release_load(state, up.backend, load)
        raise
    finally:
        up.response.release()  # back to the pool when read whole, else closed
    finish(state, up, route.config.name, load)
    state.metrics.pd_prefill_latency.labels(up.backend.url).observe(time.monotonic() - up.started)
    if up.response.status != 200:
        return _fallback(state, "prefill_error")
    try:
        params = json.loads(content).get(KV_TRANSFER_FIELD)
    except (ValueError, AttributeError):
        params = None
    if not isinstance(params, dict):
        return _fallback(state, "no_kv_transfer_params")
    return params


def _fallback(state: RouterState, reason: str) -> None:
    state.metrics.pd_fallbacks.labels(reason).inc()
    return None
