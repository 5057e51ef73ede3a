"""API-key authentication (`--api-key` or $PAGELLM_API_KEY) for every path but the open ones."""
from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm.entrypoints.openai.errors import APIError, log_and_respond


class APIKeyMiddleware:
    """401 without `Authorization: Bearer <key>` (or `x-api-key: <key>`, where the anthropic client
    sends it) on any path outside `open_paths` (/v1/*, /tokenize and /detokenize included: they
    expose the model too).

    A plain ASGI middleware, not a route dependency, so the key is checked before the body is
    parsed (an unauthenticated client learns nothing from validation errors, and takes no place
    in the queue), and streamed responses pass through untouched. The key itself is never logged.
    """

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self.open_paths = open_paths
        self._key_digest = _digest(api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in self.open_paths:
            headers = Headers(scope=scope)
            if not (self.authorized(headers.get("authorization")) or self.key_matches(headers.get("x-api-key"))):
                response = log_and_respond(scope, APIError(
                    "missing or wrong API key: send the header `Authorization: Bearer <key>` "
                    "(or `x-api-key: <key>`)", 401))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        return self.key_matches(token) and scheme.lower() == "bearer"

    def key_matches(self, token: str | None) -> bool:
        # Comparing fixed-length digests in constant time: the time taken reveals neither the key's
        # content nor its length (compare_digest on the raw strings would leak the length).
        # Headers arrive as latin-1: encoding back gives the client's bytes.
        given = _digest((token or "").strip().encode("latin-1"))
        return hmac.compare_digest(given, self._key_digest)


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()
