"""POST /v1/responses: OpenAI's Responses API, as a chat request on the chat completions path."""
from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, UsageInfo
from pagellm.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from pagellm.entrypoints.openai.protocol_tools import ResponseFormat
from pagellm.entrypoints.openai.serving_base import ChatRun, OpenAIServing

MAX_STORED_RESPONSES = 1000
"""How many stored responses (the most recently used) can be continued by previous_response_id."""
_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
          "response_format.json_schema.schema": "text.format.schema"}
"""Chat request fields -> the Responses API's names for them, for error messages."""

Message = dict[str, Any]


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, *args: Any, max_stored: int = MAX_STORED_RESPONSES, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_stored = max_stored
        self.stored: OrderedDict[str, list[Message]] = OrderedDict()
        """Response id -> its conversation (input and output, without instructions), least recently used first."""

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        _check_supported(request)
        history = self._history(request)
        system = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
        chat = ChatCompletionRequest(model=request.model, messages=system + history, stream=request.stream,
                                     max_completion_tokens=request.max_output_tokens,
                                     temperature=request.temperature, top_p=request.top_p, user=request.user,
                                     response_format=response_format(request))
        run = await self.start_chat(chat, self.make_request_id("resp", None, raw_request), raw_request, _NAMES)
        response = _response_object(request, run.model)
        if request.stream:
            return self.event_stream(self._events(run, response, history, request.store),
                                     raw_request, named=True)
        [final] = await self.finals([run.started], raw_request)
        o = final.outputs[0]
        # The message's content: without the reasoning (--reasoning-parser) the output may begin with.
        text = run.output.message(o.text).content or ""
        self._finish(response, text, o.finish_reason, self.usage([final]), history, request.store)
        return JSONResponse(response.model_dump())

    def _history(self, request: ResponsesRequest) -> list[Message]:
        """The stored conversation request.previous_response_id names, then this request's input."""
        history: list[Message] = []
        if request.previous_response_id is not None:
            stored = self.stored.get(request.previous_response_id)
            if stored is None:
                raise APIError(f"no stored response has the id `{request.previous_response_id}` (this server "
                               f"keeps the last {self.max_stored} responses created with store=true, in memory)",
                               404, param="previous_response_id")
            self.stored.move_to_end(request.previous_response_id)
            history = list(stored)
        if isinstance(request.input, str):
            # An empty text is no input, as an empty list is.
            history += [{"role": "user", "content": request.input}] if request.input else []
        else:
            history += [{"role": m.role, "content": m.chat_parts()} for m in request.input]
        if not history:
            raise APIError("input is empty: send at least one message", param="input")
        return history

    def _finish(self, response: ResponseObject, text: str, finish_reason: str | None, usage: UsageInfo,
                history: list[Message], store: bool, item_id: str | None = None) -> None:
        """Fill in `response`'s output (one message, `item_id` if given), status and usage; store it
        if asked to."""
        incomplete = finish_reason == "length"
        response.status = "incomplete" if incomplete else "completed"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
        response.output = [OutputMessage(id=item_id or f"msg_{uuid.uuid4().hex}", status=response.status,
                                         content=[OutputText(text=text)])]
        response.usage = ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                       total_tokens=usage.total_tokens, input_tokens_details=InputTokensDetails(
                                           cached_tokens=usage.prompt_tokens_details.cached_tokens))
        if store:
            self.stored[response.id] = [*history, {"role": "assistant", "content": text}]
            while len(self.stored) > self.max_stored:
                self.stored.popitem(last=False)

    async def _events(self, run: ChatRun, response: ResponseObject, history: list[Message],
                      store: bool) -> AsyncGenerator[ResponseEvent, None]:
        """The stream's events, as OpenAI sends them, each numbered by `sequence_number`."""
        sequence_number = 0

        def event(type_: str, **fields: Any) -> ResponseEvent:
            nonlocal sequence_number
            sequence_number += 1
            return ResponseEvent(type=type_, sequence_number=sequence_number - 1, **fields)

        item_id = f"msg_{uuid.uuid4().hex}"
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=response.model_dump())
        yield event("response.in_progress", response=response.model_dump())
        yield event("response.output_item.added", output_index=0,
                    item=OutputMessage(id=item_id, status="in_progress", content=[]).model_dump())
        yield event("response.content_part.added", **where, part=OutputText(text="").model_dump())
        num_tokens: dict[int, int] = {}
        finish_reason, parts = None, []
        choice = run.output.stream()  # the content deltas, without the reasoning
        async for _, _, o in self.deltas([run.started], num_tokens):
            finish_reason = o.finish_reason
            content = choice.delta(o.text, o.finish_reason is not None).get("content")
            if content:
                parts.append(content)
                yield event("response.output_text.delta", **where, delta=content, logprobs=[])
        self._finish(response, "".join(parts), finish_reason, self.usage([run.first], sum(num_tokens.values())),
                     history, store, item_id)
        item = response.output[0]
        text = item.content[0]
        yield event("response.output_text.done", **where, text=text.text, logprobs=[])
        yield event("response.content_part.done", **where, part=text.model_dump())
        yield event("response.output_item.done", output_index=0, item=item.model_dump())
        yield event("response.incomplete" if response.status == "incomplete" else "response.completed",
                    response=response.model_dump())


def _check_supported(request: ResponsesRequest) -> None:
    """400 naming a field that asks for what this server cannot do."""
    if request.tools:
        raise APIError("tools are not supported by this server yet; remove them from the request", param="tools")
    if request.tool_choice not in (None, "auto", "none"):
        raise APIError("tool_choice needs tools, which this server does not support yet; remove it",
                       param="tool_choice")
    if request.background:
        raise APIError("background responses are not supported by this server", param="background")
    if request.top_logprobs:
        raise APIError("top_logprobs is not supported on /v1/responses; use /v1/chat/completions",
                       param="top_logprobs")


def response_format(request: ResponsesRequest) -> ResponseFormat | None:
    """`text.format` as chat's response_format: the Responses API flattens json_schema's fields
    (`{"type": "json_schema", "name", "schema", "strict"}`); 400 naming the part at fault."""
    text_format = (request.text or {}).get("format")
    if text_format is None:
        return None
    if not isinstance(text_format, dict):
        raise APIError("text.format must be an object like {\"type\": \"text\"}", param="text.format")
    fields = {k: v for k, v in text_format.items() if k != "type"}
    nested = text_format.get("type") == "json_schema"
    try:
        return ResponseFormat.model_validate({"type": text_format.get("type"), "json_schema": fields} if nested
                                             else text_format)
    except ValidationError as e:
        error = e.errors()[0]
        where = [str(part) for part in error["loc"] if part != "json_schema" or not nested]
        param = ".".join(["text.format", *where])
        raise APIError(f"{param}: {error['msg']}", param=param) from None


def _response_object(request: ResponsesRequest, model: str) -> ResponseObject:
    """The response as it starts (in progress, no output yet), echoing the request's settings."""
    echoed = {name: getattr(request, name) for name in
              ("instructions", "max_output_tokens", "previous_response_id", "store", "temperature", "top_p",
               "user", "metadata", "tool_choice", "truncation", "parallel_tool_calls", "text", "reasoning")
              if getattr(request, name) is not None}
    return ResponseObject(id=f"resp_{uuid.uuid4().hex}", status="in_progress", model=model, output=[], **echoed)
