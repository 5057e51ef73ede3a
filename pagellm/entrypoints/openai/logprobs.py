"""The engine's per-token logprob dicts in OpenAI's two response shapes."""
from __future__ import annotations

from collections.abc import Sequence

from pagellm.entrypoints.openai.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from pagellm.outputs import Logprob
from pagellm.tokenizer import Tokenizer


def _token_text(token_id: int, logprob: Logprob | None, tokenizer: Tokenizer | None, as_id: bool = False) -> str:
    if as_id:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    if tokenizer is not None:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    return f"token_id:{token_id}"  # vLLM's spelling when there is no text


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], text_offset: int,
                        tokenizer: Tokenizer | None, as_ids: bool = False) -> CompletionLogprobs:
    """Legacy logprobs for `token_ids` (entry None: the first prompt token) whose text starts at
    `text_offset` in the choice's text; top_logprobs holds the scored token and the top ones.
    `as_ids` names tokens `token_id:{id}` (vLLM's return_tokens_as_token_ids)."""
    result = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    for token_id, entry in zip(token_ids, entries):
        lp = None if entry is None else entry[token_id]
        token = _token_text(token_id, lp, tokenizer, as_ids)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        # The offsets follow the choice's text, also when tokens are named by id.
        text_offset += len(token if not as_ids else _token_text(token_id, lp, tokenizer))
        result.token_logprobs.append(None if lp is None else lp.logprob)
        result.top_logprobs.append(None if entry is None else {
            _token_text(t, lp, tokenizer, as_ids): lp.logprob for t, lp in entry.items()})
    return result


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], num_top: int,
                  tokenizer: Tokenizer | None, as_ids: bool = False) -> ChatLogprobs:
    """Chat logprobs: each token's own, and the `num_top` most likely at its position (`as_ids`:
    tokens named `token_id:{id}`; `bytes` stays the token's text)."""
    def item(token_id: int, lp: Logprob) -> dict:
        token = _token_text(token_id, lp, tokenizer)
        return {"token": _token_text(token_id, lp, tokenizer, True) if as_ids else token, "logprob": lp.logprob,
                "bytes": list(token.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, entries):
        # The scored token is in the dict even when it is not among the top ones.
        top = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:num_top]
        content.append(TokenLogprob(**item(token_id, entry[token_id]),
                                    top_logprobs=[TopLogprob(**item(t, lp)) for t, lp in top]))
    return ChatLogprobs(content=content)
