"""Length governance: a prompt over `max_input_tokens` (counted with the model's tokenizer) is
rejected or truncated, and an output budget over `max_output_tokens` rejected or lowered.

Completions are cut on tokens (left keeps the end, right the start, middle both ends) and sent
as token ids, so the backend sees exactly the counted tokens. Chat keeps its system messages and
the most recent turns: the oldest other messages are dropped until the prompt fits; if the last
message alone is still too long, its text is cut by the policy's side.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.router.body import estimate_tokens, prompt_text, requested_max_tokens
from pagellm.router.config import KeyConfig, ModelConfig
from pagellm.tokenizer import Tokenizer


class LengthError(ValueError):
    """A request over a limit under the reject policy (400), naming the field, the limit and the count."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class Governed:
    body: dict[str, Any]
    """The request to send: the client's, or a truncated copy."""
    input_tokens: int
    """Prompt tokens after governance (all prompts of a batch together)."""
    truncated_from: int | None = None
    """Prompt tokens before truncation; None when nothing was cut."""


def limits(model: ModelConfig, key: KeyConfig | None) -> tuple[int | None, int | None]:
    """(max input, max output) tokens: the smaller of the model's and the key's."""
    def smaller(a: int | None, b: int | None) -> int | None:
        return b if a is None else a if b is None else min(a, b)
    return (smaller(model.max_input_tokens, key and key.max_input_tokens),
            smaller(model.max_output_tokens, key and key.max_output_tokens))


def govern(body: dict[str, Any], tokenizer: Tokenizer | None, model: ModelConfig, key: KeyConfig | None) -> Governed:
    """Apply the limits to a completions or chat body; LengthError under the reject policy. Without a
    tokenizer (then the model has no max_input_tokens) the prompt's tokens are estimated."""
    max_in, max_out = limits(model, key)
    body = dict(body)
    _govern_output(body, max_out, model.length_policy)
    if tokenizer is None:
        return Governed(body, estimate_tokens(prompt_text(body)))
    if "messages" in body:
        return _govern_chat(body, tokenizer, max_in, model.length_policy)
    return _govern_completion(body, tokenizer, max_in, model.length_policy)


def _govern_output(body: dict[str, Any], max_out: int | None, policy: str) -> None:
    if max_out is None:
        return
    field, value = requested_max_tokens(body)
    if value is None or value > max_out:
        if value is not None and policy == "reject":
            raise LengthError(f"{field} is {value}, over this model's max_output_tokens of {max_out}", field)
        body[field] = max_out


def cut(ids: list[int], keep: int, policy: str) -> list[int]:
    """`keep` of `ids` by the policy: truncate_left drops the start, right the end, middle the middle."""
    if keep >= len(ids):
        return ids
    if keep <= 0:
        return []
    if policy == "truncate_left":
        return ids[len(ids) - keep:]
    if policy == "truncate_right":
        return ids[:keep]
    head = keep // 2
    return ids[:head] + ids[len(ids) - (keep - head):]


def _govern_completion(body: dict[str, Any], tokenizer: Tokenizer, max_in: int | None, policy: str) -> Governed:
    prompt = body.get("prompt")
    single = isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
    prompts = [prompt] if single else prompt if isinstance(prompt, list) else []
    add_special = body.get("add_special_tokens", True) is not False
    ids = [p if isinstance(p, list) else tokenizer.encode(p, add_special)
           for p in prompts if isinstance(p, (str, list))]
    total = sum(map(len, ids))
    over = [i for i, p in enumerate(ids) if max_in is not None and len(p) > max_in]
    if not over:
        return Governed(body, total)
    if policy == "reject":
        i = over[0]
        where = "prompt" if single else f"prompt[{i}]"
        raise LengthError(f"{where} has {len(ids[i])} tokens, over this model's max_input_tokens of {max_in}",
                          "prompt")
    cut_ids = [cut(p, max_in, policy) for p in ids]
    body["prompt"] = cut_ids[0] if single else cut_ids
    return Governed(body, sum(map(len, cut_ids)), total)


def _govern_chat(body: dict[str, Any], tokenizer: Tokenizer, max_in: int | None, policy: str) -> Governed:
    messages = body["messages"]
    if not isinstance(messages, list):
        return Governed(body, 0)

    def count(msgs: list[Any]) -> int:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=body.get("add_generation_prompt", True))
        return len(tokenizer.encode(text, body.get("add_special_tokens", False) is True))

    total = count(messages)
    if max_in is None or total <= max_in:
        return Governed(body, total)
    if policy == "reject":
        raise LengthError(f"messages have {total} tokens, over this model's max_input_tokens of {max_in}", "messages")
    system = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") in ("system", "developer")]
    others = [i for i in range(len(messages)) if i not in system]

    def keep_last(n: int) -> list[Any]:
        kept = set(system) | set(others[len(others) - n:])
        return [m for i, m in enumerate(messages) if i in kept]

    # The fewest dropped turns that fit: counts fall as turns are dropped, so bisect over how many stay.
    lo, hi = 1, len(others)  # the last message always stays
    if count(keep_last(1)) <= max_in:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if count(keep_last(mid)) <= max_in else (lo, mid - 1)
        kept = keep_last(lo)
    else:
        kept = _cut_last_message(keep_last(1), count, tokenizer, max_in, policy)
    body["messages"] = kept
    return Governed(body, count(kept), total)


def _cut_last_message(msgs: list[Any], count: Any, tokenizer: Tokenizer, max_in: int, policy: str) -> list[Any]:
    last = msgs[-1]
    content = last.get("content") if isinstance(last, dict) else None
    base = count(msgs[:-1] + [{**last, "content": ""}]) if isinstance(content, str) else None
    if base is None or base >= max_in:
        raise LengthError(f"the system messages and the last message leave no room under max_input_tokens of "
                          f"{max_in}; the prompt cannot be truncated to fit", "messages")
    ids = tokenizer.encode(content, False)
    keep = max_in - base
    # Decoded cut text may re-tokenize a token longer at the seams: shrink until it fits (a few rounds).
    while keep > 0:
        trial = msgs[:-1] + [{**last, "content": tokenizer.decode(cut(ids, keep, policy), False)}]
        if count(trial) <= max_in:
            return trial
        keep -= max(1, count(trial) - max_in)
    raise LengthError(f"the last message cannot be truncated under max_input_tokens of {max_in}", "messages")
