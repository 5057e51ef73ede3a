"""The base of every request model: unknown fields, values of the wrong JSON type, non-finite
numbers and invalid Unicode are refused, naming the field; `null` means a field's default."""
from __future__ import annotations

import json
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

Int64 = Annotated[int, Field(ge=-(2 ** 63), le=2 ** 63 - 1)]
"""An integer the engine's wire format (msgspec over ZMQ) can carry; a larger one would fail there."""
REQUEST_ID_PATTERN = r"^[\x21-\x7e]{1,128}$"
"""A client-chosen request id: 1 to 128 visible ASCII characters, so it is safe in headers and logs."""


STRICT_TYPES = ConfigDict(strict=True)
"""A JSON string is never a boolean or a number ("yes", "10"), nor a float an integer (1.5, 2.0), as
OpenAI's API answers; a float field still takes a JSON integer."""


class StrictModel(BaseModel):
    """Unknown fields, values of another JSON type, NaN / infinite numbers and text with lone
    surrogates are refused; `null` for a field that cannot be None means its default."""

    model_config = ConfigDict(**STRICT_TYPES, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        # OpenAI's spec lets clients send `null` for most optional fields (the openai SDK does).
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or _nullable(fields[k].annotation)}

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # JSON escapes can spell lone surrogates ("\ud800"), which Python keeps in a str but the
        # tokenizer and the response encoder cannot handle. One C-speed encode checks the whole
        # body (token-id prompts can be long); only a failure walks it to name the field.
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise PydanticCustomError("invalid_unicode", "holds a lone UTF-16 surrogate, which is not valid "
                                      "Unicode; send valid UTF-8 text", {"param": _lone_surrogate_path(data)})
        except (TypeError, ValueError):
            pass  # not JSON-shaped (a model instance, say): the field validators judge it
        return data


def _nullable(annotation: Any) -> bool:
    return annotation is Any or type(None) in typing.get_args(annotation)


def _lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) in `value` that cannot be encoded as UTF-8; a key
    at fault is shown escaped, so that the error message itself stays valid UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        child = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
        child = f"{path}.{child}" if path else child
        found = _lone_surrogate_path(key, child) if isinstance(key, str) else None
        found = found or _lone_surrogate_path(item, child)
        if found is not None:
            return found
    return None
