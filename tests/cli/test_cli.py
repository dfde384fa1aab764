from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.importer import import_from_string
from uvicorn.protocols.http.h11_impl import H11Protocol

from asgi_lifetime import GiB, KiB, LifetimeSettings, MiB, __version__
from asgi_lifetime._cli._main import (
    H11_PROTOCOL,
    HTTPTOOLS_PROTOCOL,
    CommandError,
    build_parser,
    export_environ,
    flag_values,
    is_loopback,
    main,
    refusal,
    resolve_settings,
    server_config,
    settings_markdown,
)
from asgi_lifetime._settings import ENV_PREFIX, SETTINGS
from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime.testing._upstream import create_demo_upstream

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operators.md"
SECRET = "sk-do-not-print-9f3a1c"

# One valid, non-default flag value per setting, and what it parses to.
SAMPLES: dict[str, tuple[str, Any]] = {
    "max_body_bytes": ("32MiB", 32 * MiB),
    "body_idle_timeout": ("12.5", 12.5),
    "body_timeout": ("120", 120.0),
    "max_inflight": ("3", 3),
    "max_inflight_bytes": ("2GiB", 2 * GiB),
    "admission_timeout": ("0", 0.0),
    "admission_target_delay": ("0.2", 0.2),
    "admission_interval": ("2", 2.0),
    "paths": ("/v1/,/v2/", ("/v1/", "/v2/")),
    "upstream_url": ("http://10.0.0.5:8000", ("http://10.0.0.5:8000",)),
    "max_attempts": ("2", 2),
    "retry_deadline": ("30", 30.0),
    "backoff_base": ("0.1", 0.1),
    "backoff_max": ("2", 2.0),
    "retry_after_cap": ("5", 5.0),
    "connect_timeout": ("3", 3.0),
    "headers_timeout": ("60", 60.0),
    "stall_timeout": ("45", 45.0),
    "keepalive_interval": ("5", 5.0),
    "retain_outbound": ("false", "off"),
    "retain_spill_bytes": ("4MiB", 4 * MiB),
    "retain_dir": ("/var/tmp", "/var/tmp"),
    "malloc_trim": ("off", False),
    "session_header": ("x-conversation", "x-conversation"),
    "max_session_id_bytes": ("1KiB", KiB),
    "bookkeeping_sessions": ("100", 100),
    "session_store": (
        "rediss://gw:REDISPASSWORD@redis.internal:6380/1",
        "rediss://gw:REDISPASSWORD@redis.internal:6380/1",
    ),
    "session_ttl": ("3600", 3600.0),
    "session_lease": ("6", 6.0),
    "session_store_timeout": ("0.5", 0.5),
    "error_body_limit": ("8KiB", 8 * KiB),
    "upstream_api_key": (SECRET, SECRET),
    "upstream_auth": ("X-API-Key", "x-api-key"),
    "gateway_keys": ("gk-1,gk-2", ("gk-1", "gk-2")),
    "upstream_cooloff": ("1", 1.0),
    "upstream_transport": ("httpcore", "httpcore"),
    "drain_delay": ("0", 0.0),
    "shutdown_grace": ("10", 10.0),
}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No ASGI_LIFETIME_* from the developer's shell, no ./.env from the checkout."""
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


def resolve(argv: list[str], environ: dict[str, str] | None = None, env_file: str | None = None) -> Any:
    args = build_parser().parse_args(["settings", *argv])
    return resolve_settings(flag_values(args), environ or {}, env_file=env_file)


def never_serve(*args: object, **kwargs: object) -> None:
    raise AssertionError("this test must not start a server")


def subprocess_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}


def run_cli(
    cwd: Path, *argv: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """``python -m asgi_lifetime ARGV`` run to its end in ``cwd``; ``env`` defaults to ``subprocess_env()``."""
    return subprocess.run(
        [sys.executable, "-m", "asgi_lifetime", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=subprocess_env() if env is None else env,
        timeout=timeout,
    )


# --- parsing -------------------------------------------------------------------------


def test_every_setting_has_a_sample() -> None:
    assert set(SAMPLES) == set(SETTINGS)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_each_setting_is_a_flag(name: str) -> None:
    text, expected = SAMPLES[name]
    flag = "--upstream" if name == "upstream_url" else "--" + name.replace("_", "-")
    settings, sources = resolve([flag, text])
    assert getattr(settings, name) == expected
    assert sources[name] == "command line"
    assert all(source == "default" for other, source in sources.items() if other != name)


def test_precedence_flag_over_environment_over_env_file_over_default(tmp_path: Path) -> None:
    env_file = tmp_path / "gateway.env"
    env_file.write_text(f"{ENV_PREFIX}MAX_INFLIGHT=7\n{ENV_PREFIX}STALL_TIMEOUT=11\n{ENV_PREFIX}KEEPALIVE_INTERVAL=3\n")
    environ = {f"{ENV_PREFIX}MAX_INFLIGHT": "8", f"{ENV_PREFIX}STALL_TIMEOUT": "22"}
    settings, sources = resolve(["--max-inflight", "9"], environ, env_file=str(env_file))
    assert (settings.max_inflight, sources["max_inflight"]) == (9, "command line")
    assert (settings.stall_timeout, sources["stall_timeout"]) == (22.0, "environment")
    assert (settings.keepalive_interval, sources["keepalive_interval"]) == (3.0, f"env file {env_file}")
    assert (settings.max_attempts, sources["max_attempts"]) == (4, "default")


def test_dot_env_in_the_working_directory_is_read_by_default(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(f"{ENV_PREFIX}MAX_ATTEMPTS=2\n")
    settings, sources = resolve([])
    assert (settings.max_attempts, sources["max_attempts"]) == (2, "env file .env")


def test_upstream_repeats_and_accepts_lists() -> None:
    argv = ["--upstream", "http://a:1", "--upstream", "http://b:2,http://c:3", "--upstream-url", "http://d:4"]
    settings, sources = resolve(argv, {f"{ENV_PREFIX}UPSTREAM_URL": "http://env:9"})
    assert settings.upstream_url == ("http://a:1", "http://b:2", "http://c:3", "http://d:4")
    assert sources["upstream_url"] == "command line"


def test_exported_environment_rebuilds_the_same_settings() -> None:
    settings = LifetimeSettings.from_mapping({name: text for name, (text, _) in SAMPLES.items()})
    environ: dict[str, str] = {}
    export_environ(settings, environ)
    assert set(environ) == {spec.env for spec in SETTINGS.values()}
    assert LifetimeSettings.from_environ(environ, env_file=None) == settings
    defaults: dict[str, str] = {}
    export_environ(LifetimeSettings(), defaults)
    assert LifetimeSettings.from_environ(defaults, env_file=None) == LifetimeSettings()


# --- bad settings: one line, exit 2 ----------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "environ", "env_file", "expected"),
    [
        (
            ["--max-inflight", "0"],
            {},
            None,
            "asgi-lifetime: ASGI_LIFETIME_MAX_INFLIGHT=0 is invalid: must be at least 1 (set by --max-inflight)",
        ),
        ([], {"ASGI_LIFETIME_MAX_INFLIGHT": "0"}, None, "(from the environment)"),
        ([], {}, "ASGI_LIFETIME_BACKOFF_MAX=nope\n", "ASGI_LIFETIME_BACKOFF_MAX=nope is invalid"),
        (["--max-body-bytes", "lots"], {}, None, "ASGI_LIFETIME_MAX_BODY_BYTES=lots is invalid: expected a byte size"),
        (["--retain-outbound", "maybe"], {}, None, "ASGI_LIFETIME_RETAIN_OUTBOUND=maybe is invalid"),
        (["--upstream", "ftp://x"], {}, None, "ASGI_LIFETIME_UPSTREAM_URL=ftp://x is invalid"),
        (["--max-body-bytes", "2GiB"], {}, None, "ASGI_LIFETIME_MAX_INFLIGHT_BYTES=1073741824 is invalid"),
        ([], {"ASGI_LIFETIME_MAX_INFLIGT": "3"}, None, "unknown setting 'ASGI_LIFETIME_MAX_INFLIGT'"),
        (["--env-file", "missing.env"], {}, None, "asgi-lifetime: --env-file missing.env: no such file"),
        (["--upstream-api-key", SECRET, "--host", "0.0.0.0"], {}, None, "refusing to serve on 0.0.0.0"),
        (["--workers", "0", "--upstream", "http://a:1"], {}, None, "--workers=0 is invalid"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2(
    argv: list[str],
    environ: dict[str, str],
    env_file: str | None,
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setattr(uvicorn.Server, "run", never_serve)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    if env_file is not None:
        (tmp_path / ".env").write_text(env_file)
    assert main(["serve", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("asgi-lifetime: ")
    assert expected in err
    assert "Traceback" not in err and SECRET not in err


def test_a_bad_setting_in_a_real_process(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "serve", "--max-inflight", "0")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "asgi-lifetime: ASGI_LIFETIME_MAX_INFLIGHT=0 is invalid: must be at least 1 (set by --max-inflight)"
    ]


# --- the key rule ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("192.168.1.20", False),
        ("example.com", False),
        ("", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("key", "gateway_keys", "host", "refused"),
    [
        (SECRET, (), "0.0.0.0", True),
        (SECRET, (), "10.0.0.1", True),
        (SECRET, (), "127.0.0.1", False),
        (SECRET, (), "::1", False),
        (SECRET, (), "localhost", False),
        (SECRET, ("gk",), "0.0.0.0", False),
        (None, (), "0.0.0.0", False),
    ],
)
def test_refusal(key: str | None, gateway_keys: tuple[str, ...], host: str, refused: bool) -> None:
    settings = LifetimeSettings(upstream_api_key=key, gateway_keys=gateway_keys)
    problem = refusal(settings, host)
    assert (problem is not None) is refused
    if problem is not None:
        assert "UPSTREAM_API_KEY" in problem and "GATEWAY_KEYS" in problem and SECRET not in problem


def test_refusal_in_a_real_process(tmp_path: Path) -> None:
    env = {**subprocess_env(), f"{ENV_PREFIX}UPSTREAM_API_KEY": SECRET}
    done = run_cli(tmp_path, "serve", "--host", "0.0.0.0", "--upstream", "http://127.0.0.1:9", env=env)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("asgi-lifetime: refusing to serve on 0.0.0.0")
    assert SECRET not in done.stdout + done.stderr


# --- settings ---------------------------------------------------------------------------


def test_settings_report_has_sources_and_masks_secrets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv(f"{ENV_PREFIX}UPSTREAM_API_KEY", SECRET)
    monkeypatch.setenv(f"{ENV_PREFIX}STALL_TIMEOUT", "33")
    (tmp_path / "prod.env").write_text(f"{ENV_PREFIX}GATEWAY_KEYS=gk-secret-1,gk-secret-2\n")
    assert main(["settings", "--env-file", "prod.env", "--max-body-bytes", "8MiB", "--upstream", "http://a:1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert set(rows) == {spec.env for spec in SETTINGS.values()}
    assert rows[f"{ENV_PREFIX}MAX_BODY_BYTES"] == ["8MiB", "command", "line"]
    assert rows[f"{ENV_PREFIX}UPSTREAM_URL"] == ["http://a:1", "command", "line"]
    assert rows[f"{ENV_PREFIX}STALL_TIMEOUT"] == ["33", "environment"]
    assert rows[f"{ENV_PREFIX}UPSTREAM_API_KEY"] == ["***", "environment"]
    assert rows[f"{ENV_PREFIX}GATEWAY_KEYS"] == ["***", "env", "file", "prod.env"]
    assert rows[f"{ENV_PREFIX}MAX_ATTEMPTS"] == ["4", "default"]
    assert SECRET not in out and "gk-secret" not in out


def test_the_settings_report_masks_the_session_store_password(capsys: pytest.CaptureFixture[str]) -> None:
    url = "rediss://gw:REDISPASSWORD@redis.internal:6380/1"
    assert main(["settings", "--session-store", url]) == 0
    out = capsys.readouterr().out
    assert "rediss://gw:***@redis.internal:6380/1" in out and "REDISPASSWORD" not in out
    with pytest.raises(ValueError, match=r"SESSION_STORE=http://gw:\*\*\*@redis:1 is invalid") as excinfo:
        LifetimeSettings(session_store="http://gw:REDISPASSWORD@redis:1")
    assert "REDISPASSWORD" not in str(excinfo.value)


def test_settings_markdown_is_the_table_in_the_operators_guide(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["settings", "--format", "markdown"]) == 0
    generated = capsys.readouterr().out.strip()
    assert generated == settings_markdown()
    text = DOCS.read_text()
    begin, end = "<!-- settings:begin -->", "<!-- settings:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1
    pasted = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert pasted == generated, "docs/operators.md is stale: paste `asgi-lifetime settings --format markdown`"
    for spec in SETTINGS.values():
        assert f"`{spec.env}`" in generated and spec.help in generated
    assert "<!-- metrics -->" in text


# --- help and version -------------------------------------------------------------------


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for command in ("serve", "settings", "demo"):
        assert f"    {command}  " in out
    assert "examples:" in out and "asgi-lifetime serve --upstream" in out


def test_serve_help_lists_every_setting_with_its_environment_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's wrapping
    for name, spec in SETTINGS.items():
        assert ("--upstream" if name == "upstream_url" else "--" + name.replace("_", "-")) in out
        assert spec.env in out
        assert spec.help in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"asgi-lifetime {__version__}"


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2


# --- serve, end to end in a real process ------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serving(argv: list[str], tmp_path: Path, *, startup: float = 20.0) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run ``python -m asgi_lifetime serve ARGV`` on a free port until /healthz answers."""
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "asgi_lifetime", "serve", "--port", str(port), "--log-level", "warning", *argv],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env=subprocess_env(),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the gateway did not answer /healthz in time"
            time.sleep(0.05)
        yield process, base
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        log.close()


def chat(base: str) -> str:
    body = {"model": "demo", "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": "hello"}]}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        return response.read().decode()


def stop(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    process.send_signal(sig)
    return process.wait(timeout=15)


def test_serve_end_to_end_and_sigterm_exits_0(tmp_path: Path) -> None:
    with serve_in_thread(create_demo_upstream(tokens_per_second=1000)) as upstream:
        with serving(["--upstream", upstream, "--drain-delay", "0"], tmp_path) as (process, base):
            text = chat(base)
            assert "data: [DONE]" in text and '"content"' in text
            stats = httpx.get(f"{base}/lifetime/stats", timeout=5).json()
            assert stats["completed"] == 1
            started = time.monotonic()
            assert stop(process) == 0
            assert time.monotonic() - started < 10
    assert "DEMO" not in (tmp_path / "serve.log").read_text()


def test_sigterm_lets_a_stream_finish_its_grace_then_ends_it_in_band(tmp_path: Path) -> None:
    # A stream of about 20 s; SHUTDOWN_GRACE is 1 s: the stream keeps flowing for the grace,
    # then ends with an in-band shutting_down error, and the process exits 0 with nothing left.
    with serve_in_thread(create_demo_upstream(tokens_per_second=20)) as upstream:
        args = ["--upstream", upstream, "--shutdown-grace", "1", "--drain-delay", "0"]
        with serving(args, tmp_path) as (process, base):
            body = {"model": "demo", "stream": True, "max_tokens": 400, "messages": [{"role": "user", "content": "x"}]}
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=10) as response:
                chunks = response.iter_text()
                assert '"content"' in next(chunks)
                process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                during_grace: list[str] = []
                rest: list[str] = []
                for chunk in chunks:
                    (during_grace if time.monotonic() - signalled < 0.8 else rest).append(chunk)
                ended_after = time.monotonic() - signalled
            assert any('"content"' in chunk for chunk in during_grace)  # still streaming in the grace
            tail = "".join(rest)
            assert "event: error" in tail and "shutting_down" in tail
            assert 0.9 < ended_after < 5
            assert process.wait(timeout=15) == 0
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_serve_with_several_workers(tmp_path: Path) -> None:
    with serve_in_thread(create_demo_upstream(tokens_per_second=1000)) as upstream:
        with serving(["--upstream", upstream, "--workers", "2"], tmp_path) as (process, base):
            for _ in range(4):
                assert "data: [DONE]" in chat(base)
            assert stop(process) == 0


def test_serve_without_upstream_announces_and_serves_the_demo_upstream(tmp_path: Path) -> None:
    with serving([], tmp_path) as (process, base):
        assert "data: [DONE]" in chat(base)
        assert stop(process, signal.SIGINT) == 0
    log = (tmp_path / "serve.log").read_text()
    assert "no upstream configured: serving the built-in DEMO upstream at http://127.0.0.1:" in log
    assert "not a real model" in log
    assert "Traceback" not in log


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://api.example.com/v1", "https://api.example.com/v1"),
        ("https://user:pa55@api.example.com:8443/v1", "https://user:***@api.example.com:8443/v1"),
        ("http://user@10.0.0.5:8000", "http://***@10.0.0.5:8000"),  # a user name alone may be a token
    ],
)
def test_passwords_in_upstream_urls_are_not_printed(
    url: str, shown: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(f"{ENV_PREFIX}UPSTREAM_URL", url)
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    assert f"{ENV_PREFIX}UPSTREAM_URL" in out and shown in out and "pa55" not in out


# --- draining under serve, the only access log, no secret in any output ---------------------------


def test_sigterm_drains_while_still_listening_then_exits_0(tmp_path: Path) -> None:
    # DRAIN_DELAY 4 s: after SIGTERM the server still accepts; /healthz says draining, a new
    # request gets 503 + Retry-After, and the stream in flight (about 3 s) runs to its end.
    with serve_in_thread(create_demo_upstream(tokens_per_second=20)) as upstream:
        args = ["--upstream", upstream, "--drain-delay", "4", "--shutdown-grace", "10"]
        with serving(args, tmp_path) as (process, base):
            body = {"model": "demo", "stream": True, "max_tokens": 60, "messages": [{"role": "user", "content": "x"}]}
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=20) as response:
                chunks = response.iter_text()
                received = [next(chunks)]
                assert '"content"' in received[0]
                process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 3
                while (health := httpx.get(f"{base}/healthz", timeout=5)).status_code != 503:
                    assert time.monotonic() < deadline, "/healthz never said draining"
                    time.sleep(0.02)
                assert health.json() == {"status": "draining"}
                refused = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=5)
                assert process.poll() is None  # still serving the stream
                received.extend(chunks)
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "overloaded"
            text = "".join(received)
            assert text.rstrip().endswith("data: [DONE]") and "event: error" not in text
            assert process.wait(timeout=20) == 0
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_sigint_and_a_second_sigterm_skip_the_drain_delay(tmp_path: Path) -> None:
    with serve_in_thread(create_demo_upstream(tokens_per_second=1000)) as upstream:
        with serving(["--upstream", upstream, "--drain-delay", "60"], tmp_path) as (process, base):
            assert "data: [DONE]" in chat(base)
            process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while httpx.get(f"{base}/healthz", timeout=5).status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            started = time.monotonic()
            assert stop(process) == 0  # the second SIGTERM: stop listening now
            assert time.monotonic() - started < 10
        with serving(["--upstream", upstream, "--drain-delay", "60"], tmp_path) as (process, base):
            started = time.monotonic()
            assert stop(process, signal.SIGINT) == 0
            assert time.monotonic() - started < 10


PASSWORD = "pw-SECRET-51d0"
QUERY_KEY = "qk-SECRET-0a9e"


@pytest.mark.parametrize("log_level", ["info", "debug"])
def test_serve_logs_only_its_own_access_log_and_never_a_secret(tmp_path: Path, log_level: str) -> None:
    with serve_in_thread(create_demo_upstream(tokens_per_second=1000)) as upstream:
        with_password = upstream.replace("http://", f"http://user:{PASSWORD}@")
        args = ["--upstream", with_password, "--drain-delay", "0", "--log-level", log_level]
        with serving(args, tmp_path) as (process, base):
            chat_body = {"model": "demo", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
            for param in ("key", "api_key", "access_token"):
                url = f"{base}/v1/chat/completions?{param}={QUERY_KEY}&x=1"
                assert httpx.post(url, json=chat_body, timeout=10).status_code == 200
            stats = httpx.get(f"{base}/lifetime/stats", timeout=5).text
            metrics = httpx.get(f"{base}/metrics", timeout=5).text
            assert stop(process) == 0
    log = (tmp_path / "serve.log").read_text()
    assert log.count("path=/v1/chat/completions status=200") == 3  # the package's access log, one line each
    assert '"POST /v1/chat/completions' not in log  # uvicorn's access log is off
    assert f"user:***@127.0.0.1:{upstream.rsplit(':', 1)[1]}" in log  # the startup line, masked
    for text in (log, stats, metrics):
        assert PASSWORD not in text and QUERY_KEY not in text


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        (["settings"], "https://user:***@api.example.com"),
        (["settings", "--upstream", f"ftp://u:{PASSWORD}@x"], "ftp://u:***@x"),  # invalid: the error message
        (["settings", "--max-attempts", "0"], "--max-attempts"),
        (["serve", "--workers", "0"], "--workers=0"),
    ],
)
def test_settings_and_errors_never_print_an_upstream_password(
    command: list[str], shown: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(f"{ENV_PREFIX}UPSTREAM_URL", f"https://user:{PASSWORD}@api.example.com")
    monkeypatch.setattr(uvicorn.Server, "run", never_serve)
    main(command)
    captured = capsys.readouterr()
    assert shown in captured.out + captured.err
    assert PASSWORD not in captured.out + captured.err


# --- the server: httptools and uvloop when installed -------------------------------------------------------------


def _serve_config(*flags: str) -> uvicorn.Config:
    args = build_parser().parse_args(["serve", *flags])
    return server_config(args, LifetimeSettings())


def test_serve_runs_httptools_and_uvloop_when_installed() -> None:
    """``--http auto`` / ``--loop auto`` (the defaults) resolve to httptools (without trailer fields) and uvloop."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from asgi_lifetime._cli._httptools import HttpToolsProtocol as Trailerless

    config = _serve_config()
    assert import_from_string(config.http) is Trailerless and issubclass(Trailerless, HttpToolsProtocol)
    factory = config.get_loop_factory()
    assert factory is not None
    loop = factory()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_serve_can_be_switched_to_h11_and_asyncio() -> None:
    config = _serve_config("--http", "h11", "--loop", "asyncio")
    assert config.http == H11_PROTOCOL and issubclass(import_from_string(config.http), H11Protocol)
    factory = config.get_loop_factory()
    assert factory is not None
    loop = factory()
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


@pytest.mark.parametrize(("flag", "module"), [("--http=httptools", "httptools"), ("--loop=uvloop", "uvloop")])
def test_serve_says_what_to_install_for_a_missing_server_module(
    flag: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(CommandError, match=rf"{module} is not installed; pip install 'asgi-lifetime\[cli\]'"):
        _serve_config(flag)
    # auto falls back to what is there
    assert _serve_config().http in (H11_PROTOCOL, HTTPTOOLS_PROTOCOL)
