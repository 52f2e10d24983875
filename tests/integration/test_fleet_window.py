"""`tracer analyze FOLDER --since --until` over two taps' rotated captures, as a user runs
it: the segments that hold the window are read, a request across a boundary is whole, a
request whose head is in a segment not read is cut and said to be, and the reader's
one-line errors stand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.docs import ROOT, argv, command_lines, fenced_blocks, substitute
from tests.support.segments import (
    T0,
    capture_end,
    conn_close,
    conn_open,
    minute_of_traffic,
    request,
    write_segments,
)
from tracer import events as ev
from tracer.cli import commands as cli


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tracer", "analyze", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def two_taps(folder: Path) -> None:
    """Taps front and back, 5 one-minute segments each (compressed but the last): a
    request from +118 to +123 across the 1|2 boundary at both, and one from +55 to +125
    (its head in segment 0) at front."""
    for tap in ("front", "back"):
        events = [e for k in range(5) for e in minute_of_traffic(tap, k)]
        events += [conn_open(tap, 7001, 118.0), *request(tap, 7001, 1, 118.0, 123.0)]
        events.append(conn_close(tap, 7001, 123.5, 1))
        if tap == "front":
            events += [conn_open(tap, 7002, 55.0), *request(tap, 7002, 1, 55.0, 125.0)]
        events.sort(key=lambda e: e.t)
        segments: list[list[ev.Event]] = [[] for _ in range(5)]
        for e in events:
            segments[min(int((e.t - T0) // 60), 4)].append(e)
        segments[-1].append(capture_end(tap, 300.0))
        write_segments(folder, tap, segments, compress=True)


def test_a_window_over_two_taps_rotated_captures(tmp_path: Path) -> None:
    two_taps(tmp_path)
    done = analyze(str(tmp_path), "--since", "+120", "--until", "+130", "--format", "json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["filter"]["since"] == T0 + 120 and doc["filter"]["until"] == T0 + 130
    assert doc["filter"]["segments"] == {"read": 4, "followed": 0, "skipped": 6, "requests_cut": 1}
    assert [c["path"] for c in doc["captures"]] == [
        "back.1.jsonl.zst", "back.2.jsonl.zst", "front.1.jsonl.zst", "front.2.jsonl.zst",
    ]  # fmt: skip
    assert {t["tap"] for t in doc["taps"]} == {"front", "back"}
    assert all(t["ended"] == T0 + 300.0 for t in doc["taps"])
    assert doc["time_range"]["start"] == T0  # +120 counts from the captures' start
    rows = {r["id"]: r for r in doc["requests"]}
    for tap in ("front", "back"):  # across the segment boundary: one whole request
        across = rows[f"{tap}/7001/1"]
        assert across["method"] == "POST" and across["termination"] == "complete"
        assert across["start"] == T0 + 118.0 and across["duration"] == 5.0
    assert "front/7002/1" not in rows  # its head is in segment 0, not read: cut
    assert all(r["method"] == "POST" for r in doc["requests"])
    assert doc["verdict"]["kind"] == "healthy"
    # the cut request may be what hung: said beside the verdict, which is then low
    assert [c["kind"] for c in doc["verdict"]["caveats"]] == ["window_cut"]
    assert doc["verdict"]["caveats"][0]["count"] == 1 and doc["verdict"]["confidence"] == "low"

    text = analyze(str(tmp_path), "--since", "+120", "--until", "+130", "--brief")
    assert text.returncode == 0, text.stderr
    first = text.stdout.splitlines()[0]
    assert first.startswith("filter: since +120.000 s; until +130.000 s: ")
    assert "over the 4 of 10 segments that hold the window" in first
    assert "1 request open at its start began in a segment not read: not shown" in first

    whole = json.loads(analyze(str(tmp_path), "--since", "+50", "--format", "json").stdout)
    assert "segments" not in whole["filter"]  # every segment holds it: read as always
    assert whole["filter"]["since"] == T0 + 50


def test_the_readers_one_line_errors_stand(tmp_path: Path) -> None:
    two_taps(tmp_path)
    (tmp_path / "front.5.jsonl").write_bytes(b"")  # a segment with nothing in it
    done = analyze(str(tmp_path), "--since", "+120", "--until", "+130")
    assert done.returncode == 3
    assert done.stderr.strip().endswith("front.5.jsonl: not a tracer capture: empty")
    assert len(done.stderr.strip().splitlines()) == 1
    (tmp_path / "front.5.jsonl").unlink()
    late = analyze(str(tmp_path), "--since", "+900")
    assert late.returncode == 2 and "--since +900 is outside the captures" in late.stderr


def test_the_fleet_docs_analyze_commands_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every `tracer analyze` line of docs/fleet.md, run over a folder of two replicas'
    rotated captures (7 minutes from T0 = 2027-01-15T08:00:00Z, as the doc's times)."""
    for tap in ("router-a", "router-b"):
        segments = [minute_of_traffic(tap, k) for k in range(7)]
        segments[-1].append(capture_end(tap, 420.0))
        write_segments(tmp_path, tap, segments, compress=True)
    doc = (ROOT / "docs" / "fleet.md").read_text()
    lines = [line for block in fenced_blocks(doc) for line in command_lines(block)]
    runs = [argv(line) for line in lines if argv(line)[1] == "analyze"]
    assert len(runs) >= 3
    for words in runs:
        words = substitute(words, {"/shared/captures/": f"{tmp_path}/"})
        assert cli.main(words[1:]) == 0, words
        out = capsys.readouterr().out
        if "--format" in words and words[words.index("--format") + 1] == "json":
            result = json.loads(out)
            assert result["filter"]["segments"]["skipped"] > 0
            assert {r["tap"] for r in result["requests"]} <= {"router-b"}
        elif "--format" not in words:
            assert out.startswith("filter: since +300.000 s; until +360.000 s: ")
            assert "over the 6 of 14 segments that hold the window" in out.splitlines()[0]
