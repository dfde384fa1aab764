from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import prometheus_client.values
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from asgi_lifetime._fingerprint import Fingerprint
from asgi_lifetime._stats import Counters
from asgi_lifetime.gateway import _metrics, _multiprocess
from asgi_lifetime.gateway._bookkeeping import Bookkeeper, Outcome, StoreState, record_outcome
from asgi_lifetime.gateway._metrics import (
    CONTENT_TYPE,
    LATENCY_BUCKETS,
    MULTIPROC_DIR_ENV,
    GatewayMetrics,
    make_metrics_route,
)
from asgi_lifetime.gateway._upstream import AttemptEvent

A = "http://upstream-a:8000"
B_CONFIGURED = "https://user:PASSWORD@upstream-b:9000/v1?api-key=URLKEY"
B = "https://upstream-b:9000/v1"
SESSION = "sess-SESSIONMARKER-1"
PATH = "/v1/chat/completions?key=secret"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def make_outcome(
    *,
    status: int = 200,
    upstream: str | None = A,
    outcome: str = "complete",
    ttfb: float | None = 0.2,
    duration: float = 1.5,
    bytes_out: int = 100,
) -> Outcome:
    return Outcome(
        fingerprint=Fingerprint(wire_hash="ab" * 32, text_comparable=True, size=10),
        session_id=SESSION,
        path=PATH,
        status=status,
        bytes_out=bytes_out,
        attempts=1,
        upstream=upstream,
        started=100.0,
        first_byte_at=None if ttfb is None else 100.0 + ttfb,
        ended=100.0 + duration,
        outcome=outcome,
    )


def parse(body: bytes) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(_metrics.PREFIX + name, frozenset(labels.items()))]


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == _metrics.PREFIX + name}


def lbl(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


def known_counters() -> Counters:
    counters = Counters()
    for field, number in {
        "inflight_requests": 2,
        "inflight_bytes": 4096,
        "retained_input_bytes": 1024,
        "live_resources": 5,
        "pinned_sessions": 1,
        "admitted": 10,
        "rejected": 4,
        "aborted": 1,
        "too_large": 2,
        "timed_out": 3,
        "completed": 6,
        "starved": 1,
        "stalled": 2,
    }.items():
        setattr(counters, field, number)
    return counters


def describe() -> list[dict[str, object]]:
    return [
        {"url": A, "inflight": 1, "down_for": None, "requests": 7, "failures": 0},
        {"url": B_CONFIGURED, "inflight": 0, "down_for": 3.5, "requests": 2, "failures": 1},
    ]


def feed(metrics: GatewayMetrics) -> None:
    """3 x 200 on A, 1 x 502 on B, 1 starved on A; 2 retries, 1 refold, 1 role remap, 1 settled."""
    metrics.record(make_outcome(duration=1.5, bytes_out=100))
    metrics.record(make_outcome(duration=3.0, bytes_out=200))
    metrics.record(make_outcome(duration=20.0, bytes_out=300))
    metrics.record(make_outcome(status=502, upstream=B_CONFIGURED, outcome="upstream_error", ttfb=None, duration=0.05,
                                bytes_out=0))  # fmt: skip
    metrics.record(make_outcome(outcome="starved", ttfb=0.2, duration=700.0, bytes_out=50))
    metrics.on_attempt(AttemptEvent("retry", 1, 502, "status 502", 0.5))
    metrics.on_attempt(AttemptEvent("retry", 2, None, "ConnectError", 1.0))
    metrics.on_attempt(AttemptEvent("refold", 3, 400, "context overflow, window 8192"))
    metrics.on_attempt(AttemptEvent("role", 4, 400, "role 'developer' rejected, sent as 'system'"))
    metrics.on_attempt(AttemptEvent("settled", 4, 200, "status 200"))


def test_known_sequence_renders_exact_values() -> None:
    metrics = GatewayMetrics(stats=known_counters().snapshot, describe_upstreams=describe)
    feed(metrics)
    body, content_type = metrics.render()
    assert content_type == CONTENT_TYPE
    s = parse(body)

    assert series(s, "requests_total") == {
        lbl(status="200", upstream=A, outcome="complete"): 3,
        lbl(status="502", upstream=B, outcome="upstream_error"): 1,
        lbl(status="200", upstream=A, outcome="starved"): 1,
    }
    assert series(s, "attempts_total") == {
        lbl(kind="retry", reason="server_error"): 1,
        lbl(kind="retry", reason="connect"): 1,
        lbl(kind="refold", reason="context_overflow"): 1,
        lbl(kind="role", reason="role_rejected"): 1,
    }
    assert value(s, "response_bytes_total") == 650

    # Histograms: TTFB only where a first byte was sent; the 700 s stream lands in +Inf.
    assert value(s, "time_to_first_byte_seconds_count") == 4
    assert value(s, "time_to_first_byte_seconds_sum") == pytest.approx(0.8)
    assert value(s, "time_to_first_byte_seconds_bucket", le="0.1") == 0
    assert value(s, "time_to_first_byte_seconds_bucket", le="0.25") == 4
    assert value(s, "request_duration_seconds_count") == 5
    assert value(s, "request_duration_seconds_sum") == pytest.approx(724.55)
    expected_buckets = {"0.005": 0, "0.05": 1, "1.0": 1, "2.5": 2, "5.0": 3, "30.0": 4, "600.0": 4, "+Inf": 5}
    for le, count in expected_buckets.items():
        assert value(s, "request_duration_seconds_bucket", le=le) == count, le
    buckets = {dict(labels)["le"] for labels in series(s, "request_duration_seconds_bucket")}
    assert buckets == {str(b) for b in LATENCY_BUCKETS} | {"+Inf"}

    # Live state from the counters, read at scrape time.
    assert value(s, "inflight_requests") == 2
    assert value(s, "inflight_bytes") == 4096
    assert value(s, "retained_input_bytes") == 1024
    assert value(s, "live_resources") == 5
    assert value(s, "pinned_sessions") == 1
    assert value(s, "admitted_total") == 10
    assert value(s, "admission_rejections_total") == 4
    assert value(s, "body_aborted_total") == 1
    assert value(s, "body_too_large_total") == 2
    assert value(s, "body_timed_out_total") == 3
    assert value(s, "completed_total") == 6
    assert value(s, "starvations_total") == 1
    assert value(s, "stalls_total") == 2
    assert series(s, "upstream_inflight") == {lbl(upstream=A): 1, lbl(upstream=B): 0}
    assert series(s, "upstream_down") == {lbl(upstream=A): 0, lbl(upstream=B): 1}
    assert series(s, "upstream_attempts_total") == {lbl(upstream=A): 7, lbl(upstream=B): 2}
    assert series(s, "upstream_failures_total") == {lbl(upstream=A): 0, lbl(upstream=B): 1}


def test_gauges_are_read_at_scrape_time() -> None:
    counters = Counters()
    metrics = GatewayMetrics(stats=counters.snapshot, describe_upstreams=list)
    assert value(parse(metrics.render()[0]), "inflight_requests") == 0
    counters.inflight_requests = 3
    counters.rejected = 2
    s = parse(metrics.render()[0])
    assert value(s, "inflight_requests") == 3
    assert value(s, "admission_rejections_total") == 2


def test_session_store_state_is_read_at_scrape_time() -> None:
    state = StoreState(up=True, fallbacks=0, local_records=0)
    metrics = GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list, session_store=lambda: state)
    s = parse(metrics.render()[0])
    assert (value(s, "session_store_up"), value(s, "session_store_fallbacks_total")) == (1, 0)
    assert value(s, "session_store_local_records_total") == 0
    state = StoreState(up=False, fallbacks=2, local_records=5)
    s = parse(metrics.render()[0])
    assert (value(s, "session_store_up"), value(s, "session_store_fallbacks_total")) == (0, 2)
    assert value(s, "session_store_local_records_total") == 5
    without = parse(GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list).render()[0])
    assert not [name for name, _ in without if "session_store" in name]


def test_retained_body_on_disk_metrics() -> None:
    counters = Counters()
    metrics = GatewayMetrics(stats=counters.snapshot, describe_upstreams=list)
    counters.retained_disk_bytes, counters.spilled, counters.spill_failures = 3 * 1024 * 1024, 4, 1
    s = parse(metrics.render()[0])
    assert value(s, "retained_disk_bytes") == 3 * 1024 * 1024
    assert value(s, "retain_spilled_total") == 4
    assert value(s, "retain_spill_failures_total") == 1


def test_no_session_path_query_or_credentials_in_labels() -> None:
    metrics = GatewayMetrics(stats=known_counters().snapshot, describe_upstreams=describe)
    feed(metrics)
    body = metrics.render()[0]
    text = body.decode()
    for secret in ("SESSIONMARKER", SESSION, "secret", "key=", "/chat/", "PASSWORD", "URLKEY", "user:", "?"):
        assert secret not in text
    label_names: set[str] = set()
    for family in text_string_to_metric_families(text):
        assert family.name.startswith(_metrics.PREFIX)
        for sample in family.samples:
            label_names.update(sample.labels)
    assert label_names <= {"status", "upstream", "outcome", "kind", "reason", "le"}


def test_two_instances_do_not_collide() -> None:
    first = GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)
    second = GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)
    feed(first)
    assert first.registry is not second.registry
    assert series(parse(first.render()[0]), "requests_total")
    assert series(parse(second.render()[0]), "requests_total") == {}
    assert value(parse(second.render()[0]), "response_bytes_total") == 0


def test_uses_a_given_registry() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list, registry=registry)
    metrics.record(make_outcome())
    assert metrics.registry is registry
    assert registry.get_sample_value("asgi_lifetime_requests_total", {"status": "200", "upstream": A,
                                                                        "outcome": "complete"}) == 1  # fmt: skip
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list, registry=registry)


def test_upstream_labels_are_bounded() -> None:
    metrics = GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)
    for i in range(100):
        metrics.record(make_outcome(upstream=f"http://upstream-{i}:8000"))
    metrics.record(make_outcome(upstream=None))
    upstreams = [dict(labels)["upstream"] for labels in series(parse(metrics.render()[0]), "requests_total")]
    assert len(upstreams) == 66
    assert "other" in upstreams
    assert "none" in upstreams


def test_requests_series_are_looked_up_once_per_label_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """prometheus's ``labels()`` validates and sorts on every call: each distinct (status, upstream,
    outcome) is looked up once, and every request is still counted under its own labels."""
    metrics = GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)
    requests = metrics._metrics.requests
    looked_up: list[dict[str, object]] = []
    real = requests.labels

    def counting(*args: object, **kwargs: object) -> object:
        looked_up.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(requests, "labels", counting)
    for _ in range(5):
        metrics.record(make_outcome())
        metrics.record(make_outcome(status=502, upstream=B_CONFIGURED, outcome="upstream_error"))
    metrics.record(make_outcome(outcome="starved"))
    assert len(looked_up) == 3
    assert series(parse(metrics.render()[0]), "requests_total") == {
        lbl(status="200", upstream=A, outcome="complete"): 5,
        lbl(status="502", upstream=B, outcome="upstream_error"): 5,
        lbl(status="200", upstream=A, outcome="starved"): 1,
    }


def test_the_label_set_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_metrics, "_MAX_CHILDREN", 2)
    metrics = GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)
    for status in (200, 201, 202, 203, 200, 203):
        metrics.record(make_outcome(status=status))
    assert len(metrics._children) == 2
    counted = series(parse(metrics.render()[0]), "requests_total")
    assert counted == {
        lbl(status=str(s), upstream=A, outcome="complete"): n for s, n in [(200, 2), (201, 1), (202, 1), (203, 2)]
    }


def test_refused_counts_by_status_and_a_bounded_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_metrics, "_MAX_CHILDREN", 4)
    metrics = GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)
    metrics.refused(401, "invalid_api_key")
    metrics.refused(401, "invalid_api_key")
    metrics.refused(503, "overloaded")
    # Codes outside the fixed set (an app's own errors) are one "other" series per status, however many.
    for n in range(100):
        metrics.refused(400, f"made_up_{n}")
    assert len(metrics._refused_children) == 4
    assert series(parse(metrics.render()[0]), "refused_total") == {
        lbl(status="401", reason="invalid_api_key"): 2,
        lbl(status="503", reason="overloaded"): 1,
        lbl(status="400", reason="other"): 100,
    }


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (AttemptEvent("retry", 1, 429, "status 429"), "rate_limited"),
        (AttemptEvent("retry", 1, 502, "status 502"), "server_error"),
        (AttemptEvent("retry", 1, 503, "status 503"), "server_error"),
        (AttemptEvent("retry", 1, 504, "status 504"), "server_error"),
        (AttemptEvent("retry", 1, 409, "status 409"), "http_error"),
        (AttemptEvent("retry", 1, 200, "re-issued after the upstream produced no output"), "no_output"),
        (AttemptEvent("retry", 1, None, "ConnectError"), "connect"),
        (AttemptEvent("retry", 1, None, "ConnectTimeout"), "connect"),
        (AttemptEvent("retry", 1, None, "ReadTimeout"), "timeout"),
        (AttemptEvent("retry", 1, None, "no response headers within 30s"), "timeout"),
        (AttemptEvent("retry", 1, None, "RemoteProtocolError"), "transport"),
        (AttemptEvent("retry", 1, None, "session sess-123 key=abc went away"), "transport"),
        (AttemptEvent("refold", 2, 400, "context overflow, window 8192"), "context_overflow"),
        (AttemptEvent("role", 2, 400, "role 'developer' rejected, sent as 'system'"), "role_rejected"),
    ],
)
def test_attempt_reason_classes(event: AttemptEvent, reason: str) -> None:
    metrics = GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)
    metrics.on_attempt(event)
    assert series(parse(metrics.render()[0]), "attempts_total") == {lbl(kind=event.kind, reason=reason): 1}


def test_settled_events_are_not_attempts() -> None:
    metrics = GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)
    metrics.on_attempt(AttemptEvent("settled", 3, 200, "status 200"))
    assert series(parse(metrics.render()[0]), "attempts_total") == {}


@pytest.mark.parametrize("interval", [0, -1.0, math.inf, math.nan])
def test_sync_interval_must_be_positive(interval: float) -> None:
    with pytest.raises(ValueError, match="sync_interval"):
        GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list, sync_interval=interval)


@pytest.mark.anyio
async def test_is_a_bookkeeper() -> None:
    metrics = GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)
    assert isinstance(metrics, Bookkeeper)
    await record_outcome(metrics, make_outcome())
    assert value(parse(metrics.render()[0]), "requests_total", status="200", upstream=A, outcome="complete") == 1


@pytest.mark.anyio
async def test_metrics_route() -> None:
    metrics = GatewayMetrics(stats=known_counters().snapshot, describe_upstreams=describe)
    metrics.record(make_outcome())
    app = Starlette(routes=[make_metrics_route(metrics)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://testserver") as client:
        response = await client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"] == CONTENT_TYPE
        s = parse(response.content)
        assert value(s, "inflight_requests") == 2
        assert value(s, "requests_total", status="200", upstream=A, outcome="complete") == 1
        assert (await client.post("/metrics")).status_code == 405


# ---------------------------------------------------------------------------------------------
# Multiprocess mode


@pytest.fixture
def multiproc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A process that started with PROMETHEUS_MULTIPROC_DIR set: prometheus_client then uses its mmap storage."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(directory))
    monkeypatch.setattr(prometheus_client.values, "ValueClass", prometheus_client.values.MultiProcessValue())  # type: ignore[no-untyped-call]
    yield directory
    process = _multiprocess._process
    if process is not None:
        process.sync()
        if process.thread is not None:
            process.wake.set()
            process.thread.join(30)  # generous: a loaded CI machine, not a timing assumption
            assert process.thread is None, "the sync thread outlived its instances"
    prometheus_client.values.close_all_multiprocess_files()  # type: ignore[no-untyped-call]


@pytest.fixture
def make_metrics(multiproc_dir: Path) -> Iterator[Callable[..., GatewayMetrics]]:
    created: list[GatewayMetrics] = []

    def make(counters: Counters, describe_upstreams: Callable[[], list[dict[str, object]]] = list,
             sync_interval: float = 60.0) -> GatewayMetrics:  # fmt: skip
        metrics = GatewayMetrics(
            stats=counters.snapshot, describe_upstreams=describe_upstreams, sync_interval=sync_interval
        )
        created.append(metrics)
        return metrics

    yield make
    for metrics in created:
        metrics.close()


def test_multiprocess_requires_the_variable_before_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="set after prometheus_client was imported"):
        GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)


@pytest.mark.parametrize("directory", ["", "does-not-exist"])
def test_multiprocess_requires_a_directory(directory: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(tmp_path / directory) if directory else "")
    with pytest.raises(ValueError, match=MULTIPROC_DIR_ENV):
        GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)


def test_multiprocess_two_instances_sum(make_metrics: Callable[..., GatewayMetrics], multiproc_dir: Path) -> None:
    counters_a = known_counters()
    counters_b = Counters()
    counters_b.inflight_requests = 3
    counters_b.admitted = 1
    a = make_metrics(counters_a, describe)
    b = make_metrics(counters_b, lambda: [{"url": A, "inflight": 2, "down_for": 1.0, "requests": 4, "failures": 2}])
    assert a.multiprocess and b.multiprocess
    feed(a)
    b.record(make_outcome())
    b.on_attempt(AttemptEvent("retry", 1, 429, "status 429"))

    s = parse(b.render()[0])
    assert {p.name.split("_")[0] for p in multiproc_dir.iterdir()} >= {"counter", "histogram", "gauge"}
    assert series(s, "requests_total") == {
        lbl(status="200", upstream=A, outcome="complete"): 4,
        lbl(status="502", upstream=B, outcome="upstream_error"): 1,
        lbl(status="200", upstream=A, outcome="starved"): 1,
    }
    assert value(s, "attempts_total", kind="retry", reason="rate_limited") == 1
    assert value(s, "attempts_total", kind="retry", reason="server_error") == 1
    assert value(s, "time_to_first_byte_seconds_count") == 5
    assert value(s, "request_duration_seconds_count") == 6
    assert value(s, "request_duration_seconds_bucket", le="+Inf") == 6
    assert value(s, "response_bytes_total") == 750
    assert value(s, "inflight_requests") == 5
    assert value(s, "inflight_bytes") == 4096
    assert value(s, "admitted_total") == 11
    assert value(s, "admission_rejections_total") == 4
    assert value(s, "starvations_total") == 1
    assert series(s, "upstream_inflight") == {lbl(upstream=A): 3, lbl(upstream=B): 0}
    assert series(s, "upstream_down") == {lbl(upstream=A): 1, lbl(upstream=B): 1}  # down if down anywhere
    assert series(s, "upstream_attempts_total") == {lbl(upstream=A): 11, lbl(upstream=B): 2}
    assert series(s, "upstream_failures_total") == {lbl(upstream=A): 2, lbl(upstream=B): 1}
    assert parse(a.render()[0]) == s  # either instance renders the merged view

    # Totals advance by their increase; gauges follow the counters both ways.
    counters_a.admitted += 4
    counters_a.inflight_requests = 0
    s = parse(a.render()[0])
    assert value(s, "admitted_total") == 15
    assert value(s, "inflight_requests") == 3

    # A closed instance leaves the gauges; everything it counted stays.
    counters_b.admitted += 1  # counted between the last copy and close(): still reported
    b.close()
    b.close()
    s = parse(a.render()[0])
    assert value(s, "inflight_requests") == 0
    assert value(s, "admitted_total") == 16
    assert series(s, "upstream_inflight") == {lbl(upstream=A): 1, lbl(upstream=B): 0}
    assert series(s, "upstream_down") == {lbl(upstream=A): 0, lbl(upstream=B): 1}
    assert value(s, "requests_total", status="200", upstream=A, outcome="complete") == 4


def test_multiprocess_refused_sum(make_metrics: Callable[..., GatewayMetrics], multiproc_dir: Path) -> None:
    a = make_metrics(Counters())
    b = make_metrics(Counters())
    a.refused(401, "invalid_api_key")
    b.refused(401, "invalid_api_key")
    b.refused(413, "request_too_large")
    assert {p.name.split("_")[0] for p in multiproc_dir.iterdir()} >= {"counter"}
    s = parse(a.render()[0])
    assert series(s, "refused_total") == {
        lbl(status="401", reason="invalid_api_key"): 2,
        lbl(status="413", reason="request_too_large"): 1,
    }
    b.close()
    assert parse(a.render()[0]) == s  # totals: a closed instance's count stays


def test_multiprocess_session_store_is_up_only_where_every_worker_has_it(multiproc_dir: Path) -> None:
    states = {
        "a": StoreState(up=True, fallbacks=1, local_records=2),
        "b": StoreState(up=False, fallbacks=3, local_records=4),
    }

    def instance(name: str) -> GatewayMetrics:
        return GatewayMetrics(
            stats=Counters().snapshot, describe_upstreams=list, sync_interval=60.0, session_store=lambda: states[name]
        )

    a, b = instance("a"), instance("b")
    try:
        s = parse(a.render()[0])
        assert value(s, "session_store_up") == 0  # one instance on its own memory: not up
        assert value(s, "session_store_fallbacks_total") == 4
        assert value(s, "session_store_local_records_total") == 6
        states["b"] = StoreState(up=True, fallbacks=3, local_records=9)
        s = parse(a.render()[0])
        assert value(s, "session_store_up") == 1
        assert value(s, "session_store_local_records_total") == 11  # counters advance by the increase
        b.close()
        assert value(parse(a.render()[0]), "session_store_fallbacks_total") == 4  # what b counted stays
    finally:
        a.close()
        b.close()


def test_multiprocess_removes_gauges_of_dead_processes(
    make_metrics: Callable[..., GatewayMetrics], multiproc_dir: Path
) -> None:
    counters = Counters()
    counters.inflight_requests = 2
    counters.admitted = 3
    metrics = make_metrics(counters)
    metrics.sync()
    # A worker that crashed: its files are left behind. No process can have this pid (> Linux's 2**22).
    for own in multiproc_dir.glob(f"*_{os.getpid()}.db"):
        shutil.copy(own, own.with_name(own.name.replace(str(os.getpid()), "4194305")))
    assert (multiproc_dir / "gauge_livesum_4194305.db").exists()

    s = parse(metrics.render()[0])
    assert value(s, "inflight_requests") == 2  # the dead worker's gauges are gone...
    assert value(s, "admitted_total") == 6  # ...its totals are not
    assert not (multiproc_dir / "gauge_livesum_4194305.db").exists()
    assert (multiproc_dir / "counter_4194305.db").exists()


_CHILD = textwrap.dedent(
    """
    import os, sys
    from asgi_lifetime.gateway._bookkeeping import Outcome
    from asgi_lifetime._fingerprint import Fingerprint
    from asgi_lifetime.gateway._metrics import GatewayMetrics
    from asgi_lifetime._stats import Counters

    counters = Counters()
    upstreams = [{"url": "http://upstream-a:8000", "inflight": 4, "down_for": 1.0, "requests": 9, "failures": 1}]
    metrics = GatewayMetrics(stats=counters.snapshot, describe_upstreams=lambda: upstreams, sync_interval=0.02)
    fp = Fingerprint(wire_hash="cd" * 32, text_comparable=False, size=5)
    for _ in range(2):
        metrics.record(Outcome(fingerprint=fp, session_id=None, path="/v1/x", status=200, bytes_out=10, attempts=1,
                               upstream="http://upstream-a:8000", started=0.0, first_byte_at=0.1, ended=0.5,
                               outcome="complete"))
    counters.inflight_requests = 4      # left to the sync thread: no explicit sync(), no render()
    counters.admitted = 7
    print("ready", flush=True)
    sys.stdin.read()                    # until the parent closes stdin
    os._exit(0)                         # die without cleaning up, like a killed worker
    """
)


def test_multiprocess_across_processes(make_metrics: Callable[..., GatewayMetrics], multiproc_dir: Path) -> None:
    counters = Counters()
    counters.inflight_requests = 1
    counters.admitted = 1
    metrics = make_metrics(counters, lambda: [{"url": A, "inflight": 1, "down_for": None, "requests": 1,
                                               "failures": 0}])  # fmt: skip
    metrics.record(make_outcome())
    env = {**os.environ, MULTIPROC_DIR_ENV: str(multiproc_dir)}
    with subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline() == "ready\n", child.stderr.read() if child.stderr else ""
            expected = {
                "inflight": 5,
                "admitted": 8,
                "requests": 3,
                "bytes": 120,
                "durations": 3,
                "upstream_inflight": {lbl(upstream=A): 5},
                "upstream_down": {lbl(upstream=A): 1},
                "upstream_attempts": {lbl(upstream=A): 10},
            }

            def observed() -> dict[str, object]:
                s = parse(metrics.render()[0])
                return {
                    "inflight": value(s, "inflight_requests"),
                    "admitted": value(s, "admitted_total"),
                    "requests": value(s, "requests_total", status="200", upstream=A, outcome="complete"),
                    "bytes": value(s, "response_bytes_total"),
                    "durations": value(s, "request_duration_seconds_count"),
                    "upstream_inflight": series(s, "upstream_inflight"),
                    "upstream_down": series(s, "upstream_down"),
                    "upstream_attempts": series(s, "upstream_attempts_total"),
                }

            # The child's sync thread copies its counters one by one, every 20 ms, and its first copy
            # may come between two of the child's assignments: wait for the whole picture, not for
            # one value (a loaded machine showed inflight_requests=5 while admitted_total was still 1).
            deadline = time.monotonic() + 20
            seen = observed()
            while seen != expected and time.monotonic() < deadline:
                time.sleep(0.02)
                seen = observed()
            assert seen == expected
        finally:
            child.stdin.close()  # type: ignore[union-attr]
            child.wait(10)
    assert child.returncode == 0

    s = parse(metrics.render()[0])
    assert value(s, "inflight_requests") == 1  # the dead child's gauges are gone
    assert series(s, "upstream_down") == {lbl(upstream=A): 0}
    assert value(s, "admitted_total") == 8  # its totals stay
    assert value(s, "requests_total", status="200", upstream=A, outcome="complete") == 3


@pytest.mark.parametrize("name", ["gauge_livesum_99999.db", "counter_99999.db", "histogram_99998.db"])
def test_a_scrape_skips_a_file_another_process_is_creating(
    make_metrics: Callable[..., GatewayMetrics], multiproc_dir: Path, name: str
) -> None:
    # Another worker's sync thread opened this file and has not sized it yet (prometheus_client
    # creates it empty, then truncates it to its initial size): the scrape must not fail on it.
    counters = Counters()
    counters.admitted = 2
    metrics = make_metrics(counters)
    (multiproc_dir / name).touch()
    s = parse(metrics.render()[0])
    assert value(s, "admitted_total") == 2
