"""The access log: one structured line per request the gateway answers on its forwarded paths.

``AccessLog`` is a bookkeeper. Each ``record(outcome)`` logs one line at INFO on the
``asgi_lifetime.access`` logger, as logfmt ``key=value`` pairs::

    path=/v1/chat/completions status=200 outcome=complete code=- upstream=http://10.0.0.7:8000
    attempts=1 bytes_out=5120 ttfb_ms=412.3 duration_ms=9031.8 size=48213
    text_comparable=true wire_hash=af13...c2 session=ab12cd34

(one line; wrapped here). ``code`` is the error's code when the gateway answered with an error of
its own (``status=400 outcome=error code=invalid_header``, ``status=502 outcome=error
code=request_unsendable``), ``-`` when it relayed the upstream's answer. A request refused
before it reached the forwarder (a wrong gateway key, a body refused, admission shed) gets a
shorter line from ``refused(...)``, the error's code instead of the forwarding fields::

    path=/v1/chat/completions status=401 outcome=refused code=invalid_api_key duration_ms=0.1

What it never writes: the body (only its ``wire_hash`` and size),
the query string (it is where API keys travel: ``?key=...``), credentials in the upstream
URL (user info, query), and the session id in clear (an 8-hex-digit blake2b hash of it, so
lines of one session can be correlated without the log holding the id). ``upstream`` names the
upstream tried last, also when it did not answer (refused connections). A field without a
value (no first byte, no attempt made, no session) is ``-``.

The same fields go to ``extra={"asgi_lifetime": {...}}``, with numbers as numbers and
``None`` for the missing ones, so a JSON formatter can emit them as they are::

    class JSONFormatter(logging.Formatter):
        def format(self, record):
            return json.dumps(getattr(record, "asgi_lifetime", None) or {"message": record.getMessage()})
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Final
from urllib.parse import urlsplit, urlunsplit

from ._bookkeeping import Outcome

__all__ = [
    "ACCESS_LOGGER",
    "AccessLog",
    "access_fields",
    "public_path",
    "public_url",
    "refused_fields",
    "session_hash",
]

ACCESS_LOGGER: Final = "asgi_lifetime.access"

# Values made of these characters are written bare; anything else (spaces, quotes, '=',
# control characters, non-ASCII, the empty string) is quoted and escaped as a JSON string,
# so a value cannot forge a field or a line.
_BARE: Final = re.compile(r"[A-Za-z0-9_.,:/@+\-%~]+")


def public_path(path: str) -> str:
    """``path`` without its query string or fragment."""
    return path.split("?", 1)[0].split("#", 1)[0]


def public_url(url: str) -> str:
    """``url`` without user info, query string or fragment: what may be logged or used as a label."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "invalid"
    if not parts.scheme and not host:
        return public_path(url)
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc = f"{netloc}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def session_hash(session_id: str) -> str:
    """A short, stable stand-in for a session id: 8 hex digits of its blake2b hash."""
    return hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(max(0.0, seconds) * 1000.0, 1)


def _logfmt_value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    return text if _BARE.fullmatch(text) else json.dumps(text)


def access_fields(outcome: Outcome) -> dict[str, object]:
    """The fields of one access log line, in order. Safe to log: no body, key or session id."""
    fp = outcome.fingerprint
    return {
        "path": public_path(outcome.path),
        "status": outcome.status,
        "outcome": outcome.outcome,
        "code": outcome.code,
        "upstream": None if outcome.upstream is None else public_url(outcome.upstream),
        "attempts": outcome.attempts,
        "bytes_out": outcome.bytes_out,
        "ttfb_ms": _ms(outcome.ttfb),
        "duration_ms": _ms(outcome.duration),
        "size": fp.size,
        "text_comparable": fp.text_comparable,
        "wire_hash": fp.wire_hash,
        "session": None if outcome.session_id is None else session_hash(outcome.session_id),
    }


def refused_fields(path: str, status: int, code: str, duration: float) -> dict[str, object]:
    """The fields of a refused request's line, in order: nothing the client sent but its path."""
    return {
        "path": public_path(path),
        "status": status,
        "outcome": "refused",
        "code": code,
        "duration_ms": _ms(duration),
    }


class AccessLog:
    """A bookkeeper that writes one logfmt line per request to ``asgi_lifetime.access``.

    ```python
    logging.getLogger("asgi_lifetime.access").setLevel(logging.INFO)
    access = AccessLog()
    access.record(outcome)      # path=/v1/chat/completions status=200 outcome=complete ...
    access.refused("/v1/chat/completions", 401, "invalid_api_key", 0.0001)  # ... outcome=refused ...
    ```

    Pass ``logger`` to log elsewhere. Nothing is formatted when INFO is disabled.
    """

    __slots__ = ("_logger",)

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger if logger is not None else logging.getLogger(ACCESS_LOGGER)

    @property
    def logger(self) -> logging.Logger:
        return self._logger

    def record(self, outcome: Outcome) -> None:
        if not self._logger.isEnabledFor(logging.INFO):
            return
        self._write(access_fields(outcome))

    def refused(self, path: str, status: int, code: str, duration: float) -> None:
        """Log a request refused before it reached the forwarder (its error's status and code)."""
        if not self._logger.isEnabledFor(logging.INFO):
            return
        self._write(refused_fields(path, status, code, duration))

    def _write(self, fields: dict[str, object]) -> None:
        line = " ".join(f"{key}={_logfmt_value(value)}" for key, value in fields.items())
        self._logger.info("%s", line, extra={"asgi_lifetime": fields})
