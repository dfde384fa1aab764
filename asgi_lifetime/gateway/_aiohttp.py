"""The upstream transport on asyncio: httpx's client API over aiohttp's connection pool.

The gateway keeps httpx as its client API (its types, respx in tests) and only changes what
sends the bytes: measured, a bare forwarder spends 5.0 ms of CPU per request through httpx's
own transport at concurrency 1 (9.9 ms at 32) and 3.1 ms (3.2 ms) through aiohttp's, whose HTTP
parser and writer are C. aiohttp runs on asyncio only: on trio the gateway keeps httpcore
(``_transport.GuardedTransport``). ``UPSTREAM_TRANSPORT`` chooses (``UpstreamTransport``)::

    transport = UpstreamTransport(choice="auto", limits=httpx.Limits(max_connections=64))
    client = httpx.AsyncClient(transport=transport)

What holds on both transports (``tests/gateway/test_aiohttp.py`` checks it against raw sockets):

- the request body is read from its holder as it is sent (the async iterator httpx's
  ``Request.stream`` gives), never copied or kept;
- failures come out as the httpx exceptions the retry loop maps (``ConnectError``,
  ``ConnectTimeout``, ``PoolTimeout``, ``ReadTimeout``, ``RemoteProtocolError``...);
- bytes pass through as sent: no decompression (``auto_decompress=False``), header names in
  their case with duplicates kept, no header aiohttp would add (User-Agent, Accept,
  Accept-Encoding, Content-Type);
- a connection never carries one response's leftovers to the next request. aiohttp hands a
  connection back to its pool the moment the response's last byte is parsed, before it parses
  the rest of the bytes read with it, and an idle pooled connection goes on parsing what
  arrives: a second response sent after the first would be the answer to the next request.
  ``_GuardedHandler`` closes a connection that receives a byte after its response ended, or a
  second final response, so it is never picked again;
- a response closed before its end closes its connection (never pooled half-read).

A request whose header fields aiohttp cannot write byte for byte (it writes text as UTF-8: a
value with obs-text that is not UTF-8) or would write unchecked (a NUL, a name that is not a
token) goes through httpcore instead, which sends or refuses it exactly as before. So do the
requests to an upstream once aiohttp's stricter parser refused one of its response heads
(Transfer-Encoding with Content-Length, bytes that are not HTTP after a response...): that
attempt fails as a protocol error, and the retry goes through httpcore. Uses
aiohttp internals (``ResponseHandler``, the connector's protocol factory), so ``pyproject.toml``
bounds aiohttp; ``tests/gateway/test_aiohttp.py`` fails if they move.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import re
from collections.abc import Iterable
from typing import Any, Final

import aiohttp
import httpx
from aiohttp.client_proto import ResponseHandler
from yarl import URL

from ._transport import GuardedTransport

__all__ = ["AiohttpTransport"]

logger = logging.getLogger(__name__)

# Set per request: whether a timeout came while connecting (ConnectTimeout) or while waiting for a
# pooled connection (PoolTimeout); aiohttp raises the same error for both.
_connecting: contextvars.ContextVar[list[bool]] = contextvars.ContextVar("asgi_lifetime_connecting")

# Headers aiohttp adds unless told not to: the gateway sends only the client's and its own.
_SKIP_AUTO_HEADERS: Final = ("Accept", "Accept-Encoding", "Content-Type", "User-Agent")
# What a response body may buffer before aiohttp stops reading the socket (twice this). Its
# buffer keeps each HTTP chunk as an object of its own: with the default (64 KiB) an upstream
# dripping 2-byte chunks made a 2.5 MB peak while the relay held a 96 KiB event
# (tests/reliability/test_attack_upstream.py); with 16 KiB it stays under that test's bound.
_READ_BUFSIZE: Final = 16 * 1024
# h11's limit on a response head is 16 KiB in all; aiohttp's default is 8190 bytes per line.
_MAX_HEAD_LINE: Final = 16 * 1024
# What aiohttp's writer sends unchanged: a token for the name, and a value without CR, LF or NUL
# (it raises on CR/LF, passes NUL); h11 checks the same before httpcore sends anything.
_TOKEN: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE: Final = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` over one ``aiohttp.ClientSession`` (asyncio only).

    ```python
    client = httpx.AsyncClient(transport=AiohttpTransport(limits=httpx.Limits(max_connections=64)))
    ```

    The session is created on the first request, in the loop that runs it (aiohttp's objects
    belong to one loop), and closed by ``aclose()``. ``limits.max_connections`` bounds the pool
    (aiohttp has no separate bound on idle connections); ``keepalive_expiry`` is how long an
    idle one is kept. A request's ``pool`` timeout bounds the wait for a connection and its
    creation (``PoolTimeout`` if it ran out in the wait), ``connect`` the TCP (and TLS) connect
    (``ConnectTimeout``), ``read`` each read; there is no write timeout (the gateway bounds the
    whole exchange up to the headers itself).
    """

    def __init__(self, *, limits: httpx.Limits, verify: bool = True, trust_env: bool = True) -> None:
        self._limits = limits
        self._verify = verify
        self._trust_env = trust_env
        # Made here, as httpx's transport makes it: a bad CA bundle fails at startup, not on a request.
        self._ssl = httpx.create_ssl_context(verify=verify, trust_env=trust_env)
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[tuple[float | None, ...], aiohttp.ClientTimeout] = {}
        self._fallback: GuardedTransport | None = None
        self._lenient: set[bytes] = set()  # upstreams whose answers aiohttp's parser refused: sent by httpcore
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("the transport is closed")
        limits = self._limits
        connector = _GuardedConnector(
            limit=limits.max_connections or 0,
            limit_per_host=0,
            keepalive_timeout=limits.keepalive_expiry,
            ssl=self._ssl,
        )
        return aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # the relay sends the upstream's bytes as they are
            skip_auto_headers=_SKIP_AUTO_HEADERS,
            cookie_jar=aiohttp.DummyCookieJar(),  # one session serves every client: keep no cookies
            timeout=aiohttp.ClientTimeout(total=None),
            max_line_size=_MAX_HEAD_LINE,
            max_field_size=_MAX_HEAD_LINE,
            read_bufsize=_READ_BUFSIZE,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        headers = _text_headers(request.headers.raw)
        if headers is None or request.url.netloc in self._lenient:
            return await self._fallback_transport().handle_async_request(request)
        session = self._session
        if session is None:
            session = self._session = self._open()
        framed = "content-length" in request.headers or "transfer-encoding" in request.headers
        connecting = [False]
        _connecting.set(connecting)  # this request's task's context: the connector runs in it
        try:
            response = await session.request(
                request.method,
                URL(str(request.url), encoded=True),  # as httpx encoded it: not re-quoted
                headers=headers,
                data=request.stream if framed else None,
                allow_redirects=False,
                compress=False,
                timeout=self._timeout(request.extensions.get("timeout", {})),
                server_hostname=request.extensions.get("sni_hostname"),
            )
        except aiohttp.ClientResponseError as exc:
            self._refused_head(request.url.netloc, exc)
            raise _mapped(exc) from None
        except aiohttp.ConnectionTimeoutError as exc:
            raise (httpx.ConnectTimeout if connecting[0] else httpx.PoolTimeout)(str(exc)) from None
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise _mapped(exc) from None
        return httpx.Response(
            status_code=response.status,
            headers=list(response.raw_headers),
            stream=_Body(response),
            request=request,
            # aiohttp decodes the reason phrase as UTF-8 with surrogateescape: encoding it back that way
            # gives the bytes received (latin-1 raised on any byte >= 0x80, a 500 for every answer).
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": (response.reason or "").encode("utf-8", "surrogateescape"),
            },
        )

    def _refused_head(self, netloc: bytes, exc: aiohttp.ClientResponseError) -> None:
        """aiohttp's parser refused a response head that h11 may take (llhttp refuses, among others,
        Transfer-Encoding with Content-Length, which RFC 9112 lets a recipient read by the
        Transfer-Encoding): this attempt fails (the retry loop may try again), and from now on
        this upstream's requests go through httpcore, which reads such answers as before."""
        if len(self._lenient) < 64:  # the configured upstreams: a handful
            self._lenient.add(netloc)
        logger.warning(
            "the upstream %s sent a response aiohttp cannot parse (%s); its requests go through httpcore from now on",
            netloc.decode("ascii", "replace"),
            _kind_of(exc.message),
        )

    def _fallback_transport(self) -> GuardedTransport:
        if self._fallback is None:
            self._fallback = GuardedTransport(limits=self._limits, verify=self._verify, trust_env=self._trust_env)
        return self._fallback

    def _timeout(self, timeout: dict[str, float | None]) -> aiohttp.ClientTimeout:
        key = (timeout.get("connect"), timeout.get("read"), timeout.get("pool"))
        found = self._timeouts.get(key)
        if found is None:
            connect, read, pool = key
            # aiohttp's connect timeout covers the wait for a pooled connection and the connect
            # that follows it; its sock_connect the connect alone.
            found = aiohttp.ClientTimeout(total=None, connect=pool, sock_connect=connect, sock_read=read)
            if len(self._timeouts) < 16:  # one client's timeouts: a handful at most
                self._timeouts[key] = found
        return found

    def busy(self) -> list[str]:
        """The connections in a request (idle keep-alive ones are fine), the requests waiting for one."""
        busy: list[str] = []
        session = self._session
        connector = session.connector if session is not None else None
        if connector is not None and not connector.closed:
            busy += [f"aiohttp connection {proto!r}" for proto in list(connector._acquired)]
            busy += [f"aiohttp waiter for {key}" for key, waiters in connector._waiters.items() if waiters]
        if self._fallback is not None:
            busy += self._fallback.busy()
        return busy

    async def aclose(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        fallback, self._fallback = self._fallback, None
        try:
            if session is not None:
                await session.close()
        finally:
            if fallback is not None:
                await fallback.aclose()


def _text_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]] | None:
    """The header fields as aiohttp takes them (text it writes back as UTF-8), or None if that
    would not give back the same bytes, or would send what h11 refuses to."""
    fields: list[tuple[str, str]] = []
    for name, value in raw:
        if _TOKEN.fullmatch(name) is None or _VALUE.fullmatch(value) is None:
            return None
        try:
            fields.append((name.decode("ascii"), value.decode("utf-8")))
        except UnicodeDecodeError:
            return None
    return fields


class _Body(httpx.AsyncByteStream):
    """A response body read from aiohttp as it arrives; an iterator, not a generator, so that
    stopping early leaves nothing to finalize. Closing it before its end closes the connection."""

    __slots__ = ("_response",)

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        content = self._response.content
        if content.exception() is not None:
            # The connection broke after more of the body arrived: readany() would raise and drop
            # those bytes, httpcore hands them over first (a cut answer is relayed as far as it came).
            chunk = content._read_nowait(-1)
            if chunk:
                return chunk
        try:
            chunk = await content.readany()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise _mapped(exc) from None
        if not chunk:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        # A response read to its end gave its connection back to the pool at its last byte
        # (aiohttp does that itself); one that did not end closes it here.
        self._response.close()


def _kind_of(message: str) -> str:
    """The leading words of a parse error's message (``Bad status line``), without what follows: aiohttp
    quotes the bytes it refused, which may be an answer's text or an error body quoting the upstream key."""
    words = re.match(r"[A-Za-z][A-Za-z ]{0,63}", message)
    return words.group().strip() if words else "unreadable response"


def _mapped(exc: BaseException) -> httpx.TransportError:
    """The httpx exception httpcore raises for the same failure (see ``_upstream._send``)."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return httpx.ReadTimeout(message)
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ServerFingerprintMismatch):
        return httpx.ConnectError(message)
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return httpx.UnsupportedProtocol(message)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(message)
    if isinstance(exc, aiohttp.ClientConnectionError | OSError):
        return httpx.ReadError(message)
    return httpx.RemoteProtocolError(message)


class _GuardedHandler(ResponseHandler):
    """aiohttp's connection protocol, closed when the upstream sends anything after a complete
    response: bytes while no request is out, or a second final response in the same read."""

    _exchange = False  # a request is out and its response has not ended
    _finals = 0  # final (non-1xx) responses parsed for it

    def set_response_params(self, **kwargs: Any) -> None:
        # Called for each request, before it is written.
        self._exchange, self._finals = True, 0
        super().set_response_params(**kwargs)

    def data_received(self, data: bytes) -> None:
        if data and not self._exchange:
            self._leftover("bytes")
            return
        super().data_received(data)
        payload = self._payload
        if self._finals and payload is not None and payload.is_eof():
            self._exchange = False

    def feed_data(self, data: Any, size: int = 0) -> None:
        message = data[0]
        if message.code >= 200 or message.code == 101:
            self._finals += 1
            if self._finals > 1:
                self._leftover("a second response")
                return
        super().feed_data(data, size)

    def close(self) -> None:
        # asyncio closes a transport only once its unsent bytes are written: a request abandoned
        # mid-body (the client left) to an upstream that stopped reading kept its socket open and
        # its unsent slice alive, for good. Nobody wants those bytes now: abort (aiohttp closes a
        # connection it will not reuse through here).
        transport = self.transport
        if transport is not None and transport.get_write_buffer_size():
            self.abort()
            return
        super().close()

    def _leftover(self, what: str) -> None:
        logger.warning("the upstream sent %s after a complete response: connection closed, not reused", what)
        self._should_close = True
        transport = self.transport
        if transport is not None:
            transport.close()


class _GuardedConnector(aiohttp.TCPConnector):
    """aiohttp's connector with ``_GuardedHandler`` connections; it says when a request starts connecting."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._factory = functools.partial(_GuardedHandler, loop=self._loop)  # type: ignore[assignment]

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
        connecting = _connecting.get(None)
        if connecting is not None:
            connecting[0] = True  # past the wait for the pool: a timeout from now on is the connect's
        return await super()._create_connection(req, traces, timeout)
