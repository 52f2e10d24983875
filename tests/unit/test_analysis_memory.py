"""Analysis memory is bounded by what is in flight: spilled rows give the same output as
rows kept in memory, and the peak does not grow with the capture. In this process;
``tracer analyze`` as a process: tests/integration/test_analysis_memory.py."""

from __future__ import annotations

import io
import json
import os
import tempfile
import tracemalloc
from pathlib import Path

import pytest

from tests.support.captures import IN_MEMORY, SMALL, capture, fed
from tracer import events as ev
from tracer.analysis import findings, spill
from tracer.analysis.summary import Summary
from tracer.present import render


def outputs(summary: Summary, *, text: bool) -> dict[str, str]:
    marks = [1000.0 + 7.05]
    out = {"json": io.StringIO(), "md": io.StringIO()}
    render.write_json(summary.result(hang_at=marks, raw_rows=True), out["json"])
    result = summary.result(hang_at=marks)
    render.write_markdown(result, out["md"])
    rendered = {k: v.getvalue() for k, v in out.items()}
    if text:
        rendered["text"] = render.to_text(result)
    return rendered


def test_spilled_rows_give_the_same_output_as_rows_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spilled = Summary(**SMALL)
    kept = Summary(**IN_MEMORY)
    for event in capture(3_000):  # 6k request rows over two taps: 61 spills
        spilled.feed(event)
        kept.feed(event)
    assert spilled.requests.store.spills > 50 and kept.requests.store.spills == 0
    assert spilled.late_events == 0
    monkeypatch.setattr(findings.join, "SPILL_ITEMS", 101)  # the cross-tap join spills too
    a = outputs(spilled, text=False)
    monkeypatch.setattr(findings.join, "SPILL_ITEMS", 10**9)
    b = outputs(kept, text=False)
    assert a == b
    doc = json.loads(a["json"])
    assert doc["totals"]["requests"] == 6_000 - 4  # 4 hung requests never reached "back"
    kinds = [(f["party"], f["kind"]) for f in doc["findings"]]
    (hung,) = [f for f in doc["findings"] if f["kind"] == "proxy_hung_on_reuse"]
    assert hung["party"] == "proxy" and hung["grouped"] == 4  # one finding, 4 requests
    assert len([q for q in hung["requests"] if q.startswith("front/")]) == 4
    assert ("unknown", "engine_error_status") in kinds  # the router's URL is not known
    assert ("engine", "engine_queueing") in kinds  # slow first tokens while busy: a note
    assert doc["verdict"]["party"] == "proxy"


def test_text_tables_rendered_in_chunks_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    spilled, kept = fed(150, **SMALL), fed(150, **IN_MEMORY)  # each result() made anew
    a = outputs(spilled, text=True)
    b = outputs(kept, text=True)
    monkeypatch.setattr(render, "TABLE_CHUNK", 100_000)  # one chunk: all rows at once
    one_table = render.to_text(kept.result(hang_at=[1007.05]))
    monkeypatch.setattr(render, "TABLE_CHUNK", 37)
    assert a == b
    assert a["text"] == one_table
    assert render.to_text(spilled.result(hang_at=[1007.05])) == one_table
    assert a["text"].count("\nfront/") > 150  # rows of both tables: several chunks of 37


def test_chunked_table_is_the_rich_table_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """The widths come from the widest cells alone, overflowing or not, whatever the
    cells hold (markup, emoji codes, wide characters)."""
    import random

    from rich.console import Console

    pick = random.Random(5)
    shapes = ["", "-", "ok", "x" * 40, "[bold]b[/bold]", "a:smile:b", "日本語", "é" * 9]
    for width, spread in ((200, 12), (200, 90), (60, 30)):
        rows = [
            [pick.choice(shapes) + "y" * pick.randrange(spread) for _ in range(6)]
            for _ in range(120)
        ]
        columns = ("a", "bb", "[c]", "d", "e", "f")
        whole = io.StringIO()
        table = render._table("t", columns)
        for cells in rows:
            table.add_row(*cells)
        Console(
            file=whole, width=width, color_system=None, force_terminal=False, highlight=False
        ).print(table)
        monkeypatch.setattr(render, "TABLE_CHUNK", 7)
        chunked = io.StringIO()
        render._write_table(render._console(chunked, width), "t", columns, lambda: iter(rows))
        assert chunked.getvalue() == whole.getvalue(), (width, spread)


def _peak(requests: int) -> int:
    tracemalloc.start()
    try:
        summary = fed(requests, **SMALL)
        with open(os.devnull, "w") as sink:
            render.write_json(summary.result(raw_rows=True), sink)
            render.write_markdown(summary.result(), sink)
        summary.close()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_peak_memory_does_not_grow_with_the_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small bounds, so that both sizes are past the first merges of runs (memory then
    grows only by a few KiB per merge level: with the logarithm of the capture)."""
    monkeypatch.setattr(findings.join, "SPILL_ITEMS", 101)
    monkeypatch.setattr(spill, "FAN_IN", 4)
    monkeypatch.setattr(spill, "READ_BUDGET", 64 * 1024)
    small, large = _peak(600), _peak(1_500)
    assert large < 1.5 * small, f"peak {small / 2**20:.2f} MiB -> {large / 2**20:.2f} MiB"


def test_late_events_are_counted_and_ignored_not_ghost_rows() -> None:
    summary = Summary(recent_rows=2, finished_keys=100)
    events = list(capture(12, hangs=0))
    for event in events:
        summary.feed(event)
    first = next(e for e in events if isinstance(e, ev.ResponseEnd) and e.tap == "front")
    late = ev.Stall(
        t=first.t + 9, m=0, tap="front", conn=first.conn, seq=first.seq, phase="start",
        direction="client_not_reading", silent_for=0.5,
    )  # fmt: skip
    summary.feed(late)
    result = summary.result()
    assert summary.late_events == 1
    assert result["totals"]["requests"] == 24 and result["totals"]["stalls"] == 0
    assert result["totals"]["late_events_ignored"] == 1
    assert "1 events came after" in render.to_text(result)
    # within the recent rows a late event still lands on its row
    recent = Summary(recent_rows=100)
    for event in [*events, late]:
        recent.feed(event)
    assert recent.late_events == 0 and recent.result()["totals"]["stalls"] == 1


def test_spill_files_are_anonymous_and_rows_read_back_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    summary = fed(2_000, **SMALL)
    assert summary.requests.store.spills > 10
    assert list(tmp_path.iterdir()) == []  # unlinked as soon as created
    ids = [r.id for r in summary.requests.values()]
    assert len(ids) == len(summary.requests) == 4_000 - 4  # 4 hung requests: front only
    keys = [(tap, int(c), int(s)) for tap, c, s in (i.split("/") for i in ids)]
    assert keys == sorted(keys)
    rows = dict(summary.requests.items())
    assert rows[("front", 3, 2)].id == "front/3/2"
    assert summary.requests.get(("back", 1, 1)) is not None
    summary.close()
