"""A window over rotated captures (capture/segments.py): each segment's time range read
from its head and tail, and only the segments that hold the window read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tracer.capture.reader as reader
from tests.support.segments import (
    T0,
    capture_end,
    conn_close,
    conn_open,
    header,
    minute_of_traffic,
    request,
    write_segments,
)
from tracer import events as ev
from tracer.analysis.summary import Summary
from tracer.capture.files import encode_line
from tracer.capture.reader import expand_captures, read_into
from tracer.capture.segments import TAIL_BLOCK, Follow, plan_window, segment_span

# ---- a segment's time range ---------------------------------------------------------------


def test_a_plain_segments_range_is_its_first_record_after_the_header_and_its_last(
    tmp_path: Path,
) -> None:
    (path,) = write_segments(tmp_path, "a", [minute_of_traffic("a", 2)])
    span = segment_span(path)
    assert span is not None and span.header["type"] == "capture_start"
    assert span.header["t"] == T0  # the capture's start, repeated atop every segment
    assert span.first == T0 + 120.2 and span.last == T0 + 179.8
    assert span.tail is not None and span.tail["type"] == "conn_close"
    assert span.overlaps(T0 + 170, T0 + 200) and span.overlaps(None, T0 + 121)
    assert not span.overlaps(T0 + 183, None) and not span.overlaps(None, T0 + 117)


def test_a_torn_last_line_is_passed_over(tmp_path: Path) -> None:
    (path,) = write_segments(tmp_path, "a", [minute_of_traffic("a", 0)])
    whole = segment_span(path)
    with path.open("ab") as fh:
        fh.write(b'{"type":"conn_open","t":1800009999.0,"m":1.0,"tap":"a","co')  # a kill
    torn = segment_span(path)
    assert whole is not None and torn is not None
    assert torn.last == whole.last == T0 + 59.8 and torn.tail == whole.tail


def test_the_last_line_is_found_however_long(tmp_path: Path) -> None:
    events = minute_of_traffic("a", 0)
    big = ev.Anomaly(
        t=T0 + 59.9,
        m=59.9,
        tap="a",
        conn=1,
        direction="client",
        offset=0,
        error="x" * 3 * TAIL_BLOCK,
    )
    (path,) = write_segments(tmp_path, "a", [[*events, big]])
    span = segment_span(path)
    assert span is not None and span.last == T0 + 59.9
    assert span.tail is not None and span.tail["type"] == "anomaly"


def test_empty_segments(tmp_path: Path) -> None:
    only_header = tmp_path / "h.jsonl"
    only_header.write_bytes(encode_line(header("h").to_record()))
    span = segment_span(only_header)
    assert span is not None and span.empty and span.first is None
    assert not span.overlaps(None, None)  # no record: no window needs it
    nothing = tmp_path / "e.jsonl"
    nothing.write_bytes(b"")
    assert segment_span(nothing) is None  # not judged here: the reader says what it is
    text = tmp_path / "t.jsonl"
    text.write_text("hello\n")
    assert segment_span(text) is None
    assert segment_span(tmp_path / "missing.jsonl") is None


def test_a_zst_segments_range_ends_where_the_next_begins_or_at_its_decompressed_tail(
    tmp_path: Path,
) -> None:
    paths = write_segments(
        tmp_path,
        "a",
        [minute_of_traffic("a", 0), [*minute_of_traffic("a", 1), capture_end("a", 120.5)]],
        compress=True,
    )
    assert paths[0].name == "a.jsonl.zst" and paths[1].name == "a.1.jsonl"
    packed = segment_span(paths[0], next_first=T0 + 60.2)
    assert packed is not None and packed.first == T0 + 0.2 and packed.last == T0 + 60.2
    assert packed.tail is None  # not decompressed to its end
    alone = segment_span(paths[0])  # no next segment: decompressed, the last line parsed
    assert alone is not None and alone.last == T0 + 59.8
    assert alone.tail is not None and alone.tail["type"] == "conn_close"
    last = segment_span(paths[1])
    assert last is not None and last.tail is not None and last.tail["type"] == "capture_end"


# ---- the window's segments ----------------------------------------------------------------


def fleet(folder: Path, taps: tuple[str, ...] = ("a", "b"), minutes: int = 6) -> None:
    """Taps with a segment a minute, compressed but the last, which ends the capture."""
    for tap in taps:
        segments = [minute_of_traffic(tap, k) for k in range(minutes)]
        segments[-1].append(capture_end(tap, minutes * 60.0))
        write_segments(folder, tap, segments, compress=True)


def opened_for_records(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files the reader opens to read records from (not the ranges' reads)."""
    opened: list[str] = []
    real = reader._open_capture_file

    def counting(path: Any) -> Any:
        opened.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(reader, "_open_capture_file", counting)
    return opened


def test_only_the_segments_that_hold_the_window_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet(tmp_path)
    files = expand_captures([tmp_path])
    plan = plan_window(files, "+130", "+170")
    assert (plan.since, plan.until) == (T0 + 130, T0 + 170)
    assert (plan.origin, plan.end) == (T0, T0 + 360.0)
    for capture in plan.captures:
        assert [Path(s.path).name[1:] for s in capture.read] == [".2.jsonl.zst"]
        assert len(capture.before) == 2 and len(capture.after) == 3
    opened = opened_for_records(monkeypatch)
    with Summary() as summary:
        described = plan.read(summary.feed, read_into)
        result = summary.result(captures=described)
    assert opened == ["a.2.jsonl.zst", "b.2.jsonl.zst"]  # nothing open at its end: no follow
    assert plan.to_json() == {"read": 2, "followed": 0, "skipped": 10, "requests_cut": 0}
    assert [c["path"] for c in result["captures"]] == ["a.2.jsonl.zst", "b.2.jsonl.zst"]
    assert {t["tap"]: t["ended"] for t in result["taps"]} == {
        "a": T0 + 360.0,  # from the last segment's tail, not read
        "b": T0 + 360.0,
    }
    assert "caveats" not in result["verdict"]  # no_capture_end would be one
    assert result["totals"]["requests"] == 120
    assert result["time_range"]["start"] == T0  # the header: +SECONDS mean what they meant


def test_the_window_edges_relative_times_and_the_range_check(tmp_path: Path) -> None:
    fleet(tmp_path)
    files = expand_captures([tmp_path])
    assert [len(c.read) for c in plan_window(files, "+119", None).captures] == [5, 5]
    assert [len(c.read) for c in plan_window(files, None, "+61").captures] == [2, 2]
    whole = plan_window(files, "+0", "+360")
    assert not whole.skips
    with pytest.raises(ValueError, match="--since \\+900 is outside the captures"):
        plan_window(files, "+900", None)


def test_a_request_across_a_boundary_is_whole_and_one_open_at_the_window_end_is_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segments 0-3 of one tap: a request from +59 to +61 spans 0|1, both read; one from
    +119 to +185 goes on past the window's last segment (1) and is followed into 2 and
    3, no further than its end; a request whose head is in 0 (not read for
    --since +70) and ends in 1 is cut: no row, counted."""
    a = [conn_open("a", 1, 10.0), *request("a", 1, 1, 10.0, 75.0)]
    a += [conn_open("a", 2, 59.0), *request("a", 2, 1, 59.0, 61.0)]
    a += [conn_open("a", 3, 119.0), *request("a", 3, 1, 119.0, 185.0)]
    a += [conn_close("a", 2, 61.5, 1), conn_close("a", 1, 76.0, 1)]
    a += [conn_open("a", 4, 200.0), *request("a", 4, 1, 200.0, 201.0)]
    a.sort(key=lambda e: e.t)
    segments: list[list[ev.Event]] = [[], [], [], []]
    for e in a:
        segments[min(int((e.t - T0) // 60), 3)].append(e)
    write_segments(tmp_path, "a", segments, compress=True)
    files = expand_captures([tmp_path])
    opened = opened_for_records(monkeypatch)

    def analyse(since: str) -> tuple[dict[str, Any], Any]:
        plan = plan_window(files, since, "+100")
        with Summary() as summary:
            described = plan.read(summary.feed, read_into)
            return summary.result(captures=described, raw_rows=False), plan

    result, plan = analyse("+30")
    assert opened == ["a.jsonl.zst", "a.1.jsonl.zst", "a.2.jsonl.zst", "a.3.jsonl"]
    rows = {r["id"]: r for r in result["requests"]}
    assert set(rows) == {"a/1/1", "a/2/1", "a/3/1"}  # a/4 is after the window: not taken
    assert rows["a/2/1"]["termination"] == "complete" and rows["a/2/1"]["duration"] == 2.0
    assert rows["a/3/1"]["termination"] == "complete" and rows["a/3/1"]["duration"] == 66.0
    assert plan.to_json() == {"read": 2, "followed": 2, "skipped": 0, "requests_cut": 0}
    opened.clear()
    result, plan = analyse("+70")
    assert opened == ["a.1.jsonl.zst", "a.2.jsonl.zst", "a.3.jsonl"]
    rows = {r["id"]: r for r in result["requests"]}
    assert set(rows) == {"a/3/1"}  # a/1/1, a/2/1 began in segment 0: cut, no headless row
    assert plan.to_json()["requests_cut"] == 2  # a/1/1 and a/2/1
    assert all(r["method"] for r in result["requests"])


def test_a_tap_with_no_segment_in_the_window_is_still_a_tap(tmp_path: Path) -> None:
    fleet(tmp_path, taps=("a",), minutes=6)
    early = [minute_of_traffic("b", 0), [*minute_of_traffic("b", 1), capture_end("b", 121.0)]]
    write_segments(tmp_path, "b", early, compress=True)
    plan = plan_window(expand_captures([tmp_path]), "+200", "+230")
    assert [len(c.read) for c in plan.captures] == [1, 0]
    with Summary() as summary:
        described = plan.read(summary.feed, read_into)
        result = summary.result(captures=described)
    taps = {t["tap"]: t for t in result["taps"]}
    assert set(taps) == {"a", "b"} and taps["b"]["ended"] == T0 + 121.0
    assert [c["path"] for c in result["captures"]] == ["a.3.jsonl.zst"]


def test_an_unreadable_range_reads_everything(tmp_path: Path) -> None:
    fleet(tmp_path, taps=("a",), minutes=3)
    (tmp_path / "a.3.jsonl").write_bytes(b"")  # a segment just opened, or not a capture
    plan = plan_window(expand_captures([tmp_path]), "+10", "+20")
    assert plan.captures == [] and not plan.skips


def test_follow_drops_what_is_outside_the_window() -> None:
    seen: list[ev.Event] = []
    follow = Follow(seen.append)
    follow.feed(conn_open("a", 1, 0.0))
    for e in request("a", 1, 1, 0.0, 1.0)[:3]:
        follow.feed(e)
    follow.feed(request("a", 9, 4, 0.0, 1.0)[3])  # head before the window: cut
    assert follow.cut_total == 1 and follow.open_requests == {("a", 1, 1)}
    follow.following = True
    follow.feed(conn_open("a", 2, 2.0))  # after the window: not taken
    for e in request("a", 2, 1, 2.0, 3.0):
        follow.feed(e)
    follow.feed(request("a", 1, 1, 0.0, 1.0)[4])  # the open request's end
    assert not follow.open_requests
    assert [type(e).__name__ for e in seen] == [
        "ConnOpen", "RequestHead", "RequestEnd", "ResponseHead", "ResponseEnd",
    ]  # fmt: skip


def test_a_first_record_too_long_to_look_at_is_taken_to_begin_with_the_capture(
    tmp_path: Path,
) -> None:
    big = ev.Anomaly(
        t=T0 + 130.0, m=130.0, tap="a", conn=1, direction="client", offset=0,
        error="x" * (1 << 20),
    )  # fmt: skip
    (path,) = write_segments(tmp_path, "a", [[big, *minute_of_traffic("a", 2)]])
    span = segment_span(path)
    assert span is not None and not span.empty
    assert span.first == T0 and span.last == T0 + 179.8  # never skipped for a window in it
