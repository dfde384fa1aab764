"""Gateway keys: who may use the gateway's own upstream key.

Without ``UPSTREAM_API_KEY`` the gateway holds no credential: the client's ``Authorization``
passes through to the upstream and the upstream decides. With it, the gateway injects that
key upstream, so it must keep strangers out: clients present one of ``GATEWAY_KEYS``
(``Authorization: Bearer <key>`` or ``x-api-key: <key>``), compared in constant time, and
their own credential headers are replaced before anything is read or forwarded. With an
upstream key and no gateway keys (a local development proxy), only loopback clients are
served; the CLI also refuses to bind such a gateway to a non-loopback address.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from ._exceptions import AuthenticationError
from ._middleware import route_path, send_error

__all__ = ["GatewayAuth", "is_loopback"]

_CREDENTIAL_HEADERS = (b"authorization", b"x-api-key")


class GatewayAuth:
    """Pure ASGI: checks gateway keys and injects the upstream key; outermost, so a stranger's
    request is refused before admission or body reading.

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
        open_paths: Collection[str] = ("/healthz", "/metrics"),
    ) -> None:
        self.app = app
        self._keys = [key.encode() for key in gateway_keys]
        self._inject = f"Bearer {upstream_api_key}".encode() if upstream_api_key else None
        self._open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._inject is None or route_path(scope) in self._open_paths:
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if self._keys:
            allowed = self._accepts(_presented(headers))
            problem = "a valid gateway key is required (Authorization: Bearer <key>)"
        else:
            client = scope.get("client")
            allowed = client is not None and is_loopback(str(client[0]))
            problem = "this gateway injects its upstream key and has no gateway keys: loopback clients only"
        if not allowed:
            await send_error(send, AuthenticationError(problem), extra_headers=[(b"www-authenticate", b"Bearer")])
            return
        scope = dict(scope)
        scope["headers"] = [(k, v) for k, v in headers if k not in _CREDENTIAL_HEADERS]
        scope["headers"].append((b"authorization", self._inject))
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


def _presented(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.strip()
    return None
