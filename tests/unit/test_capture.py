"""The capture writer never blocks and loses nothing silently; the reader tolerates damage."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import threading
import time
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.captures import open_event, start_event
from tracer import events as ev
from tracer.capture.files import CaptureError, CaptureWriter, ReadStats, read_events, read_records


def test_round_trip_every_field(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    writer = CaptureWriter(path, flush_interval=0.001)
    writer.write(start_event())
    originals = [open_event(i) for i in range(1, 100)]
    for e in originals:
        writer.write(e)
    writer.finish("t", "done")
    got = list(read_events(path))
    assert isinstance(got[0], ev.CaptureStart) and got[0].version == ev.CAPTURE_VERSION
    assert got[1:-1] == originals
    assert isinstance(got[-1], ev.CaptureEnd) and got[-1].dropped == 0


def _value(hint: Any, name: str) -> Any:
    """A value of the annotated type, telling fields apart."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return args[0]
    if origin in (typing.Union, types.UnionType):
        return _value(args[0], name)
    kind = origin or hint
    samples = {
        float: 1.5 + len(name),
        int: 7 + len(name),
        bool: True,
        list: [name],
        dict: {"k": name},
    }
    return samples.get(kind, f"{name}-value")


def _sample(cls: type[ev.Event], fill: bool) -> ev.Event:
    """An instance with every field set (``fill``) or only the required ones."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required or fill:
            kwargs[f.name] = _value(hints[f.name], f.name)
    return cls(**kwargs)


@pytest.mark.parametrize("cls", sorted(ev._REGISTRY.values(), key=lambda c: c.TYPE))
def test_to_record_is_every_field_not_none_in_field_order(cls: type[ev.Event]) -> None:
    """The generated ``to_record`` of each class says what the plain loop over the fields says."""
    for fill in (True, False):
        event = _sample(cls, fill)
        expected = {"type": cls.TYPE}
        for f in dataclasses.fields(cls):
            value = getattr(event, f.name)
            if value is not None:
                expected[f.name] = value
        got = event.to_record()
        assert got == expected and list(got) == list(expected)
        assert ev.from_record(got) == event


def test_reader_skips_torn_tail_and_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    lines = [
        json.dumps(start_event().to_record()),
        json.dumps(open_event(1).to_record()),
        "{not json",
        json.dumps(open_event(2).to_record()),
    ]
    path.write_text("\n".join(lines) + "\n" + json.dumps(open_event(3).to_record())[:25])
    stats = ReadStats()
    got = list(read_events(path, stats))
    assert [e.conn for e in got if isinstance(e, ev.ConnOpen)] == [1, 2]
    assert stats.bad_lines == 1 and stats.torn_tail


def test_reader_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    not_capture = tmp_path / "x.jsonl"
    not_capture.write_text('{"type":"conn_open"}\n')
    with pytest.raises(CaptureError, match="not a tracer capture"):
        list(read_records(not_capture))
    future = tmp_path / "future.jsonl"
    future.write_text(
        json.dumps({**start_event().to_record(), "version": ev.CAPTURE_VERSION + 1}) + "\n"
    )
    with pytest.raises(CaptureError, match="version"):
        list(read_records(future))


def _disk_full(fd: int, data: bytes | memoryview) -> int:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_drops_and_counts_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "write", _disk_full)
    writer = CaptureWriter(tmp_path / "full.jsonl", flush_interval=0.001)
    start = time.monotonic()
    for i in range(1000):
        writer.write(open_event(i))
    assert time.monotonic() - start < 1.0
    deadline = time.monotonic() + 5
    while writer.dropped < 1000 and time.monotonic() < deadline:
        time.sleep(0.01)
    writer.close()
    assert writer.dropped == 1000 and writer.written == 0


def test_slow_disk_never_blocks_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer stuck in write(): the caller goes on; records beyond the bound are counted."""
    release = threading.Event()
    entered = threading.Event()
    real_write = os.write

    def stuck_write(fd: int, data: bytes | memoryview) -> int:
        entered.set()
        release.wait(10)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", stuck_write)
    path = tmp_path / "slow.jsonl"
    writer = CaptureWriter(path, max_pending_bytes=20_000, flush_interval=0.001)
    writer.write(start_event())
    assert entered.wait(5)
    start = time.monotonic()
    for i in range(2000):
        writer.write(open_event(i))
    elapsed = time.monotonic() - start
    assert elapsed < 1.0, "write() must not wait for the disk"
    assert writer.dropped > 0
    release.set()
    monkeypatch.setattr(os, "write", real_write)
    writer.finish("t", "done")
    records = list(read_records(path))
    losses = [r for r in records if r["type"] == "capture_loss"]
    assert losses and losses[0]["dropped"] > 0
    kept = [r for r in records if r["type"] == "conn_open"]
    assert len(kept) + writer.dropped == 2000


class _Disk:
    """os.write by script: 'ok', 'fail' (nothing written, ENOSPC), 'half' (half the
    bytes, then ENOSPC on the rest) — one step per batch the writer flushes."""

    def __init__(self, steps: list[str]) -> None:
        self.steps = steps
        self.real = os.write
        self.batch = 0
        self.done = threading.Event()

    def write(self, fd: int, data: bytes | memoryview) -> int:
        step = self.steps[self.batch] if self.batch < len(self.steps) else "ok"
        if step == "half-rest":  # the rest of a half-written batch fails
            self.batch += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        if step == "fail":
            self.batch += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        if step == "half":
            self.steps[self.batch] = "half-rest"
            return self.real(fd, bytes(data)[: max(1, len(data) // 2)])
        self.batch += 1
        return self.real(fd, data)


@pytest.mark.parametrize(
    "steps",
    [["ok", "fail", "half", "ok"], ["ok", "half", "fail", "ok"], ["ok", "half", "half", "ok"]],
)
def test_every_loss_record_parses_whatever_the_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: list[str]
) -> None:
    """A writer that fails whole, then partly (or the other way round), then recovers:
    every line but torn fragments parses, the capture_loss record is a line of its own,
    and the records it says were lost plus those on disk are all that were written."""
    disk = _Disk(list(steps))
    monkeypatch.setattr(os, "write", disk.write)
    path = tmp_path / "cap.jsonl"
    writer = CaptureWriter(path, flush_interval=0.001)
    writer.write(start_event())
    sent = 0
    for batch in range(len(steps)):
        for _ in range(3):
            writer.write(open_event(sent))
            sent += 1
        deadline = time.monotonic() + 10
        while disk.batch <= batch and time.monotonic() < deadline:
            time.sleep(0.005)
    writer.finish("t", "done")
    stats = ReadStats()
    records = list(read_records(path, stats))
    losses = [r for r in records if r["type"] == "capture_loss"]
    assert losses, records
    kept = [r for r in records if r["type"] == "conn_open"]
    assert sum(r["dropped"] for r in losses) + len(kept) >= sent
    assert records[-1]["type"] == "capture_end"
    lines = path.read_bytes().split(b"\n")
    assert all(b"capture_loss" not in line or json.loads(line) for line in lines if line)


def test_a_capture_file_is_new_private_and_never_a_symlink(tmp_path: Path) -> None:
    path = tmp_path / "cap.jsonl"
    CaptureWriter(path).close()
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        CaptureWriter(path)  # two runs never mix
    target = tmp_path / "elsewhere"
    target.write_text("precious\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    with pytest.raises(OSError):
        CaptureWriter(link)
    with pytest.raises(OSError):
        CaptureWriter(link, append="t")
    assert target.read_text() == "precious\n"


def test_append_extends_only_this_taps_capture(tmp_path: Path) -> None:
    path = tmp_path / "cap.jsonl"
    writer = CaptureWriter(path)
    writer.write(start_event())
    writer.finish("t", "done")
    path.chmod(0o644)
    again = CaptureWriter(path, append="t")
    again.write(start_event())
    again.finish("t", "again")
    assert path.stat().st_mode & 0o777 == 0o600
    assert [r["type"] for r in read_records(path)].count("capture_start") == 2
    with pytest.raises(FileExistsError, match="tap 't'"):
        CaptureWriter(path, append="other")
    junk = tmp_path / "junk.txt"
    junk.write_text("not a capture\n")
    with pytest.raises(FileExistsError, match="not a tracer capture"):
        CaptureWriter(junk, append="t")


def test_wrong_typed_records_are_counted_with_their_lines_and_skipped(tmp_path: Path) -> None:
    """A string time, a quoted status, 1e308, NaN, an unknown termination: each record is
    one bad line (with its line number among the first few), never a crash downstream."""
    path = tmp_path / "bad.jsonl"
    good = open_event(1).to_record()
    lines = [
        start_event().to_record(),
        good,
        {**open_event(2).to_record(), "t": "yesterday"},
        {"type": "response", "t": 3.0, "m": 3.0, "tap": "t", "conn": 1, "seq": 1,
         "status": "200", "reason": "", "version": "1.1", "headers": [], "ttfb": 0.1},
        {**open_event(3).to_record(), "m": 1e308},
        {"type": "response_end", "t": 4.0, "m": 4.0, "tap": "t", "conn": 1, "seq": 1,
         "termination": "exploded", "body_bytes": 0, "duration": 1.0, "events": 0},
        {**open_event(4).to_record(), "conn": True},
    ]  # fmt: skip
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in lines) + '{"type": "conn_open", "t": NaN}\n'
    )
    stats = ReadStats()
    events = list(read_events(path, stats))
    assert [type(e).__name__ for e in events] == ["CaptureStart", "ConnOpen"]
    assert stats.bad_lines == 6 and stats.invalid_records == 5
    assert stats.problems[0].startswith("line 3: conn_open.t")
    assert len(stats.problems) == 5
    from tracer.analysis.summary import Summary

    with Summary() as summary:
        for event in events:
            summary.feed(event)
        assert summary.result()["totals"]["connections"] == 1


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (b"", "not a tracer capture: empty"),
        (b"hello\nworld\n", "not a tracer capture: no capture_start, 2 unparseable"),
        (bytes(range(256)) * 8, "not a tracer capture: binary data"),
        (b"\xd4\xc3\xb2\xa1" + bytes(20), "a pcap capture with no HTTP/1.1 connection"),
        (b"\x0a\x0d\x0d\x0a" + bytes(20), "not a readable pcapng file"),
        (b"\x1f\x8b" + bytes(20), "not a tracer capture: gzip-compressed"),
    ],
)
def test_a_file_that_is_not_a_capture_is_refused_not_an_all_clear(
    tmp_path: Path, content: bytes, what: str
) -> None:
    from tracer.capture.files import read_into

    path = tmp_path / "junk.bin"
    path.write_bytes(content)
    with pytest.raises(CaptureError, match=what):
        read_into(path, lambda e: None)


def test_rotation_writes_numbered_segments_each_readable_and_all_in_order(
    tmp_path: Path,
) -> None:
    from tracer.analysis.summary import Summary
    from tracer.capture.files import expand_captures, read_into

    path = tmp_path / "cap.jsonl"
    writer = CaptureWriter(path, flush_interval=0.001, max_bytes=2000)
    writer.write(start_event())
    for i in range(200):
        writer.write(open_event(i))
        if i % 20 == 0:
            deadline = time.monotonic() + 5
            while writer.pending_bytes and time.monotonic() < deadline:
                time.sleep(0.002)
    writer.finish("t", "done")
    segments = writer.segments
    assert len(segments) >= 3 and segments[1].name == "cap.1.jsonl"
    for seg in segments:  # each reads alone: its first line is the header
        assert next(read_records(seg))["type"] == "capture_start"
    # the shell's glob order (cap.1, cap.10, cap.2 ...) or the directory: segment order
    shuffled = sorted(str(s) for s in segments)
    assert expand_captures(shuffled) == [str(s) for s in segments]
    assert expand_captures([tmp_path]) == [str(s) for s in segments]
    with Summary() as summary:
        for seg in expand_captures([tmp_path]):
            read_into(seg, summary.feed)
        result = summary.result()
    assert result["totals"]["connections"] == 200
    assert "caveats" not in result["verdict"]  # the last segment has the capture_end


def test_compressed_segments_are_read_like_plain_ones(tmp_path: Path) -> None:
    from tracer.capture.files import expand_captures, read_into

    path = tmp_path / "cap.jsonl"
    writer = CaptureWriter(path, flush_interval=0.001, max_bytes=2000, compress=True)
    writer.write(start_event())
    for i in range(200):
        writer.write(open_event(i))
        if i % 20 == 0:
            deadline = time.monotonic() + 5
            while writer.pending_bytes and time.monotonic() < deadline:
                time.sleep(0.002)
    writer.finish("t", "done")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "cap.jsonl.zst" in names and "cap.1.jsonl.zst" in names  # closed ones packed
    assert not [n for n in names if n.endswith(".tmp")]
    segments = expand_captures([tmp_path])
    assert segments[0].endswith("cap.jsonl.zst")
    conns = 0

    def count(e: ev.Event) -> None:
        nonlocal conns
        conns += isinstance(e, ev.ConnOpen)

    for seg in segments:
        read_into(seg, count)
    assert conns == 200


class _FullDisk:
    """os.write on a disk that fills when told to: nothing fits while the capture's
    reserve still holds its space; removing the reserve (or ``room``) makes room."""

    def __init__(self, reserve: Path) -> None:
        self.reserve = reserve
        self.real = os.write
        self.full = threading.Event()

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if self.full.is_set() and self.reserve.exists():
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real(fd, data)


def _wait(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert predicate()


def test_a_full_disk_still_ends_the_capture_from_its_reserve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills and stays full: the writer frees its reserve at the end for the
    capture_loss (its count and window, not resumed) and capture_end, and keeps no
    reserve file behind."""
    path = tmp_path / "cap.jsonl"
    writer = CaptureWriter(path, flush_interval=0.001)
    reserve = tmp_path / ".cap.jsonl.reserve"
    assert reserve.stat().st_size == writer.reserve_bytes > 0
    disk = _FullDisk(reserve)
    monkeypatch.setattr(os, "write", disk.write)
    writer.write(start_event())
    for i in range(5):
        writer.write(open_event(i))
    _wait(lambda: writer.written == 6)
    disk.full.set()
    for i in range(5, 15):
        writer.write(open_event(i))
    _wait(lambda: writer.dropped == 10)
    assert writer.failing
    writer.finish("t", "done")
    records = list(read_records(path))
    assert [r["type"] for r in records[-2:]] == ["capture_loss", "capture_end"]
    loss, end = records[-2:]
    assert loss["dropped"] == 10 and loss["resumed"] is False
    assert loss["first_t"] <= loss["last_t"]
    assert end["dropped"] == 10 and end["records"] == len(records)
    assert len([r for r in records if r["type"] == "conn_open"]) == 5
    assert not reserve.exists()


def test_writing_resumes_when_space_returns_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "cap.jsonl"
    writer = CaptureWriter(path, flush_interval=0.001)
    disk = _FullDisk(tmp_path / ".cap.jsonl.reserve")
    monkeypatch.setattr(os, "write", disk.write)
    writer.write(start_event())
    _wait(lambda: writer.written == 1)
    disk.full.set()
    for i in range(4):
        writer.write(open_event(i))
    _wait(lambda: writer.dropped == 4)
    disk.full.clear()  # space came back
    writer.write(open_event(99))
    _wait(lambda: writer.written >= 2)
    assert not writer.failing
    writer.finish("t", "done")
    records = list(read_records(path))
    losses = [r for r in records if r["type"] == "capture_loss"]
    assert len(losses) == 1 and losses[0]["resumed"] is True and losses[0]["dropped"] == 4
    assert records[-1]["type"] == "capture_end" and records[-1]["dropped"] == 4
    assert [r["conn"] for r in records if r["type"] == "conn_open"] == [99]


def test_a_line_cut_by_a_failed_write_is_told_from_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record half written when the disk filled is a bad line followed by the
    capture_loss the writer wrote once it could (``torn_at_loss``); a torn last line is
    a kill's (``torn_tail``)."""
    disk = _Disk(["ok", "half", "ok"])
    monkeypatch.setattr(os, "write", disk.write)
    path = tmp_path / "cap.jsonl"
    writer = CaptureWriter(path, flush_interval=0.001)
    writer.write(start_event())
    for batch in range(3):
        for i in range(3):
            writer.write(open_event(batch * 3 + i))
        _wait(lambda b=batch: disk.batch > b)  # type: ignore[misc]
    writer.finish("t", "done")
    stats = ReadStats()
    list(read_records(path, stats))
    assert stats.bad_lines == stats.torn_at_loss == 1 and not stats.torn_tail
    with open(path, "ab") as fh:
        fh.write(b'{"type":"conn_open","t":1')  # then killed mid-record
    stats = ReadStats()
    list(read_records(path, stats))
    assert stats.torn_tail and stats.torn_at_loss == 1
