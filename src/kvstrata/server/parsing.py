"""Parsing a request body into its model (server/protocol.py): no key given twice, unknown
fields left out and named (or refused with `strict_fields`), and a pydantic
`ValidationError` worded as one OpenAI error (a 400 naming the field, the value and what
is accepted, from the field's type and constraints)."""

from __future__ import annotations

import difflib
import json
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from kvstrata.server.errors import APIError, invalid
from kvstrata.server.protocol import _INNER, REQUESTS, Limits, Request


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object hook: a key given twice in one object is a 400 (JSON leaves
    that open; the last one would win silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise APIError(
            400,
            f"the request body gives the key {key[:100]!r} twice in one object: give each key once",
            code="invalid_json",
        )
    return out


def parse_request(raw: bytes, endpoint: str, limits: Limits) -> Request:
    """The body as the endpoint's request model, with no key given twice in any object
    and its fields checked together (`Request.check_together`); an APIError (400)
    otherwise. Unknown fields are left out and named in `ignored_fields` (a 400 with
    `limits.strict_fields`)."""
    model = REQUESTS[endpoint]
    ignored: list[str] = []
    try:
        request = model.model_validate_json(raw, context=limits)
    except ValidationError as exc:
        extra = [tuple(e["loc"]) for e in exc.errors() if e["type"] == "extra_forbidden"]
        if limits.strict_fields or not extra:
            raise body_error(exc, endpoint) from None
        body = json.loads(raw, object_pairs_hook=_no_duplicates)  # valid JSON: it parsed
        try:
            dropped = {loc: _drop(body, loc) for loc in extra}
        except (KeyError, IndexError, TypeError):  # a place that is no key of the body
            raise body_error(exc, endpoint) from None
        ignored = sorted({_where(loc) for loc in extra})
        try:
            request = model.model_validate_json(json.dumps(body), context=limits)
        except ValidationError as again:
            raise (_misspelled(again, dropped, endpoint) or body_error(again, endpoint)) from None
    else:
        json.loads(raw, object_pairs_hook=_no_duplicates)  # valid JSON by now, bounded
    request.check_together()
    request._ignored = tuple(ignored)
    return request


def _unknown(loc: tuple, value: Any, owner: type[BaseModel], endpoint: str) -> APIError:
    """The 400 of an unknown field at `loc` of an object of model `owner`."""
    known = sorted(owner.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    guess = f"did you mean {close[0]!r}? " if close else ""
    why = f"unknown field; {guess}known: {', '.join(known)} (endpoint {endpoint})"
    return invalid(_where(loc), value, why, "unknown_parameter")


def _misspelled(exc: ValidationError, dropped: dict, endpoint: str) -> APIError | None:
    """When a field the body needs is missing (or null) beside an unknown one close to
    its name (a misspelling the body relied on), that unknown field's 400; else None."""
    for err in exc.errors():
        if err["type"] != "missing" and err.get("input", 0) is not None:
            continue  # a value given, not one left out
        where = tuple(err["loc"])
        for loc, value in dropped.items():
            if loc[:-1] == where[:-1] and difflib.get_close_matches(
                str(loc[-1]), [str(where[-1])], n=1, cutoff=0.6
            ):
                owner = _INNER.get(str(loc[0]), REQUESTS[endpoint]) if len(loc) > 1 else None
                return _unknown(loc, value, owner or REQUESTS[endpoint], endpoint)
    return None


def closest_field(name: str, endpoint: str) -> str:
    """' (did you mean 'x'?)' for a top-level field name close to a known one, else ''."""
    known = sorted(REQUESTS[endpoint].model_fields)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _drop(body: Any, loc: tuple[int | str, ...]) -> Any:
    """Remove the value at a pydantic location from the parsed body; return it."""
    for part in loc[:-1]:
        body = body[part]
    return body.pop(loc[-1])


def _where(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as the request spells it: messages[0].content."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _accepted(field: FieldInfo) -> str | None:
    """What a field accepts, from its type and constraints (its description, where it
    has one; None for a type this does not put in words)."""
    if field.description:
        return field.description
    kind = field.annotation
    if get_origin(kind) in (Union, types.UnionType):  # X | None
        kind = next(arg for arg in get_args(kind) if arg is not type(None))
    bounds = {
        name: getattr(meta, name)
        for meta in field.metadata
        for name in ("gt", "ge", "le", "min_length", "max_length")
        if getattr(meta, name, None) is not None
    }
    if "ge" in bounds and "le" in bounds:
        span = f" from {bounds['ge']} to {bounds['le']}"
    else:
        ops = {"gt": ">", "ge": ">=", "le": "<="}
        span = " and".join(f" {op} {bounds[name]}" for name, op in ops.items() if name in bounds)
    least, most = bounds.get("min_length"), bounds.get("max_length")
    if get_origin(kind) is Literal:
        return f"one of {', '.join(map(repr, get_args(kind)))}"
    if kind is bool:
        return "true or false"
    if kind in (int, float):
        return ("a whole number" if kind is int else "a number") + span
    if kind is str:
        return f"a string of {least or 0} to {most} characters" if most else "a string"
    if get_origin(kind) is list:
        return ("a non-empty list" if least else "a list") + (
            f" of at most {most} items" if most else ""
        )
    if get_origin(kind) is dict or isinstance(kind, type) and issubclass(kind, BaseModel):
        return "an object"
    return None


def body_error(exc: ValidationError, endpoint: str) -> APIError:
    """The OpenAI error object (400) of a request body pydantic refused: its first error,
    one line naming the field (`param`), the value and what is accepted."""
    errors = exc.errors(include_url=False)
    # an unknown field first: a misspelled one leaves the field it meant missing
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    kind, loc, ctx = err["type"], tuple(err["loc"]), err.get("ctx") or {}
    if kind == "json_invalid":
        why = ctx.get("error", "malformed")
        return APIError(400, f"the request body is not valid JSON: {why}", code="invalid_json")
    if not loc:
        return APIError(400, "the request body must be a JSON object ({...})", code="invalid_json")
    deeper = ctx.get("param") or ""  # a validator's: the value's own place
    param = _where(loc) + deeper if deeper.startswith("[") else deeper or _where(loc)
    value = ctx["value"] if "value" in ctx else err.get("input")
    model = REQUESTS[endpoint]
    owner = _INNER.get(str(loc[0]), model) if len(loc) > 1 else model
    if kind == "extra_forbidden":
        return _unknown(loc, value, owner, endpoint)
    field = owner.model_fields.get(loc[-1]) if isinstance(loc[-1], str) else None
    message = err["msg"][:1].lower() + err["msg"][1:]  # pydantic's own words, at worst
    accepted = ctx.get("accepted") or (field and _accepted(field)) or message
    code = "unsupported_value" if kind == "unsupported_value" else "invalid_value"
    return invalid(param, None if kind == "missing" else value, accepted, code)
