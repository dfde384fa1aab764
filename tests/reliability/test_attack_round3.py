"""Round 3: fresh-context attacks on the changes that just landed (upstream user info as a guarded and
scrubbed credential, configuration as operators write it, an unexpected exception's record).

Findings (fixed with these tests):

- An upstream quoting the credential it got decoded (an OpenAI-style 401, ``Incorrect API key provided:
  <key>``) handed the client the password of ``UPSTREAM_URL``'s user info, or the token given as its user
  name (``https://TOKEN@host``): only the Basic token (base64) was scrubbed, while ``UPSTREAM_API_KEY`` in
  the same message was. It is scrubbed now from 8 characters on (a shorter one, ``user:pass``, only as its
  Basic token: decoded, every "password" in the answers would lose its "pass").
- A loopback client's own key in the query (``?key=``, Gemini's REST form) was not counted as its own
  credential: the user info's Basic went upstream beside it.
- ``examples/deploy/compose.yaml`` passed ``ASGI_LIFETIME_UPSTREAM_URL: ${UPSTREAM_URL:-}``: since ``serve``
  refuses an empty ``UPSTREAM_URL``, the documented quick start (``docker compose up`` without
  ``UPSTREAM_URL``, a DEMO upstream) stopped both replicas with exit status 2.

What holds (kept as tests): with several upstreams, some with user info, some with other user info, some
without, each upstream gets exactly its own credential through failover, never another's, a client's or a
gateway key; a loopback client's own credential wins over the user info; percent-encoded user info goes as
httpx itself would send it; the gateway's 401 takes the OpenAI, Anthropic or Gemini shape as it does with
``UPSTREAM_API_KEY``; ``.env`` files as shells, compose and Windows write them; ``serve --workers 2`` with
user info and ``GATEWAY_KEYS`` from a relative ``--env-file`` end to end; a preparer, a bookkeeper or a
transport failing: access line, metrics and ``Outcome`` say what the client got, nothing left held.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_lifetime import LifetimeSettings
from asgi_lifetime._cli._main import DEFAULT, resolve_settings
from asgi_lifetime._settings import read_env_file
from asgi_lifetime.gateway import Outcome, create_app
from asgi_lifetime.testing import assert_idle
from asgi_lifetime.testing._serve import serve_in_thread
from tests._servers import free_port
from tests.gateway.test_access_log import BrokenStream, explode

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
GATEWAY_KEY = "gk-round3-9c4e1a7b"
STRANGER = ("203.0.113.9", 40000)
LOCAL = ("127.0.0.1", 40000)
ACCESS_LOGGER = "asgi_lifetime.access"


def client_for(app: Any, peer: tuple[str, int] = STRANGER) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=peer, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# --- (1) each upstream its own credential --------------------------------------------------------------

UPSTREAMS = (
    "http://alice:pw-a-1f9e@a.test",  # user info
    "http://b.test",  # none
    "http://bob:pw-b-7d2c@c.test",  # other user info
    "http://sk-token-c0ffee42@d.test",  # a token as the user name
)
EXPECTED = {
    "a.test": [basic("alice", "pw-a-1f9e")],
    "b.test": [],
    "c.test": [basic("bob", "pw-b-7d2c")],
    "d.test": [basic("sk-token-c0ffee42", "")],
}


@pytest.mark.parametrize(
    ("gateway_keys", "peer", "headers", "own"),
    [
        ((GATEWAY_KEY,), STRANGER, {"authorization": f"Bearer {GATEWAY_KEY}"}, None),
        ((GATEWAY_KEY,), STRANGER, {"x-api-key": GATEWAY_KEY}, None),
        ((), LOCAL, {}, None),
        # A loopback client's own credential goes to every upstream, the user info to none.
        ((), LOCAL, {"authorization": "Bearer client-own"}, ["Bearer client-own"]),
    ],
)
async def test_each_upstream_gets_its_own_credential_through_failover(
    gateway_keys: tuple[str, ...], peer: tuple[str, int], headers: dict[str, str], own: list[str] | None
) -> None:
    seen: list[tuple[str, list[str], list[str]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(
            (request.url.host, request.headers.get_list("authorization"), request.headers.get_list("x-api-key"))
        )
        if len(seen) % 4:  # three upstreams fail, the fourth answers: every request visits all four
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, json={"object": "chat.completion", "choices": []})

    settings = LifetimeSettings(
        upstream_url=UPSTREAMS, gateway_keys=gateway_keys, max_attempts=4, backoff_base=0.001, backoff_max=0.001
    )
    app = create_app(settings, transport=httpx.MockTransport(handler))
    async with client_for(app, peer) as client:
        for _ in range(3):
            response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert response.status_code == 200
    assert {host for host, _, _ in seen} == set(EXPECTED) and len(seen) == 12
    for host, authorization, api_key in seen:
        assert authorization == (own if own is not None else EXPECTED[host]), host
        assert api_key == []
    await assert_idle(app)


@pytest.mark.parametrize(
    "user_info",
    [
        "us%40er:p%3Ass",  # "@" and ":" encoded
        "us%3Aer:p%40ss%2Fw%3Fx%23y",  # ":" in the user name, "/?#" in the password
        "user:p%25ss",  # an encoded "%"
        "%20user%20:%20pw%20",  # spaces kept
        "user:",  # an empty password
        "t%C3%B6ken",  # UTF-8 percent-encoded, a user name alone
        "user:pass:word",  # a raw ":" in the password
    ],
)
async def test_percent_encoded_user_info_goes_as_httpx_sends_it(user_info: str) -> None:
    url = f"http://{user_info}@a.test"
    got: list[list[str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        got.append(request.headers.get_list("authorization"))
        return httpx.Response(200, json={"object": "chat.completion", "choices": []})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as direct:
        await direct.post(f"{url}/v1/chat/completions", json=CHAT)
    app = create_app(LifetimeSettings(upstream_url=(url,)), transport=httpx.MockTransport(handler))
    async with client_for(app, LOCAL) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert got[1] == got[0] and len(got[0]) == 1


SCRUBBED = [
    # (user info as written, the secret as the upstream decoded it)
    ("alice:pw-Zq8%2Bx%2FYv3%3DLm", "pw-Zq8+x/Yv3=Lm"),
    ("alice:p%40ss%3Aw%2Frd-71c", "p@ss:w/rd-71c"),
    ("sk-proj-3f9a7c1e5b", "sk-proj-3f9a7c1e5b"),  # a token as the user name (redact_url hides it)
    (":sk-proj-8e2d4b6a0c", "sk-proj-8e2d4b6a0c"),  # a key as the password, no user name
]


def quoting_upstream() -> Starlette:
    """Quotes the credential it got decoded, as OpenAI's 401 quotes a wrong key: in the body and a header."""

    async def endpoint(request: Request) -> Response:
        await request.body()
        _, _, token = request.headers.get("authorization", "").partition(" ")
        user, _, password = base64.b64decode(token).decode().partition(":")
        secret = password or user
        quoted = {"x-received": secret, "x-received-encoded": quote(secret, safe="")}
        message = f"Incorrect API key provided: {secret} ({quote(secret, safe='')}) for {user}"
        status = 401 if request.path_params["path"] == "denied" else 200
        return JSONResponse({"error": {"message": message}}, status_code=status, headers=quoted)

    return Starlette(routes=[Route("/v1/{path:path}", endpoint, methods=["POST"])])


@pytest.fixture(scope="module")
def quoting_url() -> Iterator[str]:
    with serve_in_thread(quoting_upstream()) as base:
        yield base


@pytest.mark.parametrize("mode", ["denied", "ok"])
@pytest.mark.parametrize(("user_info", "secret"), SCRUBBED)
async def test_an_upstream_quoting_the_decoded_secret_is_scrubbed(
    quoting_url: str, user_info: str, secret: str, mode: str
) -> None:
    # Before: the body and headers carried the password (or the token) as the upstream read it.
    settings = LifetimeSettings(upstream_url=(quoting_url.replace("http://", f"http://{user_info}@"),))
    app = create_app(settings)
    async with app.router.lifespan_context(app), client_for(app, LOCAL) as client:
        response = await client.post(f"/v1/{mode}", json=CHAT)
    assert response.status_code == (401 if mode == "denied" else 200)
    shown = response.text + repr(response.headers.raw)
    for spelling in (secret, quote(secret, safe=""), user_info.partition(":")[2] or user_info):
        assert spelling not in shown, spelling
    assert "[redacted]" in response.headers["x-received"]


@pytest.mark.parametrize("user_info", ["user:pass", "alice"])
async def test_a_short_user_info_secret_is_not_cut_out_of_answers(quoting_url: str, user_info: str) -> None:
    # Scrubbed decoded, "pass" (or a user name alone) would be cut out of every answer: its Basic token only.
    settings = LifetimeSettings(upstream_url=(quoting_url.replace("http://", f"http://{user_info}@"),))
    app = create_app(settings)
    async with app.router.lifespan_context(app), client_for(app, LOCAL) as client:
        response = await client.post("/v1/ok", json=CHAT)
    assert response.status_code == 200
    assert response.headers["x-received"] == (user_info.partition(":")[2] or user_info)


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/v1/chat/completions", {}),
        ("/v1/messages", {"anthropic-version": "2023-06-01"}),
        ("/v1beta/models/gemini-2.0-flash:generateContent", {}),
    ],
)
async def test_the_401_for_user_info_has_each_apis_shape_as_with_an_upstream_key(
    path: str, headers: dict[str, str]
) -> None:
    answers = []
    for settings in (
        LifetimeSettings(upstream_url=("http://user:pw-1@a.test",), gateway_keys=(GATEWAY_KEY,)),
        LifetimeSettings(upstream_url=("http://a.test",), upstream_api_key="sk-up-1", gateway_keys=(GATEWAY_KEY,)),
    ):
        app = create_app(settings, transport=httpx.MockTransport(lambda request: pytest.fail("forwarded")))
        async with client_for(app) as client:
            response = await client.post(path, json=CHAT, headers={**headers, "x-api-key": "wrong"})
        answers.append((response.status_code, response.headers.get("content-type"), response.json()))
    assert answers[0] == answers[1] and answers[0][0] == 401


def test_serve_with_two_workers_user_info_and_gateway_keys_from_a_relative_env_file(tmp_path: Path) -> None:
    seen: list[str] = []

    async def endpoint(request: Request) -> Response:
        seen.append(request.headers.get("authorization", ""))
        return JSONResponse({"object": "chat.completion", "choices": []})

    upstream = Starlette(routes=[Route("/v1/{path:path}", endpoint, methods=["POST"])])
    with serve_in_thread(upstream) as base:
        conf = tmp_path / "conf"
        conf.mkdir()
        url = base.replace("http://", "http://op%40team:s3cr%3At@")
        (conf / "prod.env").write_bytes(
            f'\ufeffexport ASGI_LIFETIME_UPSTREAM_URL="{url}"\r\nASGI_LIFETIME_GATEWAY_KEYS={GATEWAY_KEY}\r\n'.encode()
        )
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASGI_LIFETIME_")}
        argv = [sys.executable, "-m", "asgi_lifetime", "serve", "--env-file", "conf/prod.env"]
        argv += ["--workers", "2", "--port", str(port), "--host", "127.0.0.1"]
        process = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
                while True:
                    assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
                    try:
                        if client.get("/healthz").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert time.monotonic() < deadline, "serve did not start within 30 s"
                    time.sleep(0.1)
                statuses = [
                    client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": GATEWAY_KEY}).status_code
                    for _ in range(4)
                ]
                refused = client.post("/v1/chat/completions", json=CHAT).status_code
        finally:
            process.terminate()
            output = process.communicate(timeout=30)[0].decode()
    assert statuses == [200] * 4
    assert refused == 401  # 127.0.0.1 is loopback, but with GATEWAY_KEYS set a key is needed
    assert seen == [basic("op@team", "s3cr:t")] * 4
    assert "s3cr" not in output, output


# --- (2) configurations that worked before --------------------------------------------------------------


def compose_environment(shell: dict[str, str]) -> dict[str, str]:
    """The gateway's environment as docker compose builds it from compose.yaml and the shell: ``${X:-d}``
    interpolated, a key without a value taken from the shell, and left out when the shell has none."""
    compose = yaml.safe_load((ROOT / "examples/deploy/compose.yaml").read_text())
    environment = compose["x-gateway"]["environment"]
    result = {}
    for key, value in environment.items():
        if value is None:
            if key in shell:
                result[key] = shell[key]
            continue
        result[key] = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: shell.get(m[1]) or (m[2] or ""), str(value))
    return result


@pytest.mark.parametrize(
    ("shell", "upstream"),
    [
        ({}, ()),  # the quick start: the DEMO upstream
        ({"ASGI_LIFETIME_UPSTREAM_URL": "http://vllm:8000"}, ("http://vllm:8000",)),
    ],
)
def test_the_compose_example_starts_with_and_without_an_upstream(
    shell: dict[str, str], upstream: tuple[str, ...]
) -> None:
    # Before: ASGI_LIFETIME_UPSTREAM_URL: ${UPSTREAM_URL:-} made it empty, and serve refused an empty one.
    settings, sources = resolve_settings({}, compose_environment(shell), env_file=None)
    assert settings.upstream_url == upstream
    assert upstream or sources["upstream_url"] == DEFAULT  # serve's condition for the DEMO upstream


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('export ASGI_LIFETIME_UPSTREAM_URL="http://h:1"\n', "http://h:1"),
        ("export ASGI_LIFETIME_UPSTREAM_URL='http://h:1'  # prod\n", "http://h:1"),
        ('ASGI_LIFETIME_UPSTREAM_URL="http://h:1"\r\n', "http://h:1"),
        ("ASGI_LIFETIME_UPSTREAM_URL=http://h:1\r\nOTHER=x\r\n", "http://h:1"),
        ('\ufeffexport ASGI_LIFETIME_UPSTREAM_URL="http://h:1"\r\n', "http://h:1"),
        # Another tool's PEM block, quoted over several lines (python-dotenv, compose): not ours, skipped.
        (
            'TLS_KEY="-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC==\n-----END PRIVATE KEY-----"\n'
            "ASGI_LIFETIME_UPSTREAM_URL=http://h:1\n",
            "http://h:1",
        ),
        ("db_password=\"it's\nASGI_LIFETIME_UPSTREAM_URL=http://h:1\n", "http://h:1"),  # another tool's odd quote
        ("ASGI_LIFETIME_UPSTREAM_URL=http://h:1 # the vLLM box\n", "http://h:1"),
    ],
)
def test_env_files_as_shells_compose_and_windows_write_them(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / ".env"
    path.write_bytes(text.encode())
    assert read_env_file(path)["ASGI_LIFETIME_UPSTREAM_URL"] == expected
    assert LifetimeSettings.from_environ({}, env_file=path).upstream_url == (expected,)


def test_the_example_env_file_and_manifests_still_validate() -> None:
    LifetimeSettings.from_environ({}, env_file=ROOT / "examples/gateway.env")
    configmap = yaml.safe_load((ROOT / "examples/deploy/k8s/configmap.yaml").read_text())
    LifetimeSettings.from_environ(configmap["data"], env_file=None)


# --- (4) an unexpected exception's record ---------------------------------------------------------------


class _Recorder:
    def __init__(self, *, fail: bool) -> None:
        self.outcomes: list[Outcome] = []
        self.fail = fail

    async def record(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        if self.fail:
            raise RuntimeError("a bookkeeper's defect")


@pytest.mark.parametrize(
    ("where", "status"), [("preparer", 500), ("relay", 200), ("upstream", 500), ("bookkeeper", 200)]
)
async def test_an_unexpected_failure_is_recorded_alike_everywhere_and_nothing_is_held(
    where: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)

    def upstream(request: httpx.Request) -> httpx.Response:
        if where == "upstream":
            raise RuntimeError("a transport's defect before any byte")
        if where == "bookkeeper":
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content=b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n',
            )
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=BrokenStream())

    book = _Recorder(fail=where == "bookkeeper")
    app = create_app(
        LifetimeSettings(upstream_url=("http://a.test",)),
        transport=httpx.MockTransport(upstream),
        preparers=[explode] if where == "preparer" else [],
        bookkeeper=book,
    )
    async with client_for(app, LOCAL) as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        metrics = (await client.get("/metrics")).text
    assert response.status_code == status
    [outcome] = book.outcomes
    assert outcome.status == status
    [record] = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert record.__dict__["asgi_lifetime"]["status"] == status
    assert re.search(rf'status="{status}"', metrics), metrics[:2000]
    await assert_idle(app)


DOCUMENTED = sorted(
    {
        match
        for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.*")]
        for match in re.findall(r"ASGI_LIFETIME_[A-Z_]+=[^\s`|'\"]+", path.read_text(errors="replace"))
    }
)


@pytest.mark.parametrize("assignment", DOCUMENTED)
def test_every_documented_assignment_is_still_accepted(assignment: str) -> None:
    name, _, value = assignment.partition("=")
    LifetimeSettings.from_environ({name: value}, env_file=None)


def test_a_plain_uvicorn_factory_still_reads_the_env_file_of_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # uvicorn --factory asgi_lifetime.gateway:create_app: only serve's workers stopped reading ./.env.
    for name in [name for name in os.environ if name.startswith("ASGI_LIFETIME_")]:
        monkeypatch.delenv(name)
    (tmp_path / ".env").write_text(
        "ASGI_LIFETIME_UPSTREAM_URL=http://user:pw-1@h.test:8000\nASGI_LIFETIME_MAX_INFLIGHT=7\n"
    )
    monkeypatch.chdir(tmp_path)
    app = create_app()
    settings = app.state.lifetime.settings
    assert settings.upstream_url == ("http://h.test:8000",) and settings.max_inflight == 7
    assert settings.upstream_authorization("http://h.test:8000") == basic("user", "pw-1")


@pytest.mark.parametrize(
    ("auth", "header", "value"),
    [
        ("bearer", "authorization", "Bearer sk-up-42"),
        ("x-api-key", "x-api-key", "sk-up-42"),
        ("x-goog-api-key", "x-goog-api-key", "sk-up-42"),
        ("api-key", "api-key", "sk-up-42"),
    ],
)
async def test_with_an_upstream_key_no_upstream_gets_the_user_info_beside_it(
    auth: str, header: str, value: str
) -> None:
    # The documented rule: the Basic credential goes only when neither the client nor UPSTREAM_API_KEY gives one.
    seen: list[httpx.Headers] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        if len(seen) % 2:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, json={"object": "chat.completion", "choices": []})

    settings = LifetimeSettings(
        upstream_url=("http://alice:pw-a-1f9e@a.test", "http://b.test"),
        upstream_api_key="sk-up-42",
        upstream_auth=auth,
        gateway_keys=(GATEWAY_KEY,),
        backoff_base=0.001,
        backoff_max=0.001,
    )
    app = create_app(settings, transport=httpx.MockTransport(handler))
    async with client_for(app) as client:
        response = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {GATEWAY_KEY}"}
        )
    assert response.status_code == 200 and len(seen) == 2
    for headers in seen:
        assert headers.get_list(header) == [value]
        assert all(not v.startswith("Basic") for v in headers.get_list("authorization"))
        assert GATEWAY_KEY not in repr(headers.raw)


@pytest.mark.parametrize(
    ("query", "headers"),
    [
        ("?key=client-own", {}),  # Gemini's REST form
        ("?alt=sse&KEY=client-own", {}),
        ("?api_key=client-own", {}),
        ("", {"x-goog-api-key": "client-own"}),
        ("", {"authorization": "Bearer client-own"}),
    ],
)
async def test_a_loopback_clients_own_credential_in_the_query_keeps_the_user_info_here(
    query: str, headers: dict[str, str]
) -> None:
    # Before: a key in the query was not counted as the client's own credential: the user info's Basic went
    # beside it (two credentials, the operator's spent on a request that brought its own).
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"candidates": []})

    settings = LifetimeSettings(upstream_url=("http://user:pw-a-1f9e@a.test",), paths=("/v1beta/",))
    app = create_app(settings, transport=httpx.MockTransport(handler))
    async with client_for(app, LOCAL) as client:
        path = "/v1beta/models/gemini-2.0-flash:generateContent" + query
        assert (await client.post(path, json={"contents": []}, headers=headers)).status_code == 200
    [request] = seen
    assert not any(value.startswith("Basic") for value in request.headers.get_list("authorization"))
    assert "client-own" in str(request.url) + repr(request.headers.raw)
