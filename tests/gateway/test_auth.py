from __future__ import annotations

import hmac
import json

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from asgi_lifetime.gateway._auth import GatewayAuth

UPSTREAM_KEY = "sk-upstream-SECRET-0123456789"


def echo_headers(seen: list[Scope]):  # type: ignore[no-untyped-def]
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def client(app: GatewayAuth) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"authorization": "Bearer wrong"}, 401),
        ({"authorization": "Basic k2"}, 401),
        ({"authorization": "Bearer "}, 401),
        ({"x-api-key": "nope"}, 401),
        ({"authorization": "Bearer k2"}, 200),
        ({"authorization": "bearer k1"}, 200),
        ({"x-api-key": "k1"}, 200),
    ],
)
async def test_gateway_keys_are_checked(headers: dict[str, str], status: int) -> None:
    seen: list[Scope] = []
    app = GatewayAuth(echo_headers(seen), gateway_keys=("k1", "k2"), upstream_api_key=UPSTREAM_KEY)
    async with client(app) as c:
        response = await c.post("/v1/chat/completions", headers=headers, content=b"{}")
    assert response.status_code == status
    if status == 401:
        assert seen == []  # refused before the inner app (admission, body reading) runs
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert response.headers["www-authenticate"] == "Bearer"
        assert UPSTREAM_KEY not in response.text and "k1" not in response.text
    else:
        forwarded = dict(seen[0]["headers"])
        # The client's credential is replaced by the upstream key.
        assert forwarded[b"authorization"] == f"Bearer {UPSTREAM_KEY}".encode()
        assert b"x-api-key" not in forwarded
        assert [k for k, _ in seen[0]["headers"]].count(b"authorization") == 1


@pytest.mark.anyio
async def test_without_upstream_key_client_authorization_passes_through() -> None:
    seen: list[Scope] = []
    app = GatewayAuth(echo_headers(seen), gateway_keys=(), upstream_api_key=None)
    async with client(app) as c:
        response = await c.post("/v1/x", headers={"authorization": "Bearer client-own"})
    assert response.status_code == 200
    assert dict(seen[0]["headers"])[b"authorization"] == b"Bearer client-own"


@pytest.mark.anyio
async def test_open_paths_need_no_key() -> None:
    seen: list[Scope] = []
    app = GatewayAuth(echo_headers(seen), gateway_keys=("k1",), upstream_api_key=UPSTREAM_KEY)
    async with client(app) as c:
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        assert (await c.get("/lifetime/stats")).status_code == 401
    assert all(b"authorization" not in dict(s["headers"]) for s in seen)


@pytest.mark.anyio
@pytest.mark.parametrize(("client_host", "status"), [("127.0.0.1", 200), ("::1", 200), ("10.1.2.3", 401)])
async def test_upstream_key_without_gateway_keys_serves_loopback_clients_only(client_host: str, status: int) -> None:
    seen: list[Scope] = []
    app = GatewayAuth(echo_headers(seen), gateway_keys=(), upstream_api_key=UPSTREAM_KEY)
    transport = httpx.ASGITransport(app=app, client=(client_host, 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
        response = await c.post("/v1/x", headers={"authorization": "Bearer anything"})
    assert response.status_code == status
    assert UPSTREAM_KEY not in response.text
    if status == 200:
        assert dict(seen[0]["headers"])[b"authorization"] == f"Bearer {UPSTREAM_KEY}".encode()
    else:
        assert seen == [] and "loopback" in response.json()["error"]["message"]


def test_every_key_is_compared_even_after_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)  # the module _auth imports
    auth = GatewayAuth(echo_headers([]), gateway_keys=("k1", "k2", "k3"), upstream_api_key=UPSTREAM_KEY)
    assert auth._accepts(b"k1") is True
    assert len(calls) == 3  # no early exit on the first key
    assert auth._accepts(b"zz") is False
    assert len(calls) == 6


@pytest.mark.anyio
async def test_lifespan_scope_passes() -> None:
    seen: list[Scope] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope)

    auth = GatewayAuth(app, gateway_keys=("k1",), upstream_api_key=UPSTREAM_KEY)

    async def receive() -> dict[str, str]:
        return {"type": "lifespan.startup"}

    async def send(message: object) -> None:
        raise AssertionError(json.dumps(str(message)))

    await auth({"type": "lifespan"}, receive, send)
    assert seen == [{"type": "lifespan"}]
