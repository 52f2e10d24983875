"""The capture writer never blocks and loses nothing silently; the reader tolerates damage."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tracer import events as ev
from tracer.capture import CaptureError, CaptureWriter, ReadStats, read_events, read_records


def _header() -> ev.CaptureStart:
    return ev.CaptureStart(t=1.0, m=1.0, tap="t", tracer_version="test", kind="proxy")


def _open(conn: int) -> ev.ConnOpen:
    return ev.ConnOpen(t=2.0, m=2.0, tap="t", conn=conn, peer="127.0.0.1:1", local="127.0.0.1:2")


def test_round_trip_every_field(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    writer = CaptureWriter(path, flush_interval=0.001)
    writer.write(_header())
    originals = [_open(i) for i in range(1, 100)]
    for e in originals:
        writer.write(e)
    writer.finish("t", "done")
    got = list(read_events(path))
    assert isinstance(got[0], ev.CaptureStart) and got[0].version == ev.CAPTURE_VERSION
    assert got[1:-1] == originals
    assert isinstance(got[-1], ev.CaptureEnd) and got[-1].dropped == 0


def _sample(cls: type[ev.Event], fill: bool) -> ev.Event:
    """An instance with every field set (``fill``) or only the required ones."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required or fill:
            kwargs[f.name] = f"{f.name}-value"
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
        json.dumps(_header().to_record()),
        json.dumps(_open(1).to_record()),
        "{not json",
        json.dumps(_open(2).to_record()),
    ]
    path.write_text("\n".join(lines) + "\n" + json.dumps(_open(3).to_record())[:25])
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
        json.dumps({**_header().to_record(), "version": ev.CAPTURE_VERSION + 1}) + "\n"
    )
    with pytest.raises(CaptureError, match="version"):
        list(read_records(future))


def test_full_disk_drops_and_counts_never_raises() -> None:
    writer = CaptureWriter("/dev/full", flush_interval=0.001)
    start = time.monotonic()
    for i in range(1000):
        writer.write(_open(i))
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
    writer.write(_header())
    assert entered.wait(5)
    start = time.monotonic()
    for i in range(2000):
        writer.write(_open(i))
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
