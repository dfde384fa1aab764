"""The retry policy of one ``forward``: an immutable value advanced per attempt.

Every rule of the retry loop lives here, as small pure decisions over scalars: whether an
outcome is tried again, how long to wait first, which role a rejected one is sent as. The
loop in ``_upstream.py`` sends, asks, and acts (close, sleep, refold); each attempt after the
first gets the state that ``Retry.increment`` returned, as httpx-retries' ``Retry`` does::

    retry = Retry.start(settings, now=clock(), upstreams=2)
    if retry.retries_failure(failure.retryable, delay, clock()):
        retry = retry.increment(failed=base, backoff=True)

The state holds numbers and upstream/role names only, never the request, its body or a
response: a frame suspended in a backoff sleep keeps nothing of the input alive through it.
"""

from __future__ import annotations

import email.utils
import math
import re
import time
from dataclasses import dataclass, replace
from datetime import timezone

import httpx

from .._json import loads
from .._settings import LifetimeSettings

__all__ = ["RETRY_STATUSES", "Retry", "asked_wait", "body_wait", "resend_safe", "says_no_retry"]

# 529 is Anthropic's overloaded_error: its 503.
RETRY_STATUSES = frozenset({429, 502, 503, 504, 529})


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Where one request's retries stand. Times are on the clock ``deadline`` was taken from."""

    max_attempts: int
    deadline: float
    backoff_base: float
    backoff_max: float
    retry_after_cap: float
    upstreams: int  # how many base URLs there are to fail over to
    attempt: int = 1  # the attempt being made, from 1
    backoffs: int = 0  # waits so far (a refold or a role rename is tried again at once)
    failed: frozenset[str] = frozenset()  # base URLs that failed this request
    roles_tried: frozenset[str] = frozenset()  # roles a rejected instruction role was sent as

    @classmethod
    def start(cls, settings: LifetimeSettings, *, now: float, upstreams: int) -> Retry:
        return cls(
            max_attempts=settings.max_attempts,
            deadline=now + settings.retry_deadline,
            backoff_base=settings.backoff_base,
            backoff_max=settings.backoff_max,
            retry_after_cap=settings.retry_after_cap,
            upstreams=upstreams,
        )

    def increment(self, *, failed: str | None = None, backoff: bool = False, role: str | None = None) -> Retry:
        """The state of the next attempt: after a wait (``backoff``), after ``failed`` failed it, or
        with the instruction role now sent as ``role``."""
        return replace(
            self,
            attempt=self.attempt + 1,
            backoffs=self.backoffs + 1 if backoff else self.backoffs,
            failed=self.failed | {failed} if failed is not None else self.failed,
            roles_tried=self.roles_tried | {role} if role is not None else self.roles_tried,
        )

    @property
    def more(self) -> bool:
        """Whether ``max_attempts`` leaves another attempt."""
        return self.attempt < self.max_attempts

    def ceiling(self) -> float:
        """The exponential ceiling of this wait's full jitter: draw the wait from ``[0, ceiling]``."""
        exponential: float = self.backoff_base * 2**self.backoffs
        return min(self.backoff_max, exponential)

    def too_long(self, asked: float | None) -> bool:
        """An asked wait longer than we would keep the client waiting: that upstream's, not ours."""
        return asked is not None and asked > self.retry_after_cap

    def delay(self, drawn: float, asked: float | None = None) -> float:
        """The wait before the next attempt: the ``drawn`` jitter, or the upstream's asked wait if
        longer. A wait over the cap is not waited out: another upstream gets the usual backoff."""
        if asked is None or self.too_long(asked):
            return drawn
        return max(drawn, min(asked, self.retry_after_cap))

    def in_time(self, delay: float, now: float) -> bool:
        """Whether another attempt is left and starts, after ``delay``, by the deadline."""
        return self.more and now + delay <= self.deadline

    def retries_failure(self, retryable: bool, delay: float, now: float) -> bool:
        """Whether a transport failure is tried again after ``delay`` (``retryable``: see ``resend_safe``)."""
        return retryable and self.in_time(delay, now)

    @staticmethod
    def retries_status(status: int) -> bool:
        """Whether a status is a busy or failing upstream's, tried again after a wait."""
        return status in RETRY_STATUSES

    def answer_stands(self, base: str, *, asked: float | None, no_retry: bool) -> bool:
        """Whether a retryable status from ``base`` goes to the client as it is: the upstream said not
        to ask again (``x-should-retry: false``), or asked for a wait over the cap and every upstream
        has failed (re-sending early would count against the key; the client gets the wait)."""
        return no_retry or (self.too_long(asked) and len(self.failed | {base}) >= self.upstreams)

    def marks_spent(self) -> bool:
        """Whether an exhausted retryable status tells SDKs not to retry it (they would multiply our
        retries); with ``max_attempts`` 1 the gateway does not retry: retrying is left to the client."""
        return self.max_attempts > 1

    @staticmethod
    def may_reshape(status: int, *, refold: bool, remap: bool) -> bool:
        """Whether a rejection could be a context overflow (``refold``) or a rejected role (``remap``):
        its error body is read to see."""
        return (status in (400, 413) and refold) or (status == 400 and remap)

    def reshapes_in_time(self, now: float) -> bool:
        """Whether a reshaped body (refolded or renamed, sent at once) may still go out."""
        return self.more and now < self.deadline

    def role_target(self, rejected: str) -> str | None:
        """The ladder: an instruction role the upstream rejects moves to system, then to user."""
        if rejected == "developer" and "system" not in self.roles_tried:
            return "system"
        if rejected in ("developer", "system") and "user" not in self.roles_tried:
            return "user"
        return None


def resend_safe(method: str, *, body_sent: bool) -> bool:
    """Whether a request that failed before its response headers may be sent again.

    Not once the upstream may have the whole request: a non-streamed answer sends no headers
    until it is generated, so re-sending bills it twice. (GET and HEAD are safe.)
    """
    return method in ("GET", "HEAD") or not body_sent


def asked_wait(headers: httpx.Headers) -> float | None:
    """The wait the upstream asked for: ``retry-after-ms`` (OpenAI, Anthropic) or ``Retry-After``."""
    milliseconds = headers.get("retry-after-ms")
    if milliseconds:
        try:
            value = float(milliseconds) / 1000
        except ValueError:
            pass
        else:
            if math.isfinite(value):
                return max(0.0, value)
    return retry_after(headers.get("retry-after"))


# A protobuf Duration in JSON: decimal seconds and an "s" ("37s", "0.500s").
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)s\s*")  # [0-9]: \d is any script's digits


def body_wait(body: bytes) -> float | None:
    """The wait an error body asks for: Google's APIs (Gemini, Vertex AI) send no ``Retry-After`` with
    their 429, and put the wait in ``error.details[]`` as a ``google.rpc.RetryInfo`` (``retryDelay``)."""
    if b"RetryInfo" not in body:  # the common case: nothing to parse
        return None
    try:
        details = loads(body)["error"]["details"]
    except (ValueError, TypeError, KeyError):  # not JSON (JSONDecodeFailure is a ValueError), not Google's
        return None
    for detail in details if isinstance(details, list) else ():
        if isinstance(detail, dict) and str(detail.get("@type", "")).endswith("google.rpc.RetryInfo"):
            match = _DURATION.fullmatch(str(detail.get("retryDelay", "")))
            if match is not None:
                return float(match[1])
    return None


def says_no_retry(headers: httpx.Headers) -> bool:
    """The upstream's own ``x-should-retry: false`` (Anthropic's API sends it)."""
    value: str = headers.get("x-should-retry", "")
    return value.strip().lower() == "false"


def retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delay-seconds or HTTP date), ``None`` if absent or invalid."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # "-0000": HTTP dates are always GMT
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - time.time())
