"""Prometheus metrics for the gateway: ``GatewayMetrics`` and the ``GET /metrics`` route.

Two sources feed the metrics (docs/metrics.md lists them all):

- **Per request**, from the ``Outcome`` scalars handed to ``GatewayMetrics.record`` (it is a
  bookkeeper) and from the upstream client's ``AttemptEvent``\\ s (``on_attempt`` is a
  listener): requests by status, upstream and outcome, time to first byte and duration
  histograms, response bytes, extra attempts by kind and reason class; and, from ``refused``
  (the gateway's ``Refusals`` calls it), requests refused before reaching the forwarder.
- **Live state**, read from the gateway's own ``Counters`` and ``UpstreamClient.describe()``:
  the gauges (in-flight requests and bytes, retained input, live resources, pinned
  sessions, per-upstream in flight and cool-off) and the totals the middleware already
  counts (admitted, admission rejections, aborted / too large / timed-out bodies,
  starvations, stalls). Nothing is counted twice: those numbers have one owner, ``Counters``.

Labels are bounded by construction: ``status`` is the exact status code, ``upstream`` the
configured base URL without user info or query (at most 64 distinct values, then
``other``), ``outcome`` one of ``OUTCOMES``, ``kind`` and ``reason`` fixed sets (a refusal's
error code outside ``REFUSAL_REASONS`` is ``other``). Never the
path, the session id, a key or a body.

**One process** (``PROMETHEUS_MULTIPROC_DIR`` not set): each ``GatewayMetrics`` has its own
``CollectorRegistry`` (not the global one, so several apps or tests in one process do not
collide). The live state is read at scrape time by a custom collector in that registry.

**Several workers** (``uvicorn --workers N``; ``PROMETHEUS_MULTIPROC_DIR`` set): a scrape
reaches one worker, and a custom collector can only see the worker it runs in. So in this
mode every value goes through prometheus_client's multiprocess files, which the scraped
worker merges with ``MultiProcessCollector`` (over a registry of its own):

- Per-request metrics are ordinary ``Counter`` / ``Histogram`` objects; their values are
  written to the worker's file as they change, and summed over all workers, past ones
  included (counter semantics).
- The live state is *mirrored*: each worker copies its ``Counters`` into ``Gauge``\\ s with
  ``multiprocess_mode="livesum"`` (summed over live workers; ``livemax`` for
  ``upstream_down``: down if any worker has it cooling off) and advances ``Counter``\\ s by
  the increase of each total since the last copy. The copy runs in a daemon thread every
  ``sync_interval`` seconds (a worker's gauges must track it even when it is never the one
  scraped, and must drop to 0 when it goes idle), before every render in the scraped
  worker, and at ``close()`` / garbage collection / interpreter exit (final totals; gauges
  back to 0). Reading plain ints from another thread is safe; a copy may mix values from
  both sides of one event-loop step, which is within a scrape's precision anyway.
- A worker that dies without exiting cleanly leaves its ``live*`` gauge file behind; before
  rendering, the scraped worker removes the files of processes that no longer exist
  (``mark_process_dead``; POSIX only). Its totals stay, as they should.
- Metric objects belong to the process, not to an instance (the files are per process, so
  two instances' objects would overwrite each other's values); several ``GatewayMetrics``
  in one worker share them, and the gauges are the sum over the worker's instances.

Requirements of that mode, as for any prometheus_client multiprocess setup: the directory
must exist, be set in the environment before the process starts (prometheus_client picks
its value storage when it is imported; ``GatewayMetrics`` raises ``ValueError`` if the
variable appeared later), and be emptied before the server starts (files of a previous
run would be added to this one's totals)::

    rm -rf /run/asgi-lifetime-metrics && mkdir -p /run/asgi-lifetime-metrics
    PROMETHEUS_MULTIPROC_DIR=/run/asgi-lifetime-metrics uvicorn --workers 4 --factory asgi_lifetime.gateway:create_app
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import anyio.to_thread
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import values as _prometheus_values
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .._settings import check_argument, positive
from .._stats import SHED_REASONS, LifetimeStats
from ._access_log import public_url
from ._bookkeeping import OUTCOMES, Outcome, StoreState
from ._upstream import AttemptEvent

if TYPE_CHECKING:
    from ._multiprocess import Process

__all__ = [
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "MULTIPROC_DIR_ENV",
    "PREFIX",
    "QUEUE_BUCKETS",
    "REFUSAL_REASONS",
    "GatewayMetrics",
    "make_metrics_route",
    "multiproc_directory_problem",
]

logger = logging.getLogger(__name__)

PREFIX: Final = "asgi_lifetime_"
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text format that ``generate_latest`` writes."""
MULTIPROC_DIR_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
LATENCY_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
"""Histogram buckets in seconds, 5 ms to 10 min: a cached short answer up to a long agent stream."""

_MAX_UPSTREAM_LABELS: Final = 64
_OVERFLOW_LABEL: Final = "other"
_NO_UPSTREAM_LABEL: Final = "none"

# The retained outbound body on disk (RETAIN_OUTBOUND=disk, gateway/_spill.py); part of the tuples below.
_RETAIN_GAUGES: Final = (
    ("retained_disk_bytes", "retained_disk_bytes", "Retained outbound body bytes held in temporary files, not in RAM."),
)
_RETAIN_TOTALS: Final = (
    ("retain_spilled", "spilled", "Retained outbound bodies moved to a temporary file."),
    ("retain_spill_failures", "spill_failures", "Retained bodies kept in memory because writing them to disk failed."),
)

# (metric name without prefix, Counters field, help). Read at scrape time, or mirrored.
_GAUGES: Final = (
    ("inflight_requests", "inflight_requests", "Requests admitted and not yet settled."),
    ("inflight_bytes", "inflight_bytes", "Bytes of the admission byte budget held by in-flight requests."),
    ("queued_requests", "queued_requests", "Requests waiting for an admission slot."),
    ("retained_input_bytes", "retained_input_bytes", "Request input bytes held right now (raw and outbound bodies)."),
    ("live_resources", "live_resources", "Per-request resources acquired and not yet released."),
    ("pinned_sessions", "pinned_sessions", "Session pins held by in-flight requests."),
    *_RETAIN_GAUGES,
)  # fmt: skip
_TOTALS: Final = (
    ("admitted", "admitted", "Requests admitted."),
    ("admission_rejections", "rejected", "Requests rejected by admission (busy or shutting down: 503)."),
    ("body_aborted", "aborted", "Requests whose client went away before the body was read."),
    ("body_too_large", "too_large", "Requests refused because the body exceeded the size limit (413)."),
    ("body_timed_out", "timed_out", "Requests whose body stopped arriving or took longer than BODY_TIMEOUT (408)."),
    ("completed", "completed", "Requests the wrapped app finished handling."),
    ("starvations", "starved", "Upstream streams that ended with no output or no terminal event (re-issued or not)."),
    ("stalls", "stalled", "Upstream streams that sent nothing for the stall timeout."),
    *_RETAIN_TOTALS,
)  # fmt: skip
# The session store (``SESSION_STORE``): (name without prefix, help).
_STORE_UP: Final = (
    "session_store_up",
    "1 while sessions are kept in the configured store, 0 on this process's memory.",
)
_STORE_FALLBACKS: Final = ("session_store_fallbacks", "Times bookkeeping fell back from the session store to memory.")
_STORE_LOCAL: Final = (
    "session_store_local_records",
    "Records decided in this process's memory in place of the session store.",
)
_SHED: Final = (
    "admission_shed",
    "Requests admission turned away (503 with Retry-After), by reason: standing_queue (refused at once: the "
    "queue was not draining), timeout (waited ADMISSION_TIMEOUT), draining (shutting down), budget_deadlock.",
)
"""Labelled by ``reason``, one ``Counters`` total per reason (``SHED_REASONS``); they add up to ``rejected``."""
_UPSTREAM_INFLIGHT: Final = ("upstream_inflight", "Attempts in flight on the upstream.")
_UPSTREAM_DOWN: Final = ("upstream_down", "1 while the upstream is cooling off after a failed connect, else 0.")
_UPSTREAM_ATTEMPTS: Final = ("upstream_attempts", "Attempts sent to the upstream.")
_UPSTREAM_FAILURES: Final = ("upstream_failures", "Failures that put the upstream into cool-off.")

_REQUESTS: Final = ("requests", "Forwarded requests by final status, upstream and outcome.")
_REFUSED: Final = (
    "refused",
    "Requests answered with an error before reaching the forwarder (bad gateway key, body refused, "
    "admission shed), by status and reason (the error code).",
)
REFUSAL_REASONS: Final = frozenset(
    {
        # 401 (GatewayAuth)
        "invalid_api_key",
        # 400 (framing, encoding, Content-Type; LifetimeMiddleware and _body)
        "malformed_body",
        "malformed_encoding",
        "content_length_mismatch",
        "invalid_content_length",
        "conflicting_framing",
        "invalid_transfer_encoding",
        "conflicting_content_type",
        "unexpected_message",
        "unsupported_http_version",
        # 400 (RequestHead: a head that cannot be forwarded, a session id refused)
        "invalid_path",
        "invalid_header",
        "conflicting_session_id",
        "session_id_too_long",
        # 408, 413, 415
        "request_timeout",
        "request_body_timeout",
        "request_too_large",
        "body_too_complex",
        "unsupported_encoding",
        # 503 (admission, whatever the reason: admission_shed_total says which)
        "overloaded",
    }
)
"""The ``reason`` label values of ``refused_total`` (besides ``other``): the error codes a refusal carries."""
_ATTEMPTS: Final = ("attempts", "Extra upstream attempts by kind (retry, refold, role) and reason class.")
_RESPONSE_BYTES: Final = ("response_bytes", "Response body bytes sent to clients.")
_TTFB: Final = ("time_to_first_byte_seconds", "Seconds from admission to the first response body byte.")
_DURATION: Final = ("request_duration_seconds", "Seconds from admission to the end of the response.")
_QUEUE: Final = ("admission_queue_seconds", "Seconds each admitted request waited for its slot (0: admitted at once).")
QUEUE_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
"""Histogram buckets of ``admission_queue_seconds``: around a target delay of tens of ms, up to a long timeout."""

_ATTEMPT_KINDS: Final = frozenset({"retry", "refold", "role"})
_MAX_CHILDREN: Final = 1024


def _status_label(status: int) -> str:
    return str(status) if 0 <= status <= 999 else _OVERFLOW_LABEL


def _reason_class(event: AttemptEvent) -> str:
    """A fixed-set class for an attempt's free-text reason."""
    if event.kind == "refold":
        return "context_overflow"
    if event.kind == "role":
        return "role_rejected"
    status = event.status
    if status is not None:
        if 200 <= status < 300:
            return "no_output"  # a re-issue after a starved stream
        if status == 429:
            return "rate_limited"
        return "server_error" if status >= 500 else "http_error"
    reason = event.reason.lower()
    if "connect" in reason:
        return "connect"
    if "timeout" in reason or "no response headers" in reason:
        return "timeout"
    return "transport"


class _UpstreamLabels:
    """Base URL -> label: credentials and query removed, at most ``_MAX_UPSTREAM_LABELS`` values."""

    __slots__ = ("_cache", "_labels", "_lock")

    def __init__(self) -> None:
        self._cache: dict[str, str] = {}
        self._labels: set[str] = set()
        self._lock = threading.Lock()  # the multiprocess sync thread labels too

    def __call__(self, url: str | None) -> str:
        if url is None:
            return _NO_UPSTREAM_LABEL
        label = self._cache.get(url)
        if label is not None:
            return label
        label = public_url(url)
        with self._lock:
            if label not in self._labels:
                if len(self._labels) >= _MAX_UPSTREAM_LABELS:
                    return _OVERFLOW_LABEL
                self._labels.add(label)
            if len(self._cache) < 4 * _MAX_UPSTREAM_LABELS:
                self._cache[url] = label
        return label


@dataclass(slots=True)
class _UpstreamView:
    inflight: int = 0
    down: bool = False
    attempts: int = 0
    failures: int = 0


def _int(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _upstream_views(
    describe: Callable[[], list[dict[str, object]]], labels: _UpstreamLabels
) -> dict[str, _UpstreamView]:
    """``describe()`` summed per label (two URLs may differ only in what the label drops)."""
    views: dict[str, _UpstreamView] = {}
    for item in describe():
        url = item.get("url")
        if not isinstance(url, str):
            continue
        view = views.setdefault(labels(url), _UpstreamView())
        view.inflight += _int(item.get("inflight"))
        view.down = view.down or item.get("down_for") is not None
        view.attempts += _int(item.get("requests"))
        view.failures += _int(item.get("failures"))
    return views


class _RequestMetrics:
    """The metrics fed by ``record`` and ``on_attempt``."""

    __slots__ = ("requests", "refused", "attempts", "response_bytes", "ttfb", "duration", "queue")

    def __init__(self, registry: CollectorRegistry | None) -> None:
        name, doc = _REQUESTS
        self.requests = Counter(PREFIX + name, doc, ["status", "upstream", "outcome"], registry=registry)
        name, doc = _REFUSED
        self.refused = Counter(PREFIX + name, doc, ["status", "reason"], registry=registry)
        name, doc = _ATTEMPTS
        self.attempts = Counter(PREFIX + name, doc, ["kind", "reason"], registry=registry)
        name, doc = _RESPONSE_BYTES
        self.response_bytes = Counter(PREFIX + name, doc, registry=registry)
        name, doc = _TTFB
        self.ttfb = Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, registry=registry)
        name, doc = _DURATION
        self.duration = Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, registry=registry)
        name, doc = _QUEUE
        self.queue = Histogram(PREFIX + name, doc, buckets=QUEUE_BUCKETS, registry=registry)


def _store_families(state: StoreState | None) -> Iterator[Metric]:
    yield GaugeMetricFamily(PREFIX + _STORE_UP[0], _STORE_UP[1], value=None if state is None else int(state.up))
    for (name, doc), value in ((_STORE_FALLBACKS, "fallbacks"), (_STORE_LOCAL, "local_records")):
        yield CounterMetricFamily(PREFIX + name, doc, value=None if state is None else getattr(state, value))


class _LiveStateCollector:
    """One process: the live state read from ``stats()``, ``describe()`` and the store at scrape time."""

    def __init__(
        self,
        stats: Callable[[], LifetimeStats],
        describe_upstreams: Callable[[], list[dict[str, object]]],
        labels: _UpstreamLabels,
        session_store: Callable[[], StoreState] | None,
    ) -> None:
        self._stats = stats
        self._describe = describe_upstreams
        self._labels = labels
        self._store = session_store

    def describe(self) -> Iterable[Metric]:
        yield from self._families(None, {})
        if self._store is not None:
            yield from _store_families(None)

    def collect(self) -> Iterable[Metric]:
        yield from self._families(self._stats(), _upstream_views(self._describe, self._labels))
        if self._store is not None:
            yield from _store_families(self._store())

    @staticmethod
    def _families(stats: LifetimeStats | None, views: dict[str, _UpstreamView]) -> Iterator[Metric]:
        for name, field, doc in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=None if stats is None else getattr(stats, field))
        for name, field, doc in _TOTALS:
            yield CounterMetricFamily(PREFIX + name, doc, value=None if stats is None else getattr(stats, field))
        shed = CounterMetricFamily(PREFIX + _SHED[0], _SHED[1], labels=["reason"])
        if stats is not None:
            for reason, field in SHED_REASONS.items():
                shed.add_metric([reason], getattr(stats, field))
        yield shed
        inflight = GaugeMetricFamily(PREFIX + _UPSTREAM_INFLIGHT[0], _UPSTREAM_INFLIGHT[1], labels=["upstream"])
        down = GaugeMetricFamily(PREFIX + _UPSTREAM_DOWN[0], _UPSTREAM_DOWN[1], labels=["upstream"])
        attempts = CounterMetricFamily(PREFIX + _UPSTREAM_ATTEMPTS[0], _UPSTREAM_ATTEMPTS[1], labels=["upstream"])
        failures = CounterMetricFamily(PREFIX + _UPSTREAM_FAILURES[0], _UPSTREAM_FAILURES[1], labels=["upstream"])
        for label, view in sorted(views.items()):
            inflight.add_metric([label], view.inflight)
            down.add_metric([label], 1 if view.down else 0)
            attempts.add_metric([label], view.attempts)
            failures.add_metric([label], view.failures)
        yield from (inflight, down, attempts, failures)


def multiproc_directory_problem(directory: str) -> str | None:
    """Why ``directory`` cannot hold the multiprocess files, or ``None``.

    Writable is tried, not inferred from its mode (root ignores the mode, a read-only mount does not):
    every worker would otherwise fail on its first metric file, and uvicorn's supervisor restarts
    a worker that fails at startup, for ever.
    """
    if not directory or not os.path.isdir(directory):
        return f"{MULTIPROC_DIR_ENV} must name an existing directory, got {directory!r}"
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return f"{MULTIPROC_DIR_ENV}={directory!r} is not a directory this process can write to ({exc.strerror})"
    return None


class GatewayMetrics:
    """Prometheus metrics for the gateway; a bookkeeper and an attempt listener.

    ```python
    metrics = GatewayMetrics(stats=lifetime.stats, describe_upstreams=upstream.describe)
    upstream = UpstreamClient(settings=settings, lifetime=lifetime, listener=metrics.on_attempt)
    await record_outcome(metrics, outcome)          # at the end of each response
    app.routes.append(make_metrics_route(metrics))  # GET /metrics
    ```

    ``registry``: where the metrics are registered (default: a new ``CollectorRegistry`` of
    this instance). With ``PROMETHEUS_MULTIPROC_DIR`` set it gets a ``MultiProcessCollector``
    instead (see the module docstring), and ``sync_interval`` is how often, in seconds, this
    worker copies its counters to the shared files. ``session_store``: the session book's
    ``store_state`` (``create_app`` passes it), for the ``session_store_*`` metrics.
    """

    def __init__(
        self,
        *,
        stats: Callable[[], LifetimeStats],
        describe_upstreams: Callable[[], list[dict[str, object]]],
        registry: CollectorRegistry | None = None,
        sync_interval: float = 1.0,
        session_store: Callable[[], StoreState] | None = None,
    ) -> None:
        check_argument("sync_interval", sync_interval, positive)
        self._stats = stats
        self._describe = describe_upstreams
        # The ``requests`` child per (status, upstream, outcome) as the outcome gives them: prometheus's
        # ``labels()`` validates, sorts and builds a tuple on every call, a cost per request.
        self._children: dict[tuple[int, str | None, str], Counter] = {}
        self._refused_children: dict[tuple[int, str], Counter] = {}  # the same, for ``refused``
        self.registry = registry if registry is not None else CollectorRegistry()
        """The registry ``render`` exposes."""
        directory = os.environ.get(MULTIPROC_DIR_ENV)
        if directory is None:
            self._process: Process | None = None
            self._directory = ""
            self._labels = _UpstreamLabels()
            self._metrics = _RequestMetrics(self.registry)
            self.registry.register(_LiveStateCollector(stats, describe_upstreams, self._labels, session_store))
            return
        problem = multiproc_directory_problem(directory)
        if problem is not None:
            raise ValueError(problem)
        if _prometheus_values.ValueClass is _prometheus_values.MutexValue:
            raise ValueError(
                f"{MULTIPROC_DIR_ENV}={directory!r} was set after prometheus_client was imported, which then "
                "chose single-process storage; set it in the environment before the process starts"
            )
        from . import _multiprocess  # only this mode needs it (and registers its fork hook)

        process = _multiprocess.process_for(directory)
        self._process = process
        self._directory = directory
        self._labels = process.labels
        self._metrics = process.metrics
        _multiprocess.SharedFilesCollector(self.registry, directory)
        source = _multiprocess.Source(stats, describe_upstreams, session_store)
        process.add(source, float(sync_interval))
        # Final totals and gauges out at close(), garbage collection or interpreter exit.
        self._finalizer = weakref.finalize(self, _multiprocess.retire, process, source)

    @property
    def multiprocess(self) -> bool:
        """True when the metrics are shared through ``PROMETHEUS_MULTIPROC_DIR``."""
        return self._process is not None

    def record(self, outcome: Outcome) -> None:
        """Count one finished request (a ``Bookkeeper``)."""
        metrics = self._metrics
        self._requests(outcome.status, outcome.upstream, outcome.outcome).inc()
        if outcome.bytes_out > 0:
            metrics.response_bytes.inc(outcome.bytes_out)
        ttfb = outcome.ttfb
        if ttfb is not None:
            metrics.ttfb.observe(max(0.0, ttfb))
        metrics.duration.observe(max(0.0, outcome.duration))
        if self._process is not None:
            self._process.ensure_thread()

    def _requests(self, status: int, upstream: str | None, outcome: str) -> Counter:
        """The ``requests`` child for these values, looked up once per distinct triple."""
        key = (status, upstream, outcome)
        child = self._children.get(key)
        if child is None:
            child = self._metrics.requests.labels(
                status=_status_label(status),
                upstream=self._labels(upstream),
                outcome=outcome if outcome in OUTCOMES else "error",
            )
            # Bounded: the labels are (statuses x 65 upstream labels x 7 outcomes); past this many
            # triples the child is looked up each time, as before.
            if len(self._children) < _MAX_CHILDREN:
                self._children[key] = child
        return child

    def refused(self, status: int, code: str) -> None:
        """Count one request refused before it reached the forwarder (the error's status and code)."""
        key = (status, code)
        child = self._refused_children.get(key)
        if child is None:
            reason = code if code in REFUSAL_REASONS else _OVERFLOW_LABEL
            child = self._metrics.refused.labels(status=_status_label(status), reason=reason)
            if len(self._refused_children) < _MAX_CHILDREN:  # codes of the caller's own errors: still bounded
                self._refused_children[key] = child
        child.inc()
        if self._process is not None:
            self._process.ensure_thread()

    def on_admission_wait(self, seconds: float) -> None:
        """Observe one admitted request's wait for its slot (an ``Admission.on_admitted`` listener)."""
        self._metrics.queue.observe(max(0.0, seconds))

    def on_attempt(self, event: AttemptEvent) -> None:
        """Count a retry, refold or role remap (an ``UpstreamClient`` listener); ``settled`` is ignored."""
        if event.kind in _ATTEMPT_KINDS:
            self._metrics.attempts.labels(kind=event.kind, reason=_reason_class(event)).inc()

    def sync(self) -> None:
        """Copy this process's counters to the multiprocess files now (no-op in one process)."""
        if self._process is not None:
            self._process.sync()

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of the Prometheus text exposition, for ``GET /metrics``."""
        if self._process is not None:
            self._process.ensure_thread()
            self._process.sync()
            self._process.remove_dead()
        return generate_latest(self.registry), CONTENT_TYPE

    def close(self) -> None:
        """Multiprocess: copy the final totals and take this instance out of the gauges. Idempotent."""
        if self._process is not None:
            self._finalizer()


def make_metrics_route(metrics: GatewayMetrics, *, path: str = "/metrics") -> Route:
    """A Starlette ``Route`` serving ``metrics.render()`` on ``GET path``.

    In multiprocess mode rendering reads every worker's file, so it runs in a worker thread.
    """

    async def endpoint(request: Request) -> Response:
        if metrics.multiprocess:
            body, content_type = await anyio.to_thread.run_sync(metrics.render)
        else:
            body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return Route(path, endpoint, methods=["GET"], name="metrics")
