"""Live counters and their immutable snapshot.

One ``Counters`` object belongs to one running middleware/gateway. Gauges go up when
something is acquired and down when it is released; tests, ``/lifetime/stats`` and the
metrics endpoint read a ``LifetimeStats`` snapshot. Between requests every gauge is 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["SHED_REASONS", "Counters", "LifetimeStats"]

SHED_REASONS = {
    "standing_queue": "shed_standing_queue",
    "timeout": "shed_timeout",
    "draining": "shed_draining",
    "budget_deadlock": "shed_budget_deadlock",
}
"""Why admission turned a request away (503), and the total that counts it: the queue was standing
(refused at once), waited ``ADMISSION_TIMEOUT``, shutting down, or the byte budget deadlocked."""


@dataclass(frozen=True, slots=True)
class LifetimeStats:
    """A point-in-time snapshot of the live counters."""

    # Gauges: what is held (or waiting for admission) right now.
    inflight_requests: int = 0
    inflight_bytes: int = 0
    queued_requests: int = 0
    retained_input_bytes: int = 0
    live_resources: int = 0
    pinned_sessions: int = 0
    # The retained outbound body on disk (RETAIN_OUTBOUND=disk): bytes in temporary files, not in RAM.
    retained_disk_bytes: int = 0
    # Totals since start.
    admitted: int = 0
    rejected: int = 0
    shed_standing_queue: int = 0
    shed_timeout: int = 0
    shed_draining: int = 0
    shed_budget_deadlock: int = 0
    aborted: int = 0
    too_large: int = 0
    timed_out: int = 0
    completed: int = 0
    retried: int = 0
    refolded: int = 0
    starved: int = 0
    stalled: int = 0
    spilled: int = 0  # retained bodies written to disk
    spill_failures: int = 0  # retained bodies kept in memory because writing them to disk failed

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @property
    def idle(self) -> bool:
        """True when nothing is held or waiting (every one of ``GAUGES`` is 0): no request (admitted or
        queued), bytes, retained input (in memory or on disk), resource or pin."""
        return not any(getattr(self, gauge) for gauge in GAUGES)


GAUGES = (
    "inflight_requests",
    "inflight_bytes",
    "queued_requests",
    "retained_input_bytes",
    "live_resources",
    "pinned_sessions",
    "retained_disk_bytes",
)
"""The gauges: what is held right now. Between requests each is 0."""

_FIELDS = tuple(f.name for f in dataclasses.fields(LifetimeStats))


class Counters:
    """Mutable counters. Only touched from the event loop thread, so plain ints suffice."""

    __slots__ = _FIELDS

    inflight_requests: int
    inflight_bytes: int
    queued_requests: int
    retained_input_bytes: int
    live_resources: int
    pinned_sessions: int
    retained_disk_bytes: int
    admitted: int
    rejected: int
    shed_standing_queue: int
    shed_timeout: int
    shed_draining: int
    shed_budget_deadlock: int
    aborted: int
    too_large: int
    timed_out: int
    completed: int
    retried: int
    refolded: int
    starved: int
    stalled: int
    spilled: int
    spill_failures: int

    def __init__(self) -> None:
        for name in _FIELDS:
            setattr(self, name, 0)

    def snapshot(self) -> LifetimeStats:
        return LifetimeStats(**{name: getattr(self, name) for name in _FIELDS})
