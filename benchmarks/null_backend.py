"""An OpenAI-compatible backend that does no work: `/v1/models` lists one model and
`/v1/completions` or `/v1/chat/completions` answer at once with `max_tokens` tokens ("t "), streamed
(with a usage chunk) or not. A bare ASGI app on uvicorn, so that a proxy's own cost
(`benchmarks.router_overhead --backend null`) is not hidden behind an engine's.

    python -m benchmarks.null_backend --port 8001 --model bench
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn

_DEFAULT_TOKENS = 16


def make_app(model: str):
    models = json.dumps({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "null"}]}).encode()

    async def app(scope: dict[str, Any], receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope["path"]
        if path == "/v1/models":
            await _answer(send, models, b"application/json")
        elif path in ("/v1/completions", "/v1/chat/completions"):
            request = json.loads(body or b"{}")
            tokens = request.get("max_tokens") or request.get("max_completion_tokens") or _DEFAULT_TOKENS
            chat = path.endswith("chat/completions")
            if request.get("stream"):
                await _answer(send, _events(model, tokens, chat), b"text/event-stream")
            else:
                await _answer(send, json.dumps(_completion(model, tokens, chat)).encode(), b"application/json")
        else:
            await _answer(send, b"{}", b"application/json", 200 if path.startswith("/health") else 404)

    return app


async def _answer(send, body: bytes, content_type: bytes, status: int = 200) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}


def _completion(model: str, tokens: int, chat: bool) -> dict[str, Any]:
    text = "t " * tokens
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"} if chat
              else {"index": 0, "text": text, "finish_reason": "length"})
    return {"id": "null", "object": "chat.completion" if chat else "text_completion", "model": model,
            "choices": [choice], "usage": _usage(tokens)}


def _events(model: str, tokens: int, chat: bool) -> bytes:
    """The whole stream at once: each token an event, then the usage chunk and [DONE]."""
    delta = {"index": 0, "delta": {"content": "t "}} if chat else {"index": 0, "text": "t "}
    event = json.dumps({"id": "null", "model": model, "choices": [delta]})
    usage = json.dumps({"id": "null", "model": model, "choices": [], "usage": _usage(tokens)})
    return "".join([f"data: {event}\n\n"] * tokens + [f"data: {usage}\n\n", "data: [DONE]\n\n"]).encode()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="bench")
    args = p.parse_args(argv)
    uvicorn.run(make_app(args.model), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
