"""Refused requests are seen: one access-log line and one ``refused_total`` count each, under uvicorn.

Before: a request refused before the forwarder (a wrong or missing gateway key, 413, 415, 400 on
framing or encoding, 408, 503 at admission) wrote no access-log line and counted in no metric
(``body_too_large_total`` and the admission totals aside); ``asgi-lifetime serve`` turns uvicorn's
access log off, so a client flooding bad keys was invisible.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing._serve import serve_in_thread

from .._servers import free_port
from ..reliability.test_faults import FAST, PATH, eventually

KEY = "client-1"
PRESENTED = "nope-PRESENTED-SECRET"  # a wrong key: must never be written anywhere
GOOD = {"authorization": f"Bearer {KEY}"}
BODY = b'{"model": "m", "messages": []}'


def _app(upstream: httpx.AsyncBaseTransport | None = None, **changes: Any) -> Starlette:
    settings = LifetimeSettings(
        upstream_url=(f"http://127.0.0.1:{free_port()}",),  # nothing listens: no refusal reaches it
        upstream_api_key="sk-up-SECRET",
        gateway_keys=(KEY,),
        **{**FAST, **changes},
    )
    return create_app(settings, transport=upstream)


def _access(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [record.__dict__["asgi_lifetime"] for record in caplog.records if record.name == "asgi_lifetime.access"]


def _refused(metrics: str) -> dict[tuple[str, str], float]:
    """``refused_total`` samples by (status, reason)."""
    return {
        (sample.labels["status"], sample.labels["reason"]): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "asgi_lifetime_refused_total"
    }


async def _raw(url: str, data: bytes) -> bytes:
    """Send ``data`` on a new connection; return all the server sent until it closed."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    received = b""
    with anyio.fail_after(10):
        async with await anyio.connect_tcp(host, int(port)) as stream:
            await stream.send(data)
            try:
                while True:
                    received += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
    return received


def _head(path: str, *headers: str) -> bytes:
    return "\r\n".join([f"POST {path} HTTP/1.1", "host: gateway", *headers, "", ""]).encode()


# (name, request headers, body, settings, status, code)
CASES: list[tuple[str, dict[str, str] | list[tuple[str, str]], bytes, dict[str, Any], int, str]] = [
    ("no key", {}, BODY, {}, 401, "invalid_api_key"),
    ("wrong bearer", {"authorization": f"Bearer {PRESENTED}"}, BODY, {}, 401, "invalid_api_key"),
    ("wrong x-api-key", {"x-api-key": PRESENTED}, BODY, {}, 401, "invalid_api_key"),
    ("too large", GOOD, b"x" * 2048, {"max_body_bytes": 1024}, 413, "request_too_large"),
    ("unknown encoding", {**GOOD, "content-encoding": "br"}, BODY, {}, 415, "unsupported_encoding"),
    ("corrupt gzip", {**GOOD, "content-encoding": "gzip"}, b"not gzip", {}, 400, "malformed_encoding"),
    (
        "two content types",
        [*GOOD.items(), ("content-type", "application/json"), ("content-type", "text/plain")],
        BODY,
        {},
        400,
        "conflicting_content_type",
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("name", "headers", "body", "changes", "status", "code"), CASES, ids=[c[0] for c in CASES])
async def test_each_refusal_is_logged_once_and_counted_once(
    caplog: pytest.LogCaptureFixture,
    name: str,
    headers: dict[str, str] | list[tuple[str, str]],
    body: bytes,
    changes: dict[str, Any],
    status: int,
    code: str,
) -> None:
    caplog.set_level(logging.DEBUG, logger="asgi_lifetime")
    caplog.set_level(logging.DEBUG, logger="uvicorn")
    with serve_in_thread(_app(**changes)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            response = await client.post(PATH + "?key=" + PRESENTED, headers=headers, content=body)
            metrics = (await client.get("/metrics")).text
    assert response.status_code == status and response.json()["error"]["code"] == code
    [line] = _access(caplog)
    assert line["path"] == PATH and line["status"] == status and line["code"] == code
    assert line["outcome"] == "refused" and isinstance(line["duration_ms"], float) and line["duration_ms"] >= 0
    assert _refused(metrics) == {(str(status), code): 1.0}
    # The presented key (in a header or the query) is nowhere: not in a line, its fields or a label.
    assert PRESENTED not in metrics
    for record in caplog.records:
        assert PRESENTED not in record.getMessage() and PRESENTED not in repr(record.__dict__)


@pytest.mark.anyio
async def test_a_body_that_stops_arriving_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    app = _app()
    with serve_in_thread(app) as url:
        answer = await _raw(url, _head(PATH, f"authorization: Bearer {KEY}", "content-length: 100") + b'{"mo')
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            metrics = (await client.get("/metrics")).text
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    [line] = _access(caplog)
    assert (line["status"], line["code"]) == (408, "request_timeout")
    # It waited for the body that long. Not to the millisecond: the idle timeout runs on the event loop's
    # clock, and uvloop's (the server's) is cached at each loop turn, so it may fire a little before
    # time.monotonic() says the timeout has passed since arrival (a clean-clone CI run saw 499.9 ms).
    assert line["duration_ms"] >= FAST["body_idle_timeout"] * 1000 * 0.9
    assert _refused(metrics) == {("408", "request_timeout"): 1.0}


@pytest.mark.anyio
async def test_a_request_admission_turns_away_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    app = _app(max_inflight=1, body_idle_timeout=10.0)
    with serve_in_thread(app) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        # The one slot: a request whose body is slow to come. Its client hangs up later (499: never answered).
        async with await anyio.connect_tcp(host, int(port)) as holder:
            await holder.send(_head(PATH, f"authorization: Bearer {KEY}", "content-length: 100"))
            await eventually(lambda: app.state.lifetime.stats().inflight_requests == 1)
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                response = await client.post(PATH, headers=GOOD, content=BODY)
                metrics = (await client.get("/metrics")).text
    assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded"
    [line] = _access(caplog)
    assert (line["status"], line["code"], line["outcome"]) == (503, "overloaded", "refused")
    assert _refused(metrics) == {("503", "overloaded"): 1.0}


@pytest.mark.anyio
async def test_a_forwarded_request_is_logged_once_and_not_counted_as_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    upstream = httpx.MockTransport(lambda request: httpx.Response(200, json={"choices": []}))
    with serve_in_thread(_app(upstream)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            ok = await client.post(PATH, headers=GOOD, content=BODY)
            # Refused by the forwarder itself: recorded by its Outcome, as before, and only by it.
            bad = await client.post(PATH, headers=GOOD, content=b"{not json")
            metrics = (await client.get("/metrics")).text
    assert ok.status_code == 200 and bad.status_code == 400
    first, second = sorted(_access(caplog), key=lambda line: int(line["status"]))  # logged as each response ends
    assert (first["status"], first["outcome"], first["code"]) == (200, "complete", None)
    assert (second["status"], second["outcome"], second["code"]) == (400, "error", "invalid_json")
    assert _refused(metrics) == {}
