"""Speculative decoding: cheap proposals of the next few tokens, verified by the model in one step.

The scheduler asks a proposer for up to `num_speculative_tokens` draft tokens of each decoding
request and schedules them after its last token; the runner scores all of them in one forward
and keeps the longest prefix that verification accepts, plus one token of its own
(`pagellm.sample.rejection`), so greedy output is exactly what it would be without speculation
and sampled output has the same distribution.
"""
from pagellm.config.speculative import SpeculativeConfig
from pagellm.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
