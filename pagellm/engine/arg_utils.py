"""Engine arguments: the user-facing knobs (`LLM(...)` keywords and CLI flags, named as in vLLM),
checked and resolved into an `EngineConfig` against the model and the machine."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import types
import typing
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, fields

import torch

from pagellm.attention import ATTENTION_BACKEND_REGISTRY
from pagellm.config import (
    CacheConfig,
    DraftModelConfig,
    EngineConfig,
    GrammarLimits,
    LoRAConfig,
    ModelArchConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from pagellm.config.cpu_threads import resolve_cpu_threads
from pagellm.config.dtype_sizes import KV_CACHE_DTYPES
from pagellm.config.kv_transfer import FLAG, KV_CONNECTOR_REGISTRY, NIXL_CONNECTOR, KVOffloadConfig, resolve_kv_offload
from pagellm.config.model import RUNNERS
from pagellm.core.kv_cache_groups import KVCacheGroup, kv_cache_groups
from pagellm.core.request_queue import SCHEDULING_POLICIES
from pagellm.executor import EXECUTOR_REGISTRY
from pagellm.loader import LOAD_FORMATS, resolve_model
from pagellm.ops.c import cpu_ops
from pagellm.ops.dispatch import triton_available, triton_interpreting
from pagellm.plugins import load_plugins
from pagellm.quantization import QUANTIZATION_REGISTRY, check_experts_dense, experts_request, resolve_quantization
from pagellm.reasoning import REASONING_PARSER_REGISTRY

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}
_FALLBACK_ATTENTION_BACKEND = "torch"
"""What errors suggest when the chosen attention backend cannot run: pure PyTorch runs on every
device and cache dtype (the oracle every other backend is tested against)."""
_DEVICE_NAMES = {"cuda": "CUDA GPUs", "cpu": "CPUs"}
DEFAULT_STEP_TIMEOUT_S = 20.0
"""engine_step_timeout's default: a decode step takes well under a second, and a hung rank should
fail its requests in seconds, not at the collectives' 600 s timeout."""
STEP_TIMEOUT_PER_TOKEN_S = {"cpu": 0.05, "cuda": 0.005}
"""engine_step_timeout's allowance per scheduled token, for long prefills: a 2,048-token CPU step
gets 102 s more (a floor of 20 prefill tokens a second), an 8,192-token GPU step 41 s."""


def _arg(default, help: str | Callable[[], str]):
    """A field whose help text the CLI shows (`pagellm serve --help`); a function of no arguments
    makes it when the parser is built (from a registry, plugins' names included)."""
    return field(default=default, metadata={"help": help})


@dataclass(slots=True)
class EngineArgs:
    """Everything `LLM(...)` and `pagellm serve` accept about the engine."""

    model: str | None = _arg(None, "GGUF file, Hugging Face directory, or (with load_format='dummy') a preset name. None: the embedded SmolLM2-135M-Instruct.")
    tokenizer: str | None = _arg(None, "Tokenizer to use instead of the model's own: a .gguf file or a directory with tokenizer.json (e.g. text prompts for dummy weights, which have none). Its vocabulary must fit the model's.")
    load_format: str = _arg("auto", 'auto | gguf | safetensors | dummy (random seeded weights, for benchmarks).')
    quantization: str | None = _arg(None, lambda: f"How linear layers' weights are stored and multiplied: {QUANTIZATION_REGISTRY.describe()}. None: the checkpoint's quantization_config; gguf for a GGUF model on a GPU, or on the CPU when the kernels can run there (x86-64 with AVX2 and a C compiler); else none. Check the quality first with pagellm eval.")
    kv_cache_dtype: str = _arg("auto", "How KV-cache entries are stored: auto (the model's dtype) | fp8 (float8 e4m3, also fp8_e4m3: one byte an entry, so about twice the KV blocks of 16-bit entries; an entry is stored divided by its layer's per-tensor k/v scale where the checkpoint has calibrated ones (k_scale / v_scale), else as it is, as vLLM does without them; attention computes in the model's dtype). fp8 needs a GPU of compute capability 8.9+ (Ada, Hopper), or on the CPU the torch attention backend.")
    dtype: str = _arg("auto", "auto | float32 | bfloat16 | float16. auto: bfloat16 on CPUs with bf16 instructions (AVX512-BF16, AMX) else float32; the checkpoint's 16-bit type (else bfloat16) on GPU.")
    device: str = _arg("auto", 'auto | cpu | cuda | cuda:N.')
    seed: int = _arg(0, 'Seed of the random weights (dummy) and of sampling for requests without their own seed.')
    max_model_len: int | None = _arg(None, "Longest prompt + output in tokens. None: the model's max_position_embeddings.")
    block_size: int = _arg(16, 'Tokens per KV-cache block.')
    gpu_memory_utilization: float = _arg(0.9, 'Fraction of GPU memory the engine may use in all (weights, activations, KV cache).')
    kv_cache_memory_bytes: int | None = _arg(None, 'KV-cache size in bytes; overrides gpu_memory_utilization. Per rank. CPU default: min(4 GiB, a quarter of RAM), shared by every rank and replica.')
    num_gpu_blocks_override: int | None = _arg(None, 'Exact number of KV blocks (tests, debugging).')
    enable_prefix_caching: bool = _arg(True, 'Reuse the KV of shared prompt prefixes across requests.')
    max_num_seqs: int = _arg(256, 'Most sequences in one step.')
    max_num_batched_tokens: int | None = _arg(None, 'Token budget of one step (prefill chunks + decodes). None: 8192 on GPU, 2048 on CPU.')
    attention_backend: str | None = _arg(None, lambda: f'Attention implementation: {ATTENTION_BACKEND_REGISTRY.describe()}. None: triton on CUDA (when Triton is installed); on a CPU, cpu for float32 where the C kernels build, else torch.')
    scheduling_policy: str = _arg(
        "fcfs", "fcfs (first come, first served) | priority: requests are admitted by their priority (lower first, "
                "arrival order among equals; LLM.generate(..., priority=[...]), the OpenAI extra field priority), the "
                "running request of the lowest priority is preempted first when KV blocks run out, and a waiting "
                "request that finds no blocks preempts running ones of a lower priority "
                "(docs/serving.md#priority-scheduling). Under fcfs a priority other than 0 is refused.")
    async_scheduling: bool | None = _arg(None, 'Schedule and prepare the next step while the device runs the current one (requests with penalties, bad words or min_tokens step without overlap). None: on for CUDA, off for the CPU, where nothing runs asynchronously.')
    enforce_eager: bool = _arg(False, 'Run every step eagerly: no CUDA graphs for decode steps (GPU only; the CPU is always eager).')
    tensor_parallel_size: int = _arg(1, "Ranks each layer is split across (tensor parallel): GPUs on CUDA, processes on the CPU.")
    pipeline_parallel_size: int = _arg(1, "Stages the layers are split into (pipeline parallel), each on its own tensor-parallel group of ranks.")
    data_parallel_size: int = _arg(1, "Engine replicas behind one server (pagellm serve), each with its own KV cache and its own tensor x pipeline ranks; requests are routed by prompt prefix and load.")
    enable_expert_parallel: bool = _arg(
        False, "Mixture-of-experts models: place whole experts on the tensor-parallel ranks (each holds num_experts / "
               "tensor_parallel_size of them, and the ranks' partial outputs are summed) instead of a slice of every "
               "expert on every rank. Attention and dense layers stay tensor-parallel. Needs num_experts divisible by "
               "tensor_parallel_size; no effect on dense models or on one rank.")
    distributed_executor_backend: str | None = _arg(None, lambda: f"How ranks are run: {EXECUTOR_REGISTRY.describe()}. None: uni for one rank, else mp.")
    engine_step_timeout: float = _arg(DEFAULT_STEP_TIMEOUT_S, f"Seconds the engine waits for a step's results from ranks in processes of their own (mp, ray), plus {STEP_TIMEOUT_PER_TOKEN_S['cpu'] * 1000:g} ms per scheduled token on a CPU and {STEP_TIMEOUT_PER_TOKEN_S['cuda'] * 1000:g} ms on a GPU (long prefills), before it counts a rank as hung (stopped, stuck in a kernel or a deadlock): it then stops every rank and fails its requests, and the server exits with status 1. 0: wait as long as the ranks' collectives do (600 s).")
    cpu_threads: int | None = _arg(None, "Threads each rank computes with (PyTorch's and the C kernels' OpenMP threads). None: OMP_NUM_THREADS if set, else the cores this process may use (CPU affinity, cgroup CPU quota) less one for the engine's other processes, shared by the ranks and replicas on this machine (at least one each).")
    max_logprobs: int = _arg(20, 'Most logprobs / prompt_logprobs a request may ask for per token.')
    runner: str = _arg("generate", "generate (text generation) | pooling (embeddings: each prompt is run through the model once and its final hidden states pooled into one vector; no prefix caching, no async scheduling).")
    reasoning_parser: str | None = _arg(None, lambda: f"How the model marks its reasoning: {REASONING_PARSER_REGISTRY.describe()}. Structured output (JSON schemas, tools) is enforced only after the reasoning ends, and the server returns the reasoning as reasoning_content.")
    structured_outputs_compile_timeout: float = _arg(10.0, "Seconds a request's JSON schema, regex or grammar may take to compile (off the step loop, in a thread pool) before the request is refused (HTTP 400).")
    structured_outputs_max_bytes: int = _arg(65536, "Largest JSON schema, regex, grammar or choice list a request may send, in bytes of its JSON text; larger ones are refused (HTTP 400).")
    structured_outputs_limits: str | dict | None = _arg(None, lambda: (
        "How complex a JSON schema, regex, grammar or choice list may be; more complex ones are refused before "
        "they compile (HTTP 400). JSON setting some of the limits, whose defaults are "
        f"{json.dumps(asdict(GrammarLimits()))} (docs/structured-output.md#limits)."))
    speculative_config: str | dict | None = _arg(None, 'Speculative decoding, as vLLM: JSON like \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (the defaults of both; prompt lookup: the tokens that followed the latest earlier occurrence of the last n tokens) or \'{"model": "draft.gguf", "num_speculative_tokens": 4}\' (a smaller model with the same vocabulary proposes greedily, with its own KV cache in the same blocks; optional "quantization" for its weights). The drafts are verified in one step: greedy output is unchanged, sampled output keeps its distribution. Optional "disable_by_batch_size": N (no speculation while N or more requests run). One rank only; steps that propose run without async scheduling. None: off.')
    enable_lora: bool = _arg(False, "Serve LoRA adapters (PEFT's format) on the base model: requests name one (LLM.generate(..., lora_request=LoRARequest(name, id, path)); on the server the request's model field, with --lora-modules); one step mixes requests of different adapters and of the base model. One tensor-parallel rank (pipeline stages may be several).")
    max_loras: int = _arg(1, "With enable_lora: most distinct adapters in one step (each adapted layer holds this many device slots); requests of further adapters wait.")
    max_lora_rank: int = _arg(16, "With enable_lora: largest adapter rank accepted (every slot is this wide); a larger adapter is refused.")
    max_cpu_loras: int | None = _arg(None, "With enable_lora: adapters kept loaded in host memory, least recently used ones dropped (>= max_loras). None: max_loras.")
    lora_dtype: str = _arg("auto", "With enable_lora: auto (the model's dtype on a GPU, float32 on a CPU) | float32 | bfloat16 | float16: how adapter weights are stored and multiplied.")
    kv_offloading_size: float | None = _arg(None, "GiB of host memory per rank for a second tier of the KV cache (the OffloadingConnector): full blocks evicted from the device's prefix cache are copied there (pinned memory on a GPU) and copied back when a later prompt shares the prefix; least recently used blocks are dropped. Full-attention models only (no sliding windows). None: off. docs/kv-offload.md.")
    swap_space: float | None = _arg(None, "Alias of kv_offloading_size (the older name).")
    preemption_mode: str | None = _arg(None, "What happens to a request preempted when device blocks run out: recompute (its KV is dropped and recomputed when it resumes; the default) | swap (its computed blocks are copied to the host tier and copied back when it resumes; needs kv_offloading_size).")
    kv_transfer_config: str | dict | None = _arg(None, lambda: f'The KV connector, as vLLM: JSON like \'{{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {{"cpu_bytes_to_use": 8589934592}}}}\'. Connectors: {KV_CONNECTOR_REGISTRY.describe()}. A kv_role without a kv_connector picks the NixlConnector (docs/disaggregated.md). None: none, unless kv_offloading_size picks the OffloadingConnector.')
    limit_mm_per_prompt: str | dict | None = _arg(
        None, 'Most images one prompt may carry, as vLLM: JSON like \'{"image": 4}\' (0: the model takes no images). '
              'None: 16. Checked offline and on the server (HTTP 400) before any image is fetched.')
    allowed_local_media_path: str | None = _arg(
        None, "A folder whose files chat image_url parts may name as file:// URLs (LLM.chat and the server); None: "
              "file URLs are refused.")
    allowed_media_domains: list[str] | None = _arg(
        None, "Hosts that http(s) image URLs may name (as vLLM: --allowed-media-domains a.com b.org; commas separate "
              "them too); None: any host. Fetches time out after PAGELLM_IMAGE_FETCH_TIMEOUT seconds (default 5) and "
              "stop at PAGELLM_MAX_IMAGE_BYTES (default 20 MiB).")
    pooler_config: str | dict | None = _arg(None, 'With runner pooling: JSON like \'{"pooling_type": "LAST", "normalize": true}\'; pooling_type LAST | MEAN | CLS (the last, mean or first token\'s final hidden state), normalize: L2-normalize the vector (a request may override it). None: LAST, normalized, as vLLM does for a decoder LM.')

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def validate(self) -> None:
        load_plugins()  # the API process's registries, before any name is looked up
        if self.quantization is not None:
            QUANTIZATION_REGISTRY.get(self.quantization)
        if self.dtype != "auto" and _DTYPE_ALIASES.get(self.dtype, self.dtype) not in _DTYPES:
            raise ValueError(f"{_flag('dtype')} must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{_flag('kv_cache_dtype')} must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"{_flag('load_format')} must be one of {', '.join(LOAD_FORMATS)}, "
                             f"got {self.load_format!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"{_flag('block_size')} must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"{_flag('gpu_memory_utilization')} must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend is not None:
            ATTENTION_BACKEND_REGISTRY.get(self.attention_backend)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"{_flag('scheduling_policy')} must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        _check_positive("max_model_len", self.max_model_len)
        _check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _check_positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"{_flag('max_logprobs')} must be a non-negative integer, got {self.max_logprobs!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"{_flag('max_num_batched_tokens')} {self.max_num_batched_tokens} must be >= "
                f"{_flag('max_num_seqs')} {self.max_num_seqs}: every running sequence needs a token each step")
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive("pipeline_parallel_size", self.pipeline_parallel_size)
        _check_positive("data_parallel_size", self.data_parallel_size)
        _check_positive("cpu_threads", self.cpu_threads)
        if isinstance(self.engine_step_timeout, bool) or not (
                isinstance(self.engine_step_timeout, (int, float)) and self.engine_step_timeout >= 0):
            raise ValueError(f"{_flag('engine_step_timeout')} must be a number of seconds >= 0 (0: no limit), "
                             f"got {self.engine_step_timeout!r}")
        executor = None
        if self.distributed_executor_backend is not None:
            executor = EXECUTOR_REGISTRY.get(self.distributed_executor_backend)
        if self.runner not in RUNNERS:
            raise ValueError(f"runner (--runner) must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        PoolerConfig.parse(self.pooler_config, self.runner)
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None:
            if speculative.quantization is not None and speculative.quantization not in QUANTIZATION_REGISTRY:
                raise ValueError(f"speculative_config (--speculative-config) quantization must be one of "
                                 f"{', '.join(QUANTIZATION_REGISTRY.names())}, got {speculative.quantization!r}")
            if self.runner != "generate":
                raise ValueError("speculative_config (--speculative-config) applies only to the generate runner")
            if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
                raise ValueError("speculative_config (--speculative-config) runs on one rank only so far: "
                                 "tensor_parallel_size and pipeline_parallel_size must be 1")
        if self.reasoning_parser is not None:
            REASONING_PARSER_REGISTRY.get(self.reasoning_parser)
        self._validate_lora()
        self._kv_offload()
        if isinstance(self.structured_outputs_compile_timeout, bool) or not (
                isinstance(self.structured_outputs_compile_timeout, (int, float))
                and self.structured_outputs_compile_timeout > 0):
            raise ValueError("structured_outputs_compile_timeout (--structured-outputs-compile-timeout) must be a "
                             f"number of seconds > 0, got {self.structured_outputs_compile_timeout!r}")
        _check_positive("structured_outputs_max_bytes", self.structured_outputs_max_bytes)
        GrammarLimits.parse(self.structured_outputs_limits)
        world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        if executor is not None and executor.max_world_size is not None and world_size > executor.max_world_size:
            fits = [repr(e.name) for e in EXECUTOR_REGISTRY.entries()
                    if e.max_world_size is None or e.max_world_size >= world_size]
            most = "one rank" if executor.max_world_size == 1 else f"at most {executor.max_world_size} ranks"
            raise ValueError(f"{_flag('distributed_executor_backend')} {executor.name!r} runs {most}, but "
                             f"tensor_parallel_size x pipeline_parallel_size is {world_size}: use "
                             f"{' or '.join(fits)}")

    def _kv_offload(self) -> KVOffloadConfig | None:
        """The KV connector from its flags, checked against this machine's host memory."""
        return resolve_kv_offload(self.kv_transfer_config, self.kv_offloading_size, self.swap_space,
                                  self.preemption_mode, self.tensor_parallel_size * self.pipeline_parallel_size
                                  * self.data_parallel_size)

    def _validate_lora(self) -> None:
        _check_positive("max_loras", self.max_loras)
        _check_positive("max_lora_rank", self.max_lora_rank)
        _check_positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"{_flag('max_cpu_loras')} {self.max_cpu_loras} must be >= {_flag('max_loras')} "
                             f"{self.max_loras}: an adapter on the device is also kept in host memory")
        if self.lora_dtype != "auto" and _DTYPE_ALIASES.get(self.lora_dtype, self.lora_dtype) not in _DTYPES:
            raise ValueError(f"{_flag('lora_dtype')} must be auto, float32, bfloat16 or float16, got {self.lora_dtype!r}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError(f"{_flag('enable_lora')} runs on one tensor-parallel rank so far: "
                             f"{_flag('tensor_parallel_size')} must be 1")

    def _lora_config(self, dtype: torch.dtype, device: torch.device) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if self.lora_dtype != "auto":
            lora_dtype = _DTYPES[_DTYPE_ALIASES.get(self.lora_dtype, self.lora_dtype)]
        else:  # a CPU multiplies a few rows faster in float32, and the fused C layer reads float32
            lora_dtype = dtype if device.type == "cuda" else torch.float32
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras or self.max_loras, dtype=lora_dtype)

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model, device, dtype and defaults, checked against the model and the machine."""
        self.validate()
        device = _resolve_device(self.device)
        source = resolve_model(self.model, self.load_format)
        if self.tokenizer is not None:
            source = dataclasses.replace(source, tokenizer=os.path.expanduser(self.tokenizer))
        arch = source.arch
        max_model_len = self.max_model_len or arch.max_position_embeddings
        if max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"{_flag('max_model_len')} {max_model_len} is larger than the model's max_position_embeddings "
                f"({arch.max_position_embeddings})")
        arch.max_model_len = max_model_len
        parallel = _resolve_parallel(self, arch, device)
        dtype = resolve_dtype(self.dtype, device, arch.torch_dtype)
        kv_cache_dtype = dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        attention_backend = self.attention_backend or _default_attention_backend(device, dtype, kv_cache_dtype)
        backend = ATTENTION_BACKEND_REGISTRY.get(attention_backend)
        if kv_cache_dtype != dtype:
            if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
                raise ValueError(f"{_flag('kv_cache_dtype')} fp8 needs a GPU of compute capability 8.9 or newer "
                                 f"(Ada, Hopper); this one is {torch.cuda.get_device_capability(device)}")
            if not backend.float8_kv_cache:
                raise ValueError(f"{_flag('kv_cache_dtype')} fp8: the {attention_backend} attention backend reads "
                                 f"no float8 caches; use --attention-backend {_FALLBACK_ATTENTION_BACKEND}")
        elif _has_kv_scales(arch.hf_config):
            logger.info("the checkpoint calibrated float8 KV-cache scales; they apply with --kv-cache-dtype fp8")
        # Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on a CPU: the tests use it.
        if device.type not in backend.devices and not (backend.triton_kernels and triton_interpreting()):
            devices = " and ".join(_DEVICE_NAMES.get(d, d) for d in backend.devices)
            raise ValueError(f"{_flag('attention_backend')} {attention_backend} runs on {devices} only, and the "
                             f"device is {device.type}: use {_FALLBACK_ATTENTION_BACKEND}")
        speculative = SpeculativeConfig.parse(self.speculative_config)
        model = ModelConfig(
            source=source,
            dtype=dtype,
            max_model_len=max_model_len,
            attention_backend=attention_backend,
            quantization=check_experts_dense(arch, resolve_quantization(
                experts_request(self.quantization, source.load_format, arch), source.load_format, source.path,
                device, arch.hf_config)),
            seed=self.seed,
            max_logprobs=self.max_logprobs,
            enforce_eager=self.enforce_eager,
            pooler=PoolerConfig.parse(self.pooler_config, self.runner),
            multimodal=MultiModalConfig.parse(self.limit_mm_per_prompt, self.allowed_local_media_path,
                                              self.allowed_media_domains),
        )
        return EngineConfig(
            model=model,
            device=device,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_dtype=kv_cache_dtype,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens or default_max_num_batched_tokens(
                    device, self.max_num_seqs),
                async_scheduling=self.async_scheduling if self.async_scheduling is not None
                else device.type == "cuda",
                policy=self.scheduling_policy,
            ),
            parallel=parallel,
            structured_outputs=StructuredOutputsConfig(
                compile_timeout_s=self.structured_outputs_compile_timeout,
                max_bytes=self.structured_outputs_max_bytes,
                limits=GrammarLimits.parse(self.structured_outputs_limits),
                reasoning_parser=self.reasoning_parser,
            ),
            speculative=speculative,
            draft=_resolve_draft(speculative, self.load_format, arch, max_model_len, device,
                                 kv_cache_groups(arch.sliding_windows, max_model_len)),
            lora=self._lora_config(dtype, device),
            kv_transfer=_check_kv_offload(self._kv_offload(), arch, max_model_len, model, speculative, parallel),
        )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, names: Collection[str] | None = None) -> None:
        """One `--kebab-case` flag per field (the model is positional), or per field in `names`, help
        from its docs."""
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            if f.name == "model" or (names is not None and f.name not in names):
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = _base_type(hints[f.name])
            text = f.metadata["help"]() if callable(f.metadata["help"]) else f.metadata["help"]
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
            elif typing.get_origin(kind) is list:
                group.add_argument(flag, nargs="+", type=typing.get_args(kind)[0], default=f.default, help=text)
            else:
                group.add_argument(flag, type=kind, default=f.default, help=text)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """The engine flags of a parsed command line, checked (ValueError naming the flag), so that a
        bad one fails before the model loads."""
        names = cls.field_names()
        args = cls(**{k: v for k, v in vars(ns).items() if k in names})
        args.validate()
        return args


def _resolve_parallel(args: EngineArgs, arch: ModelArchConfig, device: torch.device) -> ParallelConfig:
    """Check the split against the model and the machine; fail naming the flag."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    sizes = [("num_attention_heads", arch.num_attention_heads, "")]
    if not all(arch.is_moe_layer(i) for i in range(arch.num_hidden_layers)):
        sizes.append(("intermediate_size", arch.intermediate_size, ""))
    if arch.num_experts:
        sizes.append(("shared_expert_intermediate_size", arch.shared_expert_intermediate_size, ""))
        if not args.enable_expert_parallel:
            sizes.append(("moe_intermediate_size", arch.moe_intermediate_size,
                          f", or place whole experts on the ranks: {_flag('enable_expert_parallel')}"))
        elif arch.num_experts % tp:
            raise ValueError(f"{_flag('tensor_parallel_size')} {tp} must divide the model's {arch.num_experts} "
                             f"experts with {_flag('enable_expert_parallel')}")
    elif args.enable_expert_parallel:
        logger.warning("%s has no effect: %s is not a mixture of experts", _flag("enable_expert_parallel"),
                       arch.architecture)
    for name, size, hint in sizes:
        if size % tp:
            raise ValueError(f"{_flag('tensor_parallel_size')} {tp} must divide the model's {name} ({size}){hint}")
    kv = arch.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(f"{_flag('tensor_parallel_size')} {tp} must divide the model's num_key_value_heads "
                         f"({kv}) or be a multiple of it")
    if pp > arch.num_hidden_layers:
        raise ValueError(f"{_flag('pipeline_parallel_size')} {pp} exceeds the model's {arch.num_hidden_layers} "
                         f"layers")
    world_size, dp = tp * pp, args.data_parallel_size
    if device.type == "cuda":
        available = torch.cuda.device_count() - (device.index or 0)
        if world_size * dp > available:
            raise ValueError(f"--data-parallel-size x --tensor-parallel-size x --pipeline-parallel-size = "
                             f"{dp} x {tp} x {pp} ranks need as many GPUs from {device}, but {available} are "
                             f"available")
    backend = args.distributed_executor_backend or ("uni" if world_size == 1 else "mp")
    cpu_threads, why = resolve_cpu_threads(args.cpu_threads, world_size * dp)
    # Debug, not info: a command that fails on a later flag prints its error alone (the worker says
    # how many threads it took).
    logger.debug("each rank computes with %d CPU thread(s): %s", cpu_threads, why)
    return ParallelConfig(tp, pp, dp, backend, cpu_threads=cpu_threads,
                          step_timeout_s=args.engine_step_timeout or None,
                          step_timeout_per_token_s=STEP_TIMEOUT_PER_TOKEN_S[device.type],
                          enable_expert_parallel=args.enable_expert_parallel and bool(arch.num_experts))


def _resolve_draft(speculative: SpeculativeConfig | None, load_format: str, target: ModelArchConfig,
                   max_model_len: int, device: torch.device,
                   target_kv_groups: tuple[KVCacheGroup, ...]) -> DraftModelConfig | None:
    """Find the draft model and check that it can propose for the target: the same vocabulary (the
    drafts are the target's token ids), positions up to max_model_len, and a target whose blocks
    all stay (the draft keeps its KV in them). With dummy target weights the draft is a dummy too
    (a preset name works), for speed measurements."""
    if speculative is None or speculative.model is None:  # a method without a draft model
        return None
    flag = "speculative_config (--speculative-config) model"
    if len(target_kv_groups) > 1 or target_kv_groups[0].sliding_window is not None:
        raise ValueError(f"{flag}: a draft model keeps its KV cache in the target's blocks, and this model's "
                         f"sliding-window layers give theirs back as sequences grow; speculate with the ngram "
                         f"method instead")
    try:
        source = resolve_model(speculative.model, "dummy" if load_format == "dummy" else "auto")
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    if source.arch.vocab_size != target.vocab_size:
        raise ValueError(f"{flag} {speculative.model!r} has a vocabulary of {source.arch.vocab_size} tokens and the "
                         f"target {target.vocab_size}: a draft model must share the target's tokenizer")
    if source.arch.max_position_embeddings < max_model_len:
        raise ValueError(f"{flag} {speculative.model!r} takes at most {source.arch.max_position_embeddings} "
                         f"positions, fewer than max_model_len ({max_model_len}): lower --max-model-len")
    source.arch.max_model_len = max_model_len
    try:
        quantization = check_experts_dense(source.arch, resolve_quantization(
            speculative.quantization, source.load_format, source.path, device, source.arch.hf_config,
            flag='"quantization"'), flag='"quantization"')
    except ValueError as e:
        raise ValueError(f"{flag} {speculative.model!r}: {e}") from None
    return DraftModelConfig(source, quantization)


def _check_kv_offload(offload: KVOffloadConfig | None, arch: ModelArchConfig, max_model_len: int,
                      model: ModelConfig, speculative: SpeculativeConfig | None,
                      parallel: ParallelConfig) -> KVOffloadConfig | None:
    """Refuse a KV connector where its blocks would not hold a prefix's whole KV."""
    if offload is None:
        return None
    if offload.nixl is not None:
        if parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1:
            raise ValueError(f"{FLAG} {NIXL_CONNECTOR} runs with tensor parallelism only: pipeline_parallel_size "
                             f"(--pipeline-parallel-size) and data_parallel_size (--data-parallel-size) must be 1 "
                             f"(start one engine per data-parallel rank, each with its own side_channel_port)")
        # The scheduler half advertises the ranks that peers pull from.
        offload = dataclasses.replace(offload, nixl=dataclasses.replace(
            offload.nixl, tp_size=parallel.tensor_parallel_size))
    what = "kv_transfer_config (--kv-transfer-config) / kv_offloading_size (--kv-offloading-size)"
    groups = kv_cache_groups(arch.sliding_windows, max_model_len)
    if len(groups) > 1 or groups[0].sliding_window is not None:
        raise ValueError(f"{what}: {arch.architecture} has sliding-window layers, whose blocks follow their own "
                         f"rule; KV connectors take full-attention models only")
    if model.is_pooling:
        raise ValueError(f"{what}: the pooling runner keeps no prefix cache to extend")
    if speculative is not None and speculative.model is not None:
        raise ValueError(f"{what}: a draft model's KV shares the blocks and is not copied; speculate with ngram")
    return offload


def _flag(name: str) -> str:
    """A field as errors name it: the keyword of LLM(...) and the flag of the CLI."""
    return f"{name} (--{name.replace('_', '-')})"


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{_flag(name)} must be a positive integer, got {value!r}")


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{_flag('device')} must be auto, cpu or cuda[:N], got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{_flag('device')} {device!r} was asked for, but CUDA is not available: use cpu or auto")
    if dev.type == "cuda" and dev.index is None:
        # An explicit index, which memory queries and set_device need. Not current_device():
        # that would create a CUDA context in the API process, which never touches the GPU.
        dev = torch.device("cuda", 0)
    return dev


def _default_attention_backend(device: torch.device, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> str:
    if device.type != "cuda":
        cpu = dtype == torch.float32 and kv_cache_dtype == dtype and cpu_ops.available()
        return "cpu" if cpu else "torch"
    return "triton" if triton_available() else "torch"


def _cpu_has_bf16_instructions() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_max_num_batched_tokens(device: torch.device, max_num_seqs: int) -> int:
    """The step's token budget when none is given: 8192 on GPU, 2048 on CPU, at least max_num_seqs."""
    return max(8192 if device.type == "cuda" else 2048, max_num_seqs)


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """The torch dtype `dtype` (a name, an alias or "auto") stands for on `device`."""
    if dtype != "auto":
        return _DTYPES[_DTYPE_ALIASES.get(dtype, dtype)]
    if device.type == "cpu":
        # bfloat16 matmuls are ~4x faster than float32 where the CPU has bf16 dot-product
        # instructions, and several times slower where it has not.
        return torch.bfloat16 if _cpu_has_bf16_instructions() else torch.float32
    if checkpoint_dtype in ("float16", "bfloat16"):
        return _DTYPES[checkpoint_dtype]
    return torch.bfloat16


def _has_kv_scales(hf_config: dict) -> bool:
    """Whether a checkpoint's quantization_config declares calibrated KV-cache scales."""
    qc = hf_config.get("quantization_config")
    return isinstance(qc, dict) and isinstance(qc.get("kv_cache_scheme"), dict)


def _base_type(hint) -> type:
    """int | None -> int."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
