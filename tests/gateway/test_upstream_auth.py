"""The gateway's upstream key: how it is sent (UPSTREAM_AUTH), and that it never comes back to a client."""

from __future__ import annotations

import gzip
import json
from typing import Any
from urllib.parse import quote

import anthropic
import httpx
import pytest
from starlette.types import Receive, Scope, Send

from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime._stats import GAUGES
from asgi_lifetime.gateway._auth import REDACTED, GatewayAuth, KeyScrubber

from ..reliability.test_faults import PATH, Stack, busy_connections, eventually, running
from ._raw_upstream import RawRequest, Script, raw_upstream, response

KEY = "sk-upstream-SECRET/0123+456789"  # '/' and '+' so its JSON and percent spellings differ
SPELLINGS = [KEY, KEY.replace("/", "\\/"), quote(KEY, safe=""), "".join(f"\\u{ord(c):04x}" for c in KEY)]


# --- UPSTREAM_AUTH ---------------------------------------------------------------------------------


def recorder(seen: list[Scope]) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


CLIENT_CREDENTIALS = {
    "authorization": "Bearer gk",
    "x-api-key": "client-x-api-key",
    "x-goog-api-key": "client-goog-key",
    "api-key": "client-azure-key",
}
INJECTED = {
    "bearer": (b"authorization", f"Bearer {KEY}".encode()),
    "x-api-key": (b"x-api-key", KEY.encode()),
    "x-goog-api-key": (b"x-goog-api-key", KEY.encode()),
    "api-key": (b"api-key", KEY.encode()),
}


@pytest.mark.anyio
@pytest.mark.parametrize("scheme", list(INJECTED))
@pytest.mark.parametrize(
    ("query", "forwarded_query"),
    [
        ("", b""),
        ("?key=client&alt=sse", b"alt=sse"),
        ("?alt=sse&key=a&key=b", b"alt=sse"),
        ("?keys=1", b"keys=1"),
        # Spellings a server decodes to ``key`` (found by the hostile-client attack): all dropped.
        ("?%6Bey=client&alt=sse", b"alt=sse"),
        ("?KEY=client&alt=sse", b"alt=sse"),
        ("?key%3Dclient&alt=sse", b"alt=sse"),
        ("?+key=client&alt=sse", b"alt=sse"),
        ("?api_key=client&API-KEY=c&alt=sse", b"alt=sse"),
        ("?monkey=1&key_id=2", b"monkey=1&key_id=2"),
    ],
)
async def test_the_injected_key_replaces_every_client_credential(
    scheme: str, query: str, forwarded_query: bytes
) -> None:
    seen: list[Scope] = []
    app = GatewayAuth(recorder(seen), gateway_keys=("gk",), upstream_api_key=KEY, upstream_auth=scheme)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
        got = await client.post(PATH + query, headers=CLIENT_CREDENTIALS, content=b"{}")
    assert got.status_code == 200
    headers = seen[0]["headers"]
    credentials = [(k, v) for k, v in headers if k in (b"authorization", b"x-api-key", b"x-goog-api-key", b"api-key")]
    assert credentials == [INJECTED[scheme]]  # exactly one credential, ours
    assert seen[0]["query_string"] == forwarded_query


@pytest.mark.anyio
@pytest.mark.parametrize("header", ["x-api-key", "x-goog-api-key", "api-key", "authorization"])
async def test_gateway_key_may_come_in_any_credential_header(header: str) -> None:
    seen: list[Scope] = []
    app = GatewayAuth(recorder(seen), gateway_keys=("gk",), upstream_api_key=KEY, upstream_auth="x-goog-api-key")
    value = "Bearer gk" if header == "authorization" else "gk"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
        assert (await client.post(PATH, headers={header: value}, content=b"{}")).status_code == 200


def test_upstream_auth_is_validated_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="ASGI_LIFETIME_UPSTREAM_AUTH=basic is invalid"):
        LifetimeSettings(upstream_auth="basic")
    with pytest.raises(ValueError, match="ASGI_LIFETIME_UPSTREAM_AUTH"):
        LifetimeSettings.from_mapping({"UPSTREAM_AUTH": "Authorization"})
    assert LifetimeSettings.from_mapping({"UPSTREAM_AUTH": " X-Goog-Api-Key "}).upstream_auth == "x-goog-api-key"
    with pytest.raises(ValueError, match="upstream_auth='digest' is invalid"):
        GatewayAuth(recorder([]), gateway_keys=(), upstream_api_key=KEY, upstream_auth="digest")


def ok_message(request: RawRequest) -> Script:
    body = json.dumps(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [{"type": "text", "text": "hi"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
    ).encode()
    return [response(200, body, headers=(("content-type", "application/json"),))]


def test_a_keyed_gateway_fronts_anthropic_with_x_api_key() -> None:
    with (
        raw_upstream(ok_message) as upstream,
        running(upstream_url=upstream.url, upstream_api_key=KEY, upstream_auth="x-api-key", gateway_keys=("gk",)) as gw,
    ):
        with anthropic.Anthropic(base_url=gw.url, api_key="gk") as client:
            message = client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert message.content[0].text == "hi"  # type: ignore[union-attr]
    seen = upstream.requests[0].headers
    assert seen["x-api-key"] == KEY and "authorization" not in seen


async def idle(stack: Stack) -> None:
    """``assert_idle`` without HTTP: a keyed gateway's /lifetime/stats wants a key."""

    def quiet() -> bool:
        stats = stack.stats()
        inflight = [u for u in stack.app.state.upstream.describe() if u["inflight"]]
        return not any(stats[name] for name in GAUGES) and not inflight and not busy_connections(stack.app)

    await eventually(quiet)


# --- scrubbing -------------------------------------------------------------------------------------


BODIES = [
    '{"error": {"message": "invalid key: Bearer %s"}}',
    '{"error": {"message": "got authorization=%s"}, "detail": ["%s"]}',
    '{"echo": {"headers": {"Authorization": "Bearer %s", "x-api-key": "%s"}}}',
    '{"%s": 1}',
    "plain text: Authorization: Bearer %s\n",
    "<html><body>key %s rejected</body></html>",
]


@pytest.mark.parametrize("spelling", SPELLINGS, ids=["bare", "json-escaped", "percent", "unicode-escaped"])
@pytest.mark.parametrize("template", BODIES)
def test_scrubber_removes_every_spelling(template: str, spelling: str) -> None:
    body = template.replace("%s", spelling).encode()
    clean = KeyScrubber(KEY).scrub(body)
    text = clean.decode()
    for each in SPELLINGS:
        assert each not in text
    if template.startswith("{") and spelling != quote(KEY, safe=""):
        assert KEY not in json.dumps(json.loads(clean))  # still valid JSON, and no key once decoded
    assert REDACTED in text


def test_scrubber_without_a_key_changes_nothing() -> None:
    scrub = KeyScrubber(None)
    assert not scrub and scrub.scrub(b"Bearer x") == b"Bearer x" and scrub.headers([(b"a", b"b")]) is None


@pytest.mark.parametrize("cut", range(1, len(KEY)))
def test_a_body_cut_inside_the_key_keeps_no_part_of_it(cut: int) -> None:
    clean = KeyScrubber(KEY).cut(f"Bearer {KEY[:cut]}".encode())
    assert clean == b"Bearer "


def test_scrubbed_headers() -> None:
    raw = [(b"www-authenticate", f'Bearer realm="x", error="{KEY}"'.encode()), (b"x-ok", b"fine")]
    clean = KeyScrubber(KEY).headers(raw)
    assert clean == [(b"www-authenticate", f'Bearer realm="x", error="{REDACTED}"'.encode()), (b"x-ok", b"fine")]


def quoting(status: int, *, encoding: str | None = None) -> Any:
    def answer(request: RawRequest) -> Script:
        received = request.headers.get("authorization", "")
        body = json.dumps({"error": {"message": f"invalid credentials: {received}", "key": received[7:]}}).encode()
        headers = [("content-type", "application/json"), ("x-echo-authorization", received)]
        if encoding == "gzip":
            body = gzip.compress(body)
            headers.append(("content-encoding", "gzip"))
        elif encoding == "br":
            headers.append(("content-encoding", "br"))
        return [response(status, body, headers=tuple(headers))]

    return answer


@pytest.mark.anyio
@pytest.mark.parametrize("status", [401, 403, 400, 429, 500])
@pytest.mark.parametrize("encoding", [None, "gzip"])
async def test_an_upstream_error_quoting_our_key_is_scrubbed(status: int, encoding: str | None) -> None:
    with (
        raw_upstream(quoting(status, encoding=encoding)) as upstream,
        running(upstream_url=upstream.url, upstream_api_key=KEY, gateway_keys=("gk",), max_attempts=1) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            got = await client.post(PATH, json={}, headers={"authorization": "Bearer gk"})
        await idle(stack)
    assert upstream.requests[0].headers["authorization"] == f"Bearer {KEY}"  # the upstream did get it
    assert got.status_code == status
    assert KEY not in got.text and KEY not in str(got.headers.raw)
    error = got.json()["error"]  # still valid JSON
    assert error["message"] == f"invalid credentials: Bearer {REDACTED}" and error["key"] == REDACTED
    assert got.headers["x-echo-authorization"] == f"Bearer {REDACTED}"


@pytest.mark.anyio
async def test_a_success_response_header_quoting_our_key_is_scrubbed() -> None:
    with (
        raw_upstream(quoting(200)) as upstream,
        running(upstream_url=upstream.url, upstream_api_key=KEY, gateway_keys=("gk",)) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            got = await client.post(PATH, json={}, headers={"authorization": "Bearer gk"})
    assert got.status_code == 200 and got.headers["x-echo-authorization"] == f"Bearer {REDACTED}"


@pytest.mark.anyio
async def test_an_undecodable_error_body_is_withheld_when_a_key_is_set() -> None:
    with (
        raw_upstream(quoting(401, encoding="br")) as upstream,
        running(upstream_url=upstream.url, upstream_api_key=KEY, gateway_keys=("gk",)) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            got = await client.post(PATH, json={}, headers={"authorization": "Bearer gk"})
    assert got.status_code == 401 and KEY not in got.text
    assert got.json()["error"]["code"] == "upstream_error_withheld"
