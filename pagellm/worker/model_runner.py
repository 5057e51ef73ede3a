"""Runs the model on one step's flat batch and samples: the only place that touches device tensors."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention import ATTENTION_BACKEND_REGISTRY
from pagellm.attention.backend import AttentionMetadata
from pagellm.config import EngineConfig
from pagellm.core.kv_cache_groups import kv_cache_groups
from pagellm.core.kv_connector import KVConnectorOutput
from pagellm.core.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagellm.distributed import parallel_state, recv_from_prev_stage, send_to_next_stage, tensor_parallel_broadcast
from pagellm.lora.manager import LoRAManager
from pagellm.metrics import startup
from pagellm.models import CausalLM
from pagellm.models.interface import MultiModalEmbeds
from pagellm.sample.logits_processors import LogitsProcessors
from pagellm.sample.logprobs import gather_logprobs, prompt_logprobs
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.rejection import verify
from pagellm.sample.sampler import in_float32, sample
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode import DeviceProposer, build_device_proposer
from pagellm.worker.batch import CachedRequestState, FlatBatch, PromptLogprobsPlan, RequestStates, attention_layout
from pagellm.worker.cuda_graphs import MAX_CAPTURE_SIZE, MAX_CAPTURE_TOKENS, DecodeGraphs
from pagellm.worker.encoder_cache import EncoderCache
from pagellm.worker.kv_connector import KVConnectorWorker, build_kv_connector_worker
from pagellm.worker.loading import bind_kv_cache, build_model, kv_bytes_per_block
from pagellm.worker.mrope import mrope_merge_size

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.dtype = config.model.dtype
        self.arch = config.model.source.arch
        self.block_size = config.cache.block_size
        self.ps = parallel_state()
        self.kv_groups = kv_cache_groups(config.model.source.arch.sliding_windows, config.model.max_model_len)
        self.requests = RequestStates(self.block_size, self.device, num_kv_groups=len(self.kv_groups),
                                      mrope_merge_size=mrope_merge_size(self.arch.hf_config))
        self.model: CausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None
        self._last_sampled = torch.zeros(0, dtype=torch.int64, device=self.device)
        """Token ids sampled by the latest launched step, still on the device (each request's row
        in it: `RequestStates.sampled_row`)."""
        self._default_generator = torch.Generator(device=self.device)
        self._default_generator.manual_seed(config.model.seed)
        self.pooler = config.model.pooler
        """The pooling runner's pooler (embeddings instead of sampling); None: generate."""
        self.drafter: DeviceProposer | None = build_device_proposer(config)
        """Proposes draft tokens after each step (speculation whose proposer runs in the worker:
        draft_model); None otherwise."""
        self.lora: LoRAManager | None = None
        """The adapters' slots on the model's layers (enable_lora)."""
        self.kv_connector: KVConnectorWorker | None = None
        """The KV connector's worker half (a host tier), once the cache exists; None: none."""
        self.encoder_cache = EncoderCache()
        """Images' features until their placeholders are computed (a model that takes images)."""
        self.startup = startup.StartupPhases()
        """How long each start-up phase took on this rank (`pagellm.metrics.startup`)."""

    # -- start-up ------------------------------------------------------------------------------

    def load_model(self) -> None:
        with self.startup.phase(startup.LOAD_WEIGHTS):
            self._load_model()

    def _load_model(self) -> None:
        config = self.config
        self.model = build_model(config.model.source, config.model.quantization, self.dtype, self.device,
                                 config.model.attention_backend, config.model.seed)
        if self.drafter is not None:
            self.drafter.load()
        if config.lora is not None:
            max_rows = max(config.scheduler.max_num_batched_tokens, MAX_CAPTURE_SIZE, MAX_CAPTURE_TOKENS)
            self.lora = self.requests.lora = LoRAManager(self.model, config.lora, max_rows, self.device)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block on this rank: its pipeline stage's layers, its share of the KV heads,
        and the draft model's layers (draft_model speculation: a block holds both)."""
        kv_dtype = self.config.cache.kv_cache_dtype
        size = kv_bytes_per_block(self.model, self.kv_groups, self.block_size, kv_dtype)
        if self.drafter is not None:
            size += self.drafter.kv_bytes_per_block(self.block_size, kv_dtype)
        return size

    def profile_peak_memory(self) -> int:
        """Peak bytes allocated on the GPU during the largest possible step, weights included."""
        with self.startup.phase(startup.PROFILE_RUN):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.run_largest_step()
            torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def run_largest_step(self) -> torch.Tensor | None:
        """The largest step the scheduler can produce, run before the KV cache exists: a full
        token budget of fresh prompts, each sampling with top-k/top-p. Returns the sampled ids (on
        the last pipeline stage)."""
        num_tokens = self.config.scheduler.max_num_batched_tokens
        num_seqs = min(self.config.scheduler.max_num_seqs, num_tokens)
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
        hidden = self._run_stage(input_ids, torch.from_numpy(positions).to(self.device), md)
        if isinstance(hidden, _StageSend):
            hidden.wait()
            return None
        logits = self.model.compute_logits(hidden[torch.from_numpy(qsl[1:] - 1).to(self.device)])
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50).apply_model_defaults({})] * num_seqs
        sampling = SamplingMetadata.build(params, [0] * num_seqs, self.arch.vocab_size, self.device,
                                          self._default_generator)
        logits = in_float32(logits, sampling)  # the model-dtype logits freed, as in a step (the profiled peak)
        return sample(logits, sampling)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        with self.startup.phase(startup.KV_CACHE_ALLOCATE):
            self._initialize_kv_cache(num_blocks)

    def _initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = bind_kv_cache(self.model, self.kv_groups, num_blocks, self.block_size,
                                       self.config.cache.kv_cache_dtype, self.device)
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)
        if self.lora is not None:
            self.lora.bind_fused_layers()
        self.kv_connector = build_kv_connector_worker(self.config, self.kv_caches)

    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs, unless eager mode is asked for or nothing supports them (the CPU;
        the torch attention backend, which plans on the host)."""
        backend = ATTENTION_BACKEND_REGISTRY.get(self.config.model.attention_backend)
        if self.device.type != "cuda" or not backend.cuda_graphs or self.ps.pp_size > 1:
            return
        with self.startup.phase(startup.KERNEL_WARMUP):
            self._compile_eager_steps()
        if self.config.model.enforce_eager:
            return
        max_blocks = -(-self.config.model.max_model_len // self.block_size)
        spec = self.config.speculative
        self.graphs = DecodeGraphs(self.model, self.config.scheduler.max_num_seqs, max_blocks, self.device,
                                   verify_len=1 + spec.num_speculative_tokens if spec is not None else 1,
                                   before_capture=None if self.lora is None else self._lora_capture,
                                   num_kv_groups=len(self.kv_groups))
        with self.startup.phase(startup.CUDA_GRAPH_CAPTURE):
            self.graphs.capture()
            if self.drafter is not None:
                self.drafter.capture_cuda_graphs(self.config.scheduler.max_num_seqs, max_blocks)

    @torch.inference_mode()
    def _compile_eager_steps(self) -> None:
        """Run once, at start-up, the step shapes that run outside CUDA graphs, each using its own
        attention kernel variant: a prefill, short queries (2 tokens, as a prompt's last chunk) at
        one sequence and at many, and one-token decodes beyond the largest captured batch (the
        memory profile's prefill ran before the KV cache existed, through another path). Triton
        compiles a variant on its first use: else the first requests a server takes wait for it,
        seconds in all. Their KV writes land in block 0, which holds nothing yet. A one-token step
        (with its logits) first times each dense weight's one-row product against cuBLAS
        (`dense_one_row`), and the one-row kernel's tiles for each weight shape (`one_row_tiles`),
        before the graphs capture the choices."""
        from pagellm.ops.triton.attention import LARGE_DECODE_PROGRAMS  # only with Triton
        from pagellm.ops.triton.one_row_tiles import timing_one_row_products

        num_kv_heads = self.kv_caches[0][0].shape[2]
        max_num_seqs = self.config.scheduler.max_num_seqs
        shapes = [(1, 64), (1, 2), (-(-LARGE_DECODE_PROGRAMS // num_kv_heads), 2)]
        if self.config.model.enforce_eager or max_num_seqs > MAX_CAPTURE_SIZE:
            shapes.append((max_num_seqs, 1))
        with timing_one_row_products():
            for num_seqs, q in [(1, 1), *shapes]:
                num_seqs = min(num_seqs, max(1, self.config.scheduler.max_num_batched_tokens // q))
                blocks = np.zeros((num_seqs, -(-q // self.block_size)), dtype=np.int32)  # all block 0
                grid = attention_layout([blocks] * len(self.kv_groups), np.zeros(num_seqs, dtype=np.int64),
                                        np.full(num_seqs, q, dtype=np.int64), self.block_size, self.device)
                ids = torch.zeros(num_seqs * q, dtype=torch.int64, device=self.device)
                hidden = self.model(ids, grid.positions, grid.attn_metadata)
                if num_seqs * q == 1:
                    self.model.compute_logits(hidden)
        torch.cuda.synchronize(self.device)

    def _lora_capture(self, num_rows: int) -> None:
        """A graph's rows use no adapter at capture; its LoRA kernels replay each step's plan."""
        self.lora.prepare(np.full(num_rows, -1, dtype=np.int64), num_rows)

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def launch_step(self, so: SchedulerOutput) -> "StepInFlight":
        """Queue one step's GPU work and the copy of its results to the host, without waiting.

        Decode inputs whose token the previous step is still sampling are taken from that step's
        device tensor of sampled ids, so the next step can be launched before this one's results
        are read.
        """
        self.requests.update(so)
        self.encoder_cache.release(so.freed_req_ids)
        if so.kv_connector_metadata is not None:
            # Outside CUDA graphs, before any layer reads the blocks (the device waits, not the host).
            self.kv_connector.start_load_kv(so.kv_connector_metadata)
            self.kv_connector.wait_for_layer_load()
        if so.is_empty:
            return StepInFlight.done(ModelRunnerOutput([], []))
        batch = self.requests.build(so)
        if batch.placeholders is not None:
            rows, sources = batch.placeholders
            batch.input_ids[rows] = self._last_sampled[sources]
        mm_embeds = None
        if batch.images is not None and self.ps.is_first_stage:
            mm_embeds = self.encoder_cache.embeds(batch.images, self.model.encode_images, self.device)
        hidden = self._run_stage(batch.input_ids, batch.positions, batch.attn_metadata, batch.lora_slots, mm_embeds)
        if isinstance(hidden, _StageSend):
            return StepInFlight.sending(hidden)
        if self.pooler is not None:
            return self._pool(so, batch, hidden)
        plan = batch.prompt_logprobs
        req_ids = batch.sampling_req_ids
        states = [self.requests.states[r] for r in req_ids]
        to_host: list[torch.Tensor] = []
        if plan is not None:
            # Every TP rank takes part in the logits' all-gather; only the driver reports them.
            scored = prompt_logprobs(hidden[plan.hidden_indices], plan.targets, plan.max_logprobs,
                                     self.model.compute_logits)
            if self.ps.is_driver:
                to_host += scored
            else:
                plan = None
        if states and batch.num_drafts is not None:
            verified = self._verify(hidden[batch.logits_indices], states, batch, so.grammar_bitmask)
            # `_last_sampled` describes the latest step, as after plain sampling: a request's last
            # row (its only one without drafts). The scheduler never overlaps a step carrying
            # drafts, so no placeholder reads these rows today.
            self._last_sampled = verified[0]
            self.requests.sampled_row[batch.sampling_rows] = np.cumsum(batch.num_drafts) + np.arange(len(req_ids))
            to_host += verified
        elif states:
            sampled = self._sample(hidden[batch.logits_indices], states, batch.num_generated, so.grammar_bitmask)
            if sampled:
                self._last_sampled = sampled[0]
                self.requests.sampled_row[batch.sampling_rows] = np.arange(len(req_ids))
            to_host += sampled
        if not to_host:
            return StepInFlight.done(ModelRunnerOutput([], []))
        return StepInFlight(self, _HostCopy(to_host), plan, req_ids, states, num_drafts=batch.num_drafts,
                            propose=so.propose_drafts)

    def take_connector_output(self) -> KVConnectorOutput | None:
        """The KV connector's report of the step just launched (None: nothing to report)."""
        return None if self.kv_connector is None else self.kv_connector.get_finished()

    def _pool(self, so: SchedulerOutput, batch: FlatBatch, hidden: torch.Tensor) -> "StepInFlight":
        """Fold this step's final hidden states into each pooling request's result, incrementally
        (a prompt may span several steps: chunked prefill); the requests whose prompt ends in this
        step get their vector, reported by the driver. The other TP ranks hold the same hidden
        states and have nothing to do."""
        if not self.ps.is_driver:
            return StepInFlight.done(ModelRunnerOutput([], []))
        states = [self.requests.states[r] for r in so.num_scheduled_tokens]
        qsl = batch.attn_metadata.query_start_loc_cpu
        kind = self.pooler.pooling_type
        if kind == "MEAN":
            rows = np.repeat(np.arange(len(states)), np.diff(qsl))
            sums = torch.zeros((len(states), hidden.shape[1]), dtype=torch.float32, device=self.device)
            sums.index_add_(0, torch.from_numpy(rows).to(self.device, non_blocking=True), hidden.float())
            for i, s in enumerate(states):
                s.pooled = sums[i] if s.pooled is None else s.pooled + sums[i]
        elif kind == "CLS":
            starts = batch.attn_metadata.seq_lens_cpu - np.diff(qsl)
            for i, s in enumerate(states):
                if starts[i] == 0:  # this step's chunk starts the prompt
                    # A copy: `hidden` may be a CUDA graph's output buffer, which the next step reuses.
                    s.pooled = hidden[int(qsl[i])].to(torch.float32, copy=True)
        finished = [self.requests.states[r] for r in batch.sampling_req_ids]
        if not finished:
            return StepInFlight.done(ModelRunnerOutput([], []))
        if kind == "LAST":
            vectors = hidden[batch.logits_indices].float()
        elif kind == "MEAN":
            counts = torch.tensor([len(s.token_ids) for s in finished], dtype=torch.float32)
            vectors = torch.stack([s.pooled for s in finished]) / counts.to(self.device)[:, None]
        else:
            vectors = torch.stack([s.pooled for s in finished])
        normalize = torch.tensor([s.pooling_params.normalize for s in finished], dtype=torch.bool)
        vectors = torch.where(normalize.to(self.device)[:, None],
                              torch.nn.functional.normalize(vectors, dim=-1), vectors)
        return StepInFlight(self, _HostCopy([vectors]), None, [s.request_id for s in finished], [], pooled=True)

    def _run_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                   lora_slots: np.ndarray | None = None,
                   mm_embeds: MultiModalEmbeds | None = None) -> "torch.Tensor | _StageSend":
        """This pipeline stage's part of the forward: the final hidden states on the last stage,
        else the send of its intermediate tensors to the next stage (started, not waited for).
        `lora_slots`: each row's adapter slot (None: no adapter). `mm_embeds`: image features that
        replace some rows' token embeddings (the first stage of a model that takes images)."""
        # The decode graphs embed tokens themselves and take one position a token: a step with
        # image features, or with three positions a token (M-RoPE among images), runs eagerly.
        graph = self.graphs is not None and self.graphs.fits(md) and mm_embeds is None and positions.dim() == 1
        extra = {} if mm_embeds is None else {"mm_embeds": mm_embeds}
        if self.lora is not None:
            if lora_slots is None:
                lora_slots = np.full(md.num_tokens, -1, dtype=np.int64)
            # A verification graph lays rows out padded per sequence, which the tile plan does not
            # follow: steps with adapters and drafts run eagerly.
            graph = graph and (md.max_query_len == 1 or int(lora_slots.max(initial=-1)) < 0)
            self.lora.prepare(lora_slots, self.graphs.padded_rows(md) if graph else None)
        if self.ps.pp_size == 1:
            if graph:
                return self.graphs.run(input_ids, positions, md)
            return self.model(input_ids, positions, md, **extra)
        intermediate = None
        if not self.ps.is_first_stage:
            shape = (md.num_tokens, self.arch.hidden_size)
            intermediate = (torch.empty(shape, dtype=self.dtype, device=self.device),
                            torch.empty(shape, dtype=self.dtype, device=self.device))
            recv_from_prev_stage(list(intermediate))
        out = self.model(input_ids, positions, md, intermediate, **extra)
        if self.ps.is_last_stage:
            return out
        tensors = [t.contiguous() for t in out]
        return _StageSend(tensors, send_to_next_stage(tensors))

    def _sample(self, hidden: torch.Tensor, states: list[CachedRequestState], num_generated: list[int],
                grammar: GrammarBitmask | None) -> list[torch.Tensor]:
        """The sampled token ids, then (ids, logprobs, ranks) of the rows that asked for logprobs.

        The driver samples. With one pipeline stage the other TP ranks receive its ids, since
        their next step may take its inputs from them (placeholders); with several, sampled tokens
        reach every rank through the scheduler output and the other ranks return nothing."""
        logits = self.model.compute_logits(hidden)  # a TP collective: every rank computes it
        if not self.ps.is_driver:
            if self.ps.pp_size > 1:
                return []
            return [tensor_parallel_broadcast(torch.empty(len(states), dtype=torch.int64, device=self.device))]
        params = [s.record.sampling_params for s in states]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Logprobs are of the model's raw distribution, before penalties and temperature.
        raw_logprobs = logits[logprob_rows].float().log_softmax(dim=-1) if logprob_rows else None
        processors = None if not self.requests.num_special else LogitsProcessors.build(
            params, [s.token_ids for s in states], [s.num_prompt_tokens for s in states],
            [s.eos_token_ids for s in states], self.arch.vocab_size, self.device)
        md = SamplingMetadata.build(params, num_generated, self.arch.vocab_size,
                                    self.device, self._default_generator, processors)
        if grammar is not None:
            row_of = {s.request_id: i for i, s in enumerate(states)}
            md.grammar_rows = torch.tensor([row_of[r] for r in grammar.req_ids], dtype=torch.int64).to(
                self.device, non_blocking=True)
            md.grammar_bitmask = torch.from_numpy(grammar.bits).to(self.device, non_blocking=True)
        logits = in_float32(logits, md)  # the model-dtype logits freed before sampling's buffers
        sampled = sample(logits, md)
        if self.ps.pp_size == 1:
            tensor_parallel_broadcast(sampled)
        if raw_logprobs is None:
            return [sampled]
        k = max(params[i].logprobs for i in logprob_rows)
        rows = torch.tensor(logprob_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return [sampled, *gather_logprobs(raw_logprobs, sampled[rows], k)]

    def _verify(self, hidden: torch.Tensor, states: list[CachedRequestState], batch: FlatBatch,
                grammar: GrammarBitmask | None) -> list[torch.Tensor]:
        """A step with draft tokens (one rank: speculative decoding runs without TP or PP): every
        sampling row verified (`pagellm.sample.rejection`). Returns the tokens and acceptance
        per row, then (ids, logprobs, ranks) of the rows of requests that asked for logprobs."""
        logits = self.model.compute_logits(hidden)
        rows = [s for s, k in zip(states, batch.num_drafts) for _ in range(k + 1)]
        params = [s.record.sampling_params for s in rows]
        processors = LogitsProcessors.build(
            params, [s.token_ids for s in rows], [s.num_prompt_tokens for s in rows],
            [s.eos_token_ids for s in rows], self.arch.vocab_size, self.device)
        md = SamplingMetadata.build(params, batch.num_generated, self.arch.vocab_size,
                                    self.device, self._default_generator, processors)
        if grammar is not None:  # requests under a grammar have no drafts: one row each
            first_row = np.cumsum([0, *[k + 1 for k in batch.num_drafts[:-1]]])
            row_of = {s.request_id: int(r) for s, r in zip(states, first_row)}
            md.grammar_rows = torch.tensor([row_of[r] for r in grammar.req_ids], dtype=torch.int64).to(
                self.device, non_blocking=True)
            md.grammar_bitmask = torch.from_numpy(grammar.bits).to(self.device, non_blocking=True)
        logits = in_float32(logits, md)  # the model-dtype logits freed before verification's buffers
        tokens, accepted = verify(logits, md, batch.draft_ids)
        out = [tokens, accepted.to(torch.int64)]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if logprob_rows:
            index = torch.tensor(logprob_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            raw_logprobs = logits[index].float().log_softmax(dim=-1)
            k = max(params[i].logprobs for i in logprob_rows)
            out += gather_logprobs(raw_logprobs, tokens[index], k)
        return out

    def stash_prompt_logprobs(self, plan: PromptLogprobsPlan, arrays: list[np.ndarray]) -> None:
        ids, values, ranks = arrays
        start = 0
        for req_id, count in plan.counts:
            end = start + count
            state = self.requests.states.get(req_id)
            if state is not None and state.prompt_logprobs_parts is not None:  # else freed while in flight
                width = state.sampling_params.prompt_logprobs + 1
                state.prompt_logprobs_parts.append(
                    (ids[start:end, :width], values[start:end, :width], ranks[start:end]))
            start = end


class _HostCopy:
    """One device-to-host copy for the whole step, started now and read later: the tensors travel
    flattened in one float64 buffer (exact for token ids and ranks) and come back in their own
    shapes and kinds."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._specs = [(t.shape, t.is_floating_point()) for t in tensors]
        flat = tensors[0] if len(tensors) == 1 else torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        if flat.is_cuda:
            self._buffer = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._buffer.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._buffer, self._event = flat, None

    def arrays(self) -> list[np.ndarray]:
        if self._event is not None:
            self._event.synchronize()
        flat = self._buffer.numpy()
        if len(self._specs) == 1:
            return [flat]
        arrays, start = [], 0
        for shape, is_float in self._specs:
            size = int(np.prod(shape))
            part = flat[start:start + size].reshape(shape)
            arrays.append(part if is_float else part.astype(np.int64))
            start += size
        return arrays


@dataclass(slots=True)
class _StageSend:
    """Intermediate tensors on their way to the next pipeline stage."""

    tensors: list[torch.Tensor]
    """Kept alive until the sends complete."""
    works: list

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class StepInFlight:
    """A launched step whose results are read from the host copy on `result()`."""

    def __init__(self, runner: ModelRunner | None, copy: _HostCopy | None, plan: PromptLogprobsPlan | None,
                 req_ids: list[str], states: list[CachedRequestState],
                 output: ModelRunnerOutput | None = None, pooled: bool = False,
                 num_drafts: list[int] | None = None, propose: bool = False) -> None:
        """`pooled`: the copy holds one pooled vector per request of `req_ids` (pooling runner).
        `num_drafts`: per request, its draft tokens (the copy holds verified rows, `_verify`).
        `propose`: the draft model proposes once the tokens are read."""
        self._runner, self._copy, self._plan = runner, copy, plan
        self._req_ids, self._states = req_ids, states
        self._num_drafts = num_drafts
        self._propose = propose
        self._output = output
        self._pooled = pooled
        self._send: _StageSend | None = None

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> "StepInFlight":
        return cls(None, None, None, [], [], output)

    @classmethod
    def sending(cls, send: "_StageSend") -> "StepInFlight":
        """A step of a stage before the last: done once its tensors reached the next stage."""
        step = cls.done(ModelRunnerOutput([], []))
        step._send = send
        return step

    def result(self) -> ModelRunnerOutput:
        """Wait for the step, record its tokens in the worker's states, and return them (once;
        empty on every rank but the driver)."""
        if self._send is not None:
            self._send.wait()
            self._send = None
        if self._output is None:
            self._output = self._read()
        return self._output

    def _read(self) -> ModelRunnerOutput:
        host = self._copy.arrays()
        if self._pooled:
            vectors = host[0].astype("<f4", copy=False)
            return ModelRunnerOutput([], [], pooler_output={r: vectors[i].tobytes()
                                                            for i, r in enumerate(self._req_ids)})
        if self._plan is not None:
            self._runner.stash_prompt_logprobs(self._plan, host[:3])
            host = host[3:]
        if not self._states:
            return ModelRunnerOutput([], [])
        if self._num_drafts is None:
            token_ids = [[t] for t in host[0].tolist()]
        else:
            token_ids = _accepted(host[0], host[1], self._num_drafts)
            host = host[1:]
        runner = self._runner
        if runner.ps.pp_size == 1:  # with several stages, the next scheduler output brings them
            runner.requests.append_sampled(self._req_ids, token_ids)
        if not runner.ps.is_driver:
            return ModelRunnerOutput([], [])
        logprobs = _sampled_logprobs(self._states, token_ids, self._num_drafts, host[1:])
        drafts = None
        if runner.drafter is not None and self._propose:
            live = runner.requests.states  # (a request freed since the launch gave its blocks back)
            drafts = runner.drafter.propose([s for s in self._states if live.get(s.request_id) is s])
        # Read after the step's results: the device has passed the encoder's events of this step.
        images, seconds = runner.encoder_cache.times.take()
        return ModelRunnerOutput(self._req_ids, token_ids, logprobs or None,
                                 _finished_prompt_logprobs(self._states) or None, draft_token_ids=drafts or None,
                                 encoder_images=images, encoder_seconds=seconds)


def _rows(arrays: list[np.ndarray], rows: list[int] | slice, k: int) -> TokenLogprobs:
    """Rows of (ids, logprobs, ranks) arrays, cut to the given token plus the request's top k."""
    ids, values, ranks = arrays
    return TokenLogprobs(ids[rows, :k + 1].tolist(), values[rows, :k + 1].tolist(), ranks[rows].tolist())


def _accepted(tokens: np.ndarray, accepted: np.ndarray, num_drafts: list[int]) -> list[list[int]]:
    """Per request (verified rows, k + 1 each): its accepted drafts and the token after them."""
    token_ids, start = [], 0
    for k in num_drafts:
        taken = 0
        while taken < k and accepted[start + taken]:
            taken += 1
        token_ids.append(tokens[start:start + taken + 1].tolist())
        start += k + 1
    return token_ids


def _sampled_logprobs(states: list[CachedRequestState], token_ids: list[list[int]], num_drafts: list[int] | None,
                      arrays: list[np.ndarray]) -> dict[str, TokenLogprobs]:
    """`arrays` hold the sampling rows (1 + its drafts) of each state that asked for logprobs, back
    to back; each keeps the rows of the tokens it emits."""
    result, start = {}, 0
    for i, (s, emitted) in enumerate(zip(states, token_ids)):
        k = s.record.sampling_params.logprobs
        if k is None:
            continue
        result[s.request_id] = _rows(arrays, list(range(start, start + len(emitted))), k)
        start += 1 + (num_drafts[i] if num_drafts is not None else 0)
    return result


def _finished_prompt_logprobs(states: list[CachedRequestState]) -> dict[str, TokenLogprobs]:
    """Prompt logprobs of the requests that sample their first token this step, delivered once."""
    done = {}
    for s in states:
        if s.prompt_logprobs_parts is not None:
            parts = s.prompt_logprobs_parts
            k = s.sampling_params.prompt_logprobs
            if parts:
                done[s.request_id] = _rows([np.concatenate(column) for column in zip(*parts)], slice(None), k)
            else:  # a one-token prompt has no position to score
                done[s.request_id] = TokenLogprobs([], [], [])
            s.prompt_logprobs_parts = None
    return done
