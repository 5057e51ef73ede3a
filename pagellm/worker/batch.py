"""The worker's persistent view of the requests it runs, and the flat batch built from it each step."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.core.outputs import SchedulerOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """Everything about one request the worker needs across steps."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: list[int]
    prompt_logprobs_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None
    """Prompt logprobs of the chunks computed so far, until the prompt finishes; None when not
    wanted or already delivered."""
    pooling_params: PoolingParams | None = None
    """Set for a pooling request (see `ModelRunner._pool`)."""
    pooled: torch.Tensor | None = None
    """A pooling request's partial result over the chunks computed so far ([hidden_size] float32):
    the sum of the hidden states (MEAN) or the first token's (CLS)."""
    num_draft_computed: int = 0
    """Tokens whose KV the draft model holds (draft_model speculation, `DraftModelProposer`)."""


@dataclass(slots=True)
class FlatBatch:
    """One step's model inputs: all scheduled tokens back to back, no padding."""

    input_ids: torch.Tensor
    """[num_tokens] int64."""
    positions: torch.Tensor
    """[num_tokens] int64."""
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    """[num_sampling_rows] int64: rows of the hidden states whose next token is sampled: one per
    sampling request, or 1 + its number of drafts (speculative decoding)."""
    sampling_req_ids: list[str]
    """The requests behind `logits_indices`, in the same order."""
    num_generated: list[int]
    """Per sampling row, the tokens its request generated before the one sampled there."""
    num_drafts: list[int] | None = None
    """Per sampling request, its draft tokens this step; None when no request has any."""
    draft_ids: torch.Tensor | None = None
    """[num_sampling_rows] int64: the draft each row is verified against, -1 for a request's last row."""
    prompt_logprobs: "PromptLogprobsPlan | None" = None
    placeholder_rows: np.ndarray | None = None
    """Rows of `input_ids` whose token was sampled by the step still in flight (left 0 here)..."""
    placeholder_req_ids: list[str] | None = None
    """...and, row for row, the requests that sampled them."""


@dataclass(slots=True)
class PromptLogprobsPlan:
    """Prompt positions of this step whose next-token logprobs some request asked for."""

    hidden_indices: torch.Tensor
    """[N] int64: rows of the hidden states, grouped by request."""
    targets: torch.Tensor
    """[N] int64: the prompt token that follows each position."""
    counts: list[tuple[str, int]]
    """(request, number of its rows), in the order of the rows."""
    max_logprobs: int


class RequestStates:
    """Applies each SchedulerOutput diff and lays out the step's flat batch."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.states: dict[str, CachedRequestState] = {}

    def update(self, so: SchedulerOutput) -> None:
        for req_id in so.freed_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            # A request resumed with output already delivered its prompt logprobs with its first token.
            wants_prompt_logprobs = (new.sampling_params.prompt_logprobs is not None
                                     and len(new.token_ids) == new.num_prompt_tokens)
            self.states[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens, list(new.eos_token_ids),
                [] if wants_prompt_logprobs else None, new.pooling_params)
        for cached in so.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_token_ids:
                start = max(cached.num_computed_tokens, state.num_prompt_tokens)
                state.token_ids[start:] = cached.new_token_ids

    def build(self, so: SchedulerOutput) -> FlatBatch:
        req_ids = list(so.num_scheduled_tokens)
        states = [self.states[r] for r in req_ids]
        num_reqs = len(states)
        query_lens = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
        grid = attention_layout([s.block_ids for s in states], num_computed, query_lens, self.block_size, self.device)
        query_start_loc, seq_lens = grid.query_start_loc, grid.seq_lens

        input_ids = np.zeros(grid.num_tokens, dtype=np.int64)
        placeholder_rows, placeholder_req_ids = [], []
        spec = so.scheduled_spec_tokens
        for i, s in enumerate(states):
            start, end = s.num_computed_tokens, s.num_computed_tokens + int(query_lens[i])
            known = min(end, len(s.token_ids))
            row = int(query_start_loc[i])
            input_ids[row:row + known - start] = s.token_ids[start:known]
            if s.req_id in spec:  # drafts follow the last known token
                input_ids[row + known - start:row + end - start] = spec[s.req_id]
            elif end > known:  # the last input is the token the previous step is still sampling
                placeholder_rows.append(row + known - start)
                placeholder_req_ids.append(s.req_id)

        # A request samples when this step reaches the end of its tokens, known or in flight (a
        # finished prefill or a decode); a mid-prompt chunk does not.
        token_counts = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=num_reqs)
        sampling_rows = np.flatnonzero(seq_lens >= token_counts)
        logits_indices = query_start_loc[sampling_rows + 1] - 1
        num_generated = [int(seq_lens[i]) - states[i].num_prompt_tokens for i in sampling_rows]
        num_drafts = draft_ids = None
        if spec:
            # A request with k drafts samples at its last k + 1 rows: row j verifies draft j.
            num_drafts = [len(spec.get(req_ids[i], ())) for i in sampling_rows]
            logits_indices = np.concatenate([np.arange(end - k, end + 1) for end, k in zip(logits_indices, num_drafts)])
            num_generated = [n - k + j for n, k in zip(num_generated, num_drafts) for j in range(k + 1)]
            draft_ids = np.concatenate([[*spec.get(req_ids[i], ()), -1] for i in sampling_rows])

        dev = self.device
        return FlatBatch(
            input_ids=_to_device(input_ids, torch.int64, dev),
            positions=grid.positions,
            attn_metadata=grid.attn_metadata,
            logits_indices=_to_device(logits_indices, torch.int64, dev),
            sampling_req_ids=[req_ids[i] for i in sampling_rows],
            num_generated=num_generated,
            num_drafts=num_drafts,
            draft_ids=None if draft_ids is None else _to_device(draft_ids, torch.int64, dev),
            prompt_logprobs=self._plan_prompt_logprobs(states, query_start_loc, query_lens),
            placeholder_rows=np.asarray(placeholder_rows, dtype=np.int64) if placeholder_rows else None,
            placeholder_req_ids=placeholder_req_ids or None,
        )

    def _plan_prompt_logprobs(self, states: list[CachedRequestState], query_start_loc: np.ndarray,
                              query_lens: np.ndarray) -> PromptLogprobsPlan | None:
        indices, targets, counts, max_logprobs = [], [], [], 0
        for i, s in enumerate(states):
            if s.prompt_logprobs_parts is None:
                continue
            # Position j's logits predict token j + 1: prompt positions up to the second to last
            # (the last one's logits sample the first output token).
            start = s.num_computed_tokens
            end = min(start + int(query_lens[i]), s.num_prompt_tokens - 1)
            if end <= start:
                continue
            indices.append(np.arange(start, end) - start + query_start_loc[i])
            targets.append(s.token_ids[start + 1:end + 1])
            counts.append((s.req_id, end - start))
            max_logprobs = max(max_logprobs, s.sampling_params.prompt_logprobs)
        if not counts:
            return None
        return PromptLogprobsPlan(
            _to_device(np.concatenate(indices), torch.int64, self.device),
            _to_device(np.concatenate([np.asarray(t, dtype=np.int64) for t in targets]), torch.int64, self.device),
            counts, max_logprobs)

    def append_sampled(self, req_ids: list[str], token_ids: list[list[int]]) -> None:
        for req_id, new in zip(req_ids, token_ids):
            state = self.states.get(req_id)
            if state is not None:  # None: freed (finished, aborted, preempted) while in flight
                state.token_ids.extend(new)


@dataclass(slots=True)
class AttentionLayout:
    """Where each token of a flat batch sits: its position, its KV slot, its request's blocks."""

    query_start_loc: np.ndarray
    """[num_reqs + 1] int64: each request's first row."""
    seq_lens: np.ndarray
    """[num_reqs] int64: each request's length once the batch is computed."""
    positions: torch.Tensor
    """[num_tokens] int64, on the device."""
    attn_metadata: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def attention_layout(block_ids: list[list[int]], num_computed: np.ndarray, query_lens: np.ndarray,
                     block_size: int, device: torch.device) -> AttentionLayout:
    """The layout of a batch in which request i computes `query_lens[i]` tokens after its first
    `num_computed[i]`, its KV going to the blocks `block_ids[i]` (which must cover them)."""
    num_reqs = len(block_ids)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_lens = num_computed + query_lens
    # Positions without a per-token loop: each token's offset inside its request's chunk.
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)
    positions = np.arange(num_tokens) - query_start_loc[req_of_token] + num_computed[req_of_token]
    block_table = np.zeros((num_reqs, max(len(b) for b in block_ids)), dtype=np.int32)
    for i, blocks in enumerate(block_ids):
        block_table[i, :len(blocks)] = blocks
    slot_mapping = (block_table[req_of_token, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    attn_metadata = AttentionMetadata(
        num_tokens=num_tokens,
        query_start_loc=_to_device(query_start_loc, torch.int32, device),
        seq_lens=_to_device(seq_lens, torch.int32, device),
        block_table=_to_device(block_table, torch.int32, device),
        slot_mapping=_to_device(slot_mapping, torch.int64, device),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc.astype(np.int32),
        seq_lens_cpu=seq_lens.astype(np.int32),
    )
    return AttentionLayout(query_start_loc, seq_lens, _to_device(positions, torch.int64, device), attn_metadata)


def _to_device(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # non_blocking: a blocking host-to-device copy would wait for the step still running on the
    # GPU, which is what async scheduling overlaps with.
    host = np.ascontiguousarray(array, dtype=_NUMPY_TYPES[dtype])
    return torch.from_numpy(host).to(device, non_blocking=True)


_NUMPY_TYPES = {torch.int32: np.int32, torch.int64: np.int64}
