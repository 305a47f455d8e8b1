"""The JSON a request body must be: ``application/json`` in UTF-8, one value, no duplicate keys.

FastAPI alone takes any ``*/*+json`` media type, guesses UTF-16 and UTF-32
from the bytes and lets the last of two equal keys win; what one reader of a
body sees must be what every reader sees, so those are ``400
invalid_argument``, each with a message that says what is wrong and where.

A command body is a flat object without escapes; that common case is parsed
by orjson (~10x cheaper than the stdlib with a duplicate-key hook, issue 12)
and its keys counted in the text to refuse a duplicate. Anything else, and
anything orjson refuses, goes to the stdlib parser, which decides and words
the error: both give the same value or the same error for every body.
"""

from __future__ import annotations

import json
import re
from itertools import repeat
from typing import Any, NoReturn

import orjson

from roomservice import errors

MEDIA_TYPE = "application/json"
_SHOWN = 100  # characters of a bad Content-Type echoed back


def check_media_type(content_type: str | None) -> None:
    """``application/json``, optionally with ``charset=utf-8`` (any case); anything else is invalid."""
    if not content_type:
        raise errors.InvalidArgument(f"the body must be JSON sent with Content-Type: {MEDIA_TYPE}; none was given")
    media, _, params = content_type.partition(";")
    problem = None
    if media.strip().lower() != MEDIA_TYPE:
        problem = "a different media type"
    else:
        for param in params.split(";"):
            if not param.strip():
                continue
            name, _, value = param.partition("=")
            if name.strip().lower() != "charset" or value.strip().strip('"').lower() not in ("utf-8", "utf8"):
                problem = f"the parameter {param.strip()[:_SHOWN]!r} (only charset=utf-8 is accepted)"
                break
    if problem is not None:
        raise errors.InvalidArgument(
            f"the body must be sent with Content-Type: {MEDIA_TYPE} (UTF-8); got {content_type[:_SHOWN]!r}: {problem}"
        )


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _constant(name: str) -> NoReturn:
    raise ValueError(name)


_STRING = re.compile(rb'"[^"]*"(\s*:)?')  # a string without escapes, and the colon that makes it a key
_BOM = b"\xef\xbb\xbf"
# no float: orjson reads an integer beyond 64 bits as one, the stdlib as an int (and no command takes one)
_SCALARS = (str, int, bool, type(None))


def parse(body: bytes) -> Any:
    """The JSON value of ``body``; raises InvalidArgument saying what is wrong and where."""
    if b"\\" not in body and not body.startswith(_BOM):
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # the stdlib parser says what is wrong and where
        else:
            if _flat_without_duplicates(body, value):
                return value
    return _parse_stdlib(body)


def _flat_without_duplicates(body: bytes, value: Any) -> bool:
    """Is ``value`` an object of strings, integers, booleans and nulls with as many keys as ``body``
    (no backslash in it) spells?

    Without escapes every string is ``"[^"]*"``, matched left to right from the first quote, and a
    string is a key exactly when a colon follows it; orjson keeps one of two equal keys, so a
    duplicate shows as fewer keys than the text has.
    """
    if not isinstance(value, dict) or not all(map(isinstance, value.values(), repeat(_SCALARS))):
        return False
    # findall gives each string's group: the colon (a key) or b"" (a value); counted in C, not a loop
    strings = _STRING.findall(body)
    return len(strings) - strings.count(b"") == len(value)


def _parse_stdlib(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.InvalidArgument(
            f"the body is not UTF-8: byte 0x{body[exc.start]:02x} at offset {exc.start} ({exc.reason})"
        ) from None
    try:
        value = json.loads(text, object_pairs_hook=_object, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise errors.InvalidArgument(
            f"the body is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    except _DuplicateKey as exc:
        shown = exc.key[:_SHOWN]
        message = f"the body has a duplicate key {shown!r}; a key may appear once per object"
        raise errors.InvalidArgument(message) from None
    except ValueError as exc:  # NaN, Infinity, -Infinity
        raise errors.InvalidArgument(f"the body is not valid JSON: {exc} is not a JSON number") from None
    except RecursionError:  # arrays or objects nested deeper than the parser's stack
        raise errors.InvalidArgument(_TOO_DEEP) from None
    if "\\u" in text:  # an escaped lone surrogate decodes to a str no encoder can write back
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise errors.InvalidArgument(
                "the body has a \\u escape that is an unpaired UTF-16 surrogate; strings must be valid Unicode"
            ) from None
        except RecursionError:
            raise errors.InvalidArgument(_TOO_DEEP) from None
    return value


_TOO_DEEP = "the body nests arrays or objects too deeply to be a request"
