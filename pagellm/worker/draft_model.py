"""Draft-model speculation: a smaller model of the same vocabulary proposes each request's next
tokens, greedily, in the worker right after the step that sampled its latest ones."""
from __future__ import annotations

import numpy as np
import torch

from pagellm import ops
from pagellm.attention.backend import AttentionMetadata
from pagellm.config import EngineConfig
from pagellm.core.kv_cache_groups import KVCacheGroup
from pagellm.models import CausalLM
from pagellm.spec_decode.proposer import DeviceProposer
from pagellm.worker.batch import CachedRequestState, attention_layout, padded_block_table
from pagellm.worker.cuda_graphs import DecodeGraphs
from pagellm.worker.loading import bind_kv_cache, build_model, kv_bytes_per_block


class DraftModelProposer(DeviceProposer):
    """Once a step's tokens are known, the draft model catches up on each sampling request's new
    tokens (its whole prompt the first time; then the accepted drafts and the token after them) and
    decodes k - 1 more greedily, all requests in one batch per pass: k forwards a step.

    Its KV cache lives in the target's blocks, under the same block ids (a block holds both models'
    keys and values), so the scheduler's allocation serves both. The draft writes up to k - 1
    positions past a request's known tokens; the scheduler allocates that room ahead when it can,
    and a request proposes only as far as its blocks reach. Those positions' KV is a guess, written
    over by the next catch-up, which starts at the first token the draft has not seen."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.k = config.speculative.num_speculative_tokens
        self.block_size = config.cache.block_size
        self.model: CausalLM | None = None
        self.graphs: DecodeGraphs | None = None

    def load(self) -> None:
        config = self.config
        try:
            self.model = build_model(config.draft.source, config.draft.quantization, config.model.dtype, config.device,
                                     config.model.attention_backend, config.model.seed)
        except ValueError as e:  # the checkpoint's, its quantization's: say they are the draft's
            raise ValueError(f"speculative_config (--speculative-config) model {config.draft.source.path!r}: "
                             f"{e}") from None

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.model, self._kv_groups, block_size, dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        bind_kv_cache(self.model, self._kv_groups, num_blocks, self.block_size, self.config.cache.kv_cache_dtype,
                      self.config.device)

    @property
    def _kv_groups(self) -> tuple[KVCacheGroup, ...]:
        """Its layers, all in one group under the target's (full-attention, one-group) block ids."""
        return (KVCacheGroup(None, tuple(range(self.model.config.num_hidden_layers))),)

    def capture_cuda_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        """Graphs of the draft's passes of one token per request (its greedy decode) and of up to
        1 + k (its catch-up after a verification step); a prompt's catch-up runs eagerly."""
        self.graphs = DecodeGraphs(self.model, max_num_seqs, max_blocks_per_seq, self.config.device,
                                   verify_len=1 + self.k)
        self.graphs.capture()

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        if self.graphs is not None and self.graphs.fits(md):
            return self.graphs.run(input_ids, positions, md)
        return self.model(input_ids, positions, md)

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """Draft tokens for the next step of each request of `states` (those that sampled in the
        step just read, their tokens appended) that will decode: within its max_tokens and the
        model's length, none for requests whose sampling reads their output (which the scheduler
        never speculates for)."""
        todo = [(s, n) for s in states if (n := self._num_proposals(s)) > 0]
        if not todo:
            return {}
        first = self._catch_up([s for s, _ in todo])
        counts = np.array([n for _, n in todo])
        drafts = torch.zeros((len(todo), int(counts.max())), dtype=torch.int64, device=self.config.device)
        drafts[:, 0] = first
        lengths = np.array([len(s.token_ids) for s, _ in todo])
        for j in range(1, drafts.shape[1]):  # draft j - 1 in, draft j out
            rows = np.flatnonzero(counts > j)
            grid = attention_layout([padded_block_table([todo[i][0].block_ids[0] for i in rows])],
                                    lengths[rows] + j - 1, np.ones(len(rows), dtype=np.int64), self.block_size,
                                    self.config.device)
            index = torch.from_numpy(rows).to(self.config.device, non_blocking=True)
            hidden = self._forward(drafts[index, j - 1], grid.positions, grid.attn_metadata)
            drafts[index, j] = ops.argmax(self.model.compute_logits(hidden))
        host = drafts.cpu().numpy()
        return {s.request_id: host[i, :n].tolist() for i, (s, n) in enumerate(todo)}

    def _num_proposals(self, s: CachedRequestState) -> int:
        """How many drafts the request's next step can use (0: none, or it just ended) and its
        blocks have room for: the draft's inputs reach position len(tokens) + n - 2."""
        params = s.sampling_params
        n = len(s.token_ids)
        last = s.token_ids[-1]
        if (params.reads_output_history or last in params.stop_token_ids
                or (not params.ignore_eos and last in s.eos_token_ids)):
            return 0
        # The step yields the accepted drafts and one token more: all must fit.
        room = self.config.model.max_model_len - n
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - (n - s.num_prompt_tokens))
        return max(0, min(self.k, room - 1, len(s.block_ids[0]) * self.block_size - n + 1))

    def _catch_up(self, states: list[CachedRequestState]) -> torch.Tensor:
        """Run the draft over each request's tokens it has not seen, in passes of at most the
        step's token budget; returns the first draft of each (its greedy next token)."""
        first = torch.zeros(len(states), dtype=torch.int64, device=self.config.device)
        pending = list(range(len(states)))
        while pending:
            chosen, lens, left = [], [], self.config.scheduler.max_num_batched_tokens
            for i in pending:
                s = states[i]
                take = min(len(s.token_ids) - s.num_draft_computed, left)
                if take <= 0:
                    break
                chosen.append(i)
                lens.append(take)
                left -= take
            starts = np.array([states[i].num_draft_computed for i in chosen])
            grid = attention_layout([padded_block_table([states[i].block_ids[0] for i in chosen])], starts,
                                    np.array(lens), self.block_size, self.config.device)
            input_ids = np.concatenate([states[i].token_ids[start:start + n]
                                        for i, start, n in zip(chosen, starts, lens)])
            hidden = self._forward(torch.from_numpy(input_ids).to(self.config.device, non_blocking=True),
                                   grid.positions, grid.attn_metadata)
            done = [c for c, i in enumerate(chosen) if starts[c] + lens[c] == len(states[i].token_ids)]
            if done:
                rows = torch.from_numpy(grid.query_start_loc[np.array(done) + 1] - 1).to(self.config.device)
                index = torch.tensor([chosen[c] for c in done]).to(self.config.device, non_blocking=True)
                first[index] = ops.argmax(self.model.compute_logits(hidden[rows]))
            for i, n in zip(chosen, lens):
                states[i].num_draft_computed += n
            pending = [i for i in pending if states[i].num_draft_computed < len(states[i].token_ids)]
        return first
