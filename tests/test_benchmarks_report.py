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


@pytest.mark.parametrize("recorded", [None, "same"], ids=["stored-run", "same-transport-run"])
def test_the_bare_forwarder_rows_name_its_transport(recorded: str | None) -> None:
    """Section 3 and the targets compare the gateway with the bare forwarder on the same transport
    once run.py records it; older results keep saying httpx's own transport."""
    import json

    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    results["overhead"].pop("bare_transport", None)
    if recorded is not None:
        results["overhead"]["bare_transport"] = recorded
    lines: list[str] = []
    report._overhead(results, lines.append)
    section = "\n".join(lines)
    assert ("on the same transport (the gateway's aiohttp)" in section) == (recorded == "same")
    assert report._bare_transport(results).startswith("on the same transport" if recorded else "it sends over httpx")


def test_the_bare_forwarder_sends_over_the_gateways_transport() -> None:
    from asgi_lifetime.gateway._transport import UpstreamTransport
    from benchmarks.bare_forwarder import BareForwarder

    same = BareForwarder("http://127.0.0.1:9")
    plain = BareForwarder("http://127.0.0.1:9", transport="httpx")
    assert isinstance(same.client._transport, UpstreamTransport)
    assert not isinstance(plain.client._transport, UpstreamTransport)
