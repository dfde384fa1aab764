"""The gateway tried as a newcomer would, following README.md and docs/operators.md: settings from the
environment and a ``.env`` file, ``asgi-lifetime serve``, the openai and anthropic SDKs through it.

Found here:

- an ``UPSTREAM_URL`` with a query string (``https://host/?key=...``, where Gemini-style keys travel)
  was accepted: every request path was appended after the query, so every request went to the upstream's
  root (404), and the query, key included, was printed by ``settings``, the startup line and
  ``/lifetime/stats``. A port out of range or whitespace in the host was accepted too, and failed only at
  the first request.
- a ``.env`` line as shells and docker compose write it was not applied as written: ``export NAME=value``
  was silently ignored (the setting kept its default: no typo check saw it), and an inline comment
  (``NAME=sk-... # prod key``) became part of the value: a wrong upstream key, every request a 401.
- the access log (and every bookkeeper) said ``attempts=0`` for a request whose attempts all failed
  (502 ``upstream_unreachable`` after ``MAX_ATTEMPTS`` connects) or whose client left during a retry's
  wait, and did not count the blind re-issue of a starved stream: ``attempts`` is the upstream attempts.

Found in a second trial (the SDKs through ``asgi-lifetime serve`` in front of a raw-socket upstream):

- a password in a mistyped URL (an unescaped ``/`` as base64 passwords have, ``redis//``, no scheme) was
  shown whole by the error rejecting it: ``redact_url`` masked only user info urlsplit found;
- ``GATEWAY_KEYS`` without ``UPSTREAM_API_KEY`` were silently not checked: an open gateway that looked closed;
- uvicorn's ``"WebSocket <path>"`` line under ``serve`` logged a handshake's query (``?key=``);
- an upstream response header with a control character made uvicorn refuse the response: no answer,
  so the openai SDK retried and the upstream generated the answer three times;
- a key with a line break failed every request after every retry as 502 "unreachable";
- aiohttp's parse error, quoting the refused bytes (an error body quoting the upstream key), was logged.
- a ``.env`` line ``ASGI_LIFETIME_NAME: value`` (a compose file's map) was skipped: the default ran.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st

import asgi_lifetime
from asgi_lifetime._cli._main import main as cli_main
from asgi_lifetime._cli._main import refusal
from asgi_lifetime._settings import LifetimeSettings, redact_url
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._upstream import UpstreamClient
from asgi_lifetime.testing._serve import serve_in_thread

from .._servers import free_port
from ..gateway._raw_upstream import RawRequest, Script, raw_upstream
from .test_attack_upstream import END, FIRST, SSE_HEAD, STREAM_BODY, chunk
from .test_faults import FAST, PATH, assert_idle

SECRET = "AIzaSECRET-in-the-query"


@pytest.mark.parametrize(
    "url",
    [
        f"http://127.0.0.1:8000/?key={SECRET}",
        f"https://generativelanguage.googleapis.com/v1beta?key={SECRET}",
        f"http://127.0.0.1:8000/v1#{SECRET}",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:port",
        "http://user:pass word@127.0.0.1:8000",
        "http://exa mple.com",
        "http://:8000",
    ],
)
@pytest.mark.parametrize("source", ["code", "environment"])
def test_an_upstream_url_the_path_cannot_be_appended_to_fails_at_start(url: str, source: str) -> None:
    # Before: accepted; every request then went to the wrong place (or failed to connect), and the key in
    # the query was shown wherever the URL was.
    with pytest.raises(ValueError) as info:
        if source == "code":
            LifetimeSettings(upstream_url=(url,))
        else:
            LifetimeSettings.from_environ(environ={"ASGI_LIFETIME_UPSTREAM_URL": url}, env_file=None)
    message = str(info.value)
    assert message.startswith("ASGI_LIFETIME_UPSTREAM_URL=") and "is invalid" in message
    assert SECRET not in message


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8000", "http://127.0.0.1:8000/", "https://api.example.com/v1", "http://[::1]:8000/base/"],
)
def test_an_ordinary_upstream_url_is_accepted(url: str) -> None:
    assert LifetimeSettings(upstream_url=(url,)).upstream_url == (url,)


def test_a_query_is_never_shown() -> None:
    assert SECRET not in redact_url(f"redis://:pw@127.0.0.1:6379/0?password={SECRET}")


def test_the_upstream_client_refuses_a_base_url_with_a_query_without_showing_it() -> None:
    with pytest.raises(ValueError, match="has a query") as info:
        UpstreamClient(settings=LifetimeSettings(), base_url=f"https://u:pw@api.example.com/?key={SECRET}")
    assert SECRET not in str(info.value) and "pw" not in str(info.value)


@pytest.mark.parametrize(
    ("line", "name", "expected"),
    [
        ("export ASGI_LIFETIME_STALL_TIMEOUT=9", "stall_timeout", 9.0),
        ("export  ASGI_LIFETIME_STALL_TIMEOUT = 9", "stall_timeout", 9.0),
        ("ASGI_LIFETIME_UPSTREAM_API_KEY=sk-live # the production key", "upstream_api_key", "sk-live"),
        ('ASGI_LIFETIME_UPSTREAM_API_KEY="sk-live" # quoted, then a comment', "upstream_api_key", "sk-live"),
        ("ASGI_LIFETIME_UPSTREAM_API_KEY='sk-live'", "upstream_api_key", "sk-live"),
        ('ASGI_LIFETIME_UPSTREAM_API_KEY="sk-#live"', "upstream_api_key", "sk-#live"),  # quoted: kept
        ("ASGI_LIFETIME_UPSTREAM_API_KEY=sk-#live", "upstream_api_key", "sk-#live"),  # no space before #
        ("ASGI_LIFETIME_MAX_INFLIGHT=8\t# slots", "max_inflight", 8),
        ("ASGI_LIFETIME_SESSION_HEADER=x-conv-id", "session_header", "x-conv-id"),
    ],
)
def test_an_env_file_line_is_applied_as_shells_and_compose_read_it(
    tmp_path: Path, line: str, name: str, expected: object
) -> None:
    # Before: the export line was ignored (the default stayed), the comment was part of the key.
    env_file = tmp_path / ".env"
    env_file.write_text(f"# gateway\n{line}\nASGI_LIFETIME_GATEWAY_KEYS=client-key\n")
    settings = LifetimeSettings.from_environ(environ={}, env_file=env_file)
    assert getattr(settings, name) == expected
    assert settings.gateway_keys == ("client-key",)


def test_a_misspelt_exported_name_in_an_env_file_is_an_error(tmp_path: Path) -> None:
    # Before: ``export`` hid the name from the unknown-setting check, as well as from the settings.
    env_file = tmp_path / ".env"
    env_file.write_text("export ASGI_LIFETIME_STAL_TIMEOUT=9\n")
    with pytest.raises(ValueError, match="'ASGI_LIFETIME_STAL_TIMEOUT'.*known settings"):
        LifetimeSettings.from_environ(environ={}, env_file=env_file)


def _access_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The fields of each access-log line (``extra={"asgi_lifetime": ...}``)."""
    return [record.__dict__["asgi_lifetime"] for record in caplog.records if record.name == "asgi_lifetime.access"]


async def _through_gateway(upstream_url: str, body: dict[str, Any], **changes: Any) -> tuple[int, bytes]:
    app = create_app(LifetimeSettings(upstream_url=(upstream_url,), **{**FAST, **changes}))
    with serve_in_thread(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            response = await client.post(PATH, json=body)
        await assert_idle(app, url)
    return response.status_code, response.content


@pytest.mark.anyio
async def test_the_access_log_counts_the_attempts_of_an_unreachable_upstream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Nothing listens on the port: every attempt fails to connect. Before: attempts=0, then upstream=-.
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    port = free_port()
    status, body = await _through_gateway(f"http://127.0.0.1:{port}", STREAM_BODY)
    assert status == 502 and b"upstream_unreachable" in body
    [line] = _access_records(caplog)
    assert line["attempts"] == FAST["max_attempts"]
    assert line["status"] == 502 and line["upstream"] == f"http://127.0.0.1:{port}"


@pytest.mark.anyio
async def test_the_access_log_counts_the_reissue_of_a_starved_stream(caplog: pytest.LogCaptureFixture) -> None:
    # The first answer ends without an event (starved, re-issued); the second streams. Before: attempts=1.
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    answers = [[SSE_HEAD, b"0\r\n\r\n"], [SSE_HEAD, chunk(FIRST + END), b"0\r\n\r\n"]]

    def answer(request: RawRequest) -> Script:
        return list(answers[min(len(upstream.requests), 2) - 1])

    with raw_upstream(answer) as upstream:
        status, body = await _through_gateway(upstream.url, STREAM_BODY)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert len(upstream.requests) == 2
    [line] = _access_records(caplog)
    assert line["attempts"] == 2 and line["outcome"] == "complete"


@pytest.mark.anyio
async def test_the_access_log_counts_the_attempt_before_the_client_left(caplog: pytest.LogCaptureFixture) -> None:
    # The upstream asks for a 3 s wait; the client gives up after 0.3 s, during the wait. Before: attempts=0.
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    busy = b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 3\r\ncontent-length: 2\r\n\r\n{}"
    with raw_upstream(lambda request: [busy]) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **{**FAST, "retry_after_cap": 10.0}))
        with serve_in_thread(app) as url:
            async with httpx.AsyncClient(base_url=url, timeout=0.3) as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(PATH, json=STREAM_BODY)
            await assert_idle(app, url)
    assert len(upstream.requests) == 1
    [line] = _access_records(caplog)
    assert line["attempts"] == 1 and line["outcome"] == "client_disconnected"


# -- second trial (worktree newuser): what the SDKs and a hostile upstream found ------------------------

PASSWORD = "Zq9/x7+Kb"  # base64 passwords (``openssl rand -base64``) have "/" and "+"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ASGI_LIFETIME_UPSTREAM_URL", f"http://bob:{PASSWORD}@127.0.0.1:8000"),  # "/" ends urlsplit's netloc
        ("ASGI_LIFETIME_UPSTREAM_URL", "http://bob:Zq9#x7@127.0.0.1:8000"),
        ("ASGI_LIFETIME_UPSTREAM_URL", f"bob:{PASSWORD}@127.0.0.1:8000"),  # the scheme forgotten
        ("ASGI_LIFETIME_SESSION_STORE", f"redis://:{PASSWORD}@127.0.0.1:6379/0"),
        ("ASGI_LIFETIME_SESSION_STORE", f"redis//admin:{PASSWORD}@127.0.0.1:6379/0"),  # ":" forgotten
    ],
)
def test_a_password_in_a_mistyped_url_is_not_shown_by_the_error(name: str, value: str) -> None:
    # Before: the error (printed by ``serve`` and ``settings``, logged by a supervisor) showed the password
    # whole: redact_url masked only user info urlsplit had found in a netloc.
    with pytest.raises(ValueError, match=f"^{name}=.* is invalid") as info:
        LifetimeSettings.from_environ(environ={name: value}, env_file=None)
    assert "Zq9" not in str(info.value)
    # It still says which URL, unless the password has a "?" or "#": what follows its "@" may then be
    # the end of a query, and is hidden too.
    assert ("127.0.0.1" in str(info.value)) is ("#" not in value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"http://bob:{PASSWORD}@h:1/v1", "http://bob:***@h:1/v1"),
        (f"redis//admin:{PASSWORD}@h", "redis//admin:***@h"),
        ("https://user:pa55@api.example.com:8443/v1", "https://user:***@api.example.com:8443/v1"),
        ("http://bob:p#w@h/x?key=1", "http://bob:***@***"),  # the "@" may be in a fragment: "h/x" hidden too
        ("http://h:8080/p?key=ab@cd", "http://h:***@***"),  # before: "cd", the end of the query, was shown
        ("http://h/p?x=a:b@c", "http://h/p?***"),
        ("https://h/?key=a@b", "https://h/?***"),
        ("http://user@h", "http://***@h"),  # a user name alone is a credential too (Basic "user:")
        ("http://h:8000/v1", "http://h:8000/v1"),
    ],
)
def test_redact_url_masks_what_precedes_the_last_at(url: str, shown: str) -> None:
    assert redact_url(url) == shown


_SEPARATORS = "/?#@:+=&%; "


def _secret(marker: str) -> st.SearchStrategy[str]:
    """A secret of marked pieces (``Zq0/Zq1?Zq2``) joined by characters that end URL parts."""
    return st.lists(st.sampled_from(_SEPARATORS), min_size=0, max_size=4).map(
        lambda seps: "".join(f"{marker}{i}{sep}" for i, sep in enumerate(seps)) + f"{marker}{len(seps)}"
    )


@settings(max_examples=400, deadline=None)
@given(
    scheme=st.sampled_from(["http://", "https://", "redis://", "redis//", "http:/", ""]),
    user=st.sampled_from(["", "bob", "a.b-c"]),
    password=_secret("Zq"),
    host=st.sampled_from(["h", "127.0.0.1", "[::1]", "api.example.com"]),
    port=st.sampled_from(["", ":8080"]),
    path=st.sampled_from(["", "/", "/v1", "/p/q"]),
    query=st.one_of(st.just(""), _secret("Qk").map(lambda value: f"?key={value}")),
    fragment=st.one_of(st.just(""), _secret("Fr").map(lambda value: f"#{value}")),
)
def test_redact_url_never_shows_a_piece_of_a_password_query_or_fragment(
    scheme: str, user: str, password: str, host: str, port: str, path: str, query: str, fragment: str
) -> None:
    # Whatever a password, query or fragment holds ("/", "?", "#", "@": base64, a mistyped URL, an "@" in a
    # query), none of its pieces is shown: an "@" in a query once showed what followed it.
    shown = redact_url(f"{scheme}{user}:{password}@{host}{port}{path}{query}{fragment}")
    assert "Zq" not in shown and "Qk" not in shown and "Fr" not in shown, shown
    shown = redact_url(f"{scheme}{host}{port}{path}{query}{fragment}")  # no user info
    assert "Qk" not in shown and "Fr" not in shown, shown


def _never_serve(*args: object, **kwargs: object) -> None:
    raise AssertionError("the gateway must not start")


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5"])
def test_gateway_keys_without_an_upstream_key_do_not_start_an_open_gateway(
    host: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Before: ``serve`` started, and every request went through whatever key it carried (the keys are
    # checked only when the gateway injects its upstream key): the operator believed the port closed.
    monkeypatch.chdir(tmp_path)  # no ./.env
    monkeypatch.setattr(uvicorn.Server, "run", _never_serve)
    monkeypatch.setenv("ASGI_LIFETIME_GATEWAY_KEYS", "gk-SECRET-1")
    assert cli_main(["serve", "--host", host, "--upstream", "http://127.0.0.1:9"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"refusing to serve on {host}" in err and "UPSTREAM_API_KEY" in err and "gk-SECRET" not in err


@pytest.mark.parametrize(
    ("key", "gateway_keys", "host", "refused"),
    [
        (None, ("gk",), "0.0.0.0", True),
        (None, ("gk",), "127.0.0.1", False),
        (None, ("gk",), "::1", False),
        ("sk-up", ("gk",), "0.0.0.0", False),
        (None, (), "0.0.0.0", False),
        ("sk-up", (), "0.0.0.0", True),
    ],
)
def test_refusal_of_keys_that_would_not_be_checked(
    key: str | None, gateway_keys: tuple[str, ...], host: str, refused: bool
) -> None:
    problem = refusal(LifetimeSettings(upstream_api_key=key, gateway_keys=gateway_keys), host)
    assert (problem is not None) is refused


def test_create_app_warns_of_gateway_keys_that_are_not_checked(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="asgi_lifetime.gateway"):
        create_app(LifetimeSettings(upstream_url=("http://127.0.0.1:9",), gateway_keys=("gk-SECRET",)))
    warnings = [r.getMessage() for r in caplog.records if r.name == "asgi_lifetime.gateway"]
    assert any("not checked" in message for message in warnings)
    assert not any("gk-SECRET" in message for message in warnings)


def _websocket_handshake(port: int, target: str) -> bytes:
    request = (
        f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode())
        return sock.recv(65536)


def test_serve_does_not_log_the_key_in_a_websocket_query(tmp_path: Path) -> None:
    # Before: uvicorn's "WebSocket <path>" line (uvicorn.error, INFO) carried the query, so a Gemini Live
    # client's ``?key=`` was written to the gateway's log although the access log is off for that reason.
    root = Path(asgi_lifetime.__file__).parents[1]  # this checkout, not whatever is installed
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASGI_LIFETIME_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    port = free_port()
    log_path = tmp_path / "serve.log"
    argv = ["serve", "--port", str(port), "--upstream", "http://127.0.0.1:9", "--drain-delay", "0"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "asgi_lifetime", *argv], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                assert process.poll() is None, log_path.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                        break
                assert time.monotonic() < deadline, "the gateway did not answer /healthz in time"
                time.sleep(0.05)
            answer = _websocket_handshake(port, f"/ws/BidiGenerateContent?key={SECRET}&alt=x")
            assert answer.startswith(b"HTTP/1.1 403")
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=20) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    text = log_path.read_text()
    assert '"WebSocket /ws/BidiGenerateContent?***" 403' in text
    assert SECRET not in text


CHAT_ANSWER = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    }
).encode()


@pytest.mark.parametrize(
    ("transport", "field"),
    [
        ("aiohttp", b"x-trace: a\x01b"),
        ("aiohttp", b"x-trace: a\x7fb"),
        ("aiohttp", b"x-trace: a\x0bb"),  # h11 refuses this one: httpcore fails the attempt
        ("httpcore", b"x-trace: a\x01b"),
        ("httpcore", b"x-trace: a\x7fb"),
    ],
)
def test_an_upstream_header_the_server_cannot_send_is_dropped_not_fatal(field: bytes, transport: str) -> None:
    # Before: the parsers passed the field, uvicorn refused to send it (RuntimeError "Invalid HTTP header
    # value"): no answer at all, so the openai SDK retried, and the upstream generated the answer 3 times.
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + field + b"\r\n"
    answer = head + b"x-request-id: req_1\r\ncontent-length: %d\r\n\r\n" % len(CHAT_ANSWER) + CHAT_ANSWER
    with raw_upstream(lambda request: [answer]) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **{**FAST, "upstream_transport": transport}))
        with serve_in_thread(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=2, timeout=20)
            raw = client.chat.completions.with_raw_response.create(model="m", messages=[])
            assert raw.parse().choices[0].message.content == "hi"
            assert raw.headers.get("x-request-id") == "req_1" and "x-trace" not in raw.headers
    assert len(upstream.requests) == 1


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("upstream_api_key", "sk-live-1\nsk-live-2"),  # two lines of a secret file
        ("upstream_api_key", "sk-live\x00"),
        ("upstream_api_key", "sk-live\u200b"),  # a zero-width space pasted with it (strip() keeps it)
        ("gateway_keys", "gk-1,gk\u20112"),  # a non-breaking hyphen
        ("gateway_keys", "gk-1,gk\t2"),
    ],
)
@pytest.mark.parametrize("source", ["code", "environment"])
def test_a_key_that_cannot_go_in_a_header_fails_at_start(name: str, value: str, source: str) -> None:
    # Before: accepted. A line break in UPSTREAM_API_KEY failed every request after every retry as 502
    # "upstream unreachable (LocalProtocolError)"; other characters went out as UTF-8 (the upstream's 401).
    env = f"ASGI_LIFETIME_{name.upper()}"
    with pytest.raises(ValueError, match=f"^{env}=\\*\\*\\* is invalid: a key must be printable ASCII") as info:
        if source == "code":
            LifetimeSettings.from_mapping({name: value})
        else:
            LifetimeSettings.from_environ(environ={env: value}, env_file=None)
    assert "live" not in str(info.value) and "gk" not in str(info.value)


def test_ordinary_keys_are_accepted() -> None:
    settings = LifetimeSettings(upstream_api_key="sk-proj-AbC_12-x.y~z+/=", gateway_keys=("gk 1", "gk-2"))
    assert settings.upstream_api_key == "sk-proj-AbC_12-x.y~z+/=" and settings.gateway_keys == ("gk 1", "gk-2")


def test_the_upstream_key_quoted_in_bytes_aiohttp_refuses_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    # Before: the warning that sends an upstream to httpcore quoted aiohttp's parse error, which quotes the
    # bytes it refused: here an error body (longer than its Content-Length) quoting the key the gateway sent.
    key = "sk-upstream-LOGGED-SECRET"

    def answer(request: RawRequest) -> Script:
        quoted = f'{{"error": {{"message": "invalid key: {request.headers.get("authorization")}"}}}}'.encode()
        return [b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: 5\r\n\r\n" + quoted]

    caplog.set_level(logging.WARNING)
    with raw_upstream(answer) as upstream:
        settings = LifetimeSettings(upstream_url=(upstream.url,), upstream_api_key=key, gateway_keys=("gk",), **FAST)
        with serve_in_thread(create_app(settings.replace(upstream_transport="aiohttp"))) as url:
            response = httpx.post(f"{url}{PATH}", json={}, headers={"authorization": "Bearer gk"}, timeout=20)
    assert response.status_code in (401, 502)
    assert key not in response.text
    messages = [record.getMessage() for record in caplog.records]
    assert not [message for message in messages if key in message or "invalid key" in message]
    assert any("aiohttp cannot parse (Bad status line)" in message for message in messages), messages


@pytest.mark.parametrize(
    "line",
    [
        "ASGI_LIFETIME_UPSTREAM_API_KEY: sk-SECRET-1",  # copied from a compose file's environment map
        "export ASGI_LIFETIME_UPSTREAM_API_KEY sk-SECRET-1",
        "  ASGI_LIFETIME_MAX_INFLIGHT 16",
    ],
)
def test_an_env_file_line_without_equals_naming_a_setting_is_an_error(tmp_path: Path, line: str) -> None:
    # Before: silently skipped; the setting kept its default (here: no upstream key, every request a 401).
    env_file = tmp_path / ".env"
    env_file.write_text(f"ASGI_LIFETIME_STALL_TIMEOUT=9\n{line}\n")
    with pytest.raises(ValueError, match=r"line 2: ASGI_LIFETIME_[A-Z_]+ has no '='") as info:
        LifetimeSettings.from_environ(environ={}, env_file=env_file)
    assert "SECRET" not in str(info.value)


@pytest.mark.parametrize("line", ["ASGI_LIFETIME_MAX_INFLIGHT", "OTHER_TOOL: value", "# ASGI_LIFETIME_X: y"])
def test_other_lines_without_equals_are_still_skipped(tmp_path: Path, line: str) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text(f"{line}\nASGI_LIFETIME_STALL_TIMEOUT=9\n")
    assert LifetimeSettings.from_environ(environ={}, env_file=env_file).stall_timeout == 9.0
