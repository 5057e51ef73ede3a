"""Speculative decoding: cheap proposals of the next few tokens, verified by the model in one step.

The scheduler asks a proposer for up to `num_speculative_tokens` draft tokens of each decoding
request and schedules them after its last token; the runner scores all of them in one forward
and keeps the longest prefix that verification accepts, plus one token of its own
(`pagellm.sample.rejection`), so greedy output is exactly what it would be without speculation
and sampled output has the same distribution.

Proposers implement one interface (`proposer.py`): `HostProposer` beside the scheduler (n-gram,
suffix decoding), `DeviceProposer` in the workers (the draft model, `pagellm.worker.draft_model`);
the method names of `speculative_config` are `PROPOSER_REGISTRY`'s, and `register_proposer` adds one.
"""
from pagellm.config.speculative import PROPOSER_REGISTRY, ProposerEntry, SpeculativeConfig
from pagellm.spec_decode.ngram import NgramProposer
from pagellm.spec_decode.proposer import (
    DeviceProposer,
    HostProposer,
    Proposer,
    build_device_proposer,
    build_host_proposer,
    proposer_class,
    register_proposer,
)
from pagellm.spec_decode.suffix import SuffixProposer

__all__ = ["PROPOSER_REGISTRY", "DeviceProposer", "HostProposer", "NgramProposer", "Proposer", "ProposerEntry",
           "SpeculativeConfig", "SuffixProposer", "build_device_proposer", "build_host_proposer", "proposer_class",
           "register_proposer"]
