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
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asgi_lifetime._settings import LifetimeSettings, redact_url
from asgi_lifetime.gateway._upstream import UpstreamClient

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
