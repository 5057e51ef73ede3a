"""Runs the model on one step's flat batch and samples: the only place that touches device tensors."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagellm.attention import get_attn_backend
from pagellm.attention.backend import AttentionMetadata
from pagellm.config import EngineConfig
from pagellm.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagellm.loader import initialize_dummy_weights, iter_weights
from pagellm.models import get_model_class
from pagellm.sample.logits_processors import LogitsProcessors
from pagellm.sample.logprobs import gather_logprobs, prompt_logprobs
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import sample
from pagellm.sampling_params import SamplingParams
from pagellm.worker.batch import CachedRequestState, FlatBatch, PromptLogprobsPlan, RequestStates
from pagellm.worker.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.dtype = config.dtype
        self.arch = config.source.arch
        self.block_size = config.args.block_size
        self.requests = RequestStates(self.block_size, self.device)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None
        self._default_generator = torch.Generator(device=self.device)
        self._default_generator.manual_seed(config.args.seed)

    # -- start-up ------------------------------------------------------------------------------

    def load_model(self) -> None:
        start = time.perf_counter()
        backend = get_attn_backend(self.config.attention_backend)
        model_cls = get_model_class(self.arch.architecture)
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_cls(self.arch, backend)
        finally:
            torch.set_default_dtype(previous_dtype)
        if self.config.source.load_format == "dummy":
            initialize_dummy_weights(model, self.config.args.seed)
        else:
            loaded = model.load_weights(iter_weights(self.config.source))
            missing = {name for name, _ in model.named_parameters()} - loaded
            if missing:
                raise ValueError(f"checkpoint {self.config.source.path} lacks weights: {sorted(missing)[:8]}")
        self.model = model.eval()
        logger.info("loaded %s (%s) in %.2f s", self.config.source.path, self.dtype, time.perf_counter() - start)

    def kv_bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * a.num_hidden_layers * self.block_size * a.num_key_value_heads * a.head_dim * elem

    def profile_peak_memory(self) -> int:
        """Peak bytes allocated on the GPU during the largest possible step, weights included."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_largest_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def run_largest_step(self) -> torch.Tensor:
        """The largest step the scheduler can produce, run before the KV cache exists: a full
        token budget of fresh prompts, each sampling with top-k/top-p. Returns the sampled ids."""
        num_tokens = self.config.max_num_batched_tokens
        num_seqs = min(self.config.args.max_num_seqs, num_tokens)
        # Spread the tokens over num_seqs prompts, as a full step of fresh prompts would be.
        lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
        lens[: num_tokens % num_seqs] += 1
        qsl = np.concatenate([[0], np.cumsum(lens)])
        positions = np.concatenate([np.arange(n) for n in lens])
        md = AttentionMetadata(
            num_tokens=num_tokens,
            query_start_loc=torch.from_numpy(qsl).to(self.device, torch.int32),
            seq_lens=torch.from_numpy(lens).to(self.device, torch.int32),
            block_table=torch.zeros((num_seqs, 1), dtype=torch.int32, device=self.device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            max_query_len=int(lens.max()),
            max_seq_len=int(lens.max()),
            query_start_loc_cpu=qsl.astype(np.int32),
            seq_lens_cpu=lens.astype(np.int32),
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(self.device), md)
        logits = self.model.compute_logits(hidden[torch.from_numpy(qsl[1:] - 1).to(self.device)])
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50).apply_model_defaults({})] * num_seqs
        sampling = SamplingMetadata.build(params, [0] * num_seqs, self.arch.vocab_size, self.device,
                                          self._default_generator)
        return sample(logits, sampling)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        a = self.arch
        shape = (num_blocks, self.block_size, a.num_key_value_heads, a.head_dim)
        layers = self.model.attention_layers()
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in layers
        ]
        for layer, cache in zip(layers, self.kv_caches):
            layer.kv_cache = cache

    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs, unless eager mode is asked for or nothing supports them (the CPU;
        the torch attention backend, which plans on the host)."""
        if (self.device.type != "cuda" or self.config.args.enforce_eager
                or self.config.attention_backend != "triton"):
            return
        max_blocks = -(-self.config.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.config.args.max_num_seqs, max_blocks, self.device)
        self.graphs.capture()

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.requests.update(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        batch = self.requests.build(so)
        hidden = self._forward(batch)
        plan = batch.prompt_logprobs
        req_ids = batch.sampling_req_ids
        states = [self.requests.states[r] for r in req_ids]
        to_host: list[torch.Tensor] = []
        if plan is not None:
            to_host += prompt_logprobs(hidden[plan.hidden_indices], plan.targets, plan.max_logprobs,
                                       self.model.compute_logits)
        if states:
            to_host += self._sample(hidden[batch.logits_indices], states)
        if not to_host:
            return ModelRunnerOutput([], [])
        host = _to_host(to_host)
        if plan is not None:
            self._stash_prompt_logprobs(plan, host[:3])
            host = host[3:]
        if not states:
            return ModelRunnerOutput([], [])
        token_ids = host[0].tolist()
        self.requests.append_sampled(req_ids, token_ids)
        return ModelRunnerOutput(req_ids, token_ids, _sampled_logprobs(states, host[1:]) or None,
                                 _finished_prompt_logprobs(states) or None)

    def _forward(self, batch: FlatBatch) -> torch.Tensor:
        md = batch.attn_metadata
        if self.graphs is not None and md.max_query_len == 1 and md.num_seqs <= self.graphs.max_size:
            return self.graphs.run(batch.input_ids, batch.positions, md)
        return self.model(batch.input_ids, batch.positions, md)

    def _sample(self, hidden: torch.Tensor, states: list[CachedRequestState]) -> list[torch.Tensor]:
        """The sampled token ids, then (ids, logprobs, ranks) of the rows that asked for logprobs."""
        params = [s.sampling_params for s in states]
        logits = self.model.compute_logits(hidden)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Logprobs are of the model's raw distribution, before penalties and temperature.
        raw_logprobs = logits[logprob_rows].float().log_softmax(dim=-1) if logprob_rows else None
        processors = LogitsProcessors.build(
            params, [s.token_ids for s in states], [s.num_prompt_tokens for s in states],
            [s.eos_token_ids for s in states], self.arch.vocab_size, self.device)
        md = SamplingMetadata.build(params, [s.num_generated for s in states], self.arch.vocab_size,
                                    self.device, self._default_generator, processors)
        sampled = sample(logits, md)
        if raw_logprobs is None:
            return [sampled]
        k = max(params[i].logprobs for i in logprob_rows)
        rows = torch.tensor(logprob_rows, dtype=torch.int64).to(self.device)
        return [sampled, *gather_logprobs(raw_logprobs, sampled[rows], k)]

    def _stash_prompt_logprobs(self, plan: PromptLogprobsPlan, arrays: list[np.ndarray]) -> None:
        ids, values, ranks = arrays
        start = 0
        for req_id, count in plan.counts:
            state = self.requests.states[req_id]
            width = state.sampling_params.prompt_logprobs + 1
            end = start + count
            state.prompt_logprobs_parts.append((ids[start:end, :width], values[start:end, :width], ranks[start:end]))
            start = end


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """One device-to-host copy for the whole step: the tensors travel flattened in one float64
    buffer (exact for token ids and ranks) and come back in their own shapes and kinds."""
    if len(tensors) == 1:
        return [tensors[0].cpu().numpy()]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
    arrays, start = [], 0
    for t in tensors:
        size = t.numel()
        part = flat[start:start + size].reshape(t.shape)
        arrays.append(part.astype(np.int64) if not t.is_floating_point() else part)
        start += size
    return arrays


def _rows(arrays: list[np.ndarray], rows: list[int] | slice, k: int) -> TokenLogprobs:
    """Rows of (ids, logprobs, ranks) arrays, cut to the given token plus the request's top k."""
    ids, values, ranks = arrays
    return TokenLogprobs(ids[rows, :k + 1].tolist(), values[rows, :k + 1].tolist(), ranks[rows].tolist())


def _sampled_logprobs(states: list[CachedRequestState], arrays: list[np.ndarray]) -> dict[str, TokenLogprobs]:
    """`arrays` hold one row per state that asked for logprobs, in order."""
    wanting = [s for s in states if s.sampling_params.logprobs is not None]
    return {s.req_id: _rows(arrays, [r], s.sampling_params.logprobs) for r, s in enumerate(wanting)}


def _finished_prompt_logprobs(states: list[CachedRequestState]) -> dict[str, TokenLogprobs]:
    """Prompt logprobs of the requests that sample their first token this step, delivered once."""
    done = {}
    for s in states:
        if s.prompt_logprobs_parts is not None:
            parts = s.prompt_logprobs_parts
            k = s.sampling_params.prompt_logprobs
            if parts:
                done[s.req_id] = _rows([np.concatenate(column) for column in zip(*parts)], slice(None), k)
            else:  # a one-token prompt has no position to score
                done[s.req_id] = TokenLogprobs([], [], [])
            s.prompt_logprobs_parts = None
    return done
