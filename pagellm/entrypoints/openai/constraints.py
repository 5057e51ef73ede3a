"""What a request's fields ask of the output's form: at most one constraint, from `response_format`,
vLLM's `structured_outputs`, its older `guided_*` fields, or tools (serving_tools.py), each
remembered with the field it came from so that an error about it names that field."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import GenerationRequest
from pagellm.sampling_params import StructuredOutputsParams

_KIND_NAMES = {"json": "JSON schema", "regex": "regular expression", "choice": "choice list", "grammar": "grammar",
               "json_object": "JSON object grammar", "structural_tag": "structural tag"}


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    params: StructuredOutputsParams
    field: str
    """The request field it came from."""
    description: str | None = None
    """What the field holds, for error messages; None: named after the params' kind."""
    location: str | None = None
    """Where in the request the spec itself is (`response_format.json_schema.schema`), which errors
    about it name; None: `field`."""

    def error(self, reason: str) -> APIError:
        """The 400 for a constraint the engine cannot use (a GrammarError's reason: "is not
        supported: ...", "is 70000 bytes, more than the limit ...")."""
        where = self.location or self.field
        return APIError(f"{where}: the {self.description or _KIND_NAMES[self.params.kind]} {reason}", param=where)


def request_constraints(request: GenerationRequest) -> list[OutputConstraint]:
    """Every constraint the request's own fields ask for, in the order of the fields."""
    found = []
    response_format = request.response_format
    if response_format is not None and response_format.json_schema is not None:
        found.append(OutputConstraint(StructuredOutputsParams(json=response_format.json_schema.json_schema),
                                      "response_format", location="response_format.json_schema.schema"))
    elif response_format is not None and response_format.type == "json_object":
        found.append(OutputConstraint(StructuredOutputsParams(json_object=True), "response_format"))
    if request.structured_outputs is not None:
        try:
            params = request.structured_outputs.to_params()
        except ValueError as e:
            raise APIError(str(e), param="structured_outputs") from None
        found.append(OutputConstraint(params, "structured_outputs", location=f"structured_outputs.{params.kind}"))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            found.append(OutputConstraint(StructuredOutputsParams(**{kind: value}), name))
    return found


def one_constraint(constraints: Iterable[OutputConstraint]) -> OutputConstraint | None:
    """The request's constraint; 400 naming both fields when two ask for one each."""
    constraints = list(constraints)
    if len(constraints) > 1:
        first, second = constraints[:2]
        raise APIError(f"`{first.field}` and `{second.field}` both constrain the output; send only one of them",
                       param=second.field)
    return constraints[0] if constraints else None
