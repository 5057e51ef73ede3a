"""The router's HTTP client to its backends: one aiohttp session, built here, shared by every request.

aiohttp rather than httpx: its send path (no anyio layer, a C HTTP parser) costs the router about
half as much per request, which is most of what the router adds to a request's first token.
"""
from __future__ import annotations

import asyncio

import aiohttp

CONNECT_TIMEOUT_S = 5.0
KEEPALIVE_S = 4.0
"""How long an idle connection is kept: under uvicorn's 5 s, so that the router drops it before a
backend closes it (a request sent as the backend closes fails; aiohttp's default keeps 15 s)."""

UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError)
"""What a backend that does not connect, answer in time or finish its answer raises."""


def make_session(request_timeout_s: float) -> aiohttp.ClientSession:
    """The session (on the running loop): a keep-alive pool without a connection cap (aiohttp's
    default caps at 100, which would queue requests behind a busy backend's streams); connect within
    CONNECT_TIMEOUT_S, then each read within `request_timeout_s` (a stream may run longer in all).
    Proxy variables (HTTP_PROXY, ...) are not read: backends are reached directly."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


def is_timeout(error: BaseException) -> bool:
    """Whether an UPSTREAM_ERRORS error is a timeout (aiohttp's ServerTimeoutError is one too)."""
    return isinstance(error, asyncio.TimeoutError)
