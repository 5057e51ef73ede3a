"""One interface for the proposers of draft tokens, whichever process they run in, and the registry
that maps `speculative_config`'s `method` to one (`PROPOSER_REGISTRY`, in `pagellm.config.speculative`
where `SpeculativeConfig.parse` reads it).

A proposer runs either beside the scheduler (`HostProposer`: from a request's token ids, on the
host, before the step is scheduled; n-gram prompt lookup, suffix decoding) or in the workers
(`DeviceProposer`: on the device, after the step that sampled, with a model and KV cache of its
own; a draft model, EAGLE). The engine core builds the first kind (`build_host_proposer`) and hands
it to the scheduler; each worker builds the second (`build_device_proposer`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from pagellm.config import EngineConfig, SpeculativeConfig
from pagellm.config.registry import check_ref, resolve
from pagellm.config.speculative import METHOD_KEYS, PROPOSER_REGISTRY, ProposerEntry, ProposerPlace
from pagellm.core.interfaces import DraftProposer


class Proposer(ABC):
    """Proposes draft tokens that the target model then verifies in one step."""

    runs_in: ClassVar[ProposerPlace]
    """"scheduler" (`HostProposer`) or "worker" (`DeviceProposer`)."""


class HostProposer(Proposer, DraftProposer):
    """Runs beside the scheduler, which asks it for each decoding request's drafts before it
    schedules the step (the scheduler's view: `pagellm.core.interfaces.DraftProposer`)."""

    runs_in: ClassVar[ProposerPlace] = "scheduler"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    @abstractmethod
    def propose(self, token_ids: list[int], max_tokens: int, req_id: str | None = None,
                num_prompt_tokens: int = 0) -> list[int]:
        """Up to `max_tokens` draft tokens to follow `token_ids` (the first `num_prompt_tokens` the
        prompt's, 0: not told); state may be kept per `req_id`."""

    def forget(self, req_id: str) -> None:
        """Drop what was kept for a finished request (nothing by default)."""

    @property
    def num_requests_kept(self) -> int:
        """How many requests it keeps state for (none by default): 0 once all have finished."""
        return 0


class DeviceProposer(Proposer):
    """Runs in every worker: loads with the target model, keeps its KV cache in the target's blocks
    (a block holds both), and proposes for the requests that sampled, once their tokens are read."""

    runs_in: ClassVar[ProposerPlace] = "worker"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def load(self) -> None:
        """Build its model and load its weights (after the target's)."""

    @abstractmethod
    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """What its own KV cache adds to one block of the target's, in bytes on this rank."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate its KV cache for the target's `num_blocks` blocks (the same block ids)."""

    def capture_cuda_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        """Capture its passes as CUDA graphs where it has any (none by default)."""

    @abstractmethod
    def propose(self, states: Sequence[Any]) -> dict[str, list[int]]:
        """Draft tokens by request id for the next step of each of `states` (the worker's
        `CachedRequestState` of each request that sampled in the step just read, its tokens appended)."""


def register_proposer(method: str, proposer_cls: type[Proposer] | str, *, runs_in: ProposerPlace | None = None,
                      keys: Sequence[str] = (), aliases: Sequence[str] = (), description: str = "",
                      override: bool = False) -> None:
    """Make `method` a `speculative_config` method proposed by `proposer_cls`: a `HostProposer` or
    `DeviceProposer` subclass, or its "package.module:Class" name (then `runs_in` must say which,
    as the class is imported only where it runs). `keys`: which of `METHOD_KEYS` it takes ("model":
    a draft model, resolved and checked as the draft_model method's). A name already registered is
    refused unless `override`."""
    what = f"register_proposer({method!r})"
    check_ref(proposer_cls, what)
    if not isinstance(proposer_cls, str):
        _check_proposer_class(proposer_cls, method, runs_in)
        runs_in = proposer_cls.runs_in
    if runs_in not in ("scheduler", "worker"):
        raise ValueError(f"{what}: runs_in must be 'scheduler' or 'worker', got {runs_in!r}")
    unknown = [key for key in keys if key not in METHOD_KEYS]
    if unknown:
        raise ValueError(f"{what}: keys {', '.join(map(repr, unknown))} are not speculative_config keys; "
                         f"a method may take {', '.join(METHOD_KEYS)}")
    PROPOSER_REGISTRY.register(ProposerEntry(method, proposer_cls, runs_in, tuple(keys), tuple(aliases),
                                             description), override=override)


def proposer_class(method: str) -> type[Proposer]:
    """The proposer class of `speculative_config` method `method`."""
    entry = PROPOSER_REGISTRY.get(method)
    return _check_proposer_class(resolve(entry.cls), entry.name, entry.runs_in)


def build_host_proposer(speculative: SpeculativeConfig | None) -> HostProposer | None:
    """The proposer the scheduler asks for drafts; None without speculation or where the workers propose."""
    entry = _entry(speculative)
    if entry is None or entry.runs_in != "scheduler":
        return None
    return proposer_class(entry.name)(speculative)


def build_device_proposer(config: EngineConfig) -> DeviceProposer | None:
    """The proposer a worker runs after each step; None without speculation or where the scheduler proposes."""
    entry = _entry(config.speculative)
    if entry is None or entry.runs_in != "worker":
        return None
    return proposer_class(entry.name)(config)


def _entry(speculative: SpeculativeConfig | None) -> ProposerEntry | None:
    return None if speculative is None else PROPOSER_REGISTRY.get(speculative.method)


def _check_proposer_class(cls: Any, method: str, runs_in: str | None) -> type[Proposer]:
    kinds = {"scheduler": HostProposer, "worker": DeviceProposer}
    wanted = kinds.get(runs_in, (HostProposer, DeviceProposer))
    if not (isinstance(cls, type) and issubclass(cls, wanted)):
        names = ("pagellm.spec_decode.HostProposer" if runs_in == "scheduler" else
                 "pagellm.spec_decode.DeviceProposer" if runs_in == "worker" else
                 "pagellm.spec_decode.HostProposer or DeviceProposer")
        raise ValueError(f"the proposer of speculative decoding method {method!r} must be a subclass of {names}, "
                         f"got {cls!r}")
    return cls
