"""Gateway keys: who may use the gateway's own upstream key.

Without ``UPSTREAM_API_KEY`` (or user info in ``UPSTREAM_URL``, below) the gateway holds no
credential: the client's ``Authorization`` passes through to the upstream and the upstream
decides. With it, the gateway injects that key upstream, so it must keep strangers out:
clients present one of ``GATEWAY_KEYS`` (``Authorization: Bearer <key>`` or ``x-api-key: <key>``),
compared in constant time, and their own credential headers are replaced before anything is
read or forwarded. With an
upstream key and no gateway keys (a local development proxy), only loopback clients are
served; the CLI also refuses to bind such a gateway to a non-loopback address. User info in
``UPSTREAM_URL`` (sent as ``Authorization: Basic``) is a credential the gateway holds too, guarded
the same way: gateway keys are then checked (and never forwarded), or only loopback clients served.

``UPSTREAM_AUTH`` says how the key goes upstream: ``bearer`` (``Authorization: Bearer``,
OpenAI-style), ``x-api-key`` (Anthropic), ``x-goog-api-key`` (Gemini) or ``api-key`` (Azure OpenAI). Whichever it is,
every client credential (``Authorization``, ``x-api-key``, ``x-goog-api-key``, a ``key=``
query parameter) is removed first, so the upstream sees exactly one credential: ours.

An upstream may quote the credential it received (a 401 echoing ``Authorization``):
``KeyScrubber`` replaces the key (and the Basic credential of the URL's user info) in every
spelling with ``[redacted]`` in relayed headers and bodies.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Collection
from typing import Any
from urllib.parse import quote, unquote_to_bytes

from starlette.types import ASGIApp, Receive, Scope, Send

from .._asgi import BodyWatch, normalize_headers, route_path, send_error
from .._exceptions import AuthenticationError
from .._settings import LifetimeSettings

__all__ = [
    "CREDENTIAL_HEADERS",
    "REDACTED",
    "UPSTREAM_AUTH_SCHEMES",
    "GatewayAuth",
    "KeyScrubber",
    "is_loopback",
    "holds_credential",
    "open_beyond_loopback",
]

# Every header a client may carry a credential in, whatever the scheme the gateway injects.
# Where clients put a key: OpenAI's SDK (Bearer), Anthropic's (x-api-key), Gemini's, Azure OpenAI's.
CREDENTIAL_HEADERS = (b"authorization", b"x-api-key", b"x-goog-api-key", b"api-key")
# UPSTREAM_AUTH -> the header the upstream key goes in, and how its value is written.
UPSTREAM_AUTH_SCHEMES: dict[str, tuple[bytes, str]] = {
    "bearer": (b"authorization", "Bearer {key}"),
    "x-api-key": (b"x-api-key", "{key}"),
    "x-goog-api-key": (b"x-goog-api-key", "{key}"),
    "api-key": (b"api-key", "{key}"),
}
REDACTED = "[redacted]"
# The methods ``open_paths`` take without a key: the gateway's own endpoints are GET routes (HEAD too).
_OPEN_METHODS = frozenset({"GET", "HEAD"})


class GatewayAuth:
    """Pure ASGI: checks gateway keys and injects the upstream key; outermost, so a stranger's
    request is refused before admission or body reading. ``upstream_user_info``: the upstream
    URL carries user info the gateway sends as ``Authorization: Basic`` when the client sends no
    credential (a credential it holds, guarded as the key is; the client's own, if any, still goes
    through when no gateway key had to be presented). ``body_limits``: the settings whose
    ``BODY_IDLE_TIMEOUT`` and ``BODY_TIMEOUT`` bound how long a refused HTTP/2 client may go on
    sending before its answer ends (``BodyWatch``); the defaults when omitted. ``open_paths``: the
    paths whose GET (and HEAD) need no key.

    ```python
    app = GatewayAuth(app, gateway_keys=("k1", "k2"), upstream_api_key="sk-...", open_paths=("/healthz",))
    ```
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        gateway_keys: Collection[str],
        upstream_api_key: str | None,
        upstream_auth: str = "bearer",
        upstream_user_info: bool = False,
        open_paths: Collection[str] = ("/healthz", "/metrics"),
        body_limits: LifetimeSettings | None = None,
    ) -> None:
        if upstream_auth not in UPSTREAM_AUTH_SCHEMES:
            raise ValueError(
                f"upstream_auth={upstream_auth!r} is invalid: must be one of {', '.join(UPSTREAM_AUTH_SCHEMES)}"
            )
        self.app = app
        self._keys = [key.encode() for key in gateway_keys]
        header, template = UPSTREAM_AUTH_SCHEMES[upstream_auth]
        self._inject = (header, template.format(key=upstream_api_key).encode()) if upstream_api_key else None
        # Whether the gateway spends a credential of its own on a request: then it must know who asks.
        self._guarded = self._inject is not None or upstream_user_info
        self._open_paths = frozenset(open_paths)
        # BODY_IDLE_TIMEOUT, BODY_TIMEOUT: how long a refused client may go on sending (BodyWatch).
        self._limits = body_limits if body_limits is not None else LifetimeSettings()

    def _open(self, scope: Scope) -> bool:
        # Open for what the gateway answers there itself, a GET (or HEAD): another method goes to the
        # forwarder when PATHS covers the path (PATHS=/), and a stranger's POST /healthz was forwarded.
        return scope["method"] in _OPEN_METHODS and route_path(scope) in self._open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._guarded or self._open(scope):
            await self.app(scope, receive, send)
            return
        normalize_headers(scope)  # a server's "Authorization" is the credential "authorization" too
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if self._keys:
            allowed = self._accepts(_presented(headers))
            problem = (
                "a valid gateway key is required (Authorization: Bearer <key>, x-api-key, x-goog-api-key or api-key)"
            )
        else:
            client = scope.get("client")
            allowed = client is not None and is_loopback(str(client[0]))
            problem = "this gateway sends its own upstream credential and has no gateway keys: loopback clients only"
        if not allowed:
            limits = self._limits
            # The body is unread: the server must not parse it as the next request, nor fail the
            # connection for the data still coming.
            await send_error(
                scope,
                send,
                AuthenticationError(problem),
                extra_headers=[(b"www-authenticate", b"Bearer")],
                unread=BodyWatch(receive, limits.body_idle_timeout, limits.body_timeout),
            )
            return
        if self._keys or self._inject is not None:
            # The gateway key presented is not the upstream's to see; our credential replaces it (the
            # user info's Basic is added where the request is built, to a request without one).
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in headers if k not in CREDENTIAL_HEADERS]
            if self._inject is not None:
                scope["headers"].append(self._inject)
            scope["query_string"] = _without_key_param(scope.get("query_string", b""))
        await self.app(scope, receive, send)

    def _accepts(self, presented: bytes | None) -> bool:
        if presented is None:
            return False
        # Compare against every key, without stopping at a match, so timing says nothing
        # about which key (or how much of one) matched.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(presented, key)
        return matched


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def holds_credential(settings: LifetimeSettings) -> bool:
    """Whether the gateway sends a credential of its own upstream: ``UPSTREAM_API_KEY``, or user info in
    an ``UPSTREAM_URL`` (sent as ``Authorization: Basic``). Then ``GatewayAuth`` must know who asks."""
    return bool(settings.upstream_api_key or settings.upstream_userinfo)


def open_beyond_loopback(settings: LifetimeSettings) -> str | None:
    """What a client beyond loopback could do with these settings' keys unchecked, or ``None``.

    ``create_app`` warns with it; ``asgi-lifetime serve`` refuses a non-loopback host with it.
    """
    upstream_api_key, gateway_keys = settings.upstream_api_key, settings.gateway_keys
    upstream_user_info = bool(settings.upstream_userinfo)
    if upstream_api_key and not gateway_keys:
        return "UPSTREAM_API_KEY is set but GATEWAY_KEYS is not, so anyone who can reach the port would spend the key"
    if upstream_user_info and not gateway_keys:
        return (
            "UPSTREAM_URL has user info (sent as Authorization: Basic) but GATEWAY_KEYS is not set, so anyone "
            "who can reach the port would spend it"
        )
    if gateway_keys and not holds_credential(settings):
        # The keys are checked only where the gateway sends a credential of its own (the client's
        # Authorization header is otherwise its upstream credential): an operator who set them
        # believes the port closed.
        return (
            "GATEWAY_KEYS is set but UPSTREAM_API_KEY is not, so the keys are not checked (only a gateway that "
            "sends its own upstream credential checks them): anyone who can reach the port would be served"
        )
    return None


def _presented(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name in CREDENTIAL_HEADERS and value.strip():
            return value.strip()
    return None


# Query parameters that carry a credential (Gemini's ``key``; ``api_key``/``api-key`` elsewhere).
_KEY_PARAMS = frozenset({b"key", b"api_key", b"api-key"})


def _without_key_param(query: bytes) -> bytes:
    """The query string minus every credential parameter, as sent otherwise.

    Names are compared as a server would read them: percent-decoded, ``+`` as a space, any case
    (``%6Bey=``, ``KEY=`` and ``key%3D=`` are all ``key``).
    """
    if not query:
        return query
    kept = [part for part in query.split(b"&") if _param_name(part) not in _KEY_PARAMS]
    return b"&".join(kept)


def has_key_param(query: bytes) -> bool:
    """Whether the query string carries a credential parameter (read as ``_without_key_param`` reads it)."""
    return any(_param_name(part) in _KEY_PARAMS for part in query.split(b"&")) if query else False


def _param_name(part: bytes) -> bytes:
    name = unquote_to_bytes(part.partition(b"=")[0].replace(b"+", b" "))
    # ``key%3D=...`` decodes to ``key=``: the name a lenient server would see ends at its first '='.
    return name.partition(b"=")[0].strip().lower()


class KeyScrubber:
    """Replaces the gateway's upstream keys with ``[redacted]`` in what goes back to clients: each
    key given (``UPSTREAM_API_KEY``, and the Basic credential and secret of each upstream URL's user info).

    Spellings covered: the bare key (so ``Bearer <key>`` too), its JSON-escaped forms (``\\/``,
    every character ``\\u``-escaped) and percent-encoded forms, and, in JSON, any mix of escapes
    (the body is then parsed and re-serialized, so a valid JSON body stays valid JSON).

    ```python
    scrub = KeyScrubber("sk-upstream")
    scrub.scrub(b'{"error": "bad key Bearer sk-upstream"}')  # b'{"error": "bad key Bearer [redacted]"}'
    ```
    """

    __slots__ = ("_keys", "_spellings")

    def __init__(self, *keys: str | None) -> None:
        self._keys = tuple(key for key in keys if key)
        spellings: set[str] = set()
        for key in self._keys:
            spellings.update({key, json.dumps(key)[1:-1], key.replace("/", "\\/"), quote(key, safe=""), quote(key)})
            spellings.add("".join(f"\\u{ord(c):04x}" for c in key))  # every character escaped (JSON, JS)
        # Longest first: a spelling that contains another is replaced whole.
        self._spellings = sorted((s.encode() for s in spellings), key=len, reverse=True)

    def __bool__(self) -> bool:
        return bool(self._keys)

    @property
    def spellings(self) -> tuple[bytes, ...]:
        """The byte spellings of the key that ``scrub`` replaces, longest first."""
        return tuple(self._spellings)

    def scrub(self, data: bytes) -> bytes:
        if not self._keys:
            return data
        for spelling in self._spellings:
            if spelling in data:
                data = data.replace(spelling, REDACTED.encode())
        if b"\\u" in data:
            data = self._json(data)
        return data

    def scrub_text(self, text: str) -> str:
        if not self._keys:
            return text
        return self.scrub(text.encode("utf-8", "surrogatepass")).decode("utf-8", "surrogatepass")

    def cut(self, data: bytes) -> bytes:
        """``data`` scrubbed, then without a trailing start of the key (a body cut mid-key)."""
        data = self.scrub(data)
        for spelling in self._spellings:
            for size in range(min(len(spelling), len(data)), 0, -1):
                if data.endswith(spelling[:size]):
                    data = data[:-size]
                    break
        return data

    def headers(self, raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]] | None:
        """Scrubbed header pairs, or None when no value held the key."""
        if not self._keys:
            return None
        changed = False
        result = []
        for name, value in raw:
            clean = self.scrub(value)
            changed = changed or clean is not value
            result.append((name, clean))
        return result if changed else None

    def _json(self, data: bytes) -> bytes:
        try:
            document = json.loads(data)
        except ValueError:
            return data
        clean = self._walk(document)
        return data if clean == document else json.dumps(clean, ensure_ascii=False).encode()

    def _walk(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.scrub_text(value) if any(key in value for key in self._keys) else value
        if isinstance(value, list):
            return [self._walk(item) for item in value]
        if isinstance(value, dict):
            return {self._walk(k): self._walk(v) for k, v in value.items()}
        return value
