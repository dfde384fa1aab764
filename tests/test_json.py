"""The JSON seam: msgspec in front, the standard library's results for everything it refuses."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from asgi_lifetime import _json


def _stdlib(raw: bytes) -> Any:
    return json.loads(raw.decode("utf-8"))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages":[{"role":"user","content":"hi \xe2\x80\x99 \\u00e9"}],"temperature":0.7,"n":1}',
        b"123456789012345678901234567890",
        b"-0",
        b"[1e-7, 5e-324, 1.7976931348623157e308]",
        b'{"a":1,"a":2}',
        b" \t\n\r[] ",
        b'"\\u0000"',
        b'{"\\ud83d\\ude00": 1}',
        # Refused by msgspec, accepted by the standard library: parsed by the fallback.
        b"NaN",
        b"[Infinity, -Infinity]",
        b"1e400",
        b'"\\ud800"',
        b'"\\udc00x"',
    ],
)
def test_loads_matches_the_standard_library(raw: bytes) -> None:
    assert _same(_json.loads(raw), _stdlib(raw))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[1,]",
        b'{"a":1} x',
        b"01",
        b'"a\x01b"',
        b'"\xff"',
        b'"\xed\xa0\x80"',
        b"\xef\xbb\xbf{}",
        b"\x00",
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_loads_refuses_what_the_standard_library_refuses(raw: bytes) -> None:
    with pytest.raises(_json.JSONDecodeFailure):
        _json.loads(raw)


def test_non_finite_numbers_from_a_request_are_written_back_as_received() -> None:
    parsed = _json.loads(b'{"a":NaN,"b":Infinity,"c":-Infinity,"d":1e400,"e":1.5}')
    assert _json.dumps(parsed) == b'{"a":NaN,"b":Infinity,"c":-Infinity,"d":Infinity,"e":1.5}'


@pytest.mark.parametrize(
    "value",
    [
        {"messages": [{"role": "user", "content": 'é ’ λ \n " \\ \x00'}], "n": 2**70, "t": None, "s": True},
        {1: "int key"},
        {True: "bool key", None: "null key"},  # msgspec refuses these keys: the standard library writes them
        [1.5, -0.0, 0.1],
    ],
)
def test_dumps_writes_what_the_standard_library_writes(value: Any) -> None:
    expected = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    assert _json.dumps(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"messages": math.inf}, b'{"messages":Infinity}'),
        ([1.0, [{"a": -math.inf}]], b'[1.0,[{"a":-Infinity}]]'),
        ({"t": math.nan}, b'{"t":NaN}'),
    ],
)
def test_non_finite_floats_a_preparer_adds_are_written_as_the_standard_library_writes_them(
    value: Any, expected: bytes
) -> None:
    assert _json.dumps(value) == expected


def test_dumps_round_trips_through_loads() -> None:
    doc = {"messages": [{"role": "user", "content": "x" * 1000 + "’"} for _ in range(50)], "max_tokens": 5}
    assert _json.loads(_json.dumps(doc)) == doc


def test_dumps_of_str_subclass_falls_back() -> None:
    class Name(str):
        pass

    assert _json.dumps({"k": Name("v")}) == b'{"k":"v"}'


def test_dumps_refuses_what_cannot_be_encoded() -> None:
    with pytest.raises(TypeError):
        _json.dumps({"k": object()})
    with pytest.raises(UnicodeEncodeError):
        _json.dumps("\ud800")
