"""JSON Schema of the contract, generated from the dataclasses themselves.

`python -m flare_core.contract.schema > docs/contract.schema.json` regenerates the file in
docs/; a test fails when the committed file is out of date. Callables (how a recipe builds
its model, maps weights, ...) are part of the Python contract but not of its data; the schema
marks them with `"x-python-callable": true`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import types
import typing
from typing import Any

from flare_core.contract import types as contract_types
from flare_core.contract.template_patch import TemplatePatch

ROOTS = (contract_types.Recipe, contract_types.CacheSchemeFactory, contract_types.Parser, TemplatePatch)


def _field_schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return {}
    if tp is type(None):
        return {"type": "null"}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        _define(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_field_schema(a, defs) for a in args]}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _field_schema(args[0], defs)}
        return {"type": "array", "prefixItems": [_field_schema(a, defs) for a in args],
                "minItems": len(args), "maxItems": len(args)}
    if origin in (dict, collections.abc.Mapping):
        return {"type": "object", "additionalProperties": _field_schema(args[1], defs)}
    if origin is collections.abc.Callable or tp is collections.abc.Callable or _is_call_protocol(tp):
        return {"x-python-callable": True}
    raise TypeError(f"no JSON Schema mapping for {tp!r}")


def _is_call_protocol(tp: Any) -> bool:
    """A Protocol whose one member is `__call__` (BuildModel, MapWeights): a callable."""
    return getattr(tp, "_is_protocol", False) and "__call__" in vars(tp)


def _define(cls: type, defs: dict[str, Any]) -> None:
    if cls.__name__ in defs:
        return
    defs[cls.__name__] = {}  # placeholder stops recursion
    hints = typing.get_type_hints(cls, vars(contract_types))
    properties, required = {}, []
    for f in dataclasses.fields(cls):
        properties[f.name] = _field_schema(hints[f.name], defs)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    doc = " ".join((cls.__doc__ or "").split())
    defs[cls.__name__] = {"type": "object", "description": doc, "properties": properties,
                          "required": required, "additionalProperties": False}


def contract_schema() -> dict[str, Any]:
    defs: dict[str, Any] = {}
    for root in ROOTS:
        _define(root, defs)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://flare.dev/schema/contract-{contract_types.CONTRACT_VERSION}.json",
        "title": f"Flare recipe contract {contract_types.CONTRACT_VERSION}",
        "description": "Objects a Flare plugin registers through its hooks.",
        "anyOf": [{"$ref": f"#/$defs/{r.__name__}"} for r in ROOTS],
        "$defs": dict(sorted(defs.items())),
    }


def render() -> str:
    return json.dumps(contract_schema(), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":
    print(render(), end="")
