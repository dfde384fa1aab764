from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator

import httpx
import pytest

from asgi_lifetime import LifetimeSettings
from asgi_lifetime._fingerprint import Fingerprint, fingerprint
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._access_log import ACCESS_LOGGER, AccessLog, public_path, public_url, session_hash
from asgi_lifetime.gateway._bookkeeping import Bookkeeper, Outcome, record_outcome

WIRE_HASH = "0123456789abcdef" * 4
FIELDS = [
    "path",
    "status",
    "outcome",
    "code",
    "upstream",
    "attempts",
    "bytes_out",
    "ttfb_ms",
    "duration_ms",
    "size",
    "text_comparable",
    "wire_hash",
    "session",
]


def make_outcome(
    *,
    path: str = "/v1/chat/completions",
    session_id: str | None = "sess-1",
    upstream: str | None = "http://10.0.0.7:8000",
    status: int = 200,
    outcome: str = "complete",
    first_byte_at: float | None = 10.25,
    fp: Fingerprint | None = None,
) -> Outcome:
    return Outcome(
        fingerprint=fp if fp is not None else Fingerprint(wire_hash=WIRE_HASH, text_comparable=True, size=48213),
        session_id=session_id,
        path=path,
        status=status,
        bytes_out=5120,
        attempts=2,
        upstream=upstream,
        started=10.0,
        first_byte_at=first_byte_at,
        ended=19.5,
        outcome=outcome,
    )


_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"]+)(?: |$)')


def parse_logfmt(line: str) -> dict[str, str]:
    pairs = _PAIR.findall(line)
    assert " ".join(f"{k}={v}" for k, v in pairs) == line, f"not clean logfmt: {line!r}"
    return {key: json.loads(value) if value.startswith('"') else value for key, value in pairs}


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> AccessLog:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    return AccessLog()


def access_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ACCESS_LOGGER]


def test_one_line_per_outcome_with_the_fields(access: AccessLog, caplog: pytest.LogCaptureFixture) -> None:
    access.record(make_outcome())
    access.record(make_outcome(status=502, outcome="upstream_error", first_byte_at=None, session_id=None))

    records = access_records(caplog)
    assert len(records) == 2
    assert all(r.levelno == logging.INFO for r in records)
    assert all("\n" not in r.getMessage() for r in records)
    first, second = (parse_logfmt(r.getMessage()) for r in records)
    assert list(first) == FIELDS
    assert first == {
        "path": "/v1/chat/completions",
        "status": "200",
        "outcome": "complete",
        "code": "-",
        "upstream": "http://10.0.0.7:8000",
        "attempts": "2",
        "bytes_out": "5120",
        "ttfb_ms": "250.0",
        "duration_ms": "9500.0",
        "size": "48213",
        "text_comparable": "true",
        "wire_hash": WIRE_HASH,
        "session": session_hash("sess-1"),
    }
    assert second["status"] == "502"
    assert second["outcome"] == "upstream_error"
    assert second["ttfb_ms"] == "-"
    assert second["session"] == "-"


def test_extra_carries_the_fields_as_values(access: AccessLog, caplog: pytest.LogCaptureFixture) -> None:
    access.record(make_outcome(first_byte_at=None, upstream=None))

    (record,) = access_records(caplog)
    extra = record.__dict__["asgi_lifetime"]
    assert list(extra) == FIELDS
    assert extra["status"] == 200
    assert extra["attempts"] == 2
    assert extra["bytes_out"] == 5120
    assert extra["duration_ms"] == 9500.0
    assert extra["ttfb_ms"] is None
    assert extra["upstream"] is None
    assert extra["text_comparable"] is True
    assert extra["wire_hash"] == WIRE_HASH
    assert extra["session"] == session_hash("sess-1")
    json.dumps(extra)  # a JSON formatter can emit it as is


def test_no_query_key_body_or_session_id(access: AccessLog, caplog: pytest.LogCaptureFixture) -> None:
    body = b'{"messages": [{"role": "user", "content": "BODYMARKER please"}]}'
    session_id = "sess-SESSIONMARKER-42"
    access.record(
        make_outcome(
            path="/v1/chat/completions?key=secret-QUERYKEY&beta=true",
            session_id=session_id,
            upstream="https://user:PASSWORDMARKER@api.example.com/v1?api-key=URLKEYMARKER#frag",
            fp=fingerprint(body),
        )
    )

    (record,) = access_records(caplog)
    message = record.getMessage()
    extra = json.dumps(record.__dict__["asgi_lifetime"])
    for text in (message, extra):
        for secret in ("secret", "QUERYKEY", "key=", "BODYMARKER", "SESSIONMARKER", session_id, "PASSWORDMARKER",
                       "URLKEYMARKER", "?", "frag"):  # fmt: skip
            assert secret not in text
    fields = parse_logfmt(message)
    assert fields["path"] == "/v1/chat/completions"
    assert fields["upstream"] == "https://api.example.com/v1"
    assert fields["size"] == str(len(body))
    expected = hashlib.blake2b(session_id.encode(), digest_size=4).hexdigest()
    assert fields["session"] == expected
    assert f"session={expected}" in message
    assert re.fullmatch(r"[0-9a-f]{8}", expected)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/with space",
        '/v1/quote"d',
        "/v1/new\nline fake=field",
        "/v1/equals=sign",
        "/v1/ünïcode",
        "/v1/back\\slash",
        "",
    ],
)
def test_values_are_quoted_when_needed(path: str, access: AccessLog, caplog: pytest.LogCaptureFixture) -> None:
    access.record(make_outcome(path=path))

    (record,) = access_records(caplog)
    message = record.getMessage()
    assert "\n" not in message
    fields = parse_logfmt(message)
    assert list(fields) == FIELDS  # no forged field
    assert fields["path"] == path


def test_a_refused_request_gets_a_short_line(access: AccessLog, caplog: pytest.LogCaptureFixture) -> None:
    access.refused("/v1/chat/completions?key=SECRET", 401, "invalid_api_key", 0.00012)
    [record] = access_records(caplog)
    fields = {"path": "/v1/chat/completions", "status": 401, "outcome": "refused", "code": "invalid_api_key"}
    assert record.__dict__["asgi_lifetime"] == {**fields, "duration_ms": 0.1}
    assert parse_logfmt(record.getMessage()) == {**{k: str(v) for k, v in fields.items()}, "duration_ms": "0.1"}
    assert "SECRET" not in record.getMessage()


def test_nothing_formatted_when_info_is_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=ACCESS_LOGGER)
    AccessLog().record(make_outcome())
    assert access_records(caplog) == []


def test_custom_logger(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="my.access")
    AccessLog(logging.getLogger("my.access")).record(make_outcome())
    assert [r.name for r in caplog.records] == ["my.access"]


@pytest.mark.anyio
async def test_is_a_bookkeeper(access: AccessLog, caplog: pytest.LogCaptureFixture) -> None:
    assert isinstance(access, Bookkeeper)
    await record_outcome(access, make_outcome())
    assert len(access_records(caplog)) == 1


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("https://api.example.com/v1/", "https://api.example.com/v1/"),
        ("https://u:p@api.example.com/v1?key=k#f", "https://api.example.com/v1"),
        ("http://[::1]:9000/x", "http://[::1]:9000/x"),
        ("HTTP://Example.COM", "http://example.com"),
        ("primary", "primary"),
        ("primary?key=k", "primary"),
        ("http://host:notaport/", "invalid"),
    ],
)
def test_public_url(url: str, expected: str) -> None:
    assert public_url(url) == expected


@pytest.mark.parametrize(
    ("path", "expected"),
    [("/v1/x", "/v1/x"), ("/v1/x?key=k", "/v1/x"), ("/v1/x#f?g", "/v1/x"), ("?key=k", "")],
)
def test_public_path(path: str, expected: str) -> None:
    assert public_path(path) == expected


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("answer", "body", "status", "attempts"),
    [
        ("refused", b'{"model": "m"}', 502, 2),  # every attempt failed to connect: upstream_unreachable
        ("busy", b'{"model": "m"}', 503, 2),  # every attempt 503'd: the last 503 goes to the client
        ("busy", b"{bad", 400, 0),  # refused by the forwarder (invalid_json): no attempt, no upstream
    ],
)
async def test_the_line_names_the_upstream_tried_last(
    answer: str, body: bytes, status: int, attempts: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: upstream=- when every attempt failed to connect, so an operator could not tell which one failed.
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    tried: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        tried.append(f"http://{request.url.host}/base")
        if answer == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(503, json={"error": {"message": "overloaded"}})

    settings = LifetimeSettings(
        upstream_url=("http://user:PASSWORDMARKER@a.test/base", "http://b.test/base"),
        max_attempts=2,
        backoff_base=0.001,
        backoff_max=0.002,
    )
    app = create_app(settings, transport=httpx.MockTransport(upstream))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
        response = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    assert len(tried) == attempts
    [record] = access_records(caplog)
    fields = record.__dict__["asgi_lifetime"]
    assert fields["attempts"] == attempts
    assert fields["upstream"] == (tried[-1] if tried else None)
    assert parse_logfmt(record.getMessage())["upstream"] == (tried[-1] if tried else "-")
    assert "PASSWORDMARKER" not in record.getMessage()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("headers", "body", "answer", "status", "code"),
    [
        ([], b"{bad", "ok", 400, "invalid_json"),
        ([], b'{"model": "m"}', "refused", 502, "upstream_unreachable"),
        ([], b'{"model": "m"}', "unsendable", 502, "request_unsendable"),
        ([], b'{"model": "m"}', "ok", 200, None),  # the upstream's answer, relayed: no code of ours
        ([], b'{"model": "m"}', "busy", 503, None),  # the upstream's own 503 after the retries: relayed
    ],
)
async def test_the_line_names_the_code_of_the_gateways_own_error(
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    answer: str,
    status: int,
    code: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before: "status=400 outcome=error" alone: an operator could not tell an invalid header from invalid
    # JSON, nor (both 502) a request our own client refused from an upstream that refused connections.
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)

    def upstream(request: httpx.Request) -> httpx.Response:
        if answer == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if answer == "unsendable":
            raise httpx.LocalProtocolError("Illegal header value")
        return httpx.Response(503 if answer == "busy" else 200, json={})

    settings = LifetimeSettings(upstream_url=("http://a.test",), max_attempts=2, backoff_base=0.001, backoff_max=0.002)
    app = create_app(settings, transport=httpx.MockTransport(upstream))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
        response = await client.post(
            "/v1/chat/completions", content=body, headers=[(b"content-type", b"application/json"), *headers]
        )
    assert response.status_code == status
    if code is not None:
        assert response.json()["error"]["code"] == code
    [record] = access_records(caplog)
    assert record.__dict__["asgi_lifetime"]["code"] == code
    line = parse_logfmt(record.getMessage())
    assert list(line) == FIELDS and line["code"] == (code or "-") and line["status"] == str(status)


@pytest.mark.anyio
@pytest.mark.parametrize("header", [(b"x-trace", b"a\x0bb"), (b"x(trace)", b"1")])
async def test_a_head_that_cannot_be_forwarded_gets_the_refused_line_with_its_code(
    header: tuple[bytes, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    # Refused before the body is read (RequestHead), as a 401 is: the short line, its code named.
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    settings = LifetimeSettings(upstream_url=("http://a.test",))
    app = create_app(settings, transport=httpx.MockTransport(lambda request: httpx.Response(200, json={})))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
        response = await client.post("/v1/chat/completions", content=b'{"model": "m"}', headers=[header])
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_header"
    [record] = access_records(caplog)
    assert record.__dict__["asgi_lifetime"]["code"] == "invalid_header"
    line = parse_logfmt(record.getMessage())
    assert list(line) == ["path", "status", "outcome", "code", "duration_ms"]
    assert (line["status"], line["outcome"], line["code"]) == ("400", "refused", "invalid_header")


class BrokenStream(httpx.AsyncByteStream):
    """An upstream body whose transport fails with a defect (not an httpx error) after its first chunk."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": []}\n\n'
        raise RuntimeError("a transport's defect")


def explode(draft: object) -> None:
    raise RuntimeError("a preparer's defect")


@pytest.mark.anyio
@pytest.mark.parametrize(("where", "status"), [("preparer", 500), ("relay", 200)])
async def test_an_unexpected_exception_is_recorded_with_the_status_the_client_got(
    where: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: status=0 in the access line (and the metrics' status label) for both: the Forwarder recorded
    # what it had learned, nothing, though the app's handler answered 500 (or the relay had sent 200, then cut).
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)

    def upstream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=BrokenStream())

    settings = LifetimeSettings(upstream_url=("http://a.test",))
    app = create_app(
        settings,
        transport=httpx.MockTransport(upstream),
        preparers=[explode] if where == "preparer" else [],
    )
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        response = await client.post("/v1/chat/completions", json={"model": "m", "stream": True})
    assert response.status_code == status
    [record] = access_records(caplog)
    fields = record.__dict__["asgi_lifetime"]
    assert (fields["status"], fields["outcome"]) == (status, "error")
