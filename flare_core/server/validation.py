"""Typed reading of JSON request fields: each wrong type is a 400 naming the field and what it must be.

Bodies are parsed strictly before any field is read: the `NaN` / `Infinity` literals Python's
`json` accepts, numbers that overflow to infinity, integers of more than MAX_INTEGER_DIGITS digits,
nesting deeper than MAX_NESTING and strings that are not valid Unicode (lone surrogates) are a 400,
so no handler, template or model ever sees them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aiohttp import web

from flare_core.requests import INT64
from flare_core.server.errors import ApiError

# Deepest nesting of arrays and objects a request body may have. Real requests (tool schemas
# included) stay far below it; templates and parsers recurse over what they are given.
MAX_NESTING = 64
# Longest integer literal accepted: int64 needs 19 digits; longer ones are never a valid value and
# Python refuses to convert more than 4,300 digits anyway.
MAX_INTEGER_DIGITS = 20
# Integers every integer field is checked against (a signed 64-bit value), besides its own range.
INT64_MIN, INT64_MAX = INT64


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


class _NotJson(ValueError):
    """A body Flare refuses although Python's `json` parses it; `field` names where."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"'{field}': {problem}")
        self.field, self.problem = field, problem


class _Refused:
    """A literal that parsed but is refused, kept in place so the tree walk can name its field."""

    __slots__ = ("problem",)

    def __init__(self, problem: str):
        self.problem = problem


def _refuse_constant(name: str) -> _Refused:
    return _Refused(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float | _Refused:
    value = float(text)
    if not math.isfinite(value):
        return _Refused(f"the number {text[:40]} is too large (it overflows to infinity)")
    return value


def _bounded_int(text: str) -> int | _Refused:
    digits = len(text.lstrip("-"))
    if digits > MAX_INTEGER_DIGITS:
        return _Refused(_long_integer(digits))
    return int(text)


def _long_integer(digits: int) -> str:
    return f"an integer of {digits} digits is beyond the {MAX_INTEGER_DIGITS} digits any field accepts"


# Integers of smaller magnitude have at most MAX_INTEGER_DIGITS digits.
_INTEGER_BOUND = 10 ** MAX_INTEGER_DIGITS
# Parsed values that need no check (bool is not int here: the walk compares exact types).
_PLAIN_TYPES = frozenset((float, bool, type(None)))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are distinct (JSON leaves duplicates undefined; Python keeps the last)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _NotJson("(the body)", f"the key {repeated[:60]!r} appears twice in one object")
    return value


def _parse(raw: bytes | str) -> Any:
    """`json.loads` of UTF-8 text (no byte-order mark, no UTF-16 / 32: Python's `json` would
    accept them) with the refused literals kept in place and duplicate keys refused. Integers are
    converted by `json`'s C scanner: a Python hook per integer costs more than the rest of a
    1,000-token prompt's parse. An integer past Python's own conversion limit (4,300 digits)
    fails that parse; the body is then parsed again with a hook that leaves long literals
    unconverted, so the walk names their field."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw  # UnicodeDecodeError: not UTF-8
    if text.startswith("\ufeff"):
        raise _NotJson("(the body)", "the text starts with a byte-order mark; send UTF-8 without one")
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                          object_pairs_hook=_unique_keys)
    except json.JSONDecodeError:
        raise
    except _NotJson:
        raise
    except ValueError:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int,
                          object_pairs_hook=_unique_keys)


def _field_name(path: tuple) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "(the body)"


def _check_tree(data: Any) -> None:
    """Refused literals, long integers, depth and Unicode over the parsed value, iteratively (no
    recursion to exhaust); the first problem found is raised with the field it is in. Scalars are
    checked in the loop over their container and a field's path is built only for containers and
    problems; an array of token ids is checked whole."""
    if not isinstance(data, (dict, list)):
        _check_scalar(data, ())
        return
    pending: list[tuple[dict | list, tuple]] = [(data, ())]
    while pending:
        value, path = pending.pop()
        if len(path) >= MAX_NESTING:  # a container at depth len(path) + 1
            raise _NotJson(_field_name(path), f"arrays and objects are nested deeper than {MAX_NESTING} levels")
        if isinstance(value, dict):
            for key in value:
                _check_text(key, path)
            entries = value.items()
        elif _small_integers(value):
            continue
        else:
            entries = enumerate(value)
        for key, item in entries:
            kind = type(item)
            if kind in _PLAIN_TYPES or (kind is int and -_INTEGER_BOUND < item < _INTEGER_BOUND):
                continue
            if kind is dict or kind is list:
                pending.append((item, path + (key,)))
            elif kind is str:
                _check_text(item, path, key)
            else:
                _check_scalar(item, path + (key,))


def is_integers(values: Sequence[Any]) -> bool:
    """Whether every element is a JSON integer (Python's bool, JSON's true/false, is not),
    tested by a C loop rather than one Python step per element."""
    return set(map(type, values)) <= {int}


def _small_integers(values: list) -> bool:
    """Whether an array holds only integers of at most MAX_INTEGER_DIGITS digits (token ids)."""
    return bool(values) and is_integers(values) and -_INTEGER_BOUND < min(values) and max(values) < _INTEGER_BOUND


def _check_scalar(value: Any, path: tuple) -> None:
    if isinstance(value, _Refused):
        raise _NotJson(_field_name(path), value.problem)
    if isinstance(value, str):
        _check_text(value, path)
    elif type(value) is int and not -_INTEGER_BOUND < value < _INTEGER_BOUND:
        raise _NotJson(_field_name(path), _long_integer(len(str(abs(value)))))


def _check_text(text: str, path: tuple, key: str | int | None = None) -> None:
    """A lone surrogate names the field holding the text: `path`, or `key` within it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        field = _field_name(path if key is None else path + (key,))
        raise _NotJson(field, f"a string holds a lone surrogate (\\u{ord(text[exc.start]):04x}), which "
                              f"is not valid Unicode") from None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; 400 for anything strict JSON, MAX_NESTING or
    MAX_INTEGER_DIGITS refuse, naming the field where there is one."""
    try:
        data = _parse(raw)
        _check_tree(data)
    except RecursionError:
        raise ApiError(400, f"request body is not valid JSON: arrays and objects are nested deeper than "
                            f"{MAX_NESTING} levels") from None
    except _NotJson as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", param=exc.field) from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {json_type(data)}")
    return data


def parse_json_string(text: str, field: str) -> Any:
    """The JSON value a string field holds (tool-call arguments, `guided_json`), under the body's
    own limits — strict literals, MAX_NESTING, MAX_INTEGER_DIGITS, valid Unicode —: a 400 naming
    `field` (and the place inside the value) for anything `parse_json_object` refuses."""
    try:
        data = _parse(text)
        _check_tree(data)
    except RecursionError:
        raise invalid(field, f"holds JSON whose arrays and objects are nested deeper than {MAX_NESTING} "
                             f"levels") from None
    except _NotJson as exc:
        inner = "" if exc.field == "(the body)" else f" at {exc.field}"
        raise invalid(field, f"holds JSON that is refused{inner}: {exc.problem}") from None
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise invalid(field, f"is not valid JSON ({exc})") from None
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
    if not INT64_MIN <= value <= INT64_MAX:
        raise invalid(field, f"must be a 64-bit integer (from {INT64_MIN} to {INT64_MAX}), got {value}")
    if minimum is not None and value < minimum:
        raise invalid(field, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise invalid(field, f"must be at most {maximum}, got {value}")
    return value


def get_number(body: Mapping[str, Any], name: str, *, where: str | None = None, minimum: float | None = None,
               maximum: float | None = None, above: float | None = None) -> float | None:
    """A finite number, checked against the inclusive `minimum` / `maximum` and the exclusive
    `above` where given; None when absent or null."""
    field = where or name
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(field, "a number", value)
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise invalid(field, f"must be a number of at most 64-bit magnitude, got {value}")
    number = float(value)
    if not math.isfinite(number):  # parse_json_object never lets one through; bodies built in code might
        raise invalid(field, f"must be a finite number, got {number}")
    if minimum is not None and number < minimum:
        raise invalid(field, f"must be at least {minimum}, got {value}")
    if maximum is not None and number > maximum:
        raise invalid(field, f"must be at most {maximum}, got {value}")
    if above is not None and not number > above:
        raise invalid(field, f"must be greater than {above}, got {value}")
    return number


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


BODY = web.RequestKey("flare_body", bytes)


def json_body(request: web.Request) -> dict[str, Any]:
    """The request's body (received whole by the ingress middleware) as a JSON object."""
    return parse_json_object(request.get(BODY, b""))
