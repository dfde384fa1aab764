"""Settings: one frozen object holding every knob.

Construct it in code (``LifetimeSettings(max_body_bytes=8 * MiB)``), from a mapping
(``LifetimeSettings.from_mapping({"MAX_BODY_BYTES": "8MiB"})``) or from the environment
and an optional ``.env`` file (``LifetimeSettings.from_environ()``), where every setting is
``ASGI_LIFETIME_<NAME>``. Every field is described once, in ``SETTINGS``; docs, the CLI and
the ``settings`` report are generated from that table so they cannot drift.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = [
    "ENV_PREFIX",
    "GiB",
    "KiB",
    "LifetimeSettings",
    "MiB",
    "RETAIN_MODES",
    "RetainOutbound",
    "SettingSpec",
    "SETTINGS",
    "at_least_one",
    "base_url_problem",
    "check_argument",
    "non_negative",
    "positive",
    "read_env_file",
    "redact_url",
]

ENV_PREFIX = "ASGI_LIFETIME_"
KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "kib": KiB,
    "mb": 1000**2,
    "mib": MiB,
    "gb": 1000**3,
    "gib": GiB,
}
_AMBIGUOUS_UNITS = {"k", "m", "g"}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_size(text: str) -> int:
    match = _SIZE_RE.match(text)
    number, unit = (match.group(1), match.group(2).lower()) if match is not None else ("", "")
    if unit in _AMBIGUOUS_UNITS:
        # nginx (client_max_body_size 64m), docker and the JVM read 64m as 64 MiB, Kubernetes 64M as 64 MB.
        letter = unit.upper()
        raise ValueError(
            f"a one-letter unit is ambiguous: write {number}{letter}iB (binary, as nginx reads {number}{unit}) "
            f"or {number}{letter}B (decimal)"
        )
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError("expected a byte size such as 65536, 64MiB or 1GB")
    # Exact arithmetic: a float would turn "2.01KB" into 2009 and a very long number into inf.
    return int(Fraction(number) * _SIZE_UNITS[unit])


def _parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:  # Python's "invalid literal for int() with base 10" is not the operator's language
        raise ValueError("expected a whole number") from None


def _parse_float(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:  # every float setting is a duration: 30s and 1m are the likely mistakes
        raise ValueError("expected a number of seconds such as 30 or 2.5 (no unit)") from None
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return value


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("expected true/false, 1/0, yes/no or on/off")


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _parse_str(text: str) -> str:
    return text.strip()


def _parse_optional_str(text: str) -> str | None:
    return text.strip() or None


@dataclass(frozen=True, slots=True)
class SettingSpec:
    """How one setting is named, parsed, checked and documented."""

    name: str
    parse: Callable[[str], Any]
    check: Callable[[Any], str | None]
    help: str
    secret: bool = False

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def check_argument(name: str, value: Any, rule: Callable[[Any], str | None], *, integer: bool = False) -> None:
    """What ``LifetimeSettings`` does for a setting, for a constructor's number argument: a ``ValueError``
    naming it and its value unless it is a finite number (an ``int`` with ``integer``) that ``rule`` accepts."""
    problem = _kind_problem(value, (int,) if integer else (int, float)) or rule(value)
    if problem:
        raise ValueError(f"{name}={value!r} is invalid: {problem}")


def positive(value: Any) -> str | None:
    return None if value > 0 else "must be greater than 0"


def non_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be 0 or greater"


def at_least_one(value: Any) -> str | None:
    return None if value >= 1 else "must be at least 1"


def _anything(value: Any) -> str | None:
    return None


# What a prefix may not hold: "{" or "}" (the gateway's router reads "/v1/{model}" as a parameter, the
# middleware as text: what one forwarded the other had not admitted, a 500), or a "." or ".." segment
# (no path with one is forwarded: the gateway refuses it, invalid_path).
_NOT_IN_PREFIX: Final = re.compile(r"[{}]|/\.\.?(?:/|$)")


def _path_prefixes(value: Any) -> str | None:
    if not value:
        return "must name at least one path prefix"
    bad = [p for p in value if not p.startswith("/")]
    if bad:
        return f"path prefixes must start with '/' ({bad[0]!r} does not)"
    bad = [p for p in value if _NOT_IN_PREFIX.search(p)]
    if bad:
        return f"path prefixes are literal paths, without '{{', '}}' or a '.' or '..' segment ({bad[0]!r} is not)"
    return None


def _urls(value: Any) -> str | None:
    seen: set[str] = set()
    for url in value:
        problem = base_url_problem(url)
        if problem is not None:
            return f"each upstream must be an http:// or https:// base URL: {redact_url(url)!r} {problem}"
        # The pool refuses a repeat (every worker's start would fail); a trailing "/" or user info
        # does not make another upstream.
        base = _split_url(url)[0].rstrip("/")
        if base in seen:
            return f"{redact_url(url)!r} names an upstream twice: list each one once"
        seen.add(base)
    return None


def base_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a base URL that request paths are appended to, or None."""
    if not re.match(r"^https?://[^\s/]+", url) or re.search(r"\s", url):
        return "is not one"
    try:
        parts = urlsplit(url)
    except ValueError:  # "Invalid IPv6 URL": an unclosed "[" (the error would name neither setting nor value)
        return "has an invalid IPv6 address"
    if parts.query or parts.fragment or "?" in url or "#" in url:
        # The request path would land in the query (or be dropped): every request misrouted.
        return "has a query or fragment; a request's path and query are appended to the base URL"
    try:
        port = parts.port  # raises ValueError for a port that is not a number in 0-65535
    except ValueError:
        port = 0
    if port == 0:  # port 0 cannot be connected to: every request "unreachable" after every retry
        return "has an invalid port"
    return None if parts.hostname else "has no host"


def _header_name(value: Any) -> str | None:
    return None if re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", value) else "must be a valid HTTP header name"


_UPSTREAM_AUTH = ("bearer", "x-api-key", "x-goog-api-key", "api-key")  # the schemes of _auth.UPSTREAM_AUTH_SCHEMES


def _upstream_auth(value: Any) -> str | None:
    return None if value in _UPSTREAM_AUTH else f"must be one of {', '.join(_UPSTREAM_AUTH)}"


def _parse_lower(text: str) -> str:
    return text.strip().lower()


def _session_store(value: Any) -> str | None:
    if value == "memory":
        return None
    try:
        parts = urlsplit(value)
    except ValueError:  # an unclosed "[": say which setting, not just "Invalid IPv6 URL"
        parts = urlsplit("")
    if parts.scheme in ("redis", "rediss") and parts.hostname:
        return None
    return "must be memory or a redis:// or rediss:// URL with a host"


# UPSTREAM_TRANSPORT: what sends the upstream requests (httpx is the client API either way).
UPSTREAM_TRANSPORTS: tuple[str, ...] = ("auto", "aiohttp", "httpcore")


def _upstream_transport(value: Any) -> str | None:
    return None if value in UPSTREAM_TRANSPORTS else f"must be one of {', '.join(UPSTREAM_TRANSPORTS)}"


# RETAIN_OUTBOUND: where the outbound body is kept for one blind re-issue once retries settle.
RetainOutbound = Literal["memory", "disk", "off"]
RETAIN_MODES: tuple[RetainOutbound, ...] = ("memory", "disk", "off")
_RETAIN_HINT = "expected memory, disk or off (true means disk, false means off)"


def _parse_retain(text: str) -> RetainOutbound:
    lowered = text.strip().lower()
    if lowered in RETAIN_MODES:
        return lowered
    try:
        return _retain_mode(_parse_bool(lowered))
    except ValueError:
        raise ValueError(_RETAIN_HINT) from None


def _retain_mode(value: bool) -> RetainOutbound:
    """True/false keep their meaning, retained or not: retained goes where the default keeps it, on disk."""
    return "disk" if value else "off"


def _retain(value: Any) -> str | None:
    return None if value in RETAIN_MODES else _RETAIN_HINT


def _absolute_dir(value: Any) -> str | None:
    if value is None:
        return None
    if "\0" in value or not os.path.isabs(value):
        return "must be an absolute directory path (or unset: the system temp dir)"
    return None


def _keys(value: Any) -> str | None:
    if any(not k for k in value):
        return "keys must not be empty"
    return next((problem for problem in map(_key_problem, value) if problem is not None), None)


def _key(value: Any) -> str | None:
    return None if value is None else _key_problem(value)


def _key_problem(key: Any) -> str | None:
    # A key goes out in a header: a line break made every request fail as "upstream unreachable" after
    # every retry, anything else outside printable ASCII (a zero-width space pasted from a web page) a 401.
    if isinstance(key, str) and re.search(r"[^\x20-\x7e]", key):
        return "a key must be printable ASCII (it has a line break, control or non-ASCII character)"
    return None


# name -> (parser, check, help, secret). Defaults live on the dataclass below.
SETTINGS: dict[str, SettingSpec] = {
    spec.name: spec
    for spec in [
        # Reading and admission.
        SettingSpec("max_body_bytes", _parse_size, positive, "Largest request body accepted (after decoding)."),
        SettingSpec("body_idle_timeout", _parse_float, positive, "Seconds without a body chunk before 408."),
        SettingSpec("body_timeout", _parse_float, positive, "Seconds the whole request body may take before 408."),
        SettingSpec("max_inflight", _parse_int, at_least_one, "Requests admitted at once."),
        SettingSpec(
            "max_inflight_bytes",
            _parse_size,
            positive,
            "Sum of admitted request bodies, charged as bytes arrive and decode.",
        ),
        SettingSpec("admission_timeout", _parse_float, non_negative, "Seconds a request may wait for admission."),
        SettingSpec(
            "admission_target_delay",
            _parse_float,
            non_negative,
            "Queueing delay tolerated: once the longest wait for a slot has stayed above it for "
            "ADMISSION_INTERVAL, a new request that cannot be admitted at once gets 503 at once; 0: plain FIFO queue.",
        ),
        SettingSpec(
            "admission_interval",
            _parse_float,
            positive,
            "Seconds the queue delay must stay above ADMISSION_TARGET_DELAY before new requests are shed.",
        ),
        SettingSpec(
            "paths",
            _parse_list,
            _path_prefixes,
            "Comma-separated path prefixes the middleware handles, whole segments: /v1 covers /v1/models, not /v1beta.",
        ),
        # Forwarding.
        SettingSpec("upstream_url", _parse_list, _urls, "Comma-separated upstream base URLs."),
        SettingSpec("max_attempts", _parse_int, at_least_one, "Upstream attempts per request, all kinds."),
        SettingSpec("retry_deadline", _parse_float, positive, "Seconds all attempts of one request may take."),
        SettingSpec("backoff_base", _parse_float, non_negative, "First retry's backoff ceiling in seconds."),
        SettingSpec("backoff_max", _parse_float, non_negative, "Largest backoff in seconds."),
        SettingSpec("retry_after_cap", _parse_float, non_negative, "Largest upstream Retry-After honoured."),
        SettingSpec("connect_timeout", _parse_float, positive, "Seconds to connect to the upstream."),
        SettingSpec("headers_timeout", _parse_float, positive, "Seconds to wait for upstream response headers."),
        SettingSpec(
            "stall_timeout",
            _parse_float,
            positive,
            "Seconds of upstream silence that end a stream, and for an error body to arrive whole.",
        ),
        SettingSpec("keepalive_interval", _parse_float, positive, "Seconds between SSE keep-alives in silence."),
        SettingSpec(
            "retain_outbound",
            _parse_retain,
            _retain,
            "Keep the outbound body for one blind re-issue of a starved stream: disk (above RETAIN_SPILL_BYTES, "
            "in an unlinked temporary file once retries settle), memory, or off; true means disk, false off.",
        ),
        SettingSpec(
            "retain_spill_bytes",
            _parse_size,
            non_negative,
            "With RETAIN_OUTBOUND=disk, a retained body larger than this goes to disk; smaller ones stay in memory.",
        ),
        SettingSpec(
            "retain_dir",
            _parse_optional_str,
            _absolute_dir,
            "Directory of the retained bodies' temporary files (unlinked at creation); unset: the system temp "
            "dir. A tmpfs saves no memory.",
        ),
        SettingSpec(
            "malloc_trim",
            _parse_bool,
            _anything,
            "Give freed heap back to the OS (glibc malloc_trim) during and after requests of 8 MiB or more; "
            "off: never trim.",
        ),
        SettingSpec("session_header", _parse_str, _header_name, "Request header carrying the session id."),
        SettingSpec(
            "max_session_id_bytes",
            _parse_size,
            positive,
            "Longest session id accepted (longer: 400); sessions are kept by a 16-byte digest.",
        ),
        SettingSpec("bookkeeping_sessions", _parse_int, at_least_one, "Sessions kept by the default bookkeeper."),
        SettingSpec(
            "session_store",
            _parse_str,
            _session_store,
            "Where the session book lives: memory (this process) or a redis:// / rediss:// URL shared by every "
            "replica (needs the redis extra).",
        ),
        SettingSpec(
            "session_ttl", _parse_float, positive, "Seconds a session stays in a shared store after its last request."
        ),
        SettingSpec(
            "session_lease",
            _parse_float,
            positive,
            "Seconds a replica's session pin outlives it in a shared store if it dies (renewed every third of it).",
        ),
        SettingSpec(
            "session_store_timeout",
            _parse_float,
            positive,
            "Seconds one call to a shared store may take before bookkeeping falls back to this process's book.",
        ),
        SettingSpec("error_body_limit", _parse_size, positive, "Bytes of an upstream error body buffered."),
        # Operating the gateway.
        SettingSpec(
            "upstream_api_key",
            _parse_optional_str,
            _key,
            "Key injected upstream; clients must then present a gateway key.",
            secret=True,
        ),
        SettingSpec(
            "upstream_auth",
            _parse_lower,
            _upstream_auth,
            "How UPSTREAM_API_KEY is sent: bearer (Authorization), x-api-key, x-goog-api-key"
            " or api-key (Azure OpenAI).",
        ),
        SettingSpec("gateway_keys", _parse_list, _keys, "Comma-separated keys clients may present.", secret=True),
        SettingSpec(
            "upstream_transport",
            _parse_lower,
            _upstream_transport,
            "What sends upstream requests: auto (aiohttp on asyncio when installed, else httpcore), aiohttp "
            "(asyncio only; startup fails on trio) or httpcore (httpx's own transport).",
        ),
        SettingSpec("upstream_cooloff", _parse_float, non_negative, "Seconds an upstream that failed is skipped."),
        SettingSpec(
            "drain_delay",
            _parse_float,
            non_negative,
            "Seconds the server keeps accepting after SIGTERM (healthz 503, new requests 503) before it stops "
            "listening; 0 stops listening at once.",
        ),
        SettingSpec("shutdown_grace", _parse_float, non_negative, "Seconds in-flight streams get on shutdown."),
    ]
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LifetimeSettings:
    """Every knob of asgi_lifetime, validated on construction.

    ```python
    settings = LifetimeSettings(max_body_bytes=16 * MiB, paths=("/v1/",))
    settings = LifetimeSettings.from_environ()  # ASGI_LIFETIME_* and ./.env
    ```
    """

    max_body_bytes: int = 64 * MiB
    body_idle_timeout: float = 30.0
    body_timeout: float = 300.0
    max_inflight: int = 64
    max_inflight_bytes: int = 1 * GiB
    admission_timeout: float = 10.0
    admission_target_delay: float = 0.05
    admission_interval: float = 0.5
    paths: tuple[str, ...] = ("/v1/",)

    upstream_url: tuple[str, ...] = ()
    max_attempts: int = 4
    retry_deadline: float = 60.0
    backoff_base: float = 0.5
    backoff_max: float = 8.0
    retry_after_cap: float = 30.0
    connect_timeout: float = 10.0
    headers_timeout: float = 120.0
    stall_timeout: float = 120.0
    keepalive_interval: float = 15.0
    retain_outbound: RetainOutbound | bool = "disk"
    """``memory``, ``disk`` or ``off``; ``True`` / ``False`` are accepted and stored as ``disk`` / ``off``."""
    retain_spill_bytes: int = 1 * MiB
    retain_dir: str | None = None
    malloc_trim: bool = True
    session_header: str = "x-session-id"
    max_session_id_bytes: int = 256
    bookkeeping_sessions: int = 10_000
    session_store: str = field(default="memory", repr=False)  # a URL may carry a password: shown redacted
    session_ttl: float = 86_400.0
    session_lease: float = 15.0
    session_store_timeout: float = 0.25
    error_body_limit: int = 64 * KiB

    upstream_api_key: str | None = field(default=None, repr=False)
    upstream_auth: str = "bearer"
    gateway_keys: tuple[str, ...] = field(default=(), repr=False)
    upstream_transport: str = "auto"
    upstream_cooloff: float = 30.0
    drain_delay: float = 5.0
    shutdown_grace: float = 30.0

    upstream_userinfo: tuple[tuple[str, str], ...] = field(default=(), repr=False, metadata={"derived": True})
    """(base URL, user info) pairs split off ``upstream_url`` on construction; not a setting of its own.

    A password in an upstream URL would be printed wherever the URL is (stats, errors, the
    libraries' request logs): ``upstream_url`` keeps the URLs without user info, and the user
    info is sent as ``Authorization: Basic`` (see ``upstream_authorization``).
    """

    def __post_init__(self) -> None:
        if isinstance(self.retain_outbound, bool):  # the setting was a bool before it named a place
            object.__setattr__(self, "retain_outbound", _retain_mode(self.retain_outbound))
        for name, spec in SETTINGS.items():
            value = getattr(self, name)
            if isinstance(value, list):  # accept lists from code, store tuples
                value = tuple(value)
                object.__setattr__(self, name, value)
            problem = _type_problem(name, value) or spec.check(value) or _invisible_problem(value)
            if problem:
                raise ValueError(f"{spec.env}={_show(spec, value)} is invalid: {problem}")
        self._split_userinfo()
        if self.max_inflight_bytes < self.max_body_bytes:
            raise ValueError(
                f"{ENV_PREFIX}MAX_INFLIGHT_BYTES={self.max_inflight_bytes} is invalid: "
                f"must be at least MAX_BODY_BYTES ({self.max_body_bytes}) so one request can always be admitted"
            )
        if self.session_store_timeout * 2 > self.session_lease:
            raise ValueError(
                f"{ENV_PREFIX}SESSION_STORE_TIMEOUT={self.session_store_timeout:g} is invalid: must be at most half "
                f"of SESSION_LEASE ({self.session_lease:g}), so a lease is renewed before it runs out"
            )
        if self.backoff_max < self.backoff_base:
            raise ValueError(
                f"{ENV_PREFIX}BACKOFF_MAX={self.backoff_max:g} is invalid: must be at least BACKOFF_BASE "
                f"({self.backoff_base:g})"
            )

    def _split_userinfo(self) -> None:
        if not isinstance(self.upstream_userinfo, tuple) or not all(
            isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(v, str) for v in pair)
            for pair in self.upstream_userinfo
        ):
            raise ValueError("upstream_userinfo must be (base URL, user info) pairs")
        # Kept from a copy (``replace``) for the URLs still configured; a URL's own user info wins.
        found = dict(self.upstream_userinfo)
        clean: list[str] = []
        for url in self.upstream_url:
            base, userinfo = _split_url(url)
            clean.append(base)
            if userinfo is not None:
                found[base] = userinfo
        object.__setattr__(self, "upstream_url", tuple(clean))
        object.__setattr__(self, "upstream_userinfo", tuple((u, found[u]) for u in dict.fromkeys(clean) if u in found))

    def _credentials(self, base_url: str) -> tuple[str, str] | None:
        """``base_url``'s user info as the upstream reads it (user, password: percent-decoded), or ``None``."""
        userinfo = dict(self.upstream_userinfo).get(base_url)
        if userinfo is None:
            return None
        user, _, password = userinfo.partition(":")
        return unquote(user), unquote(password)

    def upstream_authorization(self, base_url: str) -> str | None:
        """The ``Authorization: Basic`` value for ``base_url``'s user info, or ``None`` if it had none."""
        credentials = self._credentials(base_url)
        if credentials is None:
            return None
        token = ":".join(credentials).encode()
        return "Basic " + base64.b64encode(token).decode("ascii")

    def upstream_secret(self, base_url: str) -> str | None:
        """What of ``base_url``'s user info is secret, decoded as the upstream reads it: the password, or a
        user name given alone (a token, ``https://TOKEN@host``); ``None`` if it had no user info."""
        credentials = self._credentials(base_url)
        if credentials is None:
            return None
        user, password = credentials
        return password or user

    def shown_upstream_urls(self) -> tuple[str, ...]:
        """The upstream URLs as a person may see them: ``http://user:***@host``."""
        userinfo = dict(self.upstream_userinfo)
        return tuple(_join_userinfo(url, _mask(userinfo.get(url))) for url in self.upstream_url)

    def upstream_urls_with_userinfo(self) -> tuple[str, ...]:
        """The upstream URLs as configured, user info included: only for handing to a child process."""
        userinfo = dict(self.upstream_userinfo)
        return tuple(_join_userinfo(url, userinfo.get(url)) for url in self.upstream_url)

    def replace(self, **changes: Any) -> LifetimeSettings:
        """A copy with some settings changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], *, base: LifetimeSettings | None = None) -> LifetimeSettings:
        """Build from a mapping. Keys may be ``max_body_bytes``, ``MAX_BODY_BYTES`` or
        ``ASGI_LIFETIME_MAX_BODY_BYTES``; string values are parsed, typed values taken as they are."""
        changes: dict[str, Any] = {}
        keys: dict[str, str] = {}
        for key, value in mapping.items():
            spec = _spec_for(key)
            if spec.name in keys:  # max_inflight and MAX_INFLIGHT: which one was meant?
                raise ValueError(f"{spec.name} is given twice ({keys[spec.name]!r} and {key!r})")
            keys[spec.name] = key
            changes[spec.name] = _coerce(spec, value)
        return dataclasses.replace(base or cls(), **changes)

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] | None = None, *, env_file: str | Path | None = ".env"
    ) -> LifetimeSettings:
        """Build from ``ASGI_LIFETIME_*`` variables, then ``env_file`` if it exists, then defaults."""
        return cls.from_mapping({name: raw for name, (raw, _) in collect_environ(environ, env_file=env_file).items()})

    def public_items(self) -> list[tuple[str, str]]:
        """(ENV name, printable value) pairs, secrets masked; for reports and logs."""
        shown = {"upstream_url": ",".join(self.shown_upstream_urls())}
        return [(spec.env, shown.get(name) or _show(spec, getattr(self, name))) for name, spec in SETTINGS.items()]


# name -> the types a field accepts, derived from the type of its default.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    f.name: {
        bool: (bool,),
        int: (int,),
        float: (int, float),
        tuple: (tuple,),
        str: (str,),
    }.get(type(f.default), (str, type(None)))
    for f in dataclasses.fields(LifetimeSettings)
}


def collect_environ(
    environ: Mapping[str, str] | None = None, *, env_file: str | Path | None = ".env"
) -> dict[str, tuple[str, str]]:
    """Raw setting values found in the environment or ``env_file``: name -> (raw text, source).

    Unknown ``ASGI_LIFETIME_*`` names raise ``ValueError``: a typo in an operator's
    environment should fail loudly at start, not be ignored.
    """
    env = os.environ if environ is None else environ
    # A pipe is read (``--env-file <(sops -d prod.env)``); a directory is not an env file (``./.env`` may be a
    # virtualenv: ``python -m venv .env``).
    file = env_file if env_file is not None and os.path.exists(env_file) and not os.path.isdir(env_file) else None
    file_values = read_env_file(file) if file is not None else {}
    for key in [*env, *file_values]:
        if key.upper().startswith(ENV_PREFIX):
            spec = _spec_for(key)
            if key != spec.env:  # the environment is case-sensitive: a lower-case name would be ignored
                raise ValueError(f"{key!r} is not read: setting names are upper case ({spec.env})")
    found: dict[str, tuple[str, str]] = {}
    for name, spec in SETTINGS.items():
        if spec.env in env:
            found[name] = (env[spec.env], "environment")
        elif spec.env in file_values:
            found[name] = (file_values[spec.env], f"env file {file}")
    return found


_ENV_LINE = re.compile(r"\s*(?:export\s+)?([^=\s]+)\s*=\s*(.*?)\s*")
_ENV_NAME = re.compile(r"\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)")
_QUOTED = re.compile(r"""(["'])(.*?)\1(?:\s+#.*)?""", re.DOTALL)


def read_env_file(path: str | Path) -> dict[str, str]:
    """``NAME=value`` lines of an env file, read as shells and docker compose read them: an ``export``
    before the name, a value in matching quotes (taken as it is), a comment after an unquoted value
    (`` # ...``, whitespace before the ``#``). Blank lines and ``#`` lines are skipped; later lines win.
    UTF-8, a byte order mark allowed. ``ValueError`` naming the file (and line, never the value) when it
    cannot be read, is not UTF-8, or a line of ours has no ``=`` or an unmatched quote."""
    values: dict[str, str] = {}
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    # A byte order mark (Windows editors) would otherwise become part of the first name, which then is no setting.
    for number, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:  # its message names neither the file nor the line (never the value)
            raise ValueError(f"{path}, line {number}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        match = _ENV_LINE.fullmatch(line)
        if match is None:
            # ``NAME: value`` (a compose file's environment map) or ``NAME value`` would otherwise
            # leave the setting at its default, unnoticed: only this package's names, never the value.
            # A bare ``NAME`` stays allowed (docker's env files: take it from the environment).
            ours = _ENV_NAME.match(line)
            rest = line[ours.end() :].strip() if ours is not None else ""
            if ours is not None and ours[1].upper().startswith(ENV_PREFIX) and rest and rest[0] != "#":
                raise ValueError(f"{path}, line {number}: {ours[1]} has no '=' (expected {ours[1]}=value)")
            continue
        if match[1].startswith("#"):
            continue
        name, value = match[1], match[2]
        quoted = _QUOTED.fullmatch(value)
        if quoted is None and value[:1] in ("'", '"') and name.upper().startswith(ENV_PREFIX):
            # Taken as written, the quote would be part of the value (a key with a quote: every request a 401).
            raise ValueError(
                f"{path}, line {number}: {name} has an unmatched quote (a quoted value ends on its line, "
                "before any comment)"
            )
        values[name] = quoted[2] if quoted else re.sub(r"\s+#.*", "", value)
    return values


def _spec_for(key: str) -> SettingSpec:
    name = key.lower()
    if name.startswith(ENV_PREFIX.lower()):
        name = name[len(ENV_PREFIX) :]
    try:
        return SETTINGS[name]
    except KeyError:
        raise ValueError(f"unknown setting {key!r}; known settings: {', '.join(sorted(SETTINGS))}") from None


def _coerce(spec: SettingSpec, value: Any) -> Any:
    if isinstance(value, str):
        try:
            return spec.parse(value)
        except ValueError as exc:
            raise ValueError(f"{spec.env}={_show(spec, value)} is invalid: {exc}") from None
    if isinstance(value, Iterable) and not isinstance(value, (bytes, str)):
        return tuple(value)
    return value


def _type_problem(name: str, value: Any) -> str | None:
    return _kind_problem(value, _FIELD_TYPES[name])


def _kind_problem(value: Any, expected: tuple[type, ...]) -> str | None:
    if isinstance(value, bool) and bool not in expected:
        return "has the wrong type (bool)"
    if not isinstance(value, expected):
        return f"has the wrong type ({type(value).__name__})"
    if isinstance(value, tuple) and not all(isinstance(v, str) for v in value):
        return "must be a list of strings"
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    return None


def _invisible_problem(value: Any) -> str | None:
    """A text value with a character no report shows (a zero-width space pasted from a web page, a control
    character): the URL, path prefix or directory would never be the one meant, and look right everywhere."""
    for text in value if isinstance(value, tuple) else (value,):
        if isinstance(text, str) and not text.isprintable():
            char = next(c for c in text if not c.isprintable())
            return f"has an invisible or control character (U+{ord(char):04X})"
    return None


def _show(spec: SettingSpec, value: Any) -> str:
    if spec.secret:
        return "***" if value else "(unset)"
    if spec.name == "session_store" and isinstance(value, str):
        return redact_url(value)
    if spec.name == "upstream_url" and isinstance(value, tuple):
        return ",".join(redact_url(v) if isinstance(v, str) else str(v) for v in value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))  # items may not be strings when the value is being rejected
    return str(value)


def redact_url(url: str) -> str:
    """``url`` with any password in it replaced by ``***`` (``https://user:***@host/``; a user name
    alone, ``https://***@host/``), and any query or fragment (where keys travel: ``?key=``,
    ``?password=``) by ``***``, for output."""
    # The user info is whatever precedes the last "@", read without urlsplit: a password with a "/",
    # "?" or "#" (base64 has "/") ends urlsplit's netloc early, and a mistyped scheme ("redis//",
    # none at all) leaves no netloc; either way the password would be shown whole.
    head, at, rest = url.rpartition("@")
    if at:
        scheme, sep, userinfo = head.partition("://")
        if not sep:
            scheme, userinfo = "", head
        user, colon, secret = userinfo.partition(":")
        if colon:
            # A "?" or "#" before the "@" may start a query the "@" is in (``http://h:80/?k=a@b``):
            # what follows it is then no host, and is hidden with the rest of that query.
            url = f"{scheme}{sep}{user}:***@{'***' if re.search('[?#]', secret) else rest}"
        elif not re.search("[/?#]", user):
            # A user name alone is a credential too (sent as Basic ``user:``; some services take a token
            # as the user name, ``https://TOKEN@host``). With a "/", "?" or "#" the "@" is in the path or
            # query, hidden below if it is in the query.
            url = f"{scheme}{sep}***@{rest}"
    return re.sub(r"[?#].*", "?***", url, count=1, flags=re.DOTALL)


def _split_url(url: str) -> tuple[str, str | None]:
    """``url`` without its user info, and the user info (``None`` if there was none)."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return url, None
    return urlunsplit(parts._replace(netloc=hostport)), userinfo


def _join_userinfo(url: str, userinfo: str | None) -> str:
    if userinfo is None:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}"))


def _mask(userinfo: str | None) -> str | None:
    if userinfo is None or ":" not in userinfo:
        return userinfo
    return userinfo.partition(":")[0] + ":***"
