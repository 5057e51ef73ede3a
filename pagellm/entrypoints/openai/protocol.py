"""Request and response bodies of the OpenAI-compatible API, with vLLM's extra request fields.

Every field OpenAI's spec defines is accepted, `null` wherever the spec allows it (it means the
default); fields that change nothing on this server (`store`, `metadata`, `service_tier`, ...) are
accepted and ignored as OpenAI documents them, and vLLM's extras are accepted too. Sampling fields
go to `SamplingParams` under the same names. A request gets a 400 naming the field, in this
order: a known field set to a value the server has no implementation for (`unsupported_fields`:
suffix, beam search, ...), then an unknown field, so a client that sends both
hears about the one that matters. Everything a request can hold that would fail deeper down (NaN
or infinite numbers, integers beyond 64 bits, text that is not valid Unicode, roles and content
parts no chat template knows) is refused here, naming the field.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol_base import REQUEST_ID_PATTERN, STRICT_TYPES, Int64, StrictModel
from pagellm.entrypoints.openai.protocol_tools import (
    MessageToolCall,
    ResponseFormat,
    StructuredOutputsRequest,
    Tool,
    ToolCall,
    ToolChoice,
    validate_tool_choice,
)
from pagellm.outputs import Logprob
from pagellm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class StreamOptions(StrictModel):
    include_usage: bool = False
    """Send a last chunk with `choices: []` and the request's usage before `[DONE]`."""
    continuous_usage_stats: bool = False
    """vLLM's extra: every chunk also carries the usage so far."""
    include_obfuscation: bool = True
    """OpenAI pads chunks against side channels; accepted and ignored (no padding is sent)."""


# Request fields with the same name and meaning as a SamplingParams field.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                    "include_stop_str_in_output", "ignore_eos", "min_tokens", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words", "allowed_token_ids",
                    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    url: str
    """data:image/...;base64,..., http(s)://... or file://... (under --allowed-local-media-path)."""
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted and ignored: the model's processor decides the resolution."""


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One message; the fields it was sent with reach the chat template (content parts as
    `chat_images.split_images` arranges them)."""

    model_config = ConfigDict(**STRICT_TYPES, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    """Text, or a list of text and image_url parts (text parts joined by newlines); other part types
    (audio, files) are refused. None only in an assistant message that calls tools."""
    tool_calls: list[MessageToolCall] | None = None
    """An assistant message's tool calls; their JSON arguments reach the template as objects."""
    tool_call_id: str | None = None
    """A tool message's answer to this call."""

    @model_validator(mode="before")
    @classmethod
    def _text_content(cls, data: Any) -> Any:
        # One clear error instead of pydantic's attempt at each branch of the content union.
        content = data.get("content") if isinstance(data, dict) else None
        calls_tools = isinstance(data, dict) and data.get("role") == "assistant" and data.get("tool_calls")
        if isinstance(data, dict) and not isinstance(content, (str, list)) and not (content is None and calls_tools):
            kind = "nothing" if content is None else type(content).__name__
            raise PydanticCustomError("invalid_content", "must be a string or a list of text parts like {part}, "
                                      "got {kind}", {"param": "content", "kind": kind,
                                                     "part": '{"type": "text", "text": "..."}'})
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in ("text", "image_url"):
                raise PydanticCustomError("unsupported_content", "only text and image_url content parts are "
                                          "supported by this server, got {kind}",
                                          {"param": f"content.{i}", "kind": repr(kind)})
        return data

    def for_template(self) -> dict[str, Any]:
        # Only the fields sent: templates test for the presence of keys like `tool_calls`.
        message = {"content": None, **self.model_dump(exclude_unset=True)}
        for call in message.get("tool_calls") or ():
            # Templates write the arguments with `tojson`, as transformers' callers pass them.
            call["function"]["arguments"] = _json_or_text(call["function"]["arguments"])
        return message


def _json_or_text(arguments: str | dict[str, Any]) -> Any:
    """A call's arguments as an object when they are JSON text, else as they are."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class ChatPromptFields(StrictModel):
    """How a conversation becomes a prompt (chat completions and /tokenize)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Leave the last message open so the model continues it (needs add_generation_prompt=false)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. {"enable_thinking": false})."""
    tools: list[Tool] | None = None
    """Functions the model may call; the chat template gets them as `tools`."""
    add_special_tokens: bool = False
    """vLLM's extra: let the tokenizer add special tokens (BOS) to the rendered template, which
    already holds the ones the model expects."""


class GenerationRequest(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Unknown fields are let through parsing and refused by `_supported_then_known`, after the
    # unsupported ones, so that the 400 names the field that matters; the schema still says so.
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    model: str | None = None
    """A served model name; None: the first one."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = Field(default=None, ge=0)
    """Not negative: the sampler keys its draws by the seed modulo 2**63, so a negative seed would only
    repeat the stream of seed + 2**63, and -1, which means "random" to some servers, would silently
    give the same output every time; omit the seed for unseeded sampling."""
    stop: list[str] | None = None
    user: str | None = None
    """An end-user id for the caller's own bookkeeping; it does not change generation."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extras.
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    allowed_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Int64 | None = None
    """Keep only the last this-many prompt tokens."""
    prompt_logprobs: Int64 | None = Field(default=None, ge=0)
    """Top logprobs per prompt token, returned as `prompt_logprobs` (not with stream)."""
    request_id: str | None = Field(default=None, pattern=REQUEST_ID_PATTERN)
    """Used in the response id and as the engine's request id; default: the X-Request-Id."""
    cache_salt: str | None = Field(default=None, min_length=1)
    """The prompt's prefix-cache blocks are shared only with requests that send the same salt (so one
    tenant cannot time another's cached prompts)."""
    return_tokens_as_token_ids: bool = False
    """Name tokens in logprobs as `token_id:{id}` instead of their text (for tokens that are not whole characters)."""
    return_token_ids: bool = False
    """Also return the prompt's (`prompt_token_ids`) and each choice's (`token_ids`) token ids."""
    priority: Int64 = 0
    """Scheduling priority (vLLM's extra): lower runs first; other than 0 only on a server started with
    --scheduling-policy priority."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's extra for disaggregated prefill/decode (docs/disaggregated.md): {"do_remote_decode": true}
    to a prefill engine, whose response carries the parameters to pass to a decode engine."""
    use_beam_search: bool = False
    response_format: ResponseFormat | None = None
    """{"type": "text"} (the default), {"type": "json_object"}, or {"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}}}: the output is then a JSON object (following the schema)."""
    structured_outputs: StructuredOutputsRequest | None = None
    """vLLM's extra: constrain the output to a JSON schema, regex, choice list or grammar."""
    # vLLM's older names for structured_outputs' kinds.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)
    guided_decoding_backend: str | None = None
    """Only xgrammar (or auto), the one backend here."""
    guided_whitespace_pattern: str | None = None
    """Not supported (xgrammar has none); refused when set."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value] if value else None
        return value or None

    @model_validator(mode="after")
    def _supported_then_known(self) -> "GenerationRequest":
        for name, why in self.unsupported_fields():
            raise PydanticCustomError("unsupported", "`{name}` {why}; remove it from the request",
                                      {"param": name, "name": name, "why": why})
        for name in self.model_extra or ():
            raise PydanticCustomError("extra_forbidden", "Extra inputs are not permitted", {"param": name})
        return self

    def unsupported_fields(self) -> Iterator[tuple[str, str]]:
        """(field, why) for each field set to something this server cannot do (yet)."""
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            yield "guided_decoding_backend", "names a backend this server does not have; its only one is xgrammar"
        for name, pattern in (("guided_whitespace_pattern", self.guided_whitespace_pattern),
                              ("structured_outputs.whitespace_pattern",
                               self.structured_outputs and self.structured_outputs.whitespace_pattern)):
            if pattern is not None:
                yield name, ("is not supported (xgrammar has no whitespace pattern); set "
                             "structured_outputs.disable_any_whitespace for JSON without optional whitespace")
        if self.use_beam_search:
            yield "use_beam_search", "is not supported by the HTTP server (beam search is offline: LLM.beam_search)"
        if self.kv_transfer_params is not None and self.n != 1:
            yield "kv_transfer_params", "takes one sequence per request (n = 1)"

    def logprob_fields(self) -> dict[str, int | None]:
        """Request field -> top logprobs per token it asks for (None: not asked), for the
        server's max_logprobs check."""
        return {"prompt_logprobs": self.prompt_logprobs}

    def sampling_extras(self) -> dict[str, Any]:
        """SamplingParams fields whose request fields differ between the endpoints."""
        return {}

    def to_sampling_params(self, max_tokens: int | None,
                           structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for this request (400 for an invalid value), with the output constraint
        worked out from the request's fields (constraints.py).

        A stream gets DELTA outputs, so each chunk carries only its own text and logprobs."""
        if self.stream and self.prompt_logprobs is not None:
            raise APIError("prompt_logprobs is not available with stream=true", param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")
        kwargs = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.CUMULATIVE
        try:
            extra_args = None if self.kv_transfer_params is None else {"kv_transfer_params": self.kv_transfer_params}
            return SamplingParams(max_tokens=max_tokens, output_kind=kind, structured_outputs=structured_outputs,
                                  extra_args=extra_args, **kwargs, **self.sampling_extras())
        except ValueError as e:
            raise APIError(str(e), param=self._field_named_in(str(e))) from None

    def _field_named_in(self, message: str) -> str | None:
        """The request field a SamplingParams error message starts with ("n must be ...")."""
        first = message.split(" ", 1)[0]
        return first if first in type(self).model_fields else None

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def final_usage(self) -> bool:
        """Whether a stream ends with a usage-only chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    """Text or token ids, or a list of several prompts (each gets `n` choices, indexed prompt by prompt)."""
    max_tokens: Int64 | None = Field(default=16, ge=0)
    """0 only with echo: the prompt's logprobs, nothing generated (the scoring idiom)."""
    echo: bool = False
    """Put the prompt in front of the generated text."""
    logprobs: Int64 | None = Field(default=None, ge=0)
    """Top logprobs per generated token (with echo, per prompt token too)."""
    best_of: Int64 | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    """vLLM's extra: let the tokenizer add its special tokens (BOS) to a text prompt."""

    def unsupported_fields(self) -> Iterator[tuple[str, str]]:
        yield from super().unsupported_fields()
        if self.suffix:
            yield "suffix", "is not supported by this server yet"

    def logprob_fields(self) -> dict[str, int | None]:
        return {**super().logprob_fields(), "logprobs": self.logprobs}

    def sampling_extras(self) -> dict[str, Any]:
        # An echoed prompt's logprobs come from prompt_logprobs, as in OpenAI's legacy API.
        echoed = self.logprobs if self.echo and self.prompt_logprobs is None else self.prompt_logprobs
        return {"logprobs": self.logprobs, "prompt_logprobs": echoed, "best_of": self.best_of}


class ChatCompletionRequest(GenerationRequest, ChatPromptFields):
    model_config = GenerationRequest.model_config

    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    """Preferred over max_tokens; None for both: up to the context length."""
    logprobs: bool = False
    """Return each generated token's logprob."""
    top_logprobs: Int64 | None = Field(default=None, ge=0)
    """With logprobs: also this many most likely tokens per position."""
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    """Whether the model may call several tools in one turn (with tool_choice required: at most one
    call when false)."""
    functions: list[dict[str, Any]] | None = None
    """OpenAI's deprecated form of tools: refused, naming tools."""
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None
    # Accepted and ignored, as OpenAI documents them: they change nothing on this server.
    store: bool = False
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None
    """Predicted Outputs only make OpenAI faster; the output is the same without them."""

    _tool_choice = field_validator("tool_choice", mode="before")(validate_tool_choice)

    def unsupported_fields(self) -> Iterator[tuple[str, str]]:
        yield from super().unsupported_fields()
        for name in ("functions", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                yield name, ("is OpenAI's deprecated form of tool calling and not supported; send `tools` "
                             '(each function as {"type": "function", "function": {...}}) and `tool_choice`')
        if self.audio is not None or (self.modalities and set(self.modalities) != {"text"}):
            yield "audio" if self.audio is not None else "modalities", "is not supported: this server outputs text"
        if self.web_search_options is not None:
            yield "web_search_options", "is not supported: this server has no web search"

    def max_tokens_field(self) -> tuple[int | None, str]:
        """The generation limit and the field that set it (max_completion_tokens over max_tokens)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def logprob_fields(self) -> dict[str, int | None]:
        return {**super().logprob_fields(), "top_logprobs": self.top_logprobs}

    def sampling_extras(self) -> dict[str, Any]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None,
                "prompt_logprobs": self.prompt_logprobs}


class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(ChatPromptFields):
    model: str | None = None


def _tokenize_kind(body: Any) -> str | None:
    if not isinstance(body, dict) or ("messages" in body) == ("prompt" in body):
        return None
    return "chat" if "messages" in body else "completion"


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("completion")] | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_tokenize_kind, custom_error_type="prompt_or_messages",
                  custom_error_message="send an object with either `prompt` (text) or `messages` (a chat)"),
]
"""A body with `messages` is a chat request, one with `prompt` a completion request; errors inside
one name it first (`chat.messages.0.role`)."""


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Int64]


# -- responses ---------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


PromptLogprobs = list[dict[int, Logprob] | None]
"""vLLM's extra: per prompt token its logprob and the top ones, by token id; None for the first."""


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: parallel lists, one entry per token."""

    text_offset: list[int]
    """Where each token starts in the choice's text (counting the echoed prompt)."""
    token_logprobs: list[float | None]
    """None for the first prompt token, which nothing predicts."""
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """vLLM's extra: the stop token id or string that ended generation; None for EOS or length."""
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    """With return_token_ids: the prompt's token ids (in a stream: in the choice's first chunk)."""
    token_ids: list[int] | None = None
    """With return_token_ids: the choice's generated token ids (in a stream: this chunk's)."""


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill engine's answer to `do_remote_decode`: what a decode engine needs to pull the KV."""


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """None when the message only calls tools."""
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    """With --reasoning-parser: the model's reasoning, apart from its answer."""
    reasoning: str | None = None
    """The same as reasoning_content: vLLM's newer name for it."""

    @model_serializer(mode="wrap")
    def _without_unused_extras(self, handler: Any) -> dict[str, Any]:
        # As OpenAI and vLLM: no `tool_calls` key without calls, no reasoning keys without a parser.
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k in ("role", "content")}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    """The token's UTF-8 bytes."""


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]
    """The most likely tokens at this position, most likely first."""


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """With return_token_ids: the choice's generated token ids (in a stream: this chunk's)."""


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, Any]
    """{"role": "assistant", "content": ""} first, then {"content": text added} (or `reasoning_content`,
    `tool_calls` fragments); {} at the end."""
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """With return_token_ids: the choice's generated token ids (in a stream: this chunk's)."""


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    """With return_token_ids: the prompt's token ids (in a stream: in the first chunk)."""
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill engine's answer to `do_remote_decode`: what a decode engine needs to pull the KV."""


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """With return_token_ids: the prompt's token ids (in a stream: in the first chunk)."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagellm"
    root: str
    """The base model's first served name (its path on the server is not shown); a LoRA adapter's
    folder, as it was given."""
    parent: str | None = None
    """A LoRA adapter's base model (its served name); None for the base model."""
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(StrictModel):
    """POST /v1/load_lora_adapter (with --allow-runtime-lora-updating), as vLLM's."""

    lora_name: str
    """The name requests will pass as `model`."""
    lora_path: str
    """The adapter's folder (PEFT's format) on the server's machine."""


class UnloadLoRAAdapterRequest(StrictModel):
    """POST /v1/unload_lora_adapter (with --allow-runtime-lora-updating), as vLLM's."""

    lora_name: str


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """vLLM's GET /tokenizer_info: what a client needs to tokenize as the server does (lm-eval's
    remote tokenizer reads it, then calls /tokenize and /detokenize)."""

    tokenizer_class: str = "PreTrainedTokenizerFast"
    """The `transformers` class that would load this tokenizer (a `tokenizers` JSON tokenizer)."""
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    chat_template: str | None
    """The template chat requests are rendered with (--chat-template, else the model's own)."""
    model_max_length: int
    vocab_size: int
