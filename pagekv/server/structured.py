"""The request fields that constrain the output, turned into one ``StructuredOutputsParams``.

OpenAI's ``response_format`` (chat: ``json_object``, ``json_schema``) and vLLM's extras on both
endpoints: ``structured_outputs`` ({json, json_object, regex, choice, grammar}) and the older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. A request may use
one of them; each constraint is compiled by the engine, whose errors name
``structured_outputs.<kind>``, which ``relabel`` turns back into the request's own field.
"""

from __future__ import annotations

from typing import Any

from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import StructuredOutputsParams

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
KINDS = ("json", "json_object", "regex", "choice", "grammar")


def constraint_of(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field that gave it (None, None: unconstrained)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        params = _response_format(response_format)
        if params is not None:
            found.append((params, "response_format"))
    for field, kind in GUIDED.items():
        value = getattr(req, field, None)
        if value is not None:
            found.append((_params(field, {kind: value}), field))
    if req.structured_outputs is not None:
        found.append((_structured(req.structured_outputs), "structured_outputs"))
    if len(found) > 1:
        fields = [field for _, field in found]
        raise InvalidRequestError(f"{fields[1]}: only one of {fields} may be given", fields[1])
    return found[0] if found else (None, None)


def _response_format(value: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _params("response_format", {"json_object": True})
    if kind == "json_schema":
        spec = value.get("json_schema")
        field = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise InvalidRequestError(f"{field}: must be an object with a schema", field)
        schema = spec.get("schema", {"type": "object"})  # OpenAI: no schema, any object
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{field}.schema: must be a JSON object", f"{field}.schema")
        return _params(f"{field}.schema", {"json": schema})
    raise InvalidRequestError(
        f"response_format.type: must be text, json_object or json_schema, got {kind!r}",
        "response_format.type",
    )


def _structured(value: dict[str, Any]) -> StructuredOutputsParams:
    given = {k: v for k, v in value.items() if k in KINDS and v not in (None, False)}
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs: unknown constraint {unknown[0]!r}; one of {KINDS}",
            "structured_outputs",
        )
    return _params("structured_outputs", given)


def _params(field: str, values: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**values)
    except InvalidRequestError as exc:
        raise relabel(exc, field) from None


def relabel(exc: InvalidRequestError, field: str | None) -> InvalidRequestError:
    """``exc`` from compiling a constraint, naming ``field`` (the request's) instead."""
    param = exc.param or ""
    if field is None or not param.startswith("structured_outputs"):
        return exc
    reason = str(exc).split(": ", 1)[-1]
    return InvalidRequestError(f"{field}: {reason}", field)
