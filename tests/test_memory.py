"""trim_after_large_request: a guarded malloc_trim for large requests."""

from __future__ import annotations

import sys

import pytest

from asgi_lifetime import _memory


def test_small_requests_are_not_trimmed() -> None:
    assert _memory.trim_after_large_request(_memory.TRIM_THRESHOLD - 1) is False
    assert _memory.trim_after_large_request(0) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_large_requests_are_trimmed_on_glibc() -> None:
    if _memory._malloc_trim is None:
        pytest.skip("not glibc")
    assert _memory.trim_after_large_request(_memory.TRIM_THRESHOLD) is True


def test_without_malloc_trim_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_memory, "_malloc_trim", None)
    assert _memory.trim_after_large_request(1 << 40) is False


def test_a_failing_trim_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(pad: int) -> int:
        raise OSError("no")

    monkeypatch.setattr(_memory, "_malloc_trim", broken)
    assert _memory.trim_after_large_request(1 << 40) is False
