"""What the heap search's cost grows with: objects that cannot hold the input are passed over a
chunk at a time, not read one by one. Counted (the objects read one by one), never timed.

A test suite enables the probe late in a long run, when its heap is large: pytest's items and
reports, the libraries the suite imported. Each probe reads that heap once; reading each object
in Python made a probe cost seconds per million objects.
"""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from asgi_lifetime.testing import _heap

KEPT: list[Any] = []


def _search(monkeypatch: pytest.MonkeyPatch, needle: str) -> tuple[int, list[str]]:
    """How many objects the search read one by one (``_Search.holds``), and what it named."""
    reads = 0
    holds = _heap._Search.holds

    def counting(self: _heap._Search, obj: object) -> bool | None:
        nonlocal reads
        reads += 1
        return holds(self, obj)

    with monkeypatch.context() as patch:
        patch.setattr(_heap._Search, "holds", counting)
        found = _heap.find_holders(needle)
    return reads, sorted(item.path for item in found)


def test_an_unrelated_heap_is_not_read_object_by_object(monkeypatch: pytest.MonkeyPatch) -> None:
    needle = "lp" + secrets.token_hex(10)
    KEPT.append(needle + " kept " * 100)
    try:
        small_reads, small_found = _search(monkeypatch, needle)
        # 60,000 tracked objects that hold no input: dicts of strings, lists of them, a tuple of atoms.
        heap = [[{"name": f"item-{i}", "tags": ("a", "b")}, f"text {i}" * 3] for i in range(30_000)]
        large_reads, large_found = _search(monkeypatch, needle)
        del heap
    finally:
        KEPT.clear()
    assert small_found == large_found == [f"module {__name__}.KEPT[0]"]
    # Before: every tracked object was read (60,000 more reads); now a few chunks' worth.
    assert large_reads - small_reads < 3_000, (small_reads, large_reads)
