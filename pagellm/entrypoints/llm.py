"""The offline API, as vLLM's `LLM`: generate() and chat() over a batch, with a progress bar."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.processor import PromptType
from pagellm.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagellm.entrypoints.chat_images import check_images, image_token_text, prepare, split_images
from pagellm.entrypoints.media import MediaLimits, load
from pagellm.lora_request import LoRARequest
from pagellm.outputs import EmbeddingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.tokenizer import Tokenizer

Conversation = list[dict[str, Any]]


class LLM:
    """Generate text from prompts with one in-process engine.

    Takes the engine arguments of `EngineArgs` as keywords (`dtype`, `max_model_len`,
    `max_num_seqs`, `max_num_batched_tokens`, `block_size`, `gpu_memory_utilization`,
    `enable_prefix_caching`, `seed`, `load_format`, ...). With no model, the embedded
    SmolLM2-135M-Instruct is used.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        if kwargs.get("data_parallel_size", 1) != 1:
            raise ValueError("data_parallel_size (--data-parallel-size) is for pagellm serve, which runs one engine "
                             "core per replica; offline, run one LLM per replica (each on its own devices)")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | Sequence[int],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A list of ints is one tokenized prompt; a prompt dict
        may carry "cache_salt" (see `PromptType`). `lora_request`: the adapter of every prompt, or
        one per prompt (None: the base model); needs `LLM(..., enable_lora=True)`. `priority`: one
        per prompt, lower runs first (None: all 0); needs `LLM(..., scheduling_policy="priority")`
        for values other than 0."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm, lora_request, priority)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType] | Sequence[int],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in the order of `prompts` (needs `LLM(..., runner="pooling")`):
        `.outputs.embedding` is the pooled final hidden state (pooler_config), as vLLM's `LLM.embed`.
        `truncate_prompt_tokens` applies to every prompt whose params leave it unset."""
        if not self.llm_engine.config.is_pooling:
            raise ValueError("embed() needs the pooling runner: create the LLM with runner='pooling'")
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"pooling_params has {len(params_list)} entries but there are "
                                 f"{len(prompt_list)} prompts")
        if truncate_prompt_tokens is not None:
            params_list = [p if not isinstance(p, PoolingParams) or p.truncate_prompt_tokens is not None
                           else dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                           for p in params_list]
        return self._run(prompt_list, params_list, use_tqdm, lora_request)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate. A message's
        content may hold OpenAI's image_url parts for a model that takes images (data:, http(s):// and,
        under allowed_local_media_path, file:// URLs; docs/serving.md#images), loaded in this thread.
        `cache_salt` (not in vLLM's `LLM.chat`, whose prompts cannot carry one): every conversation's
        prefix-cache blocks are shared only with requests of the same salt, as a prompt dict's
        "cache_salt" does in `generate`. `lora_request` and
        `priority` (one per conversation) as in `generate`."""
        conversations = [messages] if _is_conversation(messages) else list(messages)
        tokenizer = self.get_tokenizer()
        images = self.llm_engine.processor.images
        config = self.llm_engine.config.model.multimodal
        token_prompts = []
        for conv in conversations:
            content = split_images(conv, chat_template or tokenizer.chat_template, image_token_text(images, tokenizer))
            check_images(content, images, config)
            text = tokenizer.apply_chat_template(content.messages, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template, **(chat_template_kwargs or {}))
            if content.image_urls:
                limits = MediaLimits.from_env(config)
                pictures = [load(url, limits, where) for url, where in content.image_urls]
                token_ids, items = prepare(images, tokenizer, text, pictures)
                token_prompts.append({"prompt": text, "prompt_token_ids": token_ids, "multi_modal_items": items,
                                      "cache_salt": cache_salt})
            else:
                # The template already carries any BOS token: don't let the tokenizer add a second one.
                token_ids = tokenizer.encode(text, add_special_tokens=False)
                token_prompts.append({"prompt": text, "prompt_token_ids": token_ids, "cache_salt": cache_salt})
        return self.generate(token_prompts, sampling_params, use_tqdm, lora_request, priority)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search per prompt (as vLLM's `LLM.beam_search`); outputs in the order of `prompts`."""
        engine = self.llm_engine
        token_prompts = [engine.processor.tokenize(p)[1] for p in _as_prompt_list(prompts)]
        return beam_search(engine, token_prompts, params, engine.processor.eos_token_ids)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams] | list[PoolingParams], use_tqdm: bool,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None, priority: Sequence[int] | None = None,
             ) -> list[RequestOutput] | list[EmbeddingRequestOutput]:
        engine = self.llm_engine
        loras = _as_lora_list(lora_request, len(prompts))
        priorities = _as_priority_list(priority, len(prompts))
        for lora in {lora for lora in loras if isinstance(lora, LoRARequest)}:
            engine.check_lora(lora)
        ids = []
        try:
            for prompt, sp, lora, prio in zip(prompts, params, loras, priorities):
                request_id = engine.next_request_id()
                engine.add_request(request_id, prompt, _final_only(sp), lora_request=lora, priority=prio)
                ids.append(request_id)
        except ValueError:
            engine.abort_request(ids)  # a bad prompt in the batch must not leave the rest queued
            raise
        finished: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            # Until its own requests end: a prefill engine keeps stepping past them for blocks a peer pulls.
            while len(finished) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]


def _final_only(params: Any) -> Any:
    """Only final outputs are returned: don't build the ones in between (anything else is left for
    the engine to reject by name)."""
    if isinstance(params, SamplingParams):
        return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    return params


def _is_conversation(messages: Any) -> bool:
    return isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [{"prompt_token_ids": list(prompts)}]
    if isinstance(prompts, Sequence):
        return [{"prompt_token_ids": list(p)} if isinstance(p, Sequence) and not isinstance(p, str) else p
                for p in prompts]
    raise ValueError("prompts must be a string, a prompt dict, token ids, or a list of these, "
                     f"got {type(prompts).__name__}")


def _as_lora_list(lora_request: Any, n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, Sequence):
        raise ValueError(f"lora_request must be a LoRARequest, None, or one of these per prompt, "
                         f"got {type(lora_request).__name__}")
    if len(lora_request) != n:
        raise ValueError(f"lora_request has {len(lora_request)} entries but there are {n} prompts")
    return list(lora_request)


def _as_priority_list(priority: Any, n: int) -> list[int]:
    if priority is None:
        return [0] * n
    if not isinstance(priority, Sequence) or isinstance(priority, str):
        raise ValueError(f"priority must be a list of integers, one per prompt, got {type(priority).__name__}")
    if len(priority) != n:
        raise ValueError(f"priority has {len(priority)} entries but there are {n} prompts")
    return list(priority)


def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries but there are {n} prompts")
    return params
