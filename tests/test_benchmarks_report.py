"""``python -m benchmarks.run --report-only`` writes the page from the stored results, with or
without matplotlib (the ``bench`` extra): without it every plot is skipped with a note."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks import report, run

ROOT = Path(__file__).resolve().parent.parent
PLOTS = (
    "benchmarks_memory_timeline.png",
    "benchmarks_answer_length.png",
    "benchmarks_steady_state.png",
    "benchmarks_agents.png",
)


@pytest.mark.parametrize("drawn_before", [False, True], ids=["no-earlier-plots", "earlier-plots"])
def test_report_only_without_matplotlib_writes_the_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drawn_before: bool
) -> None:
    monkeypatch.setattr(report, "_have_matplotlib", lambda: False)
    shutil.copy(ROOT / "benchmarks" / "results.json", tmp_path / "benchmarks.json")  # the stored full run
    if drawn_before:
        for name in PLOTS:
            (tmp_path / name).write_bytes(b"an earlier run's plot")

    assert run.main(["--report-only", "--out", str(tmp_path)]) == 0

    page = (tmp_path / "benchmarks.md").read_text()
    assert "## Targets" in page and "## 10. Many agents" in page
    assert page.count("*Plot not drawn (") == len(PLOTS)  # one note per plot the stored results have
    assert page.count("drawn by an earlier run") == (len(PLOTS) if drawn_before else 0)
    for name in PLOTS:
        # An earlier plot is still shown (and left as it was); no plot, no dangling link.
        assert (f"]({name})" in page) == drawn_before
        assert (tmp_path / name).exists() == drawn_before
