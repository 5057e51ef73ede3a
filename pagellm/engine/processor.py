"""Input processing: prompt -> token ids, validation, and the request's record (`EngineCoreRequest`)."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Union

from pagellm.config import EngineConfig
from pagellm.core.multimodal import MultiModalItem
from pagellm.core.request import EngineCoreRequest, check_prompt_fits
from pagellm.engine.multimodal import TEXT_ONLY, ImageProcessor, takes_images
from pagellm.lora_request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.structured_output import GrammarError
from pagellm.structured_output.source import GrammarChecker
from pagellm.tokenizer import Tokenizer

PromptType = Union[str, Mapping]
"""A text prompt, {"prompt": text}, or {"prompt_token_ids": [...]} (as vLLM's TextPrompt / TokensPrompt);
a dict may carry "cache_salt": a non-empty string that keeps its prefix-cache blocks apart from those of
requests with another salt or none, and {"prompt": text, "multi_modal_data": {"image": PIL image or list}}
gives a model that takes images (LLaVA) the images of the text's image tokens. A prompt whose images were
already prepared by `InputProcessor.images.process` (the server does it off its event loop) gives them as
"multi_modal_items" beside the "prompt_token_ids" it returned."""

_POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
"""The inert sampling params a pooling request carries (it samples nothing)."""


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.generation_config = config.model.source.generation_config
        self.vocab_size = config.model.source.arch.vocab_size
        self.eos_token_ids = frozenset(_eos_ids(config, tokenizer))
        self.grammar_checker = GrammarChecker(config.structured_outputs)
        arch = config.model.source.arch
        self.images = ImageProcessor(config.model.source.path, arch) if takes_images(arch) else None
        """Prepares the images of prompts that carry some (None: the model takes text only)."""

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text if any, prompt token ids)."""
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            text, token_ids = prompt["prompt"], None
        else:
            raise ValueError(
                f"prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': list[int]}}, "
                f"got {type(prompt).__name__}")
        if token_ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (dummy weights): pass prompt_token_ids instead of text")
            token_ids = self.tokenizer.encode(text)
        return text, token_ids

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                priority: int = 0) -> tuple[EngineCoreRequest, str | None]:
        """The request's record and its prompt text (if any). SamplingParams make a generation
        request (generate runner), PoolingParams an embedding request (pooling runner); the other
        combinations are refused. `arrival_time`: time.monotonic() when it arrived (None: now).
        `lora_request`: the adapter it runs with (an engine with enable_lora). `priority`: its
        scheduling priority (lower first), other than 0 only with scheduling_policy priority."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if arrival_time is None:
            arrival_time = time.monotonic()
        self._check_lora(lora_request)
        self._check_priority(priority)
        cache_salt = _cache_salt(prompt)
        if self.config.is_pooling:
            if isinstance(params, SamplingParams):
                raise ValueError("this engine runs the pooling runner (runner='pooling', --runner pooling): it "
                                 "computes embeddings (LLM.embed, POST /v1/embeddings) and cannot generate; start "
                                 "it with runner='generate' (--runner generate, the default) to generate text")
            if not isinstance(params, PoolingParams):
                raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
            return self._process_pooling(request_id, prompt, params, arrival_time, cache_salt, lora_request,
                                         priority)
        if isinstance(params, PoolingParams):
            raise ValueError("embeddings need the pooling runner: start the engine with runner='pooling' "
                             "(--runner pooling); this one runs the generate runner")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids, multi_modal = self._tokenize_with_media(prompt)
        if params.truncate_prompt_tokens is not None:
            if multi_modal:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images (it would cut "
                                 "their placeholder tokens); leave it out")
            token_ids = token_ids[-params.truncate_prompt_tokens:]  # the end of a prompt matters most
        self._validate_prompt(token_ids)
        check_prompt_fits(len(token_ids), self.config.model.max_model_len)
        params = params.apply_model_defaults(self.generation_config)
        self._validate_token_features(params)
        self.check_structured_outputs(params)
        params._bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        # Generation also stops at max_model_len.
        room = self.config.model.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        record = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            lora_request=lora_request,
            priority=priority,
            multi_modal=multi_modal,
        )
        return record, text

    def _tokenize_with_media(self, prompt: PromptType) -> tuple[str | None, list[int], tuple[MultiModalItem, ...]]:
        """`tokenize`, and for a prompt with "multi_modal_data", the model's processor's token ids
        (each image token expanded) and the images."""
        media = prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else None
        prepared = prompt.get("multi_modal_items") if isinstance(prompt, Mapping) else None
        if prepared is not None:
            return self._prepared(prompt, prepared)
        if media is None:
            text, token_ids = self.tokenize(prompt)
            if self.images is not None and self.images.image_token_id in token_ids:
                # Its embedding is no image's features: the model would read a hole where one should be.
                raise ValueError(f"the prompt holds the image token (id {self.images.image_token_id}) but no image: "
                                 "give the images in multi_modal_data, one per image token")
            return text, token_ids, ()
        arch = self.config.model.source.arch.architecture
        if self.images is None:
            raise ValueError(f"multi_modal_data: {TEXT_ONLY} ({arch})")
        if not isinstance(media, Mapping):
            raise ValueError(f"multi_modal_data must be a dict such as {{'image': image}}, got {type(media).__name__}")
        if "prompt_token_ids" in prompt or not isinstance(prompt.get("prompt"), str):
            raise ValueError("a prompt with multi_modal_data must give its text as 'prompt' (with one image token "
                             "per image), not prompt_token_ids")
        images = media.get("image")
        self.config.model.multimodal.check_count("image", len(images) if isinstance(images, (list, tuple)) else 1)
        token_ids, items = self.images.process(prompt["prompt"], media)
        return prompt["prompt"], token_ids, items

    def _prepared(self, prompt: Mapping, items: object) -> tuple[str | None, list[int], tuple[MultiModalItem, ...]]:
        """A prompt's "prompt_token_ids" and "multi_modal_items" as `images.process` made them."""
        text, token_ids = self.tokenize(prompt)
        if self.images is None or not isinstance(items, tuple) or \
                not all(isinstance(item, MultiModalItem) for item in items):
            raise ValueError("multi_modal_items must be the items InputProcessor.images.process made for this model")
        self.config.model.multimodal.check_count("image", len(items))
        if any(item.end > len(token_ids) or token_ids[item.offset] != self.images.image_token_id for item in items):
            raise ValueError("multi_modal_items do not sit on the image tokens of prompt_token_ids")
        return text, token_ids, items

    def _process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams, arrival_time: float,
                         cache_salt: str | None, lora_request: LoRARequest | None,
                         priority: int) -> tuple[EngineCoreRequest, str | None]:
        if isinstance(prompt, Mapping) and "multi_modal_data" in prompt:
            raise ValueError("multi_modal_data: the pooling runner (embeddings) takes text only")
        text, token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        self._validate_prompt(token_ids)
        check_prompt_fits(len(token_ids), self.config.model.max_model_len)
        hidden_size = self.config.model.source.arch.hidden_size
        if params.dimensions is not None and params.dimensions != hidden_size:
            raise ValueError(f"dimensions must be the model's hidden size ({hidden_size}) or left out: this model "
                             f"was not trained for shorter (Matryoshka) embeddings, got {params.dimensions}")
        if params.normalize is None:
            params = dataclasses.replace(params, normalize=self.config.model.pooler.normalize)
        record = EngineCoreRequest(request_id=request_id, prompt_token_ids=token_ids,
                                   sampling_params=_POOLING_SAMPLING_PARAMS, eos_token_ids=frozenset(), max_tokens=0,
                                   arrival_time=arrival_time, pooling_params=params, cache_salt=cache_salt,
                                   lora_request=lora_request, priority=priority)
        return record, text

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.config.lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: this engine serves no adapters; start it "
                             "with enable_lora=True (--enable-lora)")

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise ValueError(f"priority {priority}: this engine schedules first come, first served; start it with "
                             "scheduling_policy='priority' (--scheduling-policy priority) to schedule by priority")

    def _validate_token_features(self, params: SamplingParams) -> None:
        """Limits that depend on the model and the engine, which SamplingParams cannot know."""
        limit = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name} must be at most {limit} (the engine's max_logprobs), got {value}")
        for name, ids in (("allowed_token_ids", params.allowed_token_ids or ()),
                          ("logit_bias", params.logit_bias or {})):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """A GrammarError if the request's structured-output spec is too large, too complex or does not
        parse (cached per spec; the first check imports xgrammar, so the server runs it off its event
        loop)."""
        if params.structured_outputs is None:
            return
        if self.tokenizer is None:
            raise GrammarError(params.structured_outputs.kind,
                               "needs the model's tokenizer, and this model has none (dummy weights)")
        self.grammar_checker.check(params.structured_outputs)

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each word as token ids twice, without and with a leading space (mid-sentence spelling),
        the second only where it is a different sequence of the same length, as vLLM does."""
        if not bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer, and this model has none (dummy weights)")
        sequences: list[list[int]] = []
        for word in bad_words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        return sequences

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids hold ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")


def _cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's "cache_salt" (None when absent), which must be a non-empty string."""
    salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


def _eos_ids(config: EngineConfig, tokenizer: Tokenizer | None) -> set[int]:
    ids = set(config.model.source.arch.eos_token_ids)
    eos = config.model.source.generation_config.get("eos_token_id")
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
