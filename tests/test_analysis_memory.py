"""Analysis memory is bounded by what is in flight: spilled rows give the same output as
rows kept in memory, and the peak does not grow with the capture."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tracer import events as ev
from tracer.analysis import findings, spill
from tracer.analysis.summary import Summary
from tracer.capture.files import write_all
from tracer.present import render

ROUTER = "http://127.0.0.1:8000"
ENGINE = "http://127.0.0.1:30000/metrics"
TAPS = ("back", "front")  # front: in front of a proxy; back: behind it, before the router
SMALL = {"spill_rows": 97, "recent_rows": 16, "finished_keys": 64, "spill_samples": 16}
IN_MEMORY = {"spill_rows": 10**9, "recent_rows": 10**9, "finished_keys": 10**9}


def capture(requests: int, *, hangs: int = 4) -> Iterator[ev.Event]:
    """Two taps on keep-alive connections of 4 requests; ``hangs`` requests (at most,
    whatever the size) hang on reuse between the taps, a few are slow or fail."""
    t0 = 1000.0
    for tap in TAPS:
        upstream = ROUTER if tap == "back" else "http://127.0.0.1:8001"
        yield ev.CaptureStart(
            t=t0, m=0, tap=tap, tracer_version="t", kind="proxy", upstream=upstream
        )
    hang_at = {requests * (k + 1) // (hangs + 1) // 4 * 4 + 2 for k in range(hangs)}
    for i in range(requests):
        conn, seq, t = i // 4 + 1, i % 4 + 1, t0 + i * 0.1
        rid = f"r{i}" if i % 3 else None  # a third joined by fingerprint and order
        hung = i in hang_at
        slow = i % 997 == 5 and i < 3000
        for k, tap in enumerate(TAPS[::-1]):  # front first
            at = t + 0.002 * k
            if hung and tap == "back":
                continue  # the proxy never forwarded it
            if seq == 1:
                yield ev.ConnOpen(t=at, m=0, tap=tap, conn=conn, peer="127.0.0.1:5", local="x")
            yield ev.RequestHead(
                t=at,
                m=0,
                tap=tap,
                conn=conn,
                seq=seq,
                idle_before=0.05 if seq > 1 else 0.0,
                method="POST",
                target="/v1/chat/completions",
                version="1.1",
                headers=[],
                request_id=rid,
            )
            yield ev.RequestEnd(
                t=at, m=0, tap=tap, conn=conn, seq=seq, complete=True, body_bytes=9,
                body_sha256=f"b{i % 7}",
            )  # fmt: skip
            if hung:
                yield ev.Stall(
                    t=at + 5, m=0, tap=tap, conn=conn, seq=seq, phase="start",
                    direction="upstream_silent", silent_for=5.0,
                )  # fmt: skip
                yield ev.ResponseEnd(
                    t=at + 6, m=0, tap=tap, conn=conn, seq=seq, termination="client_abort",
                    duration=6.0, body_bytes=0,
                )  # fmt: skip
                continue
            ttfb = 2.5 if slow else 0.01
            status = 503 if i % 1999 == 7 else 200
            yield ev.ResponseHead(
                t=at + ttfb, m=0, tap=tap, conn=conn, seq=seq, status=status, reason="",
                version="1.1", headers=[], ttfb=ttfb, sse=status == 200,
            )  # fmt: skip
            if status == 200:
                sse = [[j * 0.002, 60, "content"] for j in range(10)]
                yield ev.BodyData(
                    t=at + ttfb, m=0, tap=tap, conn=conn, seq=seq, size=600, reads=[], sse=sse
                )
            yield ev.ResponseEnd(
                t=at + ttfb + 0.03, m=0, tap=tap, conn=conn, seq=seq, termination="complete",
                status=status, body_bytes=600, duration=ttfb + 0.03, events=10,
                done=status == 200, first_token=ttfb, finish_reason="stop",
            )  # fmt: skip
            if seq == 4:
                yield ev.ConnClose(
                    t=at + 0.05, m=0, tap=tap, conn=conn, closed_by="client", how="fin",
                    in_flight=False, requests=4, bytes_from_client=40, bytes_from_upstream=2400,
                    upstream_opened=True, duration=0.35,
                )  # fmt: skip
        if i % 10 == 0:
            yield ev.EngineSample(
                t=t, m=0, tap="back", url=ENGINE, ok=True, elapsed=0.001, profile="sglang",
                state={"running": 0 if i in hang_at or i - 1 in hang_at else 3, "queued": 0},
                deltas={"generation_tokens_total": 0 if i - 2 in hang_at else 40},
                interval=1.0,
            )  # fmt: skip


def fed(requests: int, **bounds: int) -> Summary:
    summary = Summary(**bounds)
    for event in capture(requests):
        summary.feed(event)
    return summary


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
    for event in capture(15_000):  # 30k request rows over two taps
        spilled.feed(event)
        kept.feed(event)
    assert spilled.requests.store.spills > 100 and kept.requests.store.spills == 0
    assert spilled.late_events == 0
    monkeypatch.setattr(findings.join, "SPILL_ITEMS", 101)  # the cross-tap join spills too
    a = outputs(spilled, text=False)
    monkeypatch.setattr(findings.join, "SPILL_ITEMS", 10**9)
    b = outputs(kept, text=False)
    assert a == b
    doc = json.loads(a["json"])
    assert doc["totals"]["requests"] == 30_000 - 4  # 4 hung requests never reached "back"
    kinds = [(f["party"], f["kind"]) for f in doc["findings"]]
    (hung,) = [f for f in doc["findings"] if f["kind"] == "proxy_hung_on_reuse"]
    assert hung["party"] == "proxy" and hung["grouped"] == 4  # one finding, 4 requests
    assert len([q for q in hung["requests"] if q.startswith("front/")]) == 4
    assert ("unknown", "engine_error_status") in kinds  # the router's URL is not known
    assert ("engine", "engine_queueing") in kinds  # slow first tokens while busy: a note
    assert doc["verdict"]["party"] == "proxy"


def test_text_tables_rendered_in_chunks_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    a = outputs(fed(300, **SMALL), text=True)
    b = outputs(fed(300, **IN_MEMORY), text=True)
    monkeypatch.setattr(render, "TABLE_CHUNK", 100_000)  # one chunk: all rows at once
    one_table = render.to_text(fed(300, **IN_MEMORY).result(hang_at=[1007.05]))
    monkeypatch.setattr(render, "TABLE_CHUNK", 37)
    assert a == b
    assert a["text"] == one_table
    assert render.to_text(fed(300, **SMALL).result(hang_at=[1007.05])) == one_table
    assert a["text"].count("\nfront/") > 300  # rows of both tables


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
    small, large = _peak(1_000), _peak(4_000)
    assert large < 1.5 * small, f"peak {small / 2**20:.1f} MiB -> {large / 2**20:.1f} MiB"


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


def test_cli_analyze_spills_and_matches_the_in_memory_result(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    write_all(path, list(capture(3_000)))  # more rows than the default spill threshold
    done = subprocess.run(
        [sys.executable, "-m", "tracer", "analyze", str(path), "--format", "json"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    expected = io.StringIO()
    summary = fed(3_000, **IN_MEMORY)
    result: dict[str, Any] = summary.result(
        captures=[{"path": path.name, "records": summary.events, "bad_lines": 0,
                   "torn_tail": False, "bodies_unresolved": 0,
                   "version": ev.CAPTURE_VERSION}],
        raw_rows=True,
    )  # fmt: skip
    render.write_json(result, expected)
    assert done.stdout.decode() == expected.getvalue()


def test_cli_analyze_stops_quietly_when_its_reader_goes_away(tmp_path: Path) -> None:
    """`tracer analyze … | head`: a closed pipe ends it with 141 (SIGPIPE), no traceback."""
    path = tmp_path / "big.jsonl"
    write_all(path, list(capture(3_000)))  # far more JSON than a pipe holds
    with subprocess.Popen(
        [sys.executable, "-m", "tracer", "analyze", str(path), "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.read(100).startswith(b"{")
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 141 and b"Traceback" not in err
