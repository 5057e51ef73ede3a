"""One scheduler, one token budget per step: running requests first, then waiting ones.

There are no prefill and decode phases. Each request has `num_computed_tokens` and wants to reach
`num_tokens`; a step hands out at most `max_num_batched_tokens` tokens to at most `max_num_seqs`
requests. Chunked prefill and prefix-cache hits fall out of that. When blocks run out, the most
recently admitted running request is preempted and later recomputed.

The scheduling policy (`--scheduling-policy`) orders the waiting queue (`request_queue.py`) and the
running list: fcfs by arrival and admission; priority by (priority, arrival_time), so that the
running request preempted is the one of the lowest priority (the largest value, the latest arrival
among equals), and a waiting request that finds no blocks preempts running requests of a strictly
lower priority (larger value) to make room.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagellm.core.encoder_budget import EncoderBudget
from pagellm.core.interfaces import AdapterStore, DraftProposer, GrammarCompiler
from pagellm.core.kv_cache_groups import max_blocks_held
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.kv_connector import KVConnectorOutput, KVConnectorScheduler
from pagellm.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    GrammarBitmask,
    LoRAStats,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodeStats,
)
from pagellm.core.request import EngineCoreRequest, Request, RequestStatus, check_prompt_fits
from pagellm.core.request_queue import create_request_queue, priority_key

if TYPE_CHECKING:
    from pagellm.config.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

_TRANSFER_POLL_S = 0.002
"""How long an idle step loop sleeps between polls of KV transfers spanning steps."""


@dataclass(slots=True)
class SchedulerLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    sliding_windows: tuple[int | None, ...] = (None,)
    """Each KV cache group's sliding window (None: full attention), `pagellm.core.kv_cache_groups`."""
    max_num_encoder_input_tokens: int | None = None
    """Images' placeholder tokens a step may start encoding (`pagellm.core.encoder_budget`); None:
    max_num_batched_tokens, as vLLM's default."""

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        needed = self.blocks_per_request(self.max_model_len)
        if needed > self.num_blocks:
            longest, too_long = 0, self.max_model_len  # bisected: the blocks grow with the length
            while too_long - longest > 1:
                middle = (longest + too_long) // 2
                longest, too_long = (middle, too_long) if self.blocks_per_request(middle) <= self.num_blocks \
                    else (longest, middle)
            raise ValueError(
                f"the KV cache holds {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_blocks * self.block_size} tokens; one request of max_model_len ({self.max_model_len}) "
                f"tokens needs {needed} blocks, so it could never run. "
                f"Lower max_model_len (--max-model-len) to at most {longest}, or give the cache more memory "
                f"(--gpu-memory-utilization on GPU, kv_cache_memory_bytes on CPU, num_gpu_blocks_override).")

    def blocks_per_request(self, num_tokens: int, num_new_tokens: int | None = None) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, over all KV cache groups,
        computing up to `num_new_tokens` a step (None: prompt chunks of max_num_batched_tokens)."""
        chunk = min(self.max_num_batched_tokens, num_tokens) if num_new_tokens is None else num_new_tokens
        return sum(max_blocks_held(w, num_tokens, self.block_size, chunk) for w in self.sliding_windows)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, workers_see_samples: bool = True,
                 grammars: GrammarCompiler | None = None, speculative: SpeculativeConfig | None = None,
                 proposer: DraftProposer | None = None, adapters: AdapterStore | None = None,
                 policy: str = "fcfs", connector: KVConnectorScheduler | None = None,
                 swap_preemption: bool = False) -> None:
        """`workers_see_samples`: whether the workers learn each sampled token themselves (one
        pipeline stage: the driver shares it with its TP peers). If not, a request waits for its
        token before it is scheduled again (no placeholders), and the scheduler output carries it.
        `grammars`: compiles and matches structured-output requests (None: they are refused).
        `speculative`: propose draft tokens for decoding requests (None: no speculation), with
        `proposer` beside the scheduler, or (None) from the workers' proposals (`propose_drafts`).
        `adapters`: the LoRA adapters (None: requests that name one are refused).
        `policy`: fcfs or priority (`--scheduling-policy`, see the module's docstring).
        `connector`: the KV connector's scheduler half (a host tier; None: none), and with
        `swap_preemption` a preempted request's blocks are saved through it instead of recomputed."""
        self.limits = limits
        self.grammars = grammars
        self.rejected: list[tuple[str, str]] = []
        """(request_id, why) of requests refused after they arrived (a grammar that did not compile
        in time); the engine core reports and clears them."""
        self.workers_see_samples = workers_see_samples
        self.kv = KVCacheManager(limits.num_blocks, limits.block_size, limits.enable_prefix_caching,
                                 limits.sliding_windows)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(policy)
        self.by_priority = policy == "priority"
        self.running: list[Request] = []
        """The last one is the first to be preempted: in admission order (fcfs), or by `priority_key`."""
        self._freed_req_ids: set[str] = set()
        """Requests the workers must forget at the next step."""
        self._known_to_workers: set[str] = set()
        self._num_history_requests = 0
        """Requests whose sampling reads their output so far (see `can_overlap`)."""
        self._num_grammar_requests = 0
        self.num_preemptions = 0
        self.num_scheduled_tokens_total = 0
        self.num_generation_tokens = 0
        self.encoder_images = 0
        self.encoder_seconds = 0.0
        self.speculative = speculative
        self.proposer = proposer
        self.lookahead = speculative.num_speculative_tokens if speculative is not None and proposer is None else 0
        """Slots kept free after a request's scheduled tokens for the draft model's own guesses
        (`DraftModelProposer`): it runs k - 1 positions past the tokens it proposes from."""
        self.adapters = adapters
        self._running_loras: Counter[int] = Counter()
        """Adapter id -> running requests that use it: at most `adapters.max_loras` ids."""
        self._waiting_loras: Counter[int] = Counter()
        self._lora_names: dict[int, str] = {}
        self.connector = connector
        self.swap_preemption = swap_preemption and connector is not None
        if connector is not None:
            self.kv.record_evictions()
        self._load_failed: list[Request] = []
        """Running requests whose KV a connector failed to load: preempted (to recompute) next step."""
        self._receiving: dict[str, int] = {}
        """Requests waiting for a remote load (WAITING_FOR_REMOTE_KVS) -> their computed tokens once loaded."""
        self._loaded: set[str] = set()
        """Waiting requests whose remote load landed: they hold their blocks and skip the prefix lookup."""
        self._held: dict[str, Request] = {}
        """Ended requests whose blocks wait for the workers: a peer's pull (producer), or a load still
        landing in them (a consumer's request aborted mid-pull)."""
        self.spec_stats = (SpecDecodeStats(accepted_per_position=[0] * speculative.num_speculative_tokens)
                           if speculative is not None else None)

    # -- requests in and out ------------------------------------------------------------------

    def add_request(self, record: EngineCoreRequest) -> Request:
        """Queue a request that has arrived; returns the scheduler's state of it."""
        if record.request_id in self.requests:
            raise ValueError(f"request_id {record.request_id!r} is already in use")
        check_prompt_fits(len(record.prompt_token_ids), self.limits.max_model_len)
        if record.lora_request is not None and self.adapters is None:
            raise ValueError("this engine serves no LoRA adapters (enable_lora, --enable-lora)")
        request = Request.from_record(record)
        structured = request.sampling_params.structured_outputs
        if structured is not None:
            if self.grammars is None:
                raise ValueError("structured output needs the model's tokenizer, and this engine has none")
            request.grammar = self.grammars.start(structured, request.prompt_token_ids, request.eos_token_ids)
        self._num_grammar_requests += request.grammar is not None
        self.requests[request.request_id] = request
        self._enqueue(request)
        self._num_history_requests += request.sampling_params.reads_output_history
        return request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside (abort). Unknown or already finished ids are ignored."""
        ended = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            receiving = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if request.status == RequestStatus.RUNNING:
                self._stop_running(request)
            elif receiving:  # its blocks stay until the load in flight lands in them
                del self._receiving[req_id]
            else:
                self.waiting.remove(request)
                self._loaded.discard(req_id)
                self._count_lora(self._waiting_loras, request, -1)
            request.status = status
            self._release(request, keep_blocks=receiving)
            ended.append(request)
        return ended

    def _release(self, request: Request, keep_blocks: bool = False) -> dict | None:
        """Forget an ended request; its blocks are freed unless the KV connector (or `keep_blocks`)
        holds them for the workers. Returns the connector's `kv_transfer_params` for its output."""
        params = None
        if self.connector is not None:
            delay, params = self.connector.request_finished(request, self.kv.get_block_ids(request.request_id)[0])
            keep_blocks = keep_blocks or delay
        if keep_blocks:
            self._held[request.request_id] = request
        else:
            self.kv.free(request)
        del self.requests[request.request_id]
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        self._num_history_requests -= request.sampling_params.reads_output_history
        if request.grammar is not None:
            self._num_grammar_requests -= 1
            request.grammar.cancel()
        if request.request_id in self._known_to_workers:
            self._known_to_workers.discard(request.request_id)
            self._freed_req_ids.add(request.request_id)
        return params

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or blocks held for the workers' transfers (which steps report)."""
        return bool(self.requests) or bool(self._held)

    @property
    def can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the tokens of the one in flight are known.

        Requests then decode from placeholders (their last token stays on the device), which is
        exact unless sampling reads the output history on the host (penalties, bad words,
        min_tokens): while such a request exists, steps run one at a time. So do they while
        speculative decoding proposes, which reads each request's latest tokens; not while it is
        paused by disable_by_batch_size."""
        return self._num_history_requests == 0 and not self._speculating

    @property
    def _speculating(self) -> bool:
        """Whether draft tokens may be proposed now: speculation is on, below disable_by_batch_size."""
        spec = self.speculative
        return spec is not None and (spec.disable_by_batch_size is None
                                     or len(self.running) < spec.disable_by_batch_size)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        encoder = EncoderBudget(self.limits.max_num_encoder_input_tokens or budget)
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        spec_tokens: dict[str, list[int]] = {}
        preempted_now = False
        # Decided once, before preemptions shrink the batch: a step scheduled while another is in
        # flight (can_overlap) must not carry drafts.
        speculate = self._speculating
        if self._load_failed:
            preempted_now = self._recompute_failed_loads()

        i = 0
        running = self.running
        while i < len(running) and budget > 0:
            request = running[i]
            start = request.num_computed_tokens
            num_new = min(request.num_tokens_with_placeholders - start, budget)
            images = request.record.multi_modal
            if images and start < images[-1].end:  # a prompt chunk before its last image's end
                num_new = encoder.fit(images, start, num_new, resumed=False)
            if (num_new <= 0 or request.reaches_limit_in_flight(self.limits.max_model_len)
                    or (request.num_output_placeholders and not self.workers_see_samples)):
                i += 1
                continue
            drafts = self._propose(request, budget, speculate) if num_new == 1 and self.speculative else []
            extra = len(drafts) + (self._lookahead(request, start + num_new + len(drafts), speculate)
                                   if self.lookahead else 0)
            if start + num_new + extra <= request.kv_quiet_until:
                new_ids = ()  # the common decode step: within its blocks, filling none
            else:
                new_ids = self.kv.allocate_slots(request, num_new + extra)
                if new_ids is None and extra:  # no room to speculate: decode plainly
                    drafts = []
                    new_ids = self.kv.allocate_slots(request, num_new)
                while new_ids is None:
                    victim = running.pop()
                    self._preempt(victim, self.swap_preemption)
                    preempted_now = True
                    if victim is request:
                        break
                    new_ids = self.kv.allocate_slots(request, num_new)
                if new_ids is None:
                    break
            # The record's fields directly, not through `Request`'s properties: this runs for
            # every running request at every step.
            req_id = request.record.request_id
            if drafts:
                request.spec_token_ids = spec_tokens[req_id] = drafts
                num_new += len(drafts)
            num_scheduled[req_id] = num_new
            budget -= num_new
            if any(new_ids) or request.worker_out_of_date or not self.workers_see_samples:
                request.worker_out_of_date = False
                new_token_ids = ([] if self.workers_see_samples else
                                 request.all_token_ids[max(start, request.num_prompt_tokens):start + num_new])
                cached_reqs.append(CachedRequestData(req_id, new_ids or self.kv.empty_block_ids(), start,
                                                     new_token_ids))
            i += 1

        # Admitting new work right after a preemption would only thrash.
        compiling: list[Request] = []
        lora_full = False
        """Whether a waiting request's adapter found no free slot: later requests of running
        adapters then wait too, so those adapters drain and it gets its turn (no starvation)."""
        while (self.waiting and budget > 0 and not preempted_now
               and len(self.running) < self.limits.max_num_seqs):
            request = self.waiting.peek()
            if ((request.grammar is not None and not self._grammar_ready(request))
                    or (request.record.lora_request is not None and not self._adapter_admits(request, lora_full))):
                self.waiting.pop_next()
                if not request.status.is_finished:
                    compiling.append(request)  # others go ahead meanwhile
                    lora_full = lora_full or self._lora_blocked(request)
                continue
            loaded = request.request_id in self._loaded
            if loaded:  # its remote KV landed in the blocks it holds
                hit_blocks, num_hit_tokens = None, request.num_computed_tokens
            else:
                hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_external, load_async = 0, False  # tokens the KV connector loads after the device's hit
            if self.connector is not None and not request.load_failed and not loaded:
                matched, load_async = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
                # Never the last token (it must run to give logits), whatever the connector says.
                num_external = max(0, min(matched, request.num_tokens - 1 - num_hit_tokens))
            if load_async and num_external:
                if not self._start_remote_load(request, hit_blocks, num_hit_tokens, num_external):
                    break
                continue
            num_computed = num_hit_tokens + num_external
            num_new = min(request.num_tokens - num_computed, budget)
            images = request.record.multi_modal
            if images and num_computed < images[-1].end:
                num_new = encoder.fit(images, num_computed, num_new, resumed=True)
                if num_new <= 0:
                    break  # its next image waits for a step with encoder budget left
            lookahead = self._lookahead(request, num_computed + num_new, speculate)
            new_ids = self.kv.allocate_slots(request, num_external + num_new + lookahead, hit_blocks)
            if new_ids is None and lookahead:  # the prompt alone may still fit
                new_ids = self.kv.allocate_slots(request, num_external + num_new, hit_blocks)
            if new_ids is None:
                given_back = self._preempt_lower(request, num_scheduled, cached_reqs, spec_tokens) \
                    if self.by_priority else None
                if given_back is None:
                    break
                budget += given_back
                continue  # its prefix hits and room, again
            if self.connector is not None:
                first_block = num_hit_tokens // self.limits.block_size
                self.connector.update_state_after_alloc(
                    request, first_block, new_ids[0][:-(-num_external // self.limits.block_size)], num_external)
            self.waiting.pop_next()
            self._count_lora(self._waiting_loras, request, -1)
            self._count_lora(self._running_loras, request, 1)
            if loaded:
                self._loaded.discard(request.request_id)
            elif not request.skips_prefix_cache:
                self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            if self.by_priority:
                bisect.insort(self.running, request, key=priority_key)
            else:
                self.running.append(request)
            self._known_to_workers.add(request.request_id)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(NewRequestData(
                record=request.record,
                output_token_ids=request.output_token_ids,
                block_ids=self.kv.get_block_ids(request.request_id),
                num_computed_tokens=num_computed,
            ))
        self.waiting.push_front_all(compiling)

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.limits.max_num_batched_tokens - budget,
            freed_req_ids=self._freed_req_ids,
            grammar_bitmask=self._grammar_bitmask(num_scheduled),
            scheduled_spec_tokens=spec_tokens,
            propose_drafts=speculate and self.lookahead > 0,
        )
        if self.connector is not None:
            self.connector.blocks_evicted(self.kv.take_evicted())
            output.kv_connector_metadata = self.connector.build_connector_meta()
        self._freed_req_ids = set()
        # The tokens handed out are counted as computed once scheduled: the step that computes
        # them is always launched before the next schedule(). One reaching the end of its known
        # tokens (and of its drafts) samples one more, a placeholder until its id comes back.
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.num_tokens_with_placeholders:
                request.num_output_placeholders += 1
        self.num_scheduled_tokens_total += output.total_num_scheduled_tokens
        return output

    def _preempt_lower(self, request: Request, num_scheduled: dict[str, int], cached_reqs: list[CachedRequestData],
                       spec_tokens: dict[str, list[int]]) -> int | None:
        """Priority policy: make room for waiting `request` by preempting the lowest-priority running
        request, if its priority value is strictly larger (equals never preempt each other, which
        would only thrash). Its part of this step is withdrawn; returns the tokens that gives back
        to the step's budget, None if there is no such request. The victim was not admitted in this
        step: those admitted before `request` come first by priority."""
        if not self.running or self.running[-1].record.priority <= request.record.priority:
            return None
        victim = self.running.pop()
        # Its blocks registered for the tokens withdrawn below will hold no KV: a later hit on them
        # (or a copy to the host tier when they are evicted) would read garbage.
        self.kv.uncache_uncomputed(victim)
        self._preempt(victim, self.swap_preemption)
        req_id = victim.request_id
        spec_tokens.pop(req_id, None)
        for i, cached in enumerate(cached_reqs):
            if cached.req_id == req_id:
                del cached_reqs[i]
                break
        return num_scheduled.pop(req_id, 0)

    def _lookahead(self, request: Request, end: int, speculate: bool) -> int:
        """Room to allocate past a step's tokens, drafts included (up to position `end`), for the
        draft model's guesses, when the step ends the request's known tokens; never past
        max_model_len. Without it the draft proposes less, never wrongly."""
        if (not speculate or not self.lookahead or end < request.num_tokens
                or request.record.sampling_params.reads_output_history):
            return 0
        return max(0, min(self.lookahead, self.limits.max_model_len - end))

    def _propose(self, request: Request, budget: int, speculate: bool) -> list[int]:
        """Draft tokens for a request about to decode its last token, within its max_tokens, the
        model's length and the step's budget; none for requests whose sampling reads the output
        history (penalties, min_tokens, a grammar...), which decode one token a step."""
        proposal, request.proposed_token_ids = request.proposed_token_ids, []
        record = request.record
        if (not speculate or request.num_output_placeholders
                or request.num_computed_tokens != request.num_tokens - 1
                or record.pooling_params is not None or record.sampling_params.reads_output_history):
            return []
        # The step yields the accepted drafts and one token more: all must fit.
        room = min(record.max_tokens - request.num_output_tokens,
                   self.limits.max_model_len - request.num_tokens, budget) - 1
        if self.proposer is None:  # the workers proposed when this request's last token came back
            return proposal[:max(room, 0)]
        return self.proposer.propose(request.all_token_ids, room, record.request_id, request.num_prompt_tokens)

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a waiting request's grammar is compiled; one that failed or ran out of time is
        rejected here."""
        try:
            return request.grammar.ready()
        except ValueError as e:  # GrammarError
            self._reject_waiting(request, str(e))
            return False

    def _reject_waiting(self, request: Request, why: str) -> None:
        """End a request at the head of the waiting queue that can never run (the caller pops it)."""
        request.status = RequestStatus.FINISHED_ABORTED
        self._count_lora(self._waiting_loras, request, -1)
        self._release(request)
        self.rejected.append((request.request_id, why))

    def _adapter_admits(self, request: Request, lora_full: bool) -> bool:
        """Whether a waiting request's adapter lets it run now: loaded, and a slot of the step's
        `max_loras` free (or its adapter already running, unless another adapter waits for a slot:
        `lora_full`). A failed load rejects it."""
        lora_id = request.record.lora_request.lora_int_id
        if lora_id in self._running_loras:
            return not lora_full
        if len(self._running_loras) >= self.adapters.max_loras:
            return False
        try:
            return self.adapters.ready(request.record.lora_request, self._running_loras.keys())
        except ValueError as e:
            self._reject_waiting(request, str(e))
            return False

    def _lora_blocked(self, request: Request) -> bool:
        """Whether a request left waiting is kept out by the adapter slots being full."""
        lora = request.record.lora_request
        return (lora is not None and lora.lora_int_id not in self._running_loras
                and len(self._running_loras) >= self.adapters.max_loras)

    def _grammar_bitmask(self, num_scheduled: dict[str, int]) -> GrammarBitmask | None:
        """The allowed tokens of this step's rows that sample under an active grammar (before the
        scheduled tokens are counted as computed: a row samples when they reach its last token)."""
        if not self._num_grammar_requests:
            return None
        rows = [r for r, n in num_scheduled.items()
                if (req := self.requests[r]).grammar is not None and req.grammar.active
                and req.num_computed_tokens + n >= req.num_tokens_with_placeholders]
        if not rows:
            return None
        return GrammarBitmask(rows, self.grammars.bitmask([self.requests[r].grammar for r in rows]))

    def wait_for_pending(self, timeout_s: float) -> None:
        """Nothing could be scheduled: wait a little for a compile, an adapter load or a KV
        transfer to finish instead of spinning."""
        if self.connector is not None and self.connector.has_pending():
            time.sleep(min(timeout_s, _TRANSFER_POLL_S))
        if self.grammars is not None:
            self.grammars.wait(timeout_s)
        if self.adapters is not None:
            self.adapters.wait(timeout_s)

    def _enqueue(self, request: Request) -> None:
        self.waiting.push(request)
        self._count_lora(self._waiting_loras, request, 1)

    def _stop_running(self, request: Request) -> None:
        self.running.remove(request)
        self._count_lora(self._running_loras, request, -1)

    def _count_lora(self, counter: Counter[int], request: Request, delta: int) -> None:
        lora = request.record.lora_request
        if lora is None:
            return
        self._lora_names[lora.lora_int_id] = lora.lora_name
        counter[lora.lora_int_id] += delta
        if counter[lora.lora_int_id] <= 0:
            del counter[lora.lora_int_id]

    def _preempt(self, request: Request, swap: bool = False) -> None:
        """Back to the head of the waiting queue, its blocks freed: recomputed when it resumes, or
        with `swap` loaded back from where the KV connector saved them."""
        if swap:
            self.connector.request_preempted(request, self.kv.get_block_ids(request.request_id)[0])
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # A token in flight is dropped: recomputation samples it again (same seed, same position).
        request.num_output_placeholders = 0
        request.spec_token_ids = request.proposed_token_ids = []
        request.worker_out_of_date = False  # it comes back to the workers as a new request
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)
        self._count_lora(self._running_loras, request, -1)
        self._count_lora(self._waiting_loras, request, 1)
        if request.request_id in self._known_to_workers:
            self._known_to_workers.discard(request.request_id)
            self._freed_req_ids.add(request.request_id)

    def _start_remote_load(self, request: Request, hit_blocks, num_hit_tokens: int, num_external: int) -> bool:
        """Take the waiting queue's head out of it to wait for its remote KV, holding blocks for it;
        False when the blocks are not there (it stays at the head)."""
        # Not registered in the prefix cache before the KV lands: another request must not hit them.
        new_ids = self.kv.allocate_slots(request, num_external, hit_blocks, cache=False)
        if new_ids is None:
            return False
        self.connector.update_state_after_alloc(
            request, num_hit_tokens // self.limits.block_size, new_ids[0], num_external)
        self.waiting.pop_next()
        self._count_lora(self._waiting_loras, request, -1)
        if not request.skips_prefix_cache:
            self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._receiving[request.request_id] = num_hit_tokens + num_external
        return True

    def _remote_loads_ended(self, req_ids: set[str], failed: set[int]) -> None:
        """Requests whose remote load ended go back to the head of the waiting queue: with their KV,
        or (a block of theirs in `failed`) without it, to recompute."""
        for req_id in req_ids:
            held = self._held.pop(req_id, None)
            if held is not None:  # aborted while its KV was landing
                self.kv.free(held)
                continue
            num_loaded = self._receiving.pop(req_id, None)
            if num_loaded is None:
                continue
            request = self.requests[req_id]
            if failed and self.kv.holds_any(req_id, failed):
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.load_failed = True
                self.connector.stats.transfer_failures += 1
            else:
                self.connector.stats.remote_hit_tokens += num_loaded - request.num_computed_tokens
                request.num_computed_tokens = num_loaded
                self._loaded.add(req_id)
            request.status = RequestStatus.WAITING
            self.waiting.push_front(request)
            self._count_lora(self._waiting_loras, request, 1)

    def _recompute_failed_loads(self) -> bool:
        """Preempt the running requests whose KV failed to load, to recompute; whether any was."""
        preempted = False
        for request in self._load_failed:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._preempt(request)
                preempted = True
        self._load_failed = []
        return preempted

    def _connector_output(self, report: KVConnectorOutput) -> set[str]:
        """Apply a step's KV connector report; returns the requests whose sampled tokens are dropped
        (they read KV that failed to load, and are recomputed next step)."""
        self.connector.update_connector_output(report)
        for req_id in report.finished_sending:
            held = self._held.pop(req_id, None)
            if held is not None:
                self.kv.free(held)
        failed = report.failed_block_ids
        if report.finished_recving:
            self._remote_loads_ended(report.finished_recving, failed)
        if not failed:
            return set()
        # Rare: a scan of the running requests is fine here.
        self.kv.uncache_blocks(failed)
        dropped = {r.request_id for r in self.running if self.kv.holds_any(r.request_id, failed)}
        for request in self.running:
            if request.request_id in dropped:
                request.load_failed = True
                self._load_failed.append(request)
        self.connector.stats.failed_loads += len(dropped)
        logger.warning("KV connector: %d block(s) failed to load; %d request(s) recompute", len(failed), len(dropped))
        return dropped

    def update_from_output(self, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free what finished."""
        dropped = self._connector_output(output.kv_connector_output) if output.kv_connector_output else ()
        results = self._finish_pooled(output.pooler_output) if output.pooler_output else []
        logprobs = output.logprobs or {}
        prompt_logprobs = output.prompt_logprobs or {}
        draft_token_ids = output.draft_token_ids or {}
        if output.encoder_images:
            self.encoder_images += output.encoder_images
            self.encoder_seconds += output.encoder_seconds
        requests, running, max_model_len = self.requests, RequestStatus.RUNNING, self.limits.max_model_len
        for req_id, token_ids in zip(output.req_ids, output.sampled_token_ids):
            request = requests.get(req_id)
            if (request is None or request.status is not running  # aborted or preempted meanwhile
                    or request.num_output_placeholders == 0  # sampled before a preemption: dropped
                    or req_id in dropped):  # from KV that failed to load
                continue
            request.num_output_placeholders -= 1
            if request.spec_token_ids:
                self._count_accepted(request, len(token_ids) - 1)
            num_taken, finished = 0, False
            for token_id in token_ids:
                request.all_token_ids.append(token_id)
                num_taken += 1
                finished = request.check_stop(token_id, max_model_len)
                if request.grammar is not None and not finished:
                    finished = self._accept_grammar(request, token_id)
                if finished:  # tokens accepted after a stop are dropped
                    break
            self.num_generation_tokens += num_taken
            if self.lookahead:  # the draft model's proposal from this step's tokens, if any
                request.proposed_token_ids = [] if finished else draft_token_ids.get(req_id, [])
            results.append(EngineCoreOutput(
                req_id, token_ids if num_taken == len(token_ids) else token_ids[:num_taken],
                request.status.finish_reason, request.stop_reason, max(request.num_cached_tokens, 0),
                request.first_scheduled_time, logprobs.get(req_id), prompt_logprobs.get(req_id)))
            if finished:
                self._stop_running(request)
                results[-1].kv_transfer_params = self._release(request)
        return results

    @staticmethod
    def _accept_grammar(request: Request, token_id: int) -> bool:
        """Advance a structured-output request's grammar; whether that ends the request."""
        try:
            if request.grammar.accept(token_id):
                request.status = RequestStatus.FINISHED_STOPPED  # the output is a complete sentence
                return True
        except ValueError as e:  # GrammarError: nothing the grammar allows could be sampled
            logger.warning("request %s: %s", request.request_id, e)
            request.status = RequestStatus.FINISHED_ABORTED
            return True
        return False

    def _count_accepted(self, request: Request, num_accepted: int) -> None:
        """Roll a request back past its rejected drafts: their KV slots hold keys of tokens that
        were not taken, and are written over when the positions are computed again (no block
        is registered in the prefix cache before its tokens are known)."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if num_accepted < len(drafts):
            request.num_computed_tokens -= len(drafts) - num_accepted
            request.worker_out_of_date = True
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            stats.accepted_per_position[i] += 1

    def _finish_pooled(self, pooled: dict[str, bytes]) -> list[EngineCoreOutput]:
        """Pooling requests end with the step that pooled their last prompt chunk."""
        results = []
        for req_id, vector in pooled.items():
            request = self.requests.get(req_id)
            if (request is None or request.status != RequestStatus.RUNNING
                    or request.num_output_placeholders == 0):  # pooled before a preemption: dropped
                continue
            request.num_output_placeholders = 0
            request.status = RequestStatus.FINISHED_STOPPED
            results.append(EngineCoreOutput(req_id, [], "stop", None, max(request.num_cached_tokens, 0),
                                            request.first_scheduled_time, pooled=vector))
            self._stop_running(request)
            self._release(request)
        return results

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_waiting_by_priority=dict(self.waiting.num_by_priority),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_stats.queries,
            prefix_cache_hits=self.kv.prefix_stats.hits,
            num_preemptions=self.num_preemptions,
            num_scheduled_tokens_total=self.num_scheduled_tokens_total,
            num_generation_tokens=self.num_generation_tokens,
            spec=None if self.spec_stats is None else SpecDecodeStats(
                self.spec_stats.num_drafts, self.spec_stats.num_draft_tokens, self.spec_stats.num_accepted_tokens,
                list(self.spec_stats.accepted_per_position)),
            lora=None if self.adapters is None else LoRAStats(
                running=sorted(self._lora_names[i] for i in self._running_loras),
                waiting=sorted(self._lora_names[i] for i in self._waiting_loras),
                max_loras=self.adapters.max_loras, num_loads=self.adapters.num_loads,
                num_evictions=self.adapters.num_evictions),
            kv_transfer=None if self.connector is None else dataclasses.replace(
                self.connector.stats, held_requests=len(self._held) + len(self._receiving)),
            mm_encoder_images=self.encoder_images,
            mm_encoder_seconds=self.encoder_seconds,
        )
