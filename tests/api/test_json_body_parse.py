"""json_body.parse: orjson for flat objects without escapes, the stdlib for the rest — one answer for every body.

The stdlib parser with the duplicate-key hook (``_parse_stdlib``) is the
reference: for any body, ``parse`` gives the same value (same types) or the
same InvalidArgument message.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roomservice import errors
from roomservice.api import json_body


def _outcome(parser: Any, body: bytes) -> tuple[str, Any]:
    try:
        value = parser(body)
    except errors.InvalidArgument as exc:
        return "error", str(exc)
    return "value", _typed(value)


def _typed(value: Any) -> Any:
    """The value with each scalar's type beside it (1 == 1.0 == True in Python)."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value).__name__, repr(value))


def _same(body: bytes) -> None:
    assert _outcome(json_body.parse, body) == _outcome(json_body._parse_stdlib, body), body


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
keys = st.sampled_from(["command_id", "user_id", "a", ":", '"', "a\\b", "é", ""]) | st.text(max_size=4)


@st.composite
def objects(draw: st.DrawFn) -> bytes:
    """A JSON object as a client may spell it: maybe a duplicate key, maybe nested, any separators."""
    pairs = draw(st.lists(st.tuples(keys, scalars | st.lists(scalars, max_size=2)), max_size=5))
    if pairs and draw(st.booleans()):
        pairs.append((pairs[0][0], draw(scalars)))  # a duplicate key
    comma, colon = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]))
    ascii_only = draw(st.booleans())
    text = "{" + comma.join(json.dumps(k, ensure_ascii=ascii_only) + colon +
                            json.dumps(v, ensure_ascii=ascii_only) for k, v in pairs) + "}"
    return text.encode()


@settings(max_examples=400, deadline=None)
@given(objects())
def test_any_object_parses_as_the_stdlib_parses_it(body: bytes) -> None:
    _same(body)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=30))
def test_any_bytes_parse_as_the_stdlib_parses_them(body: bytes) -> None:
    _same(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"command_id":"c1","user_id":"u1"}',
        b'{"command_id": "c1", "command_id": "c2"}',
        b'{"a":"x",":":1}',  # a key that is a colon
        b'{"a":"x","a" :1}',
        b'{"a":1}{"b":2}',
        b'{"a":NaN}',
        b'{"a":Infinity}',
        b'{"a":1e999}',
        b'{"a":123456789012345678901234567890}',
        b'\xef\xbb\xbf{"a":1}',
        b'{"a":"\xff"}',
        b'{"a":"\xed\xa0\x80"}',  # a surrogate spelled in UTF-8
        b'{"a":"\\ud800"}',  # an escaped lone surrogate
        b'{"a":"\x01"}',
        b'{"a":{"b":1,"b":2}}',
        b'{"a":[1,{"b":1}]}',
        b"[" * 2000 + b"]" * 2000,
        b'{"a":' * 1000 + b"1" + b"}" * 1000,
        b"",
        b"  ",
        b'{"a":1,}',
        b'{"a":01}',
        b"{'a':1}",
        b'{"a":1} ',
        b'\n{"a" : true , "b" : null}\r\n',
    ],
)
def test_edge_bodies_parse_as_the_stdlib_parses_them(body: bytes) -> None:
    _same(body)


def test_a_duplicate_key_is_refused_on_the_fast_path_too() -> None:
    with pytest.raises(errors.InvalidArgument, match="duplicate key 'user_id'"):
        json_body.parse(b'{"user_id":"a","command_id":"c","user_id":"b"}')


def test_a_command_body_does_not_need_the_stdlib_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    def unused(body: bytes) -> None:
        raise AssertionError("the stdlib parser was used")

    monkeypatch.setattr(json_body, "_parse_stdlib", unused)
    body = b'{"command_id": "c1", "sender_id": "u1", "receiver_id": "o", "gift_id": "rose", "count": 2}'
    assert json_body.parse(body) == json.loads(body)
