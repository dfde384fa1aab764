"""Attacks on the recent retry rules and the upstream Basic auth (asyncio and trio)."""

from __future__ import annotations

from collections.abc import Collection

import anyio
import httpx
import pytest

from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway._prepare import Prepared
from asgi_lifetime.gateway._upstream import UpstreamClient

pytestmark = pytest.mark.anyio

PATH = "/v1/chat/completions"


def _prepared(headers: list[tuple[str, str]] | None = None) -> Prepared:
    return Prepared(method="POST", path=PATH, headers=headers or [("content-type", "application/json")], body=b"{}")


@pytest.mark.parametrize("default", ["Authorization", "x-api-key"])
async def test_basic_auth_is_not_added_beside_a_credential_of_the_callers_client(default: str) -> None:
    """A client= of the caller's with a credential among its default headers: that credential
    goes out alone, not with a second, Basic ``Authorization`` from UPSTREAM_URL's user info."""
    seen: list[httpx.Headers] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={})

    settings = LifetimeSettings.from_mapping({"upstream_url": "http://user:pw@upstream.test"})
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler), headers={default: "caller-key"})
    async with client, UpstreamClient(settings=settings, client=client) as upstream:
        response = await upstream.forward(_prepared(), on_retries_settled=lambda: None)
        await response.aclose()
    assert seen[0].get_list(default) == ["caller-key"]
    if default.lower() != "authorization":
        assert "authorization" not in seen[0]


async def test_each_upstream_gets_its_own_user_info() -> None:
    seen: list[tuple[str, list[str]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers.get_list("authorization")))
        return httpx.Response(503 if request.url.host == "a.test" else 200, json={})

    settings = LifetimeSettings.from_mapping(
        {"upstream_url": "http://ua:pa@a.test,http://ub:pb@b.test", "backoff_base": 0.001, "backoff_max": 0.001}
    )
    async with UpstreamClient(settings=settings, transport=httpx.MockTransport(handler)) as upstream:
        for _ in range(3):
            response = await upstream.forward(_prepared(), on_retries_settled=lambda: None)
            await response.aclose()
    basic = {
        "a.test": settings.upstream_authorization("http://a.test"),
        "b.test": settings.upstream_authorization("http://b.test"),
    }
    assert basic["a.test"] != basic["b.test"]
    assert seen and all(values == [basic[host]] for host, values in seen)


async def test_a_long_wait_of_one_upstream_does_not_keep_the_request_from_another() -> None:
    """Several upstreams, one asks for a wait over RETRY_AFTER_CAP: the request goes to another
    upstream (the wait is that upstream's), not withheld after waiting out the cap, nor relayed
    with ``x-should-retry: false`` when the cap does not fit in the retry deadline."""
    hosts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        if request.url.host == "a.test":
            return httpx.Response(429, headers={"retry-after": "100"})
        return httpx.Response(200, json={})

    settings = LifetimeSettings.from_mapping(
        {
            "upstream_url": "http://a.test,http://b.test",
            "retry_after_cap": 30,
            "retry_deadline": 10,
            "backoff_base": 0.001,
            "backoff_max": 0.001,
        }
    )
    sleeps: list[float] = []

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        await anyio.lowlevel.checkpoint()

    async with UpstreamClient(settings=settings, transport=httpx.MockTransport(handler)) as upstream:
        upstream._sleep = sleep

        def a_first(session_id: str | None, *, exclude: Collection[str] = ()) -> str:
            return next(u for u in ("http://a.test", "http://b.test") if u not in exclude)

        upstream._pool.choose = a_first  # type: ignore[method-assign]
        response = await upstream.forward(_prepared(), on_retries_settled=lambda: None)
        await response.aclose()
    assert hosts == ["a.test", "b.test"]
    assert response.status_code == 200
    assert all(s < 1 for s in sleeps)
