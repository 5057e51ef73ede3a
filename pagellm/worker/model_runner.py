"""Runs the model on one step's flat batch and samples: the only place that touches device tensors."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagellm.attention import get_attn_backend
from pagellm.attention.backend import AttentionMetadata
from pagellm.config import EngineConfig
from pagellm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagellm.loader import initialize_dummy_weights, iter_weights
from pagellm.models import get_model_class
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import sample
from pagellm.sampling_params import SamplingParams
from pagellm.worker.batch import RequestStates

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

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.requests.update(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        batch = self.requests.build(so)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata)
        if not batch.sampling_req_ids:
            return ModelRunnerOutput([], [])
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        states = [self.requests.states[r] for r in batch.sampling_req_ids]
        md = SamplingMetadata.build(
            [s.sampling_params for s in states], [s.num_generated for s in states],
            self.arch.vocab_size, self.device, self._default_generator)
        token_ids = sample(logits, md).tolist()
        self.requests.append_sampled(batch.sampling_req_ids, token_ids)
        return ModelRunnerOutput(batch.sampling_req_ids, token_ids)
