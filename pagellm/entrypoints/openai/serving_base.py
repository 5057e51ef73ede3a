"""What every endpoint shares: model names, prompts as token ids, limits and length checks, running a request."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from pagellm.core.multimodal import MultiModalItem
from pagellm.core.request import check_prompt_fits
from pagellm.engine.async_llm import AsyncLLM, EngineDeadError
from pagellm.entrypoints.chat_images import ChatContent, check_images, image_token_text, prepare, split_images
from pagellm.entrypoints.media import MediaLimits, load_async
from pagellm.entrypoints.openai.admission import Work, ticket_of
from pagellm.entrypoints.openai.chat_output import ChatOutput
from pagellm.entrypoints.openai.constraints import OutputConstraint, one_constraint, request_constraints
from pagellm.entrypoints.openai.errors import CLIENT_CLOSED_REQUEST, APIError, request_id_of, sse_error
from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.entrypoints.openai.prompt_encoding import encode_texts
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatPromptFields,
    GenerationRequest,
    PromptTokensDetails,
    UsageInfo,
)
from pagellm.entrypoints.openai.served_models import ServedModel, ServedModels, UnknownModelError
from pagellm.entrypoints.openai.serving_tools import plan_tools
from pagellm.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from pagellm.lora_request import LoRARequest
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.reasoning.parsers import ReasoningParser
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output import GrammarError
from pagellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MEDIA_THREADS = 2
"""Images read and decoded at once, off the event loop; more wait their turn. Bounds the CPU they
take from the engine."""
_media_pool = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="pagellm-media")
_prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="pagellm-mm-prepare")
"""The model's Hugging Face processor runs on one thread: its fast tokenizer's settings are mutated
per call, which two threads at once can break ("Already borrowed")."""

T = TypeVar("T")
Started = tuple[RequestOutput, AsyncGenerator[RequestOutput, None]]
"""A submitted request: its first output and the stream of the rest."""

# Names the template renderer itself binds, or render_chat passes from the request's own fields; a
# chat_template_kwargs key among them would clash.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "add_generation_prompt", "chat_template",
                                       "source", "special_tokens", "tools"})
_VALUE_ERRORS = (TypeError, LookupError, AttributeError, ArithmeticError)
"""What a chat template raises on a request's value it cannot use (of a type it does not expect, or a
number past the sandbox's `range` bound or zero in a division): the request's fault, a 400."""


@dataclass
class ChatRun:
    """A conversation submitted to the engine (by `OpenAIServing.start_chat`)."""

    model: str
    """The model name to report."""
    started: Started
    output: ChatOutput
    """How each choice's text becomes the assistant message (reasoning, tool calls)."""

    @property
    def first(self) -> RequestOutput:
        return self.started[0]


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, models: ServedModels, chat_template: str | None = None,
                 limits: ServerLimits | None = None, auto_tool_parser: str | None = None) -> None:
        self.engine = engine
        self.models = models
        self.chat_template = chat_template
        """Replaces the model's own template when set (`--chat-template`)."""
        self.limits = limits or ServerLimits()
        self.media_limits = MediaLimits.from_env(engine.config.model.multimodal)
        """Where chat image URLs may point, and how long and large their images may be."""
        self.metrics = next((m for m in engine.stat_loggers if isinstance(m, PrometheusStatLogger)), None)
        """The server's Prometheus metrics (images prepared), if the engine keeps them."""
        self.auto_tool_parser: ToolParser | None = get_tool_parser(auto_tool_parser)() if auto_tool_parser else None
        """Reads tool calls out of the text for tool_choice auto (--enable-auto-tool-choice --tool-call-parser)."""
        reasoning = engine.config.structured_outputs.reasoning_parser
        self.reasoning_parser = ReasoningParser.named(reasoning) if reasoning else None
        """Separates a chat answer's reasoning (--reasoning-parser)."""

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model.max_model_len

    def check_model(self, model: str | None) -> ServedModel:
        """What a request's `model` names (None: the first served name): a base model name or a LoRA
        adapter's; 404 if neither."""
        try:
            return self.models.resolve(model)
        except UnknownModelError as e:
            raise APIError(str(e), 404, param="model") from None

    def tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise APIError("this model has no tokenizer (dummy weights): send the prompt as token ids")
        return self.engine.tokenizer

    async def token_ids_of(self, prompts: Sequence[str | list[int]], add_special_tokens: bool, param: str,
                           truncating: bool = False) -> list[list[int]]:
        """Each of a request's prompts (the field `param`) as token ids: texts tokenized off the event
        loop, after a text that cannot fit max_model_len is refused by its length (unless the request
        is `truncating` its prompts: prompt_encoding.py); token-id lists as they are."""
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await encode_texts(self.tokenizer(), texts, add_special_tokens, self.max_model_len, param,
                                          truncating) if texts else ())
        return [next(encoded) if isinstance(p, str) else p for p in prompts]

    async def render_chat(self, request: ChatPromptFields, truncating: bool = False,
                          content: ChatContent | None = None) -> tuple[str, list[int]]:
        """The conversation's prompt text (`chat_text`) and its token ids (`token_ids_of`), as `LLM.chat`
        builds them, for a conversation without images."""
        content = content or self.chat_content(request)
        if content.image_urls:
            raise APIError(f"{content.image_urls[0][1]}: image parts are taken by chat completions only",
                           param="messages")
        text = self.chat_text(request, content)
        # The template already carries any BOS token: by default, don't let the tokenizer add a second one.
        [token_ids] = await self.token_ids_of([text], request.add_special_tokens, "messages", truncating)
        return text, token_ids

    def chat_content(self, request: ChatPromptFields) -> ChatContent:
        """The request's messages as the chat template takes them, and the images they point to."""
        tokenizer = self.tokenizer()
        try:
            return split_images([m.for_template() for m in request.messages],
                                self.chat_template or tokenizer.chat_template,
                                image_token_text(self.engine.processor.images, tokenizer))
        except ValueError as e:
            raise APIError(str(e), param="messages") from None

    async def render_chat_images(self, request: ChatPromptFields, content: ChatContent,
                                 ) -> tuple[str, list[int], tuple[MultiModalItem, ...]]:
        """`render_chat` for a conversation with images: they are counted (--limit-mm-per-prompt) before
        any is fetched, fetched without blocking the event loop, then decoded and prepared by the
        model's processor off the loop too; (text, token ids with each image's placeholders, the
        images). Any image that cannot be had is a 400 naming its part."""
        images = self.engine.processor.images
        tokenizer = self.tokenizer()
        start = time.perf_counter()
        try:
            check_images(content, images, self.engine.config.model.multimodal)
            text = self.chat_text(request, content)
            pictures = await asyncio.gather(*(load_async(url, self.media_limits, where, _media_pool)
                                              for url, where in content.image_urls))
            token_ids, items = await asyncio.get_running_loop().run_in_executor(
                _prepare_pool, prepare, images, tokenizer, text, list(pictures))
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        if self.metrics is not None:
            self.metrics.record_images(len(items), time.perf_counter() - start)
        return text, token_ids, items

    def chat_text(self, request: ChatPromptFields, content: ChatContent | None = None) -> str:
        """The conversation rendered through the chat template: the prompt's text."""
        if request.continue_final_message and request.add_generation_prompt:
            raise APIError("continue_final_message and add_generation_prompt cannot both be true; "
                           "set add_generation_prompt to false to continue the final message",
                           param="continue_final_message")
        kwargs = request.chat_template_kwargs or {}
        clashing = _RESERVED_TEMPLATE_KWARGS & kwargs.keys()
        if clashing:
            raise APIError(f"chat_template_kwargs may not set {', '.join(sorted(clashing))}; "
                           "use the request's own fields", param="chat_template_kwargs")
        messages = (content or self.chat_content(request)).messages
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        tokenizer = self.tokenizer()

        def render(template_kwargs: dict[str, Any]) -> str:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt,
                                                 chat_template=self.chat_template, tools=tools, **template_kwargs)

        try:
            text = render(kwargs)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        except _VALUE_ERRORS as e:
            # The template met a value it cannot use: in an extra message field, or in
            # chat_template_kwargs if it renders without them.
            param, what = "messages", "these messages"
            if kwargs:
                with contextlib.suppress(ValueError, *_VALUE_ERRORS):
                    render({})
                    param, what = "chat_template_kwargs", "with these chat_template_kwargs"
            raise APIError(f"the chat template cannot render {what} (a value it cannot use: {e})",
                           param=param) from None
        _check_late_system_messages(text, messages)
        if request.continue_final_message:
            text = _cut_after_final_message(text, messages[-1].get("content"))
        return text

    def sampling_params(self, request: GenerationRequest, max_tokens: int | None,
                        constraint: OutputConstraint | None = None) -> SamplingParams:
        """The request's SamplingParams, constrained by `constraint`; 400 naming the field that asks
        for more than the server's limits (logprobs, sequences, stop strings) or for token ids outside
        the vocabulary."""
        if request.priority != 0 and self.engine.config.scheduler.policy != "priority":
            raise APIError(f"priority {request.priority} is not supported: this server schedules first come, first "
                           "served (start it with --scheduling-policy priority to schedule by priority)",
                           param="priority")
        limit = self.engine.config.model.max_logprobs
        for name, value in request.logprob_fields().items():
            if value is not None and value > limit:
                raise APIError(f"{name} must be at most {limit} (the server's --max-logprobs), got {value}",
                               param=name)
        for name in ("n", "best_of"):
            value = getattr(request, name, None)
            if value is not None and value > self.limits.max_n:
                raise APIError(f"{name} must be at most {self.limits.max_n} (the server's --max-n), got {value}",
                               param=name)
        if request.stop is not None and len(request.stop) > self.limits.max_stop_sequences:
            raise APIError(f"stop may hold at most {self.limits.max_stop_sequences} strings (the server's "
                           f"--max-stop-sequences), got {len(request.stop)}", param="stop")
        params = request.to_sampling_params(max_tokens, constraint.params if constraint is not None else None)
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", params.logit_bias)):
            self.check_in_vocabulary(name, ids or ())
        return params

    def check_in_vocabulary(self, param: str, token_ids: Iterable[int], vocab_size: int | None = None) -> None:
        """400 naming `param` if it holds a token id outside [0, vocab_size) (default: the model's)."""
        vocab_size = vocab_size or self.engine.config.model.source.arch.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(f"{param} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param=param)

    def prompt_list(self, value: str | list[int] | list[str] | list[list[int]], param: str) -> list[str | list[int]]:
        """A request's prompts (`param`): one text or token-id list, or a list of them; 400 for none,
        or more than --max-prompts."""
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        if not value:
            raise APIError(f"{param} is empty: send a text, token ids, or a list of them", param=param)
        if len(value) > self.limits.max_prompts:
            raise APIError(f"{param} holds {len(value)} prompts, more than this server's --max-prompts "
                           f"({self.limits.max_prompts}); split the request", param=param)
        return list(value)

    def check_prompt_ids(self, token_ids: list[int], param: str) -> None:
        """400 naming `param` for an empty prompt or token ids outside the vocabulary."""
        if not token_ids:
            raise APIError(f"{param} is empty: send at least one token", param=param)
        self.check_in_vocabulary(param, token_ids)

    def check_fits(self, request: GenerationRequest, num_prompt_tokens: int, prompt_param: str,
                   max_tokens: int | None, param: str) -> None:
        """400 unless the prompt (after truncate_prompt_tokens) plus `max_tokens` (the request field
        `param`) fits in max_model_len."""
        if max_tokens is not None and max_tokens < 1:
            raise APIError(f"{param} must be a positive integer, got {max_tokens}", param=param)
        if request.truncate_prompt_tokens is not None:
            num_prompt_tokens = min(num_prompt_tokens, request.truncate_prompt_tokens)
        try:
            check_prompt_fits(num_prompt_tokens, self.max_model_len)
        except ValueError as e:
            raise APIError(str(e), param=prompt_param) from None
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise APIError(
                f"the prompt ({num_prompt_tokens} tokens) plus {param} ({max_tokens}) is "
                f"{num_prompt_tokens + max_tokens} tokens, more than this model's context of {self.max_model_len} "
                f"(max_model_len); set {param} to at most {self.max_model_len - num_prompt_tokens} or shorten "
                "the prompt", param=param)

    async def admit(self, raw_request: Request, prompt_lens: Sequence[int], params: SamplingParams | PoolingParams,
                    prompt_param: str, max_tokens_param: str | None = None, priority: int = 0) -> None:
        """Take the request's place among the work in flight (admission.py, by `priority` under the
        priority policy), by the sequences and
        tokens its prompts (of `prompt_lens` tokens, from the field `prompt_param`) ask for; 400
        naming a field when the request alone asks for more than --max-request-seqs or
        --max-request-tokens allow, 503 when no room comes in time."""
        work = Work.of(prompt_lens, params, self.max_model_len)
        per_prompt = work.seqs // len(prompt_lens)
        if work.seqs > self.limits.max_request_seqs:
            seq_param = prompt_param if per_prompt == 1 else "best_of" if getattr(params, "best_of", None) else "n"
            raise APIError(f"this request asks for {work.seqs} sequences ({len(prompt_lens)} prompts x {per_prompt}), "
                           f"more than this server's --max-request-seqs ({self.limits.max_request_seqs}); send fewer "
                           "prompts or ask for fewer sequences each", param=seq_param)
        max_tokens = self.limits.max_request_tokens
        if max_tokens is not None and work.tokens > max_tokens:
            raise APIError(f"this request's {work.seqs} sequences may reach {work.tokens} tokens in all (prompt + "
                           f"{max_tokens_param or 'output'} each), more than this server's --max-request-tokens "
                           f"({max_tokens}); ask for fewer tokens or sequences", param=max_tokens_param or prompt_param)
        await ticket_of(raw_request.scope).admit(work, priority)

    @staticmethod
    def make_request_id(prefix: str, requested: str | None, raw_request: Request) -> str:
        """The engine's id for a request: the body's `request_id`, else its X-Request-Id, so that the
        response id and the engine's log lines carry the id the client knows."""
        return f"{prefix}-{requested or request_id_of(raw_request.scope) or uuid.uuid4().hex}"

    async def start(self, prompt: dict[str, Any], params: SamplingParams | PoolingParams, request_id: str,
                    constraint: OutputConstraint | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> Started:
        """Submit a request (with the adapter `lora_request`, at `priority`) and wait for its first output, so that
        input the engine rejects (an adapter that fails to load too) is a 400 before a (streamed)
        response has begun; one whose `constraint` (the params' structured output) cannot be
        compiled names the request field it came from."""
        outputs = self.engine.generate(prompt, params, request_id, lora_request, priority=priority)
        try:
            first = await anext(outputs)
        except GrammarError as e:
            if constraint is None:
                raise APIError(str(e)) from None
            raise constraint.error(e.reason) from None
        except ValueError as e:
            raise APIError(str(e)) from None
        except EngineDeadError as e:
            raise APIError(str(e), 503) from None
        return first, outputs

    async def start_all(self, prompts: Sequence[dict[str, Any]], params: SamplingParams | PoolingParams,
                        request_id: str, constraint: OutputConstraint | None = None,
                        lora_request: LoRARequest | None = None, priority: int = 0) -> list[Started]:
        """`start` for the prompts of one request at once (they are batched together), as
        `request_id` (one prompt) or `request_id-i`; if any fails, the others are aborted and the
        first failure is raised."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        results = await asyncio.gather(*(self.start(p, params, i, constraint, lora_request, priority)
                                         for p, i in zip(prompts, ids)), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            for r in results:
                if not isinstance(r, BaseException):
                    await r[1].aclose()  # aborts the engine request
            raise failure
        return results

    async def start_chat(self, request: ChatCompletionRequest, request_id: str, raw_request: Request,
                         names: Mapping[str, str] | None = None) -> ChatRun:
        """Render `request`'s conversation through the chat template, check it fits, admit it (the
        work of `raw_request`) and submit it:
        the one path from a conversation to the engine, for chat completions and for the APIs that
        translate their requests into one (Responses, Anthropic Messages). `names` maps chat fields
        to the calling API's names for them, so that errors name the field the client sent."""
        names = names or {}
        try:
            model = self.check_model(request.model)
            tools = plan_tools(request, self.auto_tool_parser)
            tool_constraints = [tools.constraint] if tools.constraint is not None else []
            constraint = one_constraint([*request_constraints(request), *tool_constraints])
            content = self.chat_content(request)
            items: tuple[MultiModalItem, ...] = ()
            if content.image_urls:
                text, token_ids, items = await self.render_chat_images(request, content)
            else:
                text, token_ids = await self.render_chat(request, request.truncate_prompt_tokens is not None,
                                                         content)
            max_tokens, param = request.max_tokens_field()
            self.check_fits(request, len(token_ids), names.get("messages", "messages"), max_tokens,
                            names.get(param, param))
            params = self.sampling_params(request, max_tokens, constraint)
            if tools.parser is not None and tools.parser.needs_special_tokens:
                params.skip_special_tokens = False  # the parser's marker is one
            await self.admit(raw_request, [len(token_ids)], params, "messages", param, request.priority)
            prompt = {"prompt": text, "prompt_token_ids": token_ids, "cache_salt": request.cache_salt}
            if items:
                prompt["multi_modal_items"] = items
            started = await self.start(prompt, params, request_id, constraint, model.lora_request, request.priority)
        except APIError as e:
            if e.param is not None:
                e.param = names.get(e.param, e.param)
            raise
        return ChatRun(model.name, started, ChatOutput(self.reasoning_parser, tools.parser))

    @staticmethod
    async def follow(first: RequestOutput,
                     outputs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[RequestOutput]:
        """`first`, then the rest; closing the engine's stream early (client gone) aborts the request.
        An engine that dies meanwhile makes the server unavailable (503, also as a stream's error
        event): no fault of the request's, nor a bug (500)."""
        async with contextlib.aclosing(outputs):
            yield first
            try:
                async for out in outputs:
                    yield out
            except EngineDeadError as e:
                raise APIError(str(e), 503) from None

    async def finals(self, started: Sequence[Started], raw_request: Request) -> list[RequestOutput]:
        """Each request's final output; if the client disconnects first, all are aborted (499)."""
        async def drain(first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
            final = first
            async for final in self.follow(first, outputs):
                pass
            return final

        result = asyncio.ensure_future(asyncio.gather(*(drain(*s) for s in started)))
        disconnected = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            done, _ = await asyncio.wait((result, disconnected), return_when=asyncio.FIRST_COMPLETED)
            if result in done:
                return result.result()
            raise APIError("the client disconnected before the response was ready", CLIENT_CLOSED_REQUEST)
        finally:
            disconnected.cancel()
            result.cancel()  # a no-op once done; else cancelling the drains aborts the engine requests
            # Awaited, also when this handler is cancelled (a 504): the aborts are sent before the
            # answer, and the gathering future's cancellation is retrieved, not logged as lost.
            await asyncio.gather(result, disconnected, return_exceptions=True)

    async def deltas(self, started: Sequence[Started], num_tokens: dict[int, int],
                     choices_per_prompt: int = 0) -> AsyncIterator[tuple[int, RequestOutput, CompletionOutput]]:
        """The streams' DELTA outputs as chunks should report them, one sequence at a time, as
        (choice index, output, sequence); the choices of request i are numbered from
        i * `choices_per_prompt`. Tokens that complete no character yet are held back unless they
        carry logprobs, or the model has no tokenizer (no text will ever come: each step's tokens
        go out as they are made). `num_tokens` counts each choice's tokens (for usage)."""
        textless = self.engine.tokenizer is None
        async for i, out in _merged([self.follow(*s) for s in started]):
            for o in out.outputs:
                index = i * choices_per_prompt + o.index
                num_tokens[index] = num_tokens.get(index, 0) + len(o.token_ids)
                if o.text or o.finish_reason is not None or (o.token_ids and (o.logprobs or textless)):
                    yield index, out, o

    @staticmethod
    def usage(outs: Sequence[RequestOutput], completion_tokens: int | None = None) -> UsageInfo:
        """The usage of requests `outs`; a stream of DELTA outputs passes the `completion_tokens` it counted."""
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
        if completion_tokens is None:
            completion_tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
        cached = sum(out.num_cached_tokens for out in outs)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    @staticmethod
    def event_stream(chunks: AsyncGenerator[BaseModel, None], raw_request: Request,
                     named: bool = False) -> StreamingResponse:
        """Server-sent events: one `data: {json}` per chunk, an error event (quoting the request id)
        if generation fails midway, then `data: [DONE]`. `named` events, as the Responses and
        Anthropic Messages APIs send them, start with `event: {chunk.type}` and end without [DONE]."""
        request_id = request_id_of(raw_request.scope)
        path = raw_request.scope.get("path")

        async def events() -> AsyncIterator[str]:
            try:
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        name = f"event: {getattr(chunk, 'type')}\n" if named else ""
                        yield f"{name}data: {chunk.model_dump_json()}\n\n"
            except APIError as e:
                logger.info("stream failed [request id %s]: %s", request_id, e.message)
                yield sse_error(e, request_id, path)
            except Exception as e:  # the status line is already sent: report it in the stream
                logger.exception("stream failed [request id %s]", request_id)
                yield sse_error(APIError(f"{type(e).__name__}: {e}", 500), request_id, path)
            if not named:
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


async def _merged(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several streams as they come, each with its stream's position. Closing the
    merged stream cancels the readers, which closes the streams (aborting their requests)."""
    if len(streams) == 1:  # the common case, without tasks
        async with contextlib.aclosing(streams[0]):
            async for item in streams[0]:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def read(i: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, done, e))

    readers = [asyncio.create_task(read(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


async def _wait_for_disconnect(raw_request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def _check_late_system_messages(prompt: str, messages: Sequence[Mapping[str, Any]]) -> None:
    """400 for a system (or developer) message after the conversation's first turn that the chat
    template drops or moves ahead of the messages it follows (many place a system prompt only
    first): the model would silently be told something else. Each message's text is looked for in
    the prompt in order; a template that changes the text of other messages too (beyond trimming)
    is not judged."""
    system = ("system", "developer")
    first_turn = next((i for i, m in enumerate(messages) if m["role"] not in system), len(messages))
    late = {i for i in range(first_turn + 1, len(messages)) if messages[i]["role"] in system}
    if not late:
        return
    position, missing = 0, []
    for i, message in enumerate(messages):
        content = message.get("content")
        text = content.strip() if isinstance(content, str) else ""
        found = prompt.find(text, position)
        if found < 0:
            missing.append(i)
        else:
            position = found + len(text)
    if missing and late.issuperset(missing):
        i = missing[0]
        raise APIError(f"messages[{i}] ({messages[i]['role']}) follows the conversation's first turn, and this "
                       "model's chat template drops it or moves it ahead of the messages before it; send "
                       "system messages first", param="messages")


def _cut_after_final_message(prompt: str, content: Any) -> str:
    """The prompt up to the end of the final message's text, so generation continues that message."""
    position = prompt.rfind(content) if isinstance(content, str) and content else -1
    if position < 0:
        raise APIError("continue_final_message needs a final message with text content that the chat "
                       "template renders verbatim", param="continue_final_message")
    return prompt[:position + len(content)]
