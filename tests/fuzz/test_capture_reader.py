"""The capture reader (``tracer/capture/reader.py``) on arbitrary bytes and on mutated
recorded captures: a file named as a capture is read (its events fed on, each one an
``Event`` that turns back into a record) or is one line of ``CaptureError`` naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tracer import events as ev
from tracer.capture.reader import (
    CaptureError,
    ReadStats,
    file_kind,
    read_events,
    read_into,
    read_records,
)

from .support import budget, mutated, no_hang, ran

DATA = Path(__file__).parents[1] / "data"


def _is_capture(path: Path) -> bool:
    with path.open("rb") as fh:
        return b'"capture_start"' in fh.readline()


# the recorded tap captures (not the engines' own per-request records beside some of them)
CAPTURES = tuple(p for p in sorted(DATA.rglob("*.jsonl")) if _is_capture(p))
SEEDS = tuple(p.read_bytes() for p in CAPTURES)
SEED_LINES = tuple(tuple(s.splitlines(keepends=True)) for s in SEEDS)
TYPES = tuple(sorted(ev.event_types()))
KINDS = {"capture", "pcap", "pcapng", "missing", "directory", "empty", "binary data", "text"}
HEADER = orjson.dumps({"type": "capture_start", "t": 1.0, "m": 1.0, "tap": "t", "version": 3})


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("capture")


def one_line_error(exc: Exception, path: Path) -> None:
    text = str(exc)
    assert text and "\n" not in text, text
    assert str(path) in text, text


def read(path: Path) -> tuple[ReadStats | None, list[ev.Event]]:
    """``read_into`` as the analysis calls it: its stats, or None for a ``CaptureError``."""
    events: list[ev.Event] = []
    with no_hang():
        try:
            stats = read_into(path, events.append)
        except CaptureError as exc:
            one_line_error(exc, path)
            return None, events
        for event in events:
            assert isinstance(event, ev.Event)
            event.to_record()
    assert stats.version is not None
    assert stats.records >= 0 and stats.bad_lines >= 0
    return stats, events


def read_every_way(path: Path) -> None:
    """``read_records``, ``read_events`` and ``read_into``: a read or a ``CaptureError``."""
    kind = file_kind(path)
    assert kind in KINDS or kind.endswith("-compressed data"), kind
    with no_hang():
        try:
            for record in read_records(path):
                assert isinstance(record, dict)
        except CaptureError as exc:
            one_line_error(exc, path)
        try:
            for event in read_events(path):
                assert isinstance(event, ev.Event)
        except CaptureError as exc:
            one_line_error(exc, path)
    read(path)


# ---- arbitrary bytes -----------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([-1, 0, 2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30])
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
records = st.dictionaries(
    st.sampled_from(["t", "m", "tap", "conn", "req", "version", "id", "status", "body", "kind"])
    | st.text(max_size=6),
    json_values,
    max_size=6,
).map(lambda r: {"type": r.get("type") or r.pop("kind", None) or "conn_open", **r})
record_lines = st.builds(
    lambda r, t: json.dumps({**r, "type": t}).encode() + b"\n",
    records,
    st.sampled_from(TYPES) | st.text(max_size=8),
)
capture_like = st.lists(
    record_lines | st.binary(max_size=40) | st.just(HEADER + b"\n"), max_size=12
).map(lambda lines: HEADER + b"\n" + b"".join(lines))
arbitrary = st.binary(max_size=4096) | capture_like | st.text(max_size=200).map(str.encode)
MAGICS = (b"\x28\xb5\x2f\xfd", b"\x1f\x8b", b"PK\x03\x04", b"{", b" \n{", b"\xd4\xc3\xb2\xa1")


@budget(1.0)
@given(
    data=arbitrary | st.builds(bytes.__add__, st.sampled_from(MAGICS), st.binary(max_size=512)),
    name=st.sampled_from(["cap.jsonl", "cap.jsonl.zst", "cap.1.jsonl", "cap"]),
)
@example(data=b"\x28\xb5\x2f\xfd" + b"\0" * 16, name="cap.jsonl.zst")  # a broken .zst segment
def test_arbitrary_bytes(scratch: Path, data: bytes, name: str) -> None:
    ran("capture.arbitrary")
    path = scratch / name
    path.write_bytes(data)
    read_every_way(path)


# ---- mutated recorded captures ------------------------------------------------------


@st.composite
def field_mutations(draw: st.DrawFn) -> bytes:
    """A recorded capture with fields of some records given values of other types,
    deleted, or records given another record's type: every line still JSON."""
    lines = list(draw(st.sampled_from(SEED_LINES)))
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(lines) - 1))
        try:
            record: Any = json.loads(lines[i])
        except ValueError:
            continue
        if not isinstance(record, dict) or not record:
            continue
        target = record
        key = draw(st.sampled_from(sorted(record)))
        if isinstance(record[key], dict) and record[key] and draw(st.booleans()):
            target = record[key]
            key = draw(st.sampled_from(sorted(target)))
        how = draw(st.integers(0, 3))
        if how == 0:
            del target[key]
        elif how == 1:
            record["type"] = draw(st.sampled_from(TYPES))
        else:
            target[key] = draw(json_values)
        lines[i] = json.dumps(record).encode() + b"\n"
    return b"".join(lines)


@budget(1.0)
@given(data=mutated(SEEDS) | field_mutations())
def test_mutated_captures(scratch: Path, data: bytes) -> None:
    ran("capture.mutated")
    path = scratch / "mutated.jsonl"
    path.write_bytes(data)
    read_every_way(path)


@budget(0.3)
@given(seed=st.sampled_from(range(len(SEEDS))), cut=st.floats(0.0, 1.0))
def test_a_capture_cut_short_reads_as_a_prefix(scratch: Path, seed: int, cut: float) -> None:
    """A capture cut anywhere (still being written) gives the first events of the whole
    one: a torn last line is no event, never another one."""
    ran("capture.cut")
    whole = SEEDS[seed]
    path = scratch / "cut.jsonl"
    path.write_bytes(whole[: int(len(whole) * cut)])
    _, events = read(path)
    path.write_bytes(whole)
    _, all_events = read(path)
    got = [e.to_record() for e in events]
    assert got == [e.to_record() for e in all_events[: len(got)]]


def test_every_recorded_capture_reads_clean(scratch: Path) -> None:
    for path in CAPTURES:
        stats, events = read(path)
        assert stats is not None and stats.bad_lines == 0 and events, path
