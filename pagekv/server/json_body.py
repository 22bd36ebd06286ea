"""A request body as a JSON object, parsed safely: UTF-8, a nesting limit checked on the raw
bytes before any parser recurses (``MAX_JSON_DEPTH``), JSON, an object, and strings that are
valid Unicode (lone UTF-16 surrogates such as ``"\\ud800"`` decode, but no tokenizer or encoder
takes them). Every failure is an ``InvalidRequestError`` (400) naming where it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from pagekv.errors import InvalidRequestError

MAX_JSON_DEPTH = 32  # arrays and objects inside each other; the bodies of this API need few
_STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"'  # a JSON string, escapes included
_STRING_OR_BRACKET = re.compile(_STRING + rb"|[\[\]{}]")
_STRINGS = re.compile(_STRING)
_NOT_OPENING = bytes(b for b in range(256) if b not in b"[{")
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json(raw: bytes, fields: Collection[str] = ()) -> dict[str, Any]:
    """The JSON object in ``raw``; 400 for bad UTF-8, deep nesting, bad JSON, a non-object or
    a string that is not valid Unicode."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid UTF-8: {exc.reason}") from None
    check_depth(raw, fields)
    try:
        data = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than int() takes
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    bad_text = invalid_text_path(data)
    if bad_text is not None:
        param = bad_text or "body"
        raise InvalidRequestError(f"{param}: not valid Unicode (a lone UTF-16 surrogate)", param)
    return data


def check_depth(raw: bytes, fields: Collection[str] = ()) -> None:
    """Refuse JSON whose arrays and objects nest deeper than ``MAX_JSON_DEPTH``, from the raw
    bytes and before any parser recurses; ``param`` is the top-level field holding the depth.

    Brackets inside strings do not count. A body with fewer opening brackets than the limit
    cannot be too deep, so an ordinary body costs one substitution and one ``translate``.
    """
    skeleton = _STRINGS.sub(b'""', raw)
    if len(skeleton.translate(None, _NOT_OPENING)) <= MAX_JSON_DEPTH:
        return
    depth, outer, key = 0, 0, b""
    for match in _STRING_OR_BRACKET.finditer(raw):
        first = raw[match.start()]
        if first == ord('"'):
            key = match.group() if depth == 1 else key
        elif first in b"[{":
            depth += 1
            outer = outer or first
            if depth > MAX_JSON_DEPTH:
                param = _field_named(key, fields) if outer == ord("{") else "body"
                raise InvalidRequestError(
                    f"{param}: nested deeper than {MAX_JSON_DEPTH} arrays or objects", param
                )
        else:
            depth -= 1


def _field_named(key: bytes, fields: Collection[str]) -> str:
    """The request field a raw JSON key names, or ``body`` for a key that names none."""
    try:
        name = json.loads(key)
    except ValueError:
        return "body"
    return name if name in fields else "body"


def invalid_text_path(value: Any, path: str = "") -> str | None:
    """Where the first string (object key or value) in ``value`` that is not valid Unicode is,
    as ``messages[0].content`` ("" for the top); None if every string is valid.

    A bad key is reported as the object holding it, so a reported path is itself valid text.
    """
    if isinstance(value, str):
        return None if _is_unicode(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            if not _is_unicode(key):
                return path
            found = invalid_text_path(item, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, str | dict | list):
                continue  # a number, a bool or null: no text (and token id lists are long)
            found = invalid_text_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _is_unicode(text: str) -> bool:
    """No lone surrogate: ``text`` encodes as UTF-8."""
    return text.isascii() or _SURROGATE.search(text) is None
