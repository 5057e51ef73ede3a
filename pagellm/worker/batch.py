"""The worker's persistent view of the requests it runs, and the flat batch built from it each step."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.core.outputs import NewRequestData, SchedulerOutput
from pagellm.core.request import EngineCoreRequest, RecordFields
from pagellm.lora.manager import LoRAManager
from pagellm.sample.logits_processors import uses_logits_processors
from pagellm.worker.encoder_cache import ScheduledImage, scheduled_images
from pagellm.worker.mrope import MRopePositions, mrope_positions


@dataclass(slots=True, kw_only=True)
class CachedRequestState(RecordFields):
    """Everything about one request the worker needs across steps: its record (what was asked) and
    where it stands on this worker."""

    record: EngineCoreRequest
    token_ids: list[int]
    """Prompt and output tokens known to this worker."""
    num_prompt_tokens: int
    block_ids: list[list[int]]
    """Per KV cache group, its blocks (those a sliding window gave back keep their old ids, unread)."""
    num_computed_tokens: int
    prompt_logprobs_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None
    """Prompt logprobs of the chunks computed so far, until the prompt finishes; None when not
    wanted or already delivered."""
    pooled: torch.Tensor | None = None
    """A pooling request's partial result over the chunks computed so far ([hidden_size] float32):
    the sum of the hidden states (MEAN) or the first token's (CLS)."""
    num_draft_computed: int = 0
    """Tokens whose KV the draft model holds (draft_model speculation, `DraftModelProposer`)."""
    row: int = 0
    """Its row of the persistent batch (`RequestStates.block_tables`...), while it lives."""
    uses_processors: bool = False
    """Whether its sampling needs logits processors (`uses_logits_processors`)."""
    mrope: MRopePositions | None = None
    """Its tokens' three rotary positions (a prompt with images, a model with M-RoPE); None: each
    token is at its index."""

    @classmethod
    def from_new(cls, new: NewRequestData, *, row: int) -> CachedRequestState:
        """The state of a request the scheduler sent as new, in persistent-batch row `row`."""
        record = new.record
        params = record.sampling_params
        # A request resumed with output already delivered its prompt logprobs with its first token.
        wants_prompt_logprobs = params.prompt_logprobs is not None and not new.output_token_ids
        return cls(record=record, token_ids=[*record.prompt_token_ids, *new.output_token_ids],
                   num_prompt_tokens=len(record.prompt_token_ids), block_ids=[list(ids) for ids in new.block_ids],
                   num_computed_tokens=new.num_computed_tokens,
                   prompt_logprobs_parts=[] if wants_prompt_logprobs else None, row=row,
                   uses_processors=uses_logits_processors(params))


@dataclass(slots=True)
class FlatBatch:
    """One step's model inputs: all scheduled tokens back to back, no padding."""

    input_ids: torch.Tensor
    """[num_tokens] int64."""
    positions: torch.Tensor
    """[num_tokens] int64: each token's rotary position (its index; with M-RoPE, plus its request's
    delta after its images), or [3, num_tokens] for a step of a model with M-RoPE that computes
    tokens among a request's images (`_mrope_step_positions`)."""
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
    placeholders: tuple[torch.Tensor, torch.Tensor] | None = None
    """Rows of `input_ids` whose token was sampled by the step still in flight (left 0 here), and
    row for row where that token is in the step's tensor of sampled ids (both int64, on the device)."""
    sampling_rows: np.ndarray | None = None
    """The persistent-batch rows of `sampling_req_ids`."""
    lora_slots: np.ndarray | None = None
    """[num_tokens] int64: each token's adapter slot, -1 for the base model (None: LoRA is off)."""
    images: list[ScheduledImage] | None = None
    """The image placeholder tokens this step computes (None: none)."""


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
    """Applies each SchedulerOutput diff and lays out the step's flat batch.

    Besides each request's state, a persistent host batch: every live request owns a row of a
    block table per KV cache group and of per-row counters, written when its blocks change (a new
    request, a request crossing a block boundary), so a step gathers its rows with numpy instead
    of walking requests."""

    def __init__(self, block_size: int, device: torch.device, lora: LoRAManager | None = None,
                 num_kv_groups: int = 1, mrope_merge_size: int | None = None) -> None:
        """`lora`: the adapters' slots, which the requests that use one hold while they live.
        `mrope_merge_size`: a model with M-RoPE's vision `spatial_merge_size` (None: plain positions)."""
        self.block_size = block_size
        self.mrope_merge_size = mrope_merge_size
        self.device = device
        self.lora = lora
        self.states: dict[str, CachedRequestState] = {}
        self._free_rows: list[int] = []
        self.block_tables = [np.zeros((0, 1), dtype=np.int32) for _ in range(num_kv_groups)]
        """Per KV cache group, [rows, max blocks] block ids of each live request's row (see
        `CachedRequestState.row`)."""
        self.num_blocks = np.zeros(0, dtype=np.int64)
        """Per row, the blocks its request holds (by index: the same in every group)."""
        self.sampled_row = np.zeros(0, dtype=np.int64)
        """Per row: its request's row in the latest launched step's tensor of sampled ids."""
        self.lora_slot = np.zeros(0, dtype=np.int64)
        """Per row: its request's adapter slot, -1 for the base model."""
        self.num_special = 0
        """Live requests whose sampling needs more than temperature and filters (logits processors)."""
        self.num_with_images = 0
        """Live requests with images (a step looks for their placeholders only while there are some)."""

    def update(self, so: SchedulerOutput) -> None:
        for req_id in so.freed_req_ids:
            state = self.states.pop(req_id, None)
            if state is not None:
                self._free_rows.append(state.row)
                self.num_special -= state.uses_processors
                self.num_with_images -= bool(state.record.multi_modal)
                if self.lora_slot[state.row] >= 0:
                    self.lora.release(int(self.lora_slot[state.row]))
        for new in so.scheduled_new_reqs:
            state = self.states[new.req_id] = CachedRequestState.from_new(new, row=self._take_row())
            self.num_special += state.uses_processors
            self.num_with_images += bool(state.record.multi_modal)
            if self.mrope_merge_size is not None and state.record.multi_modal:
                state.mrope = mrope_positions(state.num_prompt_tokens, state.record.multi_modal,
                                              self.mrope_merge_size)
            self.num_blocks[state.row] = 0
            lora = state.record.lora_request
            self.lora_slot[state.row] = -1 if lora is None else self.lora.acquire(lora.lora_int_id)
            self._write_blocks(state, state.block_ids)
        for cached in so.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            for ids, new_ids in zip(state.block_ids, cached.new_block_ids):
                ids.extend(new_ids)
            self._write_blocks(state, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_token_ids:
                start = max(cached.num_computed_tokens, state.num_prompt_tokens)
                state.token_ids[start:] = cached.new_token_ids

    def _take_row(self) -> int:
        if not self._free_rows:  # grow the persistent batch: twice the rows
            old = len(self.num_blocks)
            size = max(2 * old, 8)
            self.block_tables = [_grown(table, (size, table.shape[1])) for table in self.block_tables]
            self.num_blocks = _grown(self.num_blocks, (size,))
            self.sampled_row = _grown(self.sampled_row, (size,))
            self.lora_slot = _grown(self.lora_slot, (size,))
            self._free_rows = list(range(size - 1, old - 1, -1))
        return self._free_rows.pop()

    def _write_blocks(self, state: CachedRequestState, block_ids: tuple[list[int], ...]) -> None:
        """Append a request's new blocks, as many in each group."""
        start = int(self.num_blocks[state.row])
        end = start + len(block_ids[0])
        for g, (table, ids) in enumerate(zip(self.block_tables, block_ids, strict=True)):
            if end > table.shape[1]:
                table = self.block_tables[g] = _grown(table, (len(table), max(end, 2 * table.shape[1])))
            table[state.row, start:end] = ids
        self.num_blocks[state.row] = end

    def build(self, so: SchedulerOutput) -> FlatBatch:
        req_ids = list(so.num_scheduled_tokens)
        states = [self.states[r] for r in req_ids]
        num_reqs = len(states)
        query_lens = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
        token_counts = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=num_reqs)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_reqs)
        width = max(int(self.num_blocks[rows].max()), 1)
        block_tables = [table[rows, :width] for table in self.block_tables]
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        # Each row's known inputs: a decode row's one token, a prefill chunk's span; inputs past
        # the known tokens are drafts or the token the step in flight is still sampling.
        input_ids = np.zeros(num_tokens, dtype=np.int64)
        ends = starts + query_lens
        num_known = np.minimum(ends, token_counts) - starts
        single = np.flatnonzero((num_known == 1) & (query_lens == 1))
        input_ids[query_start_loc[single]] = [states[i].token_ids[c]
                                              for i, c in zip(single.tolist(), starts[single].tolist())]
        for i in np.flatnonzero((num_known > 0) & (query_lens > 1)).tolist():
            row, start = int(query_start_loc[i]), int(starts[i])
            input_ids[row:row + int(num_known[i])] = states[i].token_ids[start:start + int(num_known[i])]
        spec = so.scheduled_spec_tokens
        index_of = {r: i for i, r in enumerate(req_ids)} if spec else {}
        for req_id, drafts in spec.items():  # drafts follow the last known token
            i = index_of[req_id]
            first = int(query_start_loc[i] + num_known[i])
            input_ids[first:first + len(drafts)] = drafts
        placeholders = np.flatnonzero(ends > token_counts)
        if spec:
            placeholders = np.array([i for i in placeholders.tolist() if req_ids[i] not in spec], dtype=np.int64)
        # The last input of such a row is the token the previous step is still sampling; its
        # value is taken on the device from that step's sampled ids (`sampled_row`).
        placeholder_rows = query_start_loc[placeholders] + num_known[placeholders]

        # A request samples when this step reaches the end of its tokens, known or in flight (a
        # finished prefill or a decode); a mid-prompt chunk does not.
        sampling_rows = np.flatnonzero(ends >= token_counts)
        logits_indices = query_start_loc[sampling_rows + 1] - 1
        num_generated = (ends[sampling_rows] - np.fromiter(
            (states[i].num_prompt_tokens for i in sampling_rows.tolist()), dtype=np.int64,
            count=len(sampling_rows))).tolist()
        num_drafts = draft_ids = None
        if spec:
            # A request with k drafts samples at its last k + 1 rows: row j verifies draft j.
            num_drafts = [len(spec.get(req_ids[i], ())) for i in sampling_rows]
            logits_indices = np.concatenate([np.arange(end - k, end + 1) for end, k in zip(logits_indices, num_drafts)])
            num_generated = [n - k + j for n, k in zip(num_generated, num_drafts) for j in range(k + 1)]
            draft_ids = np.concatenate([[*spec.get(req_ids[i], ()), -1] for i in sampling_rows]).astype(np.int64)

        extra = [input_ids, logits_indices, placeholder_rows, self.sampled_row[rows[placeholders]]]
        if draft_ids is not None:
            extra.append(draft_ids)
        rope_positions = (_mrope_step_positions(states, starts, query_lens, query_start_loc)
                          if self.mrope_merge_size is not None and self.num_with_images else None)
        if rope_positions is not None:
            extra.append(rope_positions)
        grid = attention_layout(block_tables, starts, query_lens, self.block_size, self.device, extra)
        input_ids_dev, logits_dev, placeholder_dev, source_dev, *drafts_dev = grid.extra
        # The KV slots follow each token's index; the rotary positions may not (M-RoPE).
        positions = drafts_dev.pop() if rope_positions is not None else grid.positions
        batch = FlatBatch(
            input_ids=input_ids_dev,
            positions=positions,
            attn_metadata=grid.attn_metadata,
            logits_indices=logits_dev,
            sampling_req_ids=[req_ids[i] for i in sampling_rows.tolist()],
            num_generated=num_generated,
            num_drafts=num_drafts,
            draft_ids=drafts_dev[0] if drafts_dev else None,
            prompt_logprobs=self._plan_prompt_logprobs(states, query_start_loc, query_lens),
            placeholders=(placeholder_dev, source_dev) if len(placeholders) else None,
            sampling_rows=rows[sampling_rows],
            lora_slots=None if self.lora is None else np.repeat(self.lora_slot[rows], query_lens),
            images=(scheduled_images(states, starts, query_lens, query_start_loc) or None
                    if self.num_with_images else None),
        )
        # The workers advance each request by its scheduled tokens; the scheduler says otherwise
        # (`CachedRequestData`) only when it moved some other way.
        for s, n in zip(states, query_lens.tolist()):
            s.num_computed_tokens += n
        return batch

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
            counts.append((s.request_id, end - start))
            max_logprobs = max(max_logprobs, s.sampling_params.prompt_logprobs)
        if not counts:
            return None
        hidden_indices, target_ids = upload(
            [np.concatenate(indices).astype(np.int64),
             np.concatenate([np.asarray(t, dtype=np.int64) for t in targets])], self.device)
        return PromptLogprobsPlan(hidden_indices, target_ids, counts, max_logprobs)

    def append_sampled(self, req_ids: list[str], token_ids: list[list[int]]) -> None:
        for req_id, new in zip(req_ids, token_ids):
            state = self.states.get(req_id)
            if state is not None:  # None: freed (finished, aborted, preempted) while in flight
                state.token_ids.extend(new)


def _mrope_step_positions(states: list[CachedRequestState], starts: np.ndarray, query_lens: np.ndarray,
                          query_start_loc: np.ndarray) -> np.ndarray | None:
    """The rotary positions of a step's tokens where some request has M-RoPE positions (None:
    every token at its index): [3, num_tokens] when some computes tokens among its images', else
    [num_tokens], each token after a request's last image moved by its delta (decode steps keep
    one position a token, as the decode graphs take them)."""
    chosen = [i for i, s in enumerate(states) if s.mrope is not None]
    if not chosen:
        return None
    num_tokens = int(query_start_loc[-1])
    req_of_token = np.repeat(np.arange(len(states)), query_lens)
    positions = np.arange(num_tokens) - query_start_loc[req_of_token] + starts[req_of_token]
    ends = starts + query_lens
    if not any(starts[i] < states[i].mrope.end and ends[i] > states[i].mrope.start for i in chosen):
        for i in chosen:
            if starts[i] >= states[i].mrope.end:
                positions[query_start_loc[i]:query_start_loc[i + 1]] += states[i].mrope.delta
        return positions
    positions = np.repeat(positions[None], 3, axis=0)
    for i in chosen:
        mrope, row, start, end = states[i].mrope, int(query_start_loc[i]), int(starts[i]), int(ends[i])
        prompt_end = min(end, mrope.prompt.shape[1])
        if start < prompt_end:
            positions[:, row:row + prompt_end - start] = mrope.prompt[:, start:prompt_end]
        first_output = max(start, prompt_end)
        positions[:, row + first_output - start:row + end - start] += mrope.delta
    return positions


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
    extra: list[torch.Tensor]
    """The caller's extra arrays, on the device."""

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def padded_block_table(block_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """[len(block_ids), longest] int32: each request's blocks, padded with 0."""
    table = np.zeros((len(block_ids), max(len(b) for b in block_ids)), dtype=np.int32)
    for i, blocks in enumerate(block_ids):
        table[i, :len(blocks)] = blocks
    return table


def attention_layout(block_tables: Sequence[np.ndarray], num_computed: np.ndarray, query_lens: np.ndarray,
                     block_size: int, device: torch.device, extra: list[np.ndarray] = ()) -> AttentionLayout:
    """The layout of a batch in which request i computes `query_lens[i]` tokens after its first
    `num_computed[i]`, its KV going to the blocks of row i of each KV cache group's table in
    `block_tables` (which must cover them). `extra` int32/int64 arrays travel to the device in the
    same copies (`AttentionLayout.extra`)."""
    num_reqs = len(block_tables[0])
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_lens = num_computed + query_lens
    # Positions without a per-token loop: each token's offset inside its request's chunk.
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)
    positions = np.arange(num_tokens) - query_start_loc[req_of_token] + num_computed[req_of_token]
    columns, offsets = positions // block_size, positions % block_size
    slot_mappings = [table[req_of_token, columns].astype(np.int64) * block_size + offsets for table in block_tables]
    qsl32, seq_lens32 = query_start_loc.astype(np.int32), seq_lens.astype(np.int32)
    num_groups = len(block_tables)
    qsl_dev, seq_lens_dev, positions_dev, *rest = upload(
        [qsl32, seq_lens32, positions, *block_tables, *slot_mappings, *extra], device)
    tables_dev, slots_dev, extra_dev = rest[:num_groups], rest[num_groups:2 * num_groups], rest[2 * num_groups:]
    groups = [AttentionMetadata(
        num_tokens=num_tokens,
        query_start_loc=qsl_dev,
        seq_lens=seq_lens_dev,
        block_table=table,
        slot_mapping=slots,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl32,
        seq_lens_cpu=seq_lens32,
    ) for table, slots in zip(tables_dev, slots_dev)]
    groups[0].kv_groups = tuple(groups[1:])
    return AttentionLayout(query_start_loc, seq_lens, positions_dev, groups[0], extra_dev)


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int32/int64 host arrays on the device, in one copy per dtype. On a GPU the copy goes
    through pinned memory: queued behind the step in flight (async scheduling), where a copy
    from pageable memory may wait for it. Each array starts 16 bytes aligned in the shared
    buffer, as if allocated alone (Triton specializes kernels on their pointers' alignment)."""
    result: list[torch.Tensor | None] = [None] * len(arrays)
    for np_type, torch_type in ((np.int32, torch.int32), (np.int64, torch.int64)):
        chosen = [i for i, a in enumerate(arrays) if a.dtype == np_type]
        if not chosen:
            continue
        per_16_bytes = 16 // np.dtype(np_type).itemsize
        starts, end = [], 0
        for i in chosen:
            starts.append(end)
            end += -(-arrays[i].size // per_16_bytes) * per_16_bytes
        staging = torch.empty(max(end, 1), dtype=torch_type, pin_memory=device.type == "cuda")
        host = staging.numpy()
        for i, start in zip(chosen, starts):
            host[start:start + arrays[i].size] = arrays[i].ravel()
        flat = staging.to(device, non_blocking=True)
        for i, start in zip(chosen, starts):
            result[i] = flat[start:start + arrays[i].size].view(arrays[i].shape)
    if any(r is None for r in result):
        raise TypeError(f"upload takes int32 or int64 arrays, got {[a.dtype for a in arrays]}")
    return result


def _grown(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A zero array of `shape` holding `array` in its corner."""
    grown = np.zeros(shape, dtype=array.dtype)
    grown[tuple(slice(0, n) for n in array.shape)] = array
    return grown
