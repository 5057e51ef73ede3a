"""What the router reads from an OpenAI request body without parsing it into the server's models:
the prompt as text (for prefix affinity and token estimates), the output budget, determinism."""
from __future__ import annotations

import json
from typing import Any

CHARS_PER_TOKEN_ESTIMATE = 4
"""Without a tokenizer, a prompt's token count is estimated from its length (load balancing only)."""
DEFAULT_MAX_TOKENS_ESTIMATE = 256
"""The output a request without max_tokens is assumed to ask for, when estimating a backend's load."""
OUTPUT_BUDGET_FIELDS = ("max_completion_tokens", "max_tokens")
"""Chat's fields for the output budget (the first present wins, as on OpenAI); completions use max_tokens."""


def message_text(content: Any) -> str:
    """A chat message's text: a string, or its text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as one text: chat messages in order with their roles, or the completion prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"<{m.get('role')}>{message_text(m.get('content'))}\n" for m in messages if isinstance(m, dict))
    prompt = body.get("prompt", body.get("input", ""))
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def requested_max_tokens(body: dict[str, Any]) -> tuple[str, int | None]:
    """(field, value) of the request's output budget; the field a limit is written to when absent."""
    fields = OUTPUT_BUDGET_FIELDS if "messages" in body else ("max_tokens",)
    for name in fields:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return "max_tokens", None


def is_deterministic(body: dict[str, Any]) -> bool:
    """Greedy (temperature 0) or seeded: the same request gives the same response."""
    return body.get("temperature") == 0 or isinstance(body.get("seed"), int)


def estimate_tokens(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN_ESTIMATE + 1
