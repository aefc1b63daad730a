"""Typed reading of JSON request fields: each wrong type is a 400 naming the field and what it must be."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from aiohttp import web

from flare_core.server.errors import ApiError


# bool comes before int: Python's True is an int, JSON's true is not a number.
_JSON_TYPE_NAMES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                    (dict, "object"))


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages ("got string")."""
    if value is None:
        return "null"
    for kind, name in _JSON_TYPE_NAMES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def invalid(field: str, problem: str) -> ApiError:
    return ApiError(400, f"'{field}': {problem}", param=field)


def _wrong_type(field: str, expected: str, value: Any) -> ApiError:
    return invalid(field, f"must be {expected}, got {json_type(value)}")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {json_type(data)}")
    return data


def reject_unknown(body: Mapping[str, Any], known: Iterable[str], where: str = "") -> None:
    """For APIs that refuse fields they do not define (Anthropic's wording)."""
    allowed = set(known)
    for name in body:
        if name not in allowed:
            field = f"{where}.{name}" if where else name
            raise ApiError(400, f"{field}: Extra inputs are not permitted", param=field)


def _value(body: Mapping[str, Any], name: str, field: str, required: bool) -> Any:
    """The field's value: None when absent or null, which a required field may not be."""
    value = body.get(name)
    if value is None and required:
        raise invalid(field, "is required")
    return value


def _typed(body: Mapping[str, Any], name: str, where: str | None, required: bool, kind: type,
           expected: str) -> Any:
    """The field's value when it is an instance of `kind`, None when absent or null."""
    field = where or name
    value = _value(body, name, field, required)
    if value is not None and not isinstance(value, kind):
        raise _wrong_type(field, expected, value)
    return value


def get_str(body: Mapping[str, Any], name: str, *, where: str | None = None, required: bool = False,
            default: str | None = None) -> str | None:
    value = _typed(body, name, where, required, str, "a string")
    return default if value is None else value


def get_bool(body: Mapping[str, Any], name: str, *, where: str | None = None, default: bool = False) -> bool:
    value = _typed(body, name, where, False, bool, "a boolean")
    return default if value is None else value


def get_int(body: Mapping[str, Any], name: str, *, where: str | None = None, required: bool = False,
            minimum: int | None = None, maximum: int | None = None, default: int | None = None) -> int | None:
    field = where or name
    value = _value(body, name, field, required)
    if value is None:
        return default
    # JSON clients sometimes send 5.0 for 5; accept integral floats, refuse 5.5.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(field, "an integer", value)
    if minimum is not None and value < minimum:
        raise invalid(field, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise invalid(field, f"must be at most {maximum}, got {value}")
    return value


def get_number(body: Mapping[str, Any], name: str, *, where: str | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(where or name, "a number", value)
    return float(value)


def get_list(body: Mapping[str, Any], name: str, *, where: str | None = None, required: bool = False) -> list | None:
    return _typed(body, name, where, required, list, "an array")


def get_object(body: Mapping[str, Any], name: str, *, where: str | None = None,
               required: bool = False) -> dict | None:
    return _typed(body, name, where, required, dict, "an object")


def as_object(value: Any, field: str) -> dict[str, Any]:
    """An array element that must be an object."""
    if not isinstance(value, dict):
        raise _wrong_type(field, "an object", value)
    return value


async def read_json_body(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object body, refused with 413 past `max_bytes` (declared or actual)."""
    too_large = ApiError(413, f"request body exceeds the server's limit of {max_bytes} bytes "
                              f"(server.max_body_bytes in the config)")
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise too_large from exc
    return parse_json_object(raw)
