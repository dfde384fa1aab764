"""trim_after_large_request: a guarded malloc_trim for large requests, on only with the MALLOC_TRIM setting."""

from __future__ import annotations

import sys

import anyio
import httpx
import pytest
import respx

from asgi_lifetime import LifetimeSettings, _json
from asgi_lifetime._settings import RetainOutbound
from asgi_lifetime.gateway import _memory, create_app
from asgi_lifetime.gateway._prepare import Draft

from .test_prepare import run


def test_small_requests_are_trimmed_once_they_add_up_to_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_trims(monkeypatch)
    monkeypatch.setattr(_memory, "_settled", 0)
    quarter = _memory.TRIM_THRESHOLD // 4
    assert [_memory.trim_after_large_request(quarter, enabled=True) for _ in range(8)] == [
        False,
        False,
        False,
        True,
    ] * 2
    assert calls == [0, 0]
    assert _memory.trim_after_large_request(0, enabled=True) is False
    # A disabled trim counts nothing: enabling it later does not trim for what settled meanwhile.
    assert _memory.trim_after_large_request(_memory.TRIM_THRESHOLD, enabled=False) is False
    assert _memory.trim_after_large_request(quarter, enabled=True) is False
    assert calls == [0, 0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_large_requests_are_trimmed_on_glibc() -> None:
    if _memory._malloc_trim is None:
        pytest.skip("not glibc")
    assert _memory.trim_after_large_request(_memory.TRIM_THRESHOLD, enabled=True) is True


def test_without_malloc_trim_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_memory, "_malloc_trim", None)
    assert _memory.trim_after_large_request(1 << 40, enabled=True) is False


def test_a_failing_trim_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(pad: int) -> int:
        raise OSError("no")

    monkeypatch.setattr(_memory, "_malloc_trim", broken)
    assert _memory.trim_after_large_request(1 << 40, enabled=True) is False


def test_disabled_it_never_calls_malloc_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_trims(monkeypatch)
    assert _memory.trim_after_large_request(1 << 40, enabled=False) is False
    assert calls == []
    assert _memory.trim_after_large_request(1 << 40, enabled=True) is True
    assert calls == [0]


# --- the MALLOC_TRIM setting reaches every trim: prepare() and the gateway -----------------------------

MiB = 1024 * 1024
LARGE = 10 * MiB  # above TRIM_THRESHOLD, and more than _TRIM_EVERY written when re-serialized
BASE = "http://upstream.test/base"
PATH = "/v1/chat/completions"
OK = {"id": "c1", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant"}}]}


def _count_trims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Replace glibc's malloc_trim (or its absence) with a recorder of the calls."""
    calls: list[int] = []

    def counting(pad: int) -> int:
        calls.append(pad)
        return 1

    monkeypatch.setattr(_memory, "_malloc_trim", counting)
    return calls


def _large_conversation() -> bytes:
    turn = {"role": "user", "content": "x" * 4096}
    body = _json.dumps({"model": "m", "messages": [turn] * (LARGE // 4096 + 1)})
    assert len(body) > LARGE > _memory.TRIM_THRESHOLD
    return body


def _inject_system(draft: Draft) -> None:
    draft.body["messages"].insert(0, {"role": "system", "content": "be brief"})
    draft.mark_changed()


@pytest.mark.anyio
@pytest.mark.parametrize("malloc_trim", [True, False])
async def test_prepare_trims_while_serializing_only_when_enabled(
    monkeypatch: pytest.MonkeyPatch, malloc_trim: bool
) -> None:
    calls = _count_trims(monkeypatch)
    raw = _large_conversation()
    parsed = _json.loads(raw)
    prepared = await run([_inject_system], raw, parsed, session_id=None, path=PATH, headers=[], malloc_trim=malloc_trim)
    assert prepared.body is not None and len(prepared.body) > LARGE
    assert (len(calls) >= 1) is malloc_trim, calls


@pytest.mark.anyio
@pytest.mark.parametrize("malloc_trim", [True, False])
@pytest.mark.parametrize("retain_outbound", ["disk", "memory", "off"])
@pytest.mark.parametrize("changed", [True, False], ids=["changed", "unchanged"])
async def test_the_gateway_trims_a_large_request_only_when_enabled(
    monkeypatch: pytest.MonkeyPatch, malloc_trim: bool, retain_outbound: RetainOutbound, changed: bool
) -> None:
    calls = _count_trims(monkeypatch)
    body = _large_conversation()
    settings = LifetimeSettings(upstream_url=(BASE,), retain_outbound=retain_outbound, malloc_trim=malloc_trim)
    app = create_app(settings, preparers=[_inject_system] if changed else [])
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(200, json=OK)
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                with anyio.fail_after(30):
                    response = await client.post(PATH, content=body, headers={"content-type": "application/json"})
        finally:
            await app.state.upstream.aclose()
    assert response.status_code == 200 and response.json() == OK
    assert (route.calls[0].request.content == body) is not changed
    assert app.state.lifetime.stats().idle
    if malloc_trim:
        assert len(calls) >= 1  # at the settle point at least
    else:
        assert calls == []  # not at the settle point, not while prepare() serializes, not at the end
