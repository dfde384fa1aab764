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


class _Name(str):
    pass


@pytest.mark.parametrize(
    ("doc", "consumed"),
    [
        (
            {"model": "m", "messages": [{"role": "user", "content": 'é ’ — λ \n " \\ \x00'}, {"x": 1e-5, "n": 2**70}]},
            True,
        ),
        ({"stream": True, "input": [], "max_tokens": 5}, True),
        ({1: "int key", "contents": [{"parts": [{"text": "hi"}]}, [1.5, -0.0]], "after": None}, True),
        # What msgspec refuses or writes differently: dumps writes it, the list is left whole.
        ({"messages": [{"a": 1e16}, {"b": 2.5e-7}, {True: "bool key"}], "x": 1e-5}, False),  # refused: item 3
        ({"messages": [{"a": 1}, {"b": 2}], "x": {None: "null key"}}, False),  # refused: after the list
        ({"messages": [{"a": 1}, {"b": math.nan}]}, False),  # non-finite
        ({"messages": [{"k": _Name("v")}, "plain"]}, False),  # a str subclass value
    ],
)
def test_dumps_consuming_writes_what_dumps_writes(doc: Any, consumed: bool) -> None:
    key = next(k for k in ("messages", "input", "contents") if k in doc)
    expected = _json.dumps(doc)
    items = list(doc[key])
    keys = list(doc)
    written = _json.dumps_consuming(doc, key)
    assert written == expected
    assert list(doc) == keys
    if consumed:
        assert doc[key] == []  # every item was dropped as it was written
    else:
        assert _same(doc[key], items)


def test_dumps_consuming_drops_each_item_as_it_is_written() -> None:
    class Item(dict[str, Any]):
        pass

    import weakref

    items = [Item(role="user", content=f"turn {n} " + "x" * 1000) for n in range(20)]
    refs = [weakref.ref(item) for item in items]
    doc = {"model": "m", "messages": items, "max_tokens": 5}
    expected = _json.dumps(doc)
    del items
    alive: list[int] = []
    written = _json.dumps_consuming(
        doc, "messages", every=4000, progress=lambda: alive.append(sum(r() is not None for r in refs))
    )
    assert written == expected
    assert doc == {"model": "m", "messages": [], "max_tokens": 5}
    assert all(r() is None for r in refs)
    assert alive and alive == sorted(alive, reverse=True) and alive[0] < 20 and alive[-1] < 5  # freed while writing


def test_dumps_consuming_leaves_the_list_when_it_fails_or_is_shared() -> None:
    doc: dict[str, Any] = {"messages": [{"a": 1}, {"b": object()}]}
    with pytest.raises(TypeError):
        _json.dumps_consuming(doc, "messages")
    assert doc["messages"][0] == {"a": 1} and len(doc["messages"]) == 2  # the written item was put back
    surrogate: dict[str, Any] = {"messages": [{"a": 1}, "\ud800"]}
    assert _json.dumps_consuming(surrogate, "messages") == b'{"messages":[{"a":1},"\\ud800"]}'
    assert surrogate["messages"] == [{"a": 1}, "\ud800"]  # written by dumps, whole
    shared = [{"a": 1}]
    doc = {"messages": shared, "copy": {"of": shared}}
    assert _json.dumps_consuming(doc, "messages") == b'{"messages":[{"a":1}],"copy":{"of":[{"a":1}]}}'
    assert shared == [{"a": 1}]


# --- lone surrogates: accepted, and written back as the escapes they came as -----------------------

SURROGATE_BODIES = [
    b'{"messages":[{"role":"user","content":"a \\ud800 b"}]}',
    b'{"messages":[{"role":"user","content":"\\udfff"}],"t":NaN}',
    b'{"k\\udbff":["\\udc00x",{"\\ud83d":1e400}],"messages":[]}',
    b'["\\ud83d\\ude00 a pair is fine", "\\ud83d alone is not"]',
]


@pytest.mark.parametrize("raw", SURROGATE_BODIES)
def test_dumps_writes_a_lone_surrogate_as_its_escape(raw: bytes) -> None:
    parsed = _json.loads(raw)
    written = _json.dumps(parsed)
    written.decode("utf-8")  # valid UTF-8: no surrogate was encoded
    assert _same(_stdlib(written.replace(b"NaN", b'"nan"')), _stdlib(raw.replace(b"NaN", b'"nan"')))
    assert _same(_json.loads(written), parsed)


@pytest.mark.parametrize("raw", [r for r in SURROGATE_BODIES if r.startswith(b'{"messages"')])
def test_dumps_consuming_writes_a_lone_surrogate_as_its_escape(raw: bytes) -> None:
    doc = _json.loads(raw)
    expected = _json.dumps(doc)
    assert _json.dumps_consuming(doc, "messages") == expected


@pytest.mark.parametrize(
    "value",
    ["\ud800", {"\udfff": "x"}, ["ok", {"nested": ["\udc00 tail"]}], {"f": math.nan, "s": "\ud800"}],
)
def test_dumps_never_raises_for_a_surrogate_a_preparer_wrote(value: Any) -> None:
    written = _json.dumps(value)
    written.decode("utf-8")
    assert b"\\ud" in written
