"""The settings tried by a confused or careless operator: ``.env`` files as python-dotenv, docker and systemd users
write them, values in the forms other tools take, the same setting twice, and ``asgi-lifetime serve``'s flags.

Found here (each silently ran something other than what was written, or failed without naming it):

- a ``.env`` saved with a UTF-8 byte order mark (Windows editors) lost its first line: the setting kept its default;
- a value with an unmatched quote (``KEY="sk-live``, a multi-line quoted value, ``"sk-live" trailing``) was taken
  with the quote in it: a wrong upstream key, every request a 401;
- a ``.env`` that is not UTF-8 failed with a bare ``'utf-8' codec can't decode`` (no file, no line), and one the
  service user cannot read with a traceback;
- ``asgi_lifetime_max_inflight=8`` (lower case, as pydantic-settings users write it) was silently ignored;
- ``--env-file <(sops -d prod.env)`` (a pipe) was "no such file", and ``from_environ`` skipped it;
- ``serve --env-file prod.env`` still had its workers read ``./.env``: a stray one there failed the start;
- ``UPSTREAM_URL=http://[::1`` failed with a bare ``Invalid IPv6 URL``; ``http://host:0`` was accepted;
- ``--port 99999`` listened on port 34463 (getaddrinfo wraps it), announcing ``:99999``;
- ``--paths /v1/ --paths /v2/`` or ``--gateway-keys a --gateway-keys b`` kept only the last (``--upstream`` repeats);
- ``64m``/``64M``/``64k`` were decimal (64,000,000 bytes), where nginx's ``client_max_body_size 64m``, docker and
  the JVM mean 64 MiB: bodies nginx let through got 413;
- a mapping with ``max_inflight`` and ``MAX_INFLIGHT`` kept whichever came last;
- an explicitly empty ``UPSTREAM_URL`` (``${UPSTREAM}`` unset in a compose file, ``--upstream "$U"``) served the
  lorem-ipsum DEMO upstream to every client with 200s.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from asgi_lifetime import MiB
from asgi_lifetime._cli._main import build_parser, main, resolve_settings
from asgi_lifetime._settings import ENV_PREFIX, LifetimeSettings

KEY = "ASGI_LIFETIME_UPSTREAM_API_KEY"
SECRET = "sk-live-SECRET"


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no stray ./.env
    yield


def from_file(tmp_path: Path, content: str | bytes) -> LifetimeSettings:
    path = tmp_path / "gateway.env"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, newline="")
    return LifetimeSettings.from_environ(environ={}, env_file=path)


def never_serve(*args: object, **kwargs: object) -> None:
    raise AssertionError("this test must not start a server")


def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve`` in process, stopped before a server runs (the logging setup it applies on the way is undone
    after the test, tests/conftest.py)."""
    monkeypatch.setattr(uvicorn.Server, "run", never_serve)


def serve_fails(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    no_server(monkeypatch)
    assert main(["serve", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("asgi-lifetime: ")
    assert "Traceback" not in err and SECRET not in err
    return err


# --- the .env file --------------------------------------------------------------------------------------------------


def test_a_byte_order_mark_does_not_hide_the_first_line(tmp_path: Path) -> None:
    # Before: the name read "\ufeffASGI_LIFETIME_MAX_INFLIGHT", no setting and no typo: the default ran.
    assert (
        from_file(tmp_path, "\ufeffASGI_LIFETIME_MAX_INFLIGHT=8\r\nASGI_LIFETIME_STALL_TIMEOUT=9\r\n").max_inflight == 8
    )


@pytest.mark.parametrize(
    "content",
    [
        f'{KEY}="{SECRET}\n',
        f"{KEY}='{SECRET}\n",
        f'{KEY}="{SECRET}\nrest-of-the-key"\n',  # python-dotenv's multi-line value
        f'{KEY}="{SECRET}" trailing\n',
        f'export {KEY}="{SECRET}\n',
    ],
)
def test_an_unmatched_quote_is_an_error_naming_the_line_not_the_value(tmp_path: Path, content: str) -> None:
    # Before: the key was taken with its quote (and without the rest): every request a 401.
    with pytest.raises(ValueError, match=rf"gateway.env, line 1: {KEY} has an unmatched quote") as info:
        from_file(tmp_path, content)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (f'{KEY}="{SECRET}"\n', SECRET),
        (f"{KEY}='{SECRET}'  # prod\n", SECRET),
        (f"{KEY}={SECRET}'\n", SECRET + "'"),  # not opened by a quote: the value as written
        (f'{KEY}=""\n', None),
    ],
)
def test_balanced_quotes_are_still_taken(tmp_path: Path, content: str, expected: str | None) -> None:
    assert from_file(tmp_path, content).upstream_api_key == expected


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path: Path) -> None:
    # Before: "'utf-8' codec can't decode byte 0xff in position 34": which file, which line?
    with pytest.raises(ValueError, match=r"gateway.env, line 2: not UTF-8 text") as info:
        from_file(tmp_path, b"ASGI_LIFETIME_MAX_INFLIGHT=8\n" + f"{KEY}={SECRET}\xff\n".encode("latin-1"))
    assert SECRET not in str(info.value)


def test_an_unreadable_env_file_is_a_value_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: PermissionError, a traceback from ``serve``. (Simulated: the tests may run as root.)
    path = tmp_path / "gateway.env"
    path.write_text("ASGI_LIFETIME_MAX_INFLIGHT=8\n")

    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("builtins.open", denied)
    with pytest.raises(ValueError, match=r"gateway.env: cannot read it: Permission denied"):
        LifetimeSettings.from_environ(environ={}, env_file=path)


def test_an_unreadable_env_file_stops_serve_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "gateway.env").write_text("ASGI_LIFETIME_MAX_INFLIGHT=8\n")
    real_open = open

    def denied(file: object, *args: object, **kwargs: object) -> object:
        if str(file).endswith("gateway.env"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr("builtins.open", denied)
    assert "gateway.env: cannot read it" in serve_fails(["--env-file", "gateway.env"], monkeypatch, capsys)


@pytest.mark.parametrize("name", ["asgi_lifetime_max_inflight", "Asgi_Lifetime_MAX_INFLIGHT"])
@pytest.mark.parametrize("source", ["environment", "env file"])
def test_a_name_in_the_wrong_case_is_an_error_not_ignored(tmp_path: Path, name: str, source: str) -> None:
    # Before: skipped as "not ours", and not a typo either: the default ran.
    with pytest.raises(ValueError, match=rf"{name}.*ASGI_LIFETIME_MAX_INFLIGHT"):
        if source == "environment":
            LifetimeSettings.from_environ(environ={name: "8"}, env_file=None)
        else:
            from_file(tmp_path, f"{name}=8\n")


def test_an_env_file_that_is_a_pipe_is_read(tmp_path: Path) -> None:
    # ``--env-file <(sops -d prod.env)``: a pipe, not a regular file. Before: skipped (and "no such file" from serve).
    fifo = tmp_path / "secrets.fifo"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb") as pipe:  # waits for the reader, as the shell's process substitution does
            pipe.write(b"ASGI_LIFETIME_MAX_INFLIGHT=8\n")

    writer = threading.Thread(target=write)
    writer.start()
    try:
        settings, sources = resolve_settings({}, {}, env_file=str(fifo))
    finally:
        if writer.is_alive():  # the pipe was never opened: let the writer finish
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(5)
    assert settings.max_inflight == 8 and sources["max_inflight"] == f"env file {fifo}"


def test_a_directory_given_as_the_env_file_is_named_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "conf").mkdir()
    assert "--env-file conf: is a directory" in serve_fails(["--env-file", "conf"], monkeypatch, capsys)
    # ``./.env`` may be a virtualenv (``python -m venv .env``): skipped, as before.
    (tmp_path / ".env").mkdir()
    assert LifetimeSettings.from_environ(environ={}) == LifetimeSettings()


def test_serve_workers_do_not_read_the_dot_env_that_env_file_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: ``serve --env-file prod.env`` validated prod.env, and each worker's create_app() read ./.env as
    # well: a stray line there (a typo, a bad byte) failed the start after the banner, with a traceback.
    from uvicorn.importer import import_from_string

    from asgi_lifetime._cli._main import export_environ, server_config

    (tmp_path / ".env").write_text("ASGI_LIFETIME_MAX_INFLIHGT=2\n")
    (tmp_path / "prod.env").write_text("ASGI_LIFETIME_MAX_INFLIGHT=8\n")
    args = build_parser().parse_args(["serve", "--env-file", "prod.env", "--upstream", "http://127.0.0.1:9"])
    settings, _ = resolve_settings({"upstream_url": "http://127.0.0.1:9"}, {}, env_file="prod.env")
    environ: dict[str, str] = {}
    export_environ(settings, environ)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    no_server(monkeypatch)
    config = server_config(args, settings)
    factory = import_from_string(config.app)
    app = factory()
    assert app.state.lifetime.settings.max_inflight == 8


# --- values ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["64m", "64M", "64k", "64K", "1g", "1G"])
def test_a_one_letter_size_unit_is_refused_as_ambiguous(raw: str) -> None:
    # Before: decimal (64m = 64,000,000), where nginx's client_max_body_size 64m, docker and the JVM mean 64 MiB.
    number, unit = raw[:-1], raw[-1].upper()
    with pytest.raises(
        ValueError, match=rf"MAX_BODY_BYTES={raw} is invalid: .*ambiguous.*{number}{unit}iB.*{number}{unit}B"
    ):
        LifetimeSettings.from_mapping({"max_body_bytes": raw})


@pytest.mark.parametrize(("raw", "expected"), [("64MiB", 64 * MiB), ("64MB", 64 * 10**6), ("64mib", 64 * MiB)])
def test_the_two_letter_units_keep_their_meaning(raw: str, expected: int) -> None:
    assert LifetimeSettings.from_mapping({"max_body_bytes": raw}).max_body_bytes == expected


@pytest.mark.parametrize("url", ["http://[::1", "http://user@[::1:80", "http://[fe80::1"])
def test_a_broken_ipv6_upstream_url_names_the_setting(url: str) -> None:
    # Before: a bare "Invalid IPv6 URL" (urlsplit's), naming neither the setting nor the value.
    with pytest.raises(ValueError, match=r"^ASGI_LIFETIME_UPSTREAM_URL=.* is invalid: .*invalid IPv6"):
        LifetimeSettings.from_mapping({"upstream_url": url})


def test_a_broken_ipv6_session_store_names_the_setting() -> None:
    with pytest.raises(ValueError, match=r"^ASGI_LIFETIME_SESSION_STORE=redis://\[::1 is invalid"):
        LifetimeSettings.from_mapping({"session_store": "redis://[::1"})


def test_port_0_in_an_upstream_url_is_refused() -> None:
    # Before: accepted; every request then "upstream unreachable" after every retry.
    with pytest.raises(ValueError, match="has an invalid port"):
        LifetimeSettings.from_mapping({"upstream_url": "http://127.0.0.1:0"})


@pytest.mark.parametrize(
    "mapping",
    [
        {"max_inflight": "8", "MAX_INFLIGHT": "16"},
        {"max_inflight": 8, "ASGI_LIFETIME_MAX_INFLIGHT": "16"},
    ],
)
def test_the_same_setting_twice_in_a_mapping_is_an_error(mapping: dict[str, object]) -> None:
    # Before: whichever spelling came last won, silently.
    with pytest.raises(ValueError, match=r"max_inflight is given twice"):
        LifetimeSettings.from_mapping(mapping)


# --- asgi-lifetime serve --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_a_port_out_of_range_is_refused(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: 99999 listened on 34463 (getaddrinfo wraps it) while announcing :99999; -1 failed after startup.
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--port", port])
    assert info.value.code == 2
    assert f"--port: {port} is not a port" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "name", "values", "expected"),
    [
        ("--paths", "paths", ["/v1/", "/v1beta/"], ("/v1/", "/v1beta/")),
        ("--gateway-keys", "gateway_keys", ["key-a", "key-b,key-c"], ("key-a", "key-b", "key-c")),
    ],
)
def test_every_list_flag_repeats_as_upstream_does(
    flag: str, name: str, values: list[str], expected: tuple[str, ...]
) -> None:
    # Before: only --upstream appended; a repeated --paths kept the last (/v1/ got the gateway's 404).
    argv = ["settings"]
    for value in values:
        argv += [flag, value]
    from asgi_lifetime._cli._main import flag_values

    settings, _ = resolve_settings(flag_values(build_parser().parse_args(argv)), {}, env_file=None)
    assert getattr(settings, name) == expected


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        (["--upstream", ""], {}),
        ([], {"ASGI_LIFETIME_UPSTREAM_URL": ""}),
        ([], {"ASGI_LIFETIME_UPSTREAM_URL": " , "}),
    ],
)
def test_an_upstream_given_empty_does_not_serve_the_demo(
    argv: list[str], environ: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: the lorem-ipsum DEMO upstream answered every client with 200s (a banner on stderr only).
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert "UPSTREAM_URL is empty" in serve_fails(argv, monkeypatch, capsys)


@pytest.mark.parametrize(
    "urls",
    [
        "http://127.0.0.1:9,http://127.0.0.1:9",
        "http://127.0.0.1:9/,http://127.0.0.1:9",  # the same base URL: a request's path is appended the same way
        f"http://user:{SECRET}@127.0.0.1:9,http://127.0.0.1:9",
    ],
)
def test_the_same_upstream_twice_is_refused_at_start(
    urls: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: accepted by the settings (``settings`` showed it), then every worker's pool refused it: a traceback
    # from ``serve`` after its banner, exit status 1.
    with pytest.raises(ValueError, match=r"^ASGI_LIFETIME_UPSTREAM_URL=.* is invalid: .*twice") as info:
        LifetimeSettings.from_mapping({"upstream_url": urls})
    assert SECRET not in str(info.value)
    assert "twice" in serve_fails(["--upstream", urls], monkeypatch, capsys)


@pytest.mark.parametrize("settings", [{"max_body_bytes": "8MiB", KEY: SECRET}, LifetimeSettings])
def test_settings_that_are_not_a_settings_object_are_named_at_construction(settings: object) -> None:
    # ``app.state.lifetime_settings`` takes a mapping, so an operator passes one to ``settings=`` too. Before:
    # ``AttributeError: 'dict' object has no attribute 'max_inflight'`` (the class itself: at the first request).
    from asgi_lifetime import LifetimeMiddleware
    from asgi_lifetime.gateway import create_app

    async def inner(scope: object, receive: object, send: object) -> None:
        raise AssertionError("not reached")

    for build in (lambda: LifetimeMiddleware(inner, settings=settings), lambda: create_app(settings)):  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"settings must be a LifetimeSettings.*from_mapping") as info:
            build()
        assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("upstream_url", "https://api.example.com\u200b"),  # a zero-width space copied from a web page
        ("upstream_url", "http://a\x7fb.example"),
        ("paths", "/v1/\u200b"),
        ("paths", "/v1/,/v1beta/\ufeff"),
        ("session_store", "redis://re\u200bdis:6379/0"),
        ("retain_dir", "/var/tmp/spill\u200b"),
        ("session_header", "x-session-id\u200b"),
    ],
)
def test_an_invisible_character_in_a_value_is_refused_and_shown(name: str, value: str) -> None:
    # Before (but for the header): accepted; the URL failed every request (httpx: invalid IDNA host), the path
    # prefix never matched (404), the directory never existed, and every report showed the value as meant.
    with pytest.raises(ValueError, match=rf"^ASGI_LIFETIME_{name.upper()}=.* is invalid: .*(character \(U\+|header)"):
        LifetimeSettings.from_mapping({name: value})


def test_printable_unicode_is_still_accepted() -> None:
    settings = LifetimeSettings.from_mapping({"upstream_url": "http://bücher.example/", "paths": "/v1/,/ü/"})
    assert settings.paths == ("/v1/", "/ü/")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # ``--host "$HOST"`` with HOST unset: uvicorn listened on every address (the default is loopback).
        (["--host", ""], "--host: an empty host"),
        (["--host", " "], "--host: an empty host"),
        # A negative keep-alive closed every idle client connection at once.
        (["--timeout-keep-alive", "-1"], "--timeout-keep-alive: -1 is invalid"),
    ],
)
def test_serve_refuses_server_flags_that_mean_something_else(
    argv: list[str], expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    no_server(monkeypatch)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--upstream", "http://127.0.0.1:9", *argv])
    assert info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("stall_timeout", "30s", "expected a number of seconds such as 30 or 2.5 (no unit)"),
        ("stall_timeout", "1m", "expected a number of seconds"),
        ("stall_timeout", "", "expected a number of seconds"),  # ``NAME=${UNSET}`` in a compose file
        ("max_attempts", "4.0", "expected a whole number"),
        ("max_attempts", "", "expected a whole number"),
    ],
)
def test_a_number_in_another_form_is_refused_in_the_operators_terms(name: str, raw: str, expected: str) -> None:
    # Before: Python's own words: "could not convert string to float: '30s'", "invalid literal for int() with
    # base 10: ''".
    with pytest.raises(ValueError, match=rf"^ASGI_LIFETIME_{name.upper()}={raw} is invalid: {re.escape(expected)}"):
        LifetimeSettings.from_environ(environ={f"ASGI_LIFETIME_{name.upper()}": raw}, env_file=None)
