"""The engine core's logprob rows turned into vLLM's output structure, per sequence."""
from __future__ import annotations

from pagellm.core.outputs import EngineCoreOutput, TokenLogprobs
from pagellm.outputs import Logprob, PromptLogprobs, SampleLogprobs
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer


class LogprobsState:
    """One sequence's logprobs so far: what CompletionOutput and RequestOutput report."""

    __slots__ = ("tokenizer", "logprobs", "prompt_logprobs", "cumulative_logprob")

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer if params.detokenize else None
        """Decodes each token alone for Logprob.decoded_token; None leaves it None."""
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = None
        """Set once, with the first generated token."""
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None

    @staticmethod
    def wanted(params: SamplingParams) -> bool:
        return params.logprobs is not None or params.prompt_logprobs is not None

    def update(self, out: EngineCoreOutput, num_new_tokens: int) -> None:
        """Take an engine-core output of which the first `num_new_tokens` tokens are kept (fewer
        than it carries when a stop string ended the sequence inside it)."""
        if out.new_prompt_logprobs is not None:
            # Nothing predicts the first prompt token.
            self.prompt_logprobs = [None, *self._dicts(out.new_prompt_logprobs)]
        if out.new_logprobs is not None and self.logprobs is not None and num_new_tokens:
            rows = out.new_logprobs
            kept = TokenLogprobs(rows.token_ids[:num_new_tokens], rows.logprobs[:num_new_tokens],
                                 rows.ranks[:num_new_tokens])
            self.logprobs.extend(self._dicts(kept))
            self.cumulative_logprob += sum(values[0] for values in kept.logprobs)

    def sample_logprobs(self, start: int) -> SampleLogprobs | None:
        """The generated tokens' logprobs from token `start` on (0: all; later: a delta)."""
        return None if self.logprobs is None else self.logprobs[start:]

    def _dicts(self, rows: TokenLogprobs) -> list[dict[int, Logprob]]:
        texts = self._decode(rows.token_ids)
        out = []
        for ids, values, rank, words in zip(rows.token_ids, rows.logprobs, rows.ranks, texts):
            # The scored token first, with its true rank; then the top-k (rank = place), where the
            # scored token is not repeated.
            entry = {ids[0]: Logprob(values[0], rank, words[0])}
            for place, (token_id, value, word) in enumerate(zip(ids[1:], values[1:], words[1:]), start=1):
                if token_id not in entry:
                    entry[token_id] = Logprob(value, place, word)
            out.append(entry)
        return out

    def _decode(self, token_ids: list[list[int]]) -> list[list[str | None]]:
        if self.tokenizer is None:
            return [[None] * len(ids) for ids in token_ids]
        flat = [[t] for ids in token_ids for t in ids]
        words = iter(self.tokenizer.backend.decode_batch(flat, skip_special_tokens=False))
        return [[next(words) for _ in ids] for ids in token_ids]
