"""Chat templates rendered the way Hugging Face Transformers renders them, plus `{% mark %}`.

Semantics follow `transformers.utils.chat_template_utils` (5.x): an immutable
sandbox with trim_blocks + lstrip_blocks and loop controls, a `tojson` filter that
does not escape HTML or non-ASCII, `raise_exception` and `strftime_now` globals,
messages with None-valued keys dropped, every input rebuilt from plain JSON types,
and reasoning accepted under `reasoning_content`, `thinking` or `reasoning`.
Special tokens (bos_token, eos_token, ...) are ordinary keyword arguments, as
Transformers passes them.

`{% mark %}` emits no text; it records the UTF-8 byte offset of the output at that
point. It is implemented with a random per-render sentinel that the tag prints and
`render` cuts out, so it stays exact inside loops, macros and captured blocks, and
no message content can forge it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from flare_core.contract.protocols import ConversationRenderer, RenderedPrompt

# Context variable the mark tag prints; `render` fills it with a fresh sentinel each time.
_SENTINEL_VARIABLE = "_flare_mark_sentinel"

# Names a message's reasoning may arrive under; templates read the first one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateError(jinja2.exceptions.TemplateError):
    """A chat template failed to compile or render, or raised an error itself."""


class _MarkExtension(jinja2.ext.Extension):
    tags = {"mark"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        return jinja2.nodes.Output([jinja2.nodes.Name(_SENTINEL_VARIABLE, "load")], lineno=lineno)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, which could reach the object's internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors Namespace, so `namespace(self=1)` works
        self, positional = args[0], args[1:]
        for name in dict(*positional, **kwargs):
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, *positional, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set namespace attribute {name!r}")


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    # Templates call dict(...) to build mappings; exposing a function instead of the type hides the type's attributes.
    return dict(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template raised an error: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates need plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _new_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_MarkExtension, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _make_dict
    environment.globals["namespace"] = _TemplateNamespace
    return environment


def _plain_data(value: Any, where: str) -> Any:
    """A copy of `value` made only of JSON types, so the sandbox never sees caller objects or their methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (enums, numpy scalars) carry extra methods the sandbox would expose; keep only the base value.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(key, where): _plain_data(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_data(item, f"{where}[{index}]") for index, item in enumerate(value)]
    raise TypeError(
        f"{where} must hold only JSON data (dict, list, str, int, float, bool, None), got {type(value).__name__}"
    )


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    prepared = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{index}] must be a mapping, got {type(message).__name__}")
        # Clients send `"content": null` and the like; templates handle a missing key but not a None value.
        present = {key: value for key, value in message.items() if value is not None}
        message = _plain_data(present, f"messages[{index}]")
        reasoning = next((message[field] for field in _REASONING_FIELDS if message.get(field) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


class ChatTemplate:
    """A chat template compiled once; `render` turns a conversation into prompt text and mark offsets."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _new_environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise TemplateError(f"chat template does not compile: line {error.lineno}: {error.message}") from error

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **template_kwargs: Any,
    ) -> RenderedPrompt:
        """Render like Transformers' `apply_chat_template(..., tokenize=False)`; extra kwargs reach the template."""
        if _SENTINEL_VARIABLE in template_kwargs:
            raise ValueError(f"template keyword {_SENTINEL_VARIABLE!r} is reserved for {{% mark %}}")
        if tools is not None:
            for index, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise TypeError(f"tools[{index}] must be a JSON schema mapping, got {type(tool).__name__}")
        nonce = secrets.token_hex(16)
        sentinel = f"\x00mark-{nonce}\x00"
        context = {
            "messages": _template_messages(messages),
            "tools": _plain_data(tools, "tools"),
            "documents": _plain_data(documents, "documents"),
            "add_generation_prompt": add_generation_prompt,
            **{name: _plain_data(value, name) for name, value in template_kwargs.items()},
            _SENTINEL_VARIABLE: sentinel,
        }
        try:
            marked_text = self._template.render(context)
        except TemplateError:
            raise
        # Python errors here come from the template operating on request data (e.g. `None + "text"`).
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, LookupError, ArithmeticError) as error:
            raise TemplateError(f"chat template failed to render: {type(error).__name__}: {error}") from error
        return _cut_marks(marked_text, sentinel, nonce)


def _cut_marks(marked_text: str, sentinel: str, nonce: str) -> RenderedPrompt:
    pieces = marked_text.split(sentinel)
    text = "".join(pieces)
    if nonce in text:
        raise TemplateError(
            "chat template altered the output of a {% mark %} tag (e.g. with a filter), so its offset is lost"
        )
    marks: list[int] = []
    offset = 0
    for piece in pieces[:-1]:
        # surrogatepass: escaped special-token spellings carry lone-surrogate brackets (see literals)
        offset += len(piece.encode("utf-8", "surrogatepass"))
        if not marks or marks[-1] != offset:
            marks.append(offset)
    return RenderedPrompt(text=text, marks=tuple(marks))
