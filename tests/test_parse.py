"""The first parse of a body: its cost bounded before it runs, charged, refused past 8x, off the loop.

``parse_cost`` must be an upper bound of what the parse allocates (tracemalloc's peak) on
every shape, pathological or realistic; ``parse_body`` refuses what would exceed
``parse_limit`` and accepts legitimate LLM bodies; the standard library parses again
only what msgspec refused for a reason it does not share.
"""

from __future__ import annotations

import gc
import json
import random
import threading
import tracemalloc
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asgi_lifetime import _json, _parse
from asgi_lifetime._exceptions import BodyTooComplex
from asgi_lifetime._parse import PARSE_SLACK, THREAD_THRESHOLD, parse_body, parse_cost, parse_limit, stdlib_extra
from benchmarks.bodies import make_body

from .test_fingerprint import CORPUS

KiB = 1024
MiB = 1024 * KiB
N = 60_000


def _array(item: bytes, n: int = N) -> bytes:
    return b"[" + b",".join([item] * n) + b"]"


def _rng_ids(seed: int, n: int, high: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(high) for _ in range(n)]


# Bodies whose parse multiplies their size: each must be estimated from above, and refused.
PATHOLOGICAL: dict[str, bytes] = {
    "empty dicts": b'{"messages":[' + b",".join([b"{}"] * N) + b"]}",
    "empty lists": _array(b"[]"),
    "nested lists": _array(b"[[[]]]"),
    "one-key dicts": _array(b'{"a":1}'),
    "distinct one-key dicts": b"[" + b",".join(b'{"k%d":1}' % i for i in range(N)) + b"]",
    "short strings": _array(b'"ab"'),
    "short non-ASCII strings": _array('"éb"'.encode()),
    "one emoji strings": _array('"😀"'.encode()),
    "escaped one-char strings": _array(b'"\\""'),
    "small floats": _array(b"0.5"),
    "four-digit ints": _array(b"1000"),
    "dict of many keys": b"{" + b",".join(b'"k%d":1' % i for i in range(N)) + b"}",
    "deep nesting": b"[" * 900 + b"]" * 900,
    "deep nesting, wide": _array(b"[" * 40 + b"]" * 40, 2000),
}

# Bodies that multiply less, or not at all: estimated from above, and accepted.
MODEST: dict[str, bytes] = {
    "empty strings": _array(b'""'),
    "small ints": _array(b"7"),
    "trues and nulls": _array(b"true,null"),
    "token ids, five digits": _array(b"12345"),
    "token ids, real mix": json.dumps({"input": [_rng_ids(seed, 8000, 100_256) for seed in range(8)]}).encode(),
    "huge ints": _array(b"1" * 40, 20_000),
    "emoji then ASCII": json.dumps(["😀" + "a" * 1000] * 500, ensure_ascii=False).encode(),
    "emoji then ASCII, escaped": json.dumps(["😀" + "a" * 1000] * 500).encode(),
    "escaped quotes": b'["' + b'\\"' * 300_000 + b'"]',
    "escaped backslashes": b'["' + b"\\\\" * 300_000 + b'"]',
    "no commas": b'{"a":"' + b"x" * (3 * MiB) + b'"}',
    "pretty printed": json.dumps({"messages": [{"role": "user", "content": "hello " * 40}] * 2000}, indent=2).encode(),
    "tool results of JSON": json.dumps(
        {
            "messages": [{"role": "tool", "content": json.dumps([{"id": i, "tags": ["a", "b"]} for i in range(3000)])}]
            * 8
        }
    ).encode(),
    "code with braces": json.dumps(
        {"messages": [{"role": "user", "content": "def f(a, b):\n    return {'a': [a, b]}\n" * 20_000}] * 4}
    ).encode(),
    "turns": make_body("turns", 3 * MiB),
    "huge text": make_body("huge_text", 3 * MiB),
    "image": make_body("image", 3 * MiB),
}

# What the standard library parses after msgspec refused it.
STDLIB: dict[str, bytes] = {
    "NaN": b'{"messages":[{"role":"user","content":"' + b"x" * 100_000 + b'"}],"t":[' + b"NaN," * 999 + b"NaN]}",
    "NaN, dense": _array(b"NaN", 20_000),
    "Infinity": b'{"messages":[{"role":"user","content":"' + b"x" * 100_000 + b'"}],"t":-Infinity}',
    "1e400": _array(b"1e400", 20_000),
    "lone surrogates": _array(b'"\\ud800 and some text' + b" and more" * 30 + b'"', 2_000),
    "lone surrogate in a long string": b'{"content":"\\udc00' + "é".encode() * 200_000 + b'"}',
}


def _parses(raw: object) -> bool:
    try:
        _json.loads(raw)  # type: ignore[arg-type]
    except (_json.JSONDecodeFailure, TypeError):
        return False
    return True


def _peak(function: Callable[[], Any]) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        value = function()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del value
    return peak


@pytest.mark.parametrize("raw", [pytest.param(raw, id=name) for name, raw in {**PATHOLOGICAL, **MODEST}.items()])
def test_parse_cost_is_an_upper_bound_of_the_parse(raw: bytes) -> None:
    actual = _peak(lambda: _json.loads_fast(raw))
    estimate = parse_cost(raw)
    assert actual <= estimate


@pytest.mark.parametrize("raw", [pytest.param(raw, id=name) for name, raw in STDLIB.items()])
def test_parse_cost_bounds_the_standard_library_parse_too(raw: bytes) -> None:
    with pytest.raises(_json.StdlibMayAccept):
        _json.loads_fast(raw)
    actual = _peak(lambda: _json.loads_stdlib(raw))
    cost = parse_cost(raw)
    assert actual <= cost + stdlib_extra(raw, cost)


@pytest.mark.parametrize("raw", [pytest.param(raw, id=name) for name, raw in PATHOLOGICAL.items()])
@pytest.mark.anyio
async def test_a_body_whose_parse_multiplies_it_is_refused_before_parsing(
    raw: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    charged: list[int] = []

    async def charge(total: int) -> None:
        charged.append(total)

    def never(raw: bytes) -> Any:
        raise AssertionError("parsed a body that was refused")

    monkeypatch.setattr(_json, "loads_fast", never)
    with pytest.raises(BodyTooComplex) as refused:
        await parse_body(raw, charge=charge)
    assert charged == []
    assert refused.value.status_code == 413 and refused.value.code == "body_too_complex"
    assert refused.value.to_dict()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [pytest.param(raw, id=name) for name, raw in {**PATHOLOGICAL, **MODEST}.items()])
def test_what_is_accepted_stays_within_eight_times_its_size(raw: bytes) -> None:
    cost = parse_cost(raw)
    if len(raw) + cost > parse_limit(len(raw)):
        return  # refused (the test above): never parsed
    assert len(raw) + _peak(lambda: _json.loads_fast(raw)) <= parse_limit(len(raw))


@pytest.mark.parametrize(
    "raw",
    [pytest.param(raw, id=name) for name, raw in MODEST.items()]
    + [pytest.param(raw, id=f"corpus-{n}") for n, (raw, _) in enumerate(p.values for p in CORPUS) if _parses(raw)],
)
@pytest.mark.anyio
async def test_legitimate_bodies_are_accepted_and_charged_their_parse(raw: bytes) -> None:
    charged: list[int] = []

    async def charge(total: int) -> None:
        charged.append(total)

    expected = _json.loads(raw)
    parsed = await parse_body(raw, charge=charge)
    assert parsed == expected
    assert charged == [len(raw) + max(0, parse_cost(raw) - PARSE_SLACK)]


@pytest.mark.parametrize("raw", [pytest.param(raw, id=name) for name, raw in STDLIB.items()])
@pytest.mark.anyio
async def test_the_standard_library_parse_is_charged_its_decoded_copy(raw: bytes) -> None:
    charged: list[int] = []

    async def charge(total: int) -> None:
        charged.append(total)

    cost = parse_cost(raw)
    total = cost + stdlib_extra(raw, cost)
    if len(raw) + total > parse_limit(len(raw)):  # a dense body: refused before or after msgspec's attempt
        with pytest.raises(BodyTooComplex):
            await parse_body(raw, charge=charge)
        assert charged == ([] if len(raw) + cost > parse_limit(len(raw)) else [len(raw) + max(0, cost - PARSE_SLACK)])
        return
    parsed = await parse_body(raw, charge=charge)
    assert json.dumps(parsed) == json.dumps(json.loads(raw.decode()))
    assert charged == [len(raw) + max(0, c - PARSE_SLACK) for c in (cost, total)]


# --- the second pass -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"NaN",
        b"[1, NaN]",
        b"[Infinity]",
        b"-Infinity",
        b'{"t": 1e400}',
        b"-1e400",
        b'"\\ud800"',
        b'"\\udc00x"',
        b'{"a\\uDBFF": 1}',
        b'["\\ud800 tail", 1]',
    ],
)
def test_the_standard_library_parses_what_msgspec_refuses_for_its_own_reasons(
    raw: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    stdlib = json.loads

    def counting(text: str, **kw: Any) -> Any:
        calls.append(text)
        return stdlib(text, **kw)

    monkeypatch.setattr(json, "loads", counting)
    assert json.dumps(_json.loads(raw)) == json.dumps(stdlib(raw.decode()))
    assert len(calls) == 1


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
        b"[" * 100_000 + b"]" * 100_000,
        b'{"messages": [{"role": "user", "content": "cut',  # truncated, no surrogate escape
        b'{"a": nan}',
        b"[+1]",
        b"[.5]",
        b'{"a" 1}',
        b"[" + b"{}," * 100_000 + b"x]",  # a syntax error after many values: one pass only
    ],
)
def test_a_syntax_error_is_not_parsed_twice(raw: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(text: str, **kw: Any) -> Any:
        raise AssertionError("the standard library parsed a body msgspec refused for a syntax error")

    monkeypatch.setattr(json, "loads", never)
    with pytest.raises(_json.JSONDecodeFailure) as failure:
        _json.loads(raw)
    assert not isinstance(failure.value, _json.StdlibMayAccept)


# --- off the event loop ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_large_parse_runs_in_a_worker_thread_and_the_loop_keeps_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered = threading.Event()
    release = threading.Event()
    loop_thread = threading.get_ident()
    parse_threads: list[int] = []
    real = _json.loads_fast

    def blocked(raw: bytes) -> Any:
        parse_threads.append(threading.get_ident())
        entered.set()
        assert release.wait(10), "the parse was never released"
        return real(raw)

    monkeypatch.setattr(_json, "loads_fast", blocked)
    raw = make_body("turns", THREAD_THRESHOLD + 1)
    results: list[Any] = []
    ticks = 0

    async def charge(total: int) -> None:
        pass

    async def parse() -> None:
        results.append(await parse_body(raw, charge=charge))

    async with anyio.create_task_group() as tg:
        tg.start_soon(parse)
        with anyio.fail_after(10):
            while not entered.is_set():  # noqa: ASYNC110  (a threading.Event: nothing to await)
                await anyio.sleep(0.001)
            # The parse is blocked in its thread: this task still runs.
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
                ticks += 1
        release.set()
    assert ticks == 5 and parse_threads and parse_threads[0] != loop_thread
    assert results == [real(raw)]


@pytest.mark.anyio
async def test_a_small_parse_stays_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[int] = []
    real = _json.loads_fast

    def recording(raw: bytes) -> Any:
        threads.append(threading.get_ident())
        return real(raw)

    monkeypatch.setattr(_json, "loads_fast", recording)

    async def charge(total: int) -> None:
        pass

    await parse_body(b'{"messages":[]}', charge=charge)
    assert threads == [threading.get_ident()]


def test_the_scan_is_linear_on_hostile_escapes() -> None:
    # Unterminated, and escapes at every chunk cut: the estimate still bounds what the parse builds.
    for raw in (
        b'"' + b'\\"' * MiB,
        b'["' + b"\\" * (2 * MiB + 1),
        b'["' + b"\\u00e9" * 400_000 + b'"]',
        b'["' + b"a\\ud83d\\ude00" * 200_000 + b'"]',
    ):
        cost = parse_cost(raw)
        try:
            actual = _peak(lambda raw=raw: _json.loads_fast(raw))  # type: ignore[misc]
        except _json.JSONDecodeFailure:
            continue
        assert actual <= cost


def test_limits_are_what_the_docs_say() -> None:
    assert _parse.PARSE_RATIO == 8 and parse_limit(0) == PARSE_SLACK == 64 * KiB


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"[" * 100_000, id="nested-unclosed"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="nested-closed"),
        pytest.param(b'{"a":' * 100_000 + b"1" + b"}" * 100_000, id="nested-objects"),
        pytest.param(b"[" + b"{}," * 200_000 + b"x]", id="syntax-error-at-the-end"),
        pytest.param(b'{"messages":[' + b"{}," * 200_000, id="truncated"),
    ],
)
@pytest.mark.anyio
async def test_what_is_not_json_is_a_decode_failure_however_complex(raw: bytes) -> None:
    async def charge(total: int) -> None:
        raise AssertionError("charged a body that is not JSON")

    assert len(raw) + parse_cost(raw) > parse_limit(len(raw))  # it would be too complex, were it JSON
    with pytest.raises(_json.JSONDecodeFailure):
        await parse_body(raw, charge=charge)
