"""The request and response pieces of tool calling and structured output: OpenAI's `tools`,
`tool_choice`, `response_format` and `tool_calls`, and vLLM's `structured_outputs` object.

Shapes only; what they ask of the output is worked out in constraints.py and serving_tools.py.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.openai.protocol_base import STRICT_TYPES, StrictModel
from pagellm.entrypoints.openai.tool_parsers import tool_call_id
from pagellm.sampling_params import StructuredOutputsParams


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; None: the function takes no arguments."""
    strict: bool | None = None
    """Accepted: a forced call's arguments always follow the schema here."""


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    """Call this function (the output is constrained to its arguments)."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
"""none: no calls; auto: the model decides (needs --enable-auto-tool-choice); required: at least one
call (constrained); a named function: that call (constrained). Default: auto with tools, else none."""


def validate_tool_choice(value: Any) -> Any:
    """A tool_choice as one clear error naming the part at fault, rather than pydantic's attempt at
    each branch of the union."""
    if value is not None and not isinstance(value, dict) and value not in ("none", "auto", "required"):
        raise PydanticCustomError("tool_choice", 'must be "none", "auto", "required" or {choice}, got {value}',
                                  {"choice": '{"type": "function", "function": {"name": ...}}', "value": repr(value)})
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError as e:
            error = e.errors()[0]
            raise PydanticCustomError("tool_choice", "{message}", {
                "message": error["msg"], "param": ".".join(str(part) for part in error["loc"])}) from None
    return value


class MessageFunctionCall(BaseModel):
    model_config = STRICT_TYPES

    name: str
    arguments: str | dict[str, Any]
    """The arguments' JSON text (OpenAI's form) or the object itself."""


class MessageToolCall(BaseModel):
    """A call in an earlier assistant message of the conversation."""

    model_config = ConfigDict(**STRICT_TYPES, extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class JsonSchemaSpec(StrictModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    """The JSON schema the output follows."""
    strict: bool | None = None
    """Accepted: the output always follows the schema here."""


class ResponseFormat(StrictModel):
    """text (the default), json_object (any JSON object) or json_schema (JSON that follows `json_schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
    """With type json_schema only."""

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("json_schema", "json_schema goes with type json_schema, and only with it",
                                      {"param": "json_schema"})
        return self


class StructuredOutputsRequest(StrictModel):
    """vLLM's `structured_outputs` request field: exactly one of json, regex, choice, grammar,
    json_object, structural_tag."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    """A JSON schema (an object, or its JSON text)."""
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    """An EBNF (GBNF) grammar whose start rule is `root`."""
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    """JSON without optional whitespace."""
    disable_fallback: bool = False
    """Accepted: there is one backend (xgrammar), so nothing to fall back to."""
    disable_additional_properties: bool = False
    """Accepted: objects already get no properties beyond the schema's unless it allows them."""
    whitespace_pattern: str | None = None
    """Not supported (xgrammar has none); refused when set."""

    def to_params(self) -> StructuredOutputsParams:
        """The engine's params (ValueError, naming `structured_outputs`, unless exactly one kind is set)."""
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=self.json_object or None, structural_tag=self.structural_tag,
                                       disable_any_whitespace=self.disable_any_whitespace)


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments object's JSON text."""


class ToolCall(BaseModel):
    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall
