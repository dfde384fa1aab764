from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest

from asgi_lifetime._settings import SETTINGS, GiB, KiB, LifetimeSettings, MiB, check_argument, collect_environ, positive

SECRET = "sk-very-secret-1234"


def write_env(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# Defaults and construction in code


def test_defaults() -> None:
    settings = LifetimeSettings()
    assert settings.max_body_bytes == 64 * MiB
    assert settings.body_idle_timeout == 30.0
    assert settings.body_timeout == 300.0
    assert settings.max_inflight == 64
    assert settings.max_inflight_bytes == 1 * GiB
    assert settings.admission_timeout == 10.0
    assert settings.admission_target_delay == 0.05
    assert settings.admission_interval == 0.5
    assert settings.paths == ("/v1/",)
    assert settings.upstream_url == ()
    assert settings.max_attempts == 4
    assert settings.backoff_base == 0.5
    assert settings.backoff_max == 8.0
    assert settings.retain_outbound == "disk"
    assert settings.retain_spill_bytes == 1 * MiB
    assert settings.retain_dir is None
    assert settings.malloc_trim is True
    assert settings.session_header == "x-session-id"
    assert settings.error_body_limit == 64 * KiB
    assert settings.upstream_api_key is None
    assert settings.gateway_keys == ()
    assert settings.shutdown_grace == 30.0


def test_every_field_is_described_once() -> None:
    fields = [f.name for f in dataclasses.fields(LifetimeSettings) if not f.metadata.get("derived")]
    assert fields == list(SETTINGS)


def test_construction_in_code_turns_lists_into_tuples() -> None:
    settings = LifetimeSettings(
        paths=["/a/", "/b/"],  # type: ignore[arg-type]
        upstream_url=["http://up:8000"],  # type: ignore[arg-type]
        gateway_keys=["k1"],  # type: ignore[arg-type]
    )
    assert settings.paths == ("/a/", "/b/")
    assert settings.upstream_url == ("http://up:8000",)
    assert settings.gateway_keys == ("k1",)
    # Stored as tuples, so the settings stay hashable and equal to the tuple spelling.
    same = LifetimeSettings(paths=("/a/", "/b/"), upstream_url=("http://up:8000",), gateway_keys=("k1",))
    assert settings == same
    assert hash(settings) == hash(same)


def test_int_accepted_for_float_setting() -> None:
    settings = LifetimeSettings(body_idle_timeout=5, backoff_base=0, backoff_max=0)
    assert settings.body_idle_timeout == 5
    assert settings.backoff_max == 0


# ---------------------------------------------------------------------------------------------
# from_mapping: spellings and parsing


@pytest.mark.parametrize("key", ["max_body_bytes", "MAX_BODY_BYTES", "ASGI_LIFETIME_MAX_BODY_BYTES", "Max_Body_Bytes"])
def test_from_mapping_key_spellings(key: str) -> None:
    assert LifetimeSettings.from_mapping({key: "8MiB"}).max_body_bytes == 8 * MiB


def test_from_mapping_empty_is_defaults() -> None:
    assert LifetimeSettings.from_mapping({}) == LifetimeSettings()


def test_from_mapping_keeps_base() -> None:
    base = LifetimeSettings(max_inflight=3)
    settings = LifetimeSettings.from_mapping({"paths": "/x/"}, base=base)
    assert settings.max_inflight == 3
    assert settings.paths == ("/x/",)
    assert base.paths == ("/v1/",)


def test_from_mapping_takes_typed_values_as_they_are() -> None:
    settings = LifetimeSettings.from_mapping({"max_inflight": 3, "paths": ["/a/"], "retain_outbound": False})
    assert settings.max_inflight == 3
    assert settings.paths == ("/a/",)
    assert settings.retain_outbound == "off"  # a bool keeps its meaning: not retained


@pytest.mark.parametrize(
    ("key", "raw", "expected"),
    [
        ("max_body_bytes", "65536", 65536),
        ("max_body_bytes", "64MiB", 64 * MiB),
        ("max_body_bytes", "1GB", 10**9),
        ("max_body_bytes", "1.5KiB", 1536),
        ("max_body_bytes", " 8 kib ", 8 * KiB),
        ("max_body_bytes", "100b", 100),
        ("max_body_bytes", "2kb", 2000),
        ("max_body_bytes", "3mb", 3 * 10**6),
        ("max_body_bytes", "1gb", 10**9),
        # One-letter units (2k, 3m, 1g) are refused as ambiguous: tests/reliability/test_attack_config.py.
        ("max_body_bytes", "1GiB", GiB),
        # Decimal sizes are exact: float arithmetic would give 2009.
        ("error_body_limit", "2.01KB", 2010),
        ("error_body_limit", "0.5MiB", MiB // 2),
        # Far beyond a float's precision, still exact.
        ("max_inflight_bytes", "123456789012345678901234567890", 123456789012345678901234567890),
        # Would overflow a float (OverflowError); as an exact int it is just very large.
        ("max_inflight_bytes", "9" * 400, int("9" * 400)),
    ],
)
def test_size_parsing(key: str, raw: str, expected: int) -> None:
    value = getattr(LifetimeSettings.from_mapping({key: raw}), key)
    assert value == expected
    assert type(value) is int


@pytest.mark.parametrize(
    ("key", "raw", "expected"),
    [
        ("body_idle_timeout", "2.5", 2.5),
        ("body_idle_timeout", "10", 10.0),
        ("body_timeout", "60", 60.0),
        ("body_timeout", "0.5", 0.5),
        ("admission_timeout", " 0 ", 0.0),
        ("admission_target_delay", "0", 0.0),
        ("admission_target_delay", "0.25", 0.25),
        ("admission_interval", "2", 2.0),
        ("retry_deadline", "1e2", 100.0),
        ("shutdown_grace", "0.25", 0.25),
    ],
)
def test_duration_parsing(key: str, raw: str, expected: float) -> None:
    assert getattr(LifetimeSettings.from_mapping({key: raw}), key) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("true", True),
        ("false", False),
        ("1", True),
        ("0", False),
        ("yes", True),
        ("no", False),
        ("on", True),
        ("off", False),
        ("TRUE", True),
        (" Off ", False),
    ],
)
@pytest.mark.parametrize("name", ["malloc_trim"])
def test_bool_parsing(name: str, raw: str, expected: bool) -> None:
    assert getattr(LifetimeSettings.from_mapping({name: raw}), name) is expected
    assert (
        getattr(LifetimeSettings.from_environ({f"ASGI_LIFETIME_{name.upper()}": raw}, env_file=None), name) is expected
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("disk", "disk"),
        ("memory", "memory"),
        ("off", "off"),
        (" Memory ", "memory"),
        ("DISK", "disk"),
        # RETAIN_OUTBOUND was a bool: true/false keep their meaning (retained or not); retained is on disk.
        ("true", "disk"),
        ("1", "disk"),
        ("yes", "disk"),
        ("on", "disk"),
        ("false", "off"),
        ("0", "off"),
        ("no", "off"),
    ],
)
def test_retain_outbound_modes_and_booleans(raw: str, expected: str) -> None:
    assert LifetimeSettings.from_mapping({"retain_outbound": raw}).retain_outbound == expected
    environ = {"ASGI_LIFETIME_RETAIN_OUTBOUND": raw}
    assert LifetimeSettings.from_environ(environ, env_file=None).retain_outbound == expected


@pytest.mark.parametrize(("value", "expected"), [(True, "disk"), (False, "off"), ("memory", "memory")])
def test_retain_outbound_in_code_takes_a_mode_or_a_bool(value: object, expected: str) -> None:
    settings = LifetimeSettings(retain_outbound=value)  # type: ignore[arg-type]
    assert settings.retain_outbound == expected
    assert settings.replace(malloc_trim=False).retain_outbound == expected


def test_retain_outbound_error_names_the_modes() -> None:
    with pytest.raises(
        ValueError, match=r"^ASGI_LIFETIME_RETAIN_OUTBOUND=tmpfs is invalid: expected memory, disk or off"
    ):
        LifetimeSettings.from_mapping({"retain_outbound": "tmpfs"})


def test_retain_spill_bytes_and_dir() -> None:
    settings = LifetimeSettings.from_mapping({"retain_spill_bytes": "4MiB", "retain_dir": "/var/tmp/gw"})
    assert (settings.retain_spill_bytes, settings.retain_dir) == (4 * MiB, "/var/tmp/gw")
    assert LifetimeSettings.from_mapping({"retain_dir": " "}).retain_dir is None  # empty: the system temp dir
    with pytest.raises(ValueError, match="^ASGI_LIFETIME_RETAIN_DIR=var/tmp is invalid: must be an absolute"):
        LifetimeSettings.from_mapping({"retain_dir": "var/tmp"})


@pytest.mark.parametrize(
    ("key", "raw", "expected"),
    [
        ("paths", "/v1/", ("/v1/",)),
        ("paths", "/v1/, /v2/ ,,", ("/v1/", "/v2/")),
        ("upstream_url", "http://a:1,https://b.example/base", ("http://a:1", "https://b.example/base")),
        ("upstream_url", "", ()),
        ("gateway_keys", " k1 , k2 ", ("k1", "k2")),
        ("gateway_keys", "", ()),
    ],
)
def test_list_parsing(key: str, raw: str, expected: tuple[str, ...]) -> None:
    assert getattr(LifetimeSettings.from_mapping({key: raw}), key) == expected


@pytest.mark.parametrize(
    ("key", "raw", "expected"),
    [
        ("max_inflight", " 12 ", 12),
        ("session_header", " X-Conversation-Id ", "X-Conversation-Id"),
        ("upstream_api_key", "  sk-up  ", "sk-up"),
        ("upstream_api_key", "", None),
    ],
)
def test_int_and_string_parsing(key: str, raw: str, expected: Any) -> None:
    assert getattr(LifetimeSettings.from_mapping({key: raw}), key) == expected


# ---------------------------------------------------------------------------------------------
# Invalid values: ValueError naming the setting and the value


INVALID_STRINGS = [
    ("max_body_bytes", "abc"),
    ("max_body_bytes", "-1"),
    ("max_body_bytes", "0"),
    ("max_body_bytes", "12XB"),
    ("max_body_bytes", "1TB"),
    ("max_body_bytes", "1 2"),
    ("body_idle_timeout", "0"),
    ("body_idle_timeout", "-1"),
    ("body_idle_timeout", "nan"),
    ("body_idle_timeout", "inf"),
    ("body_idle_timeout", "soon"),
    ("body_timeout", "0"),
    ("body_timeout", "-1"),
    ("body_timeout", "nan"),
    ("body_timeout", "inf"),
    ("max_inflight", "0"),
    ("max_inflight", "1.5"),
    ("max_inflight", "many"),
    ("max_inflight_bytes", "0"),
    ("admission_timeout", "-0.5"),
    ("admission_target_delay", "-0.01"),
    ("admission_target_delay", "nan"),
    ("admission_target_delay", "soon"),
    ("admission_interval", "0"),
    ("admission_interval", "-1"),
    ("admission_interval", "inf"),
    ("paths", "v1/"),
    ("paths", "/v1/,v2/"),
    ("paths", ""),
    ("upstream_url", "ftp://files.example"),
    ("upstream_url", "localhost:8000"),
    ("upstream_url", "http://ok.example,https://"),
    ("max_attempts", "0"),
    ("retry_deadline", "0"),
    ("backoff_base", "-1"),
    ("backoff_max", "-1"),
    ("retry_after_cap", "-1"),
    ("connect_timeout", "0"),
    ("headers_timeout", "0"),
    ("stall_timeout", "-3"),
    ("keepalive_interval", "0"),
    ("retain_outbound", "maybe"),
    ("retain_outbound", "2"),
    ("retain_outbound", "tmpfs"),
    ("retain_outbound", ""),
    ("retain_spill_bytes", "-1"),
    ("retain_spill_bytes", "lots"),
    ("retain_dir", "relative/dir"),
    ("retain_dir", "tmp"),
    ("malloc_trim", "maybe"),
    ("malloc_trim", "-1"),
    ("malloc_trim", ""),
    ("session_header", "x session"),
    ("session_header", "x:y"),
    ("session_header", ""),
    ("bookkeeping_sessions", "0"),
    ("session_store", "redis"),
    ("session_store", "redis://"),
    ("session_store", "http://cache:6379"),
    ("session_store", "Memory "),
    ("session_ttl", "0"),
    ("session_lease", "-1"),
    ("session_store_timeout", "0"),
    ("error_body_limit", "0"),
    ("upstream_cooloff", "-1"),
    ("upstream_transport", "curl"),
    ("upstream_transport", ""),
    ("shutdown_grace", "-1"),
]


@pytest.mark.parametrize(("raw", "expected"), [("auto", "auto"), ("AIOHTTP", "aiohttp"), (" httpcore ", "httpcore")])
def test_upstream_transport_choices(raw: str, expected: str) -> None:
    assert LifetimeSettings.from_mapping({"upstream_transport": raw}).upstream_transport == expected
    assert LifetimeSettings().upstream_transport == "auto"


def test_upstream_transport_error_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"UPSTREAM_TRANSPORT=curl is invalid: must be one of auto, aiohttp, httpcore"):
        LifetimeSettings(upstream_transport="curl")


@pytest.mark.parametrize(("key", "raw"), INVALID_STRINGS)
def test_invalid_string_names_setting_and_value(key: str, raw: str) -> None:
    with pytest.raises(ValueError) as info:
        LifetimeSettings.from_mapping({key: raw})
    message = str(info.value)
    assert f"ASGI_LIFETIME_{key.upper()}=" in message
    assert raw.strip() in message
    assert "is invalid" in message


@pytest.mark.parametrize(("key", "raw"), INVALID_STRINGS)
def test_invalid_string_from_environ(key: str, raw: str) -> None:
    env = f"ASGI_LIFETIME_{key.upper()}"
    with pytest.raises(ValueError, match=f"^{env}="):
        LifetimeSettings.from_environ(environ={env: raw}, env_file=None)


def test_huge_body_limit_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="^ASGI_LIFETIME_MAX_INFLIGHT_BYTES=.*MAX_BODY_BYTES"):
        LifetimeSettings.from_mapping({"max_body_bytes": "1" * 400})


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("max_inflight", 1.5, "1.5"),
        ("max_inflight", True, "True"),
        ("max_body_bytes", "8MiB-as-text-in-code", "8MiB-as-text-in-code"),
        ("body_idle_timeout", float("nan"), "nan"),
        ("body_idle_timeout", float("inf"), "inf"),
        ("body_idle_timeout", False, "False"),
        ("retain_outbound", 1, "1"),
        ("retain_outbound", "on-disk", "on-disk"),
        ("retain_outbound", "Disk", "Disk"),  # in code, the mode exactly; from text, any case
        ("retain_spill_bytes", -1, "-1"),
        ("retain_spill_bytes", 1.5, "1.5"),
        ("retain_dir", "var/tmp", "var/tmp"),
        ("retain_dir", "/tmp/a\0b", "/tmp/a\0b"),
        ("retain_dir", 3, "3"),
        ("malloc_trim", 0, "0"),
        ("malloc_trim", "off", "off"),
        ("paths", "/v1/", "/v1/"),
        ("paths", ("/v1/", 5), "/v1/,5"),
        ("paths", (), ""),
        ("upstream_url", ["http://ok.example", 3], "http://ok.example,3"),
        ("session_header", "", ""),
        ("session_header", 42, "42"),
    ],
)
def test_invalid_value_in_code(key: str, value: Any, shown: str) -> None:
    with pytest.raises(ValueError) as info:
        LifetimeSettings(**{key: value})
    assert str(info.value).startswith(f"ASGI_LIFETIME_{key.upper()}={shown} is invalid")


@pytest.mark.parametrize(
    "build",
    [
        lambda: LifetimeSettings(gateway_keys=(SECRET, "")),
        lambda: LifetimeSettings(gateway_keys=[SECRET, ""]),  # type: ignore[arg-type]
        lambda: LifetimeSettings(gateway_keys=SECRET),  # type: ignore[arg-type]
        lambda: LifetimeSettings(gateway_keys=(SECRET, 7)),  # type: ignore[arg-type]
        lambda: LifetimeSettings.from_mapping({"ASGI_LIFETIME_GATEWAY_KEYS": [SECRET, ""]}),
        lambda: LifetimeSettings.from_mapping({"gateway_keys": (SECRET, None)}),
    ],
)
def test_invalid_gateway_keys_are_not_echoed(build: Any) -> None:
    with pytest.raises(ValueError) as info:
        build()
    message = str(info.value)
    assert message.startswith("ASGI_LIFETIME_GATEWAY_KEYS=*** is invalid")
    assert SECRET not in message


@pytest.mark.parametrize("value", [12345678, [SECRET], True])
def test_invalid_upstream_api_key_is_not_echoed(value: Any) -> None:
    with pytest.raises(ValueError) as info:
        LifetimeSettings(upstream_api_key=value)
    message = str(info.value)
    assert message.startswith("ASGI_LIFETIME_UPSTREAM_API_KEY=*** is invalid")
    assert "12345678" not in message and SECRET not in message


def test_empty_key_in_environment_is_dropped_not_echoed() -> None:
    settings = LifetimeSettings.from_environ(environ={"ASGI_LIFETIME_GATEWAY_KEYS": f"{SECRET},,"}, env_file=None)
    assert settings.gateway_keys == (SECRET,)
    assert SECRET not in repr(settings)


@pytest.mark.parametrize("key", ["max_body_byte", "ASGI_LIFETIME_NOPE", "timeout", "ASGI_LIFETIME_"])
def test_unknown_key_lists_known_settings(key: str) -> None:
    with pytest.raises(ValueError) as info:
        LifetimeSettings.from_mapping({key: "1"})
    message = str(info.value)
    assert repr(key) in message
    assert "known settings:" in message
    for name in SETTINGS:
        assert name in message


# ---------------------------------------------------------------------------------------------
# Cross-field checks


def test_inflight_bytes_below_body_limit() -> None:
    with pytest.raises(ValueError) as info:
        LifetimeSettings(max_body_bytes=2 * MiB, max_inflight_bytes=1 * MiB)
    message = str(info.value)
    assert message.startswith(f"ASGI_LIFETIME_MAX_INFLIGHT_BYTES={MiB} is invalid")
    assert str(2 * MiB) in message


def test_inflight_bytes_equal_to_body_limit_is_fine() -> None:
    settings = LifetimeSettings(max_body_bytes=MiB, max_inflight_bytes=MiB)
    assert settings.max_inflight_bytes == settings.max_body_bytes


def test_cross_field_check_sees_both_sources() -> None:
    # The default MAX_INFLIGHT_BYTES (1GiB) is below a 2GiB body limit.
    with pytest.raises(ValueError, match="MAX_INFLIGHT_BYTES"):
        LifetimeSettings.from_mapping({"MAX_BODY_BYTES": "2GiB"})


def test_backoff_max_below_base() -> None:
    with pytest.raises(ValueError) as info:
        LifetimeSettings(backoff_base=2.0, backoff_max=1.5)
    message = str(info.value)
    assert message.startswith("ASGI_LIFETIME_BACKOFF_MAX=1.5 is invalid")
    assert "BACKOFF_BASE (2)" in message


@pytest.mark.parametrize("store", ["memory", "redis://127.0.0.1:6379/0", "rediss://user:pw@cache.internal:6380/2"])
def test_session_store_accepts_memory_and_redis_urls(store: str) -> None:
    assert LifetimeSettings.from_mapping({"SESSION_STORE": store}).session_store == store


def test_session_store_timeout_is_at_most_half_the_lease() -> None:
    with pytest.raises(ValueError) as info:
        LifetimeSettings(session_lease=1.0, session_store_timeout=0.6)
    message = str(info.value)
    assert message.startswith("ASGI_LIFETIME_SESSION_STORE_TIMEOUT=0.6 is invalid")
    assert "SESSION_LEASE (1)" in message
    assert LifetimeSettings(session_lease=1.0, session_store_timeout=0.5).session_store_timeout == 0.5


# ---------------------------------------------------------------------------------------------
# Immutability and replace()


def test_frozen() -> None:
    settings = LifetimeSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_inflight = 3  # type: ignore[misc]
    assert settings.max_inflight == 64


def test_replace_returns_validated_copy() -> None:
    settings = LifetimeSettings()
    changed = settings.replace(max_inflight=3, paths=["/a/"])
    assert changed.max_inflight == 3
    assert changed.paths == ("/a/",)
    assert settings.max_inflight == 64
    assert settings.paths == ("/v1/",)


@pytest.mark.parametrize(
    "changes",
    [
        {"max_inflight": 0},
        {"paths": ["relative/"]},
        {"backoff_max": 0.1},
        {"max_inflight_bytes": MiB},
    ],
)
def test_replace_revalidates(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="^ASGI_LIFETIME_"):
        LifetimeSettings().replace(**changes)


# ---------------------------------------------------------------------------------------------
# Environment and .env file


def test_from_environ_precedence(tmp_path: Path) -> None:
    env_file = write_env(
        tmp_path / ".env",
        "# operator overrides",
        "ASGI_LIFETIME_MAX_INFLIGHT=7",
        "ASGI_LIFETIME_PATHS=/file/",
        'ASGI_LIFETIME_SESSION_HEADER="x-conv-id"',
        "UNRELATED=whatever",
    )
    environ = {"ASGI_LIFETIME_PATHS": "/env/,/other/", "PATH": "/usr/bin", "HOME": "/root"}
    settings = LifetimeSettings.from_environ(environ=environ, env_file=env_file)
    assert settings.paths == ("/env/", "/other/")  # environment beats the file
    assert settings.max_inflight == 7  # the file beats the default
    assert settings.session_header == "x-conv-id"  # quotes stripped
    assert settings.max_attempts == 4  # default


def test_from_environ_accepts_str_path(tmp_path: Path) -> None:
    env_file = write_env(tmp_path / "custom.env", "ASGI_LIFETIME_MAX_ATTEMPTS=2")
    assert LifetimeSettings.from_environ(environ={}, env_file=str(env_file)).max_attempts == 2


@pytest.mark.parametrize("env_file", ["missing", None])
def test_missing_env_file_is_fine(tmp_path: Path, env_file: str | None) -> None:
    path = None if env_file is None else tmp_path / "missing.env"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = LifetimeSettings.from_environ(environ={"ASGI_LIFETIME_MAX_INFLIGHT": "5"}, env_file=path)
    assert caught == []
    assert settings.max_inflight == 5


def test_unknown_variable_in_environment(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'ASGI_LIFETIME_MAX_INFLIGH'"):
        LifetimeSettings.from_environ(environ={"ASGI_LIFETIME_MAX_INFLIGH": "3"}, env_file=None)


def test_unknown_variable_in_env_file(tmp_path: Path) -> None:
    env_file = write_env(tmp_path / ".env", "ASGI_LIFETIME_MAX_INFLIGHT=3", "ASGI_LIFETIME_PATH=/v2/")
    with pytest.raises(ValueError, match="'ASGI_LIFETIME_PATH'.*known settings"):
        LifetimeSettings.from_environ(environ={}, env_file=env_file)


def test_variables_without_prefix_are_ignored(tmp_path: Path) -> None:
    # A lower-case asgi_lifetime_* name is an error, not ignored: tests/reliability/test_attack_config.py.
    env_file = write_env(tmp_path / ".env", "MAX_INFLIGHT=3", "OTHER_TOOL_MAX_INFLIGHT=4")
    settings = LifetimeSettings.from_environ(environ={"MAX_ATTEMPTS": "9"}, env_file=env_file)
    assert settings == LifetimeSettings()


def test_invalid_value_in_env_file(tmp_path: Path) -> None:
    env_file = write_env(tmp_path / ".env", "ASGI_LIFETIME_MAX_INFLIGHT=lots")
    with pytest.raises(ValueError, match="^ASGI_LIFETIME_MAX_INFLIGHT=lots is invalid"):
        LifetimeSettings.from_environ(environ={}, env_file=env_file)


def test_collect_environ_reports_sources(tmp_path: Path) -> None:
    env_file = write_env(tmp_path / ".env", "ASGI_LIFETIME_MAX_INFLIGHT=7", "ASGI_LIFETIME_PATHS=/file/")
    found = collect_environ({"ASGI_LIFETIME_PATHS": "/env/", "HOME": "/root"}, env_file=env_file)
    assert found == {
        "max_inflight": ("7", f"env file {env_file}"),
        "paths": ("/env/", "environment"),
    }


def test_collect_environ_without_file() -> None:
    assert collect_environ({"ASGI_LIFETIME_MAX_INFLIGHT": "2"}, env_file=None) == {"max_inflight": ("2", "environment")}


# ---------------------------------------------------------------------------------------------
# Reporting


def test_public_items_mask_secrets() -> None:
    settings = LifetimeSettings(
        gateway_keys=(SECRET, "other-key"), upstream_api_key="sk-upstream", paths=("/a/", "/b/")
    )
    items = dict(settings.public_items())
    assert list(items) == [spec.env for spec in SETTINGS.values()]
    assert items["ASGI_LIFETIME_GATEWAY_KEYS"] == "***"
    assert items["ASGI_LIFETIME_UPSTREAM_API_KEY"] == "***"
    assert items["ASGI_LIFETIME_PATHS"] == "/a/,/b/"
    assert items["ASGI_LIFETIME_MAX_BODY_BYTES"] == str(64 * MiB)
    assert items["ASGI_LIFETIME_RETAIN_OUTBOUND"] == "disk"
    rendered = " ".join(items.values()) + repr(settings)
    assert SECRET not in rendered
    assert "other-key" not in rendered
    assert "sk-upstream" not in rendered


def test_public_items_unset_secrets() -> None:
    items = dict(LifetimeSettings().public_items())
    assert items["ASGI_LIFETIME_GATEWAY_KEYS"] == "(unset)"
    assert items["ASGI_LIFETIME_UPSTREAM_API_KEY"] == "(unset)"
    assert items["ASGI_LIFETIME_UPSTREAM_URL"] == ""


@pytest.mark.parametrize(
    ("value", "integer", "problem"),
    [
        (0, False, "must be greater than 0"),
        (-1.5, False, "must be greater than 0"),
        (float("inf"), False, "must be a finite number"),
        (float("nan"), False, "must be a finite number"),
        (True, False, r"has the wrong type \(bool\)"),
        ("5", False, r"has the wrong type \(str\)"),
        (1.5, True, r"has the wrong type \(float\)"),
    ],
)
def test_a_constructor_argument_is_checked_as_a_setting_is(value: Any, integer: bool, problem: str) -> None:
    # One message for every constructor's number argument (relay timeouts, pool cooloff, store
    # lease...): the argument's name, its value, and what is wrong with it.
    with pytest.raises(ValueError, match=f"^interval={value!r} is invalid: {problem}$"):
        check_argument("interval", value, positive, integer=integer)
    check_argument("interval", 2 if integer else 0.5, positive, integer=integer)  # a good one passes
