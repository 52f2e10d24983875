"""A time window over rotated captures: which segments it needs, read cheaply.

A rotated capture is numbered segments (``cap.jsonl``, ``cap.1.jsonl``, ``cap.2.jsonl.zst``
...), each beginning with the capture's ``capture_start`` (the same line: its ``t`` is the
capture's start, not the segment's). A segment's time range is the ``t`` of its first
record after that header and of its last complete record, read from the file's tail (a
seek near the end; a torn last line is passed over). A ``.zst`` segment is decompressed
only as far as its second line; its end is the next segment's first time, or, for a
last segment, found by decompressing it without parsing (the writer leaves the last
segment plain).

``plan_window``: for ``--since``/``--until``, each capture's segments from the first to
the last that overlap the window (give or take ``SLACK``) are read whole; those before
are not opened for their records; those after are read only for the requests still
open at the window's end (``Follow``), up to the event that ends the last of them, then
no further. What that leaves out, and how it is told:

- a request whose head is in a segment not read (open at the window's start) has no
  row: its later events are dropped and counted (``requests_cut``), never made into a
  row without a head;
- a connection opened in a segment not read has no row (its requests read are rows);
- a capture none of whose segments overlaps is still a tap of the analysis: its header
  is fed, and its ``capture_end`` (from the last segment's tail) when it has one, so a
  capture that ended cleanly is not taken for a killed one.

Anything whose range cannot be read so (not a tracer capture, a pcap, an empty or
unreadable file, a header that does not parse) makes the plan give up: everything is
read, as without a window, and the reader says what is wrong with the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .. import events as ev
from ..times import parse_time
from .reader import ReadStats, _open_capture_file, event_from_record, read_events, segment_key

# the window is widened by this much on each side before segments are chosen: taps on
# different hosts whose clocks differ, records a batch puts slightly out of time order
SLACK = 2.0
MAX_LINE = 1 << 20  # a header or first record longer than this: the range is not read
TAIL_BLOCK = 1 << 16  # bytes read back from the end at a time
MAX_TAIL = 1 << 24  # give up looking for a last complete line past this many bytes


@dataclass
class Span:
    """One segment's time range: ``first`` the ``t`` of its first record after the
    header (None: no record but the header), ``last`` that of its last complete record
    (or the next segment's first, for a ``.zst`` one); ``tail`` its last complete
    record, when read."""

    path: str
    header: dict[str, Any]
    first: float | None
    last: float | None
    tail: dict[str, Any] | None = None

    @property
    def empty(self) -> bool:
        return self.first is None

    def overlaps(self, since: float | None, until: float | None, slack: float = SLACK) -> bool:
        if self.first is None:
            return False
        end = self.last if self.last is not None else float("inf")
        return (since is None or end >= since - slack) and (
            until is None or self.first <= until + slack
        )


def _record(line: bytes) -> dict[str, Any] | None:
    """A complete line's record with a numeric ``t``, else None."""
    if not line.endswith(b"\n"):
        return None
    try:
        record = orjson.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    t = record.get("t")
    if not isinstance(t, int | float) or isinstance(t, bool):
        return None
    return record


def segment_span(path: str | os.PathLike[str], next_first: float | None = None) -> Span | None:
    """The segment's time range, from its head and its tail; None when it cannot be
    read cheaply as a tracer capture (the reader then says why, reading it whole)."""
    name = str(path)
    try:
        if name.endswith(".zst"):
            return _zst_span(name, next_first)
        with open(name, "rb") as fh:
            head = _head(fh, name)
            if head is None:
                return None
            header, first, after = head
            size = os.fstat(fh.fileno()).st_size
            tail = _last_record(fh, after, size)
    except (OSError, ValueError):
        return None
    if tail is None and first is not None:
        return Span(name, header, first, None)  # no end found: taken to reach any window
    last = tail["t"] if tail is not None else header["t"]
    return Span(name, header, first, float(last), tail if tail is not None else header)


def _head(fh: Any, name: str) -> tuple[dict[str, Any], float | None, int] | None:
    """The header, the first record's time, and the offset after the header."""
    header = _record(fh.readline(MAX_LINE))
    if header is None or header.get("type") != ev.CaptureStart.TYPE:
        return None
    version = header.get("version")
    if not isinstance(version, int) or version > ev.CAPTURE_VERSION:
        return None  # the reader's own error names it
    after = fh.tell()
    second = fh.readline(MAX_LINE)
    record = _record(second)
    if record is None and second.endswith(b"\n"):
        return None  # a bad second line: leave the judgement to the reader
    if record is None and len(second) >= MAX_LINE:
        # a first record too long to look at: the segment is taken to begin with the
        # capture (read for any window up to its end)
        return header, float(header["t"]), after
    return header, float(record["t"]) if record is not None else None, after


def _last_record(fh: Any, start: int, size: int) -> dict[str, Any] | None:
    """The last complete line's record at or after ``start`` (a torn last line — no
    newline — passed over, and any that does not parse); None when there is none."""
    pos, carry = size, b""
    while pos > start and size - pos < MAX_TAIL:
        step = min(TAIL_BLOCK, pos - start)
        pos -= step
        fh.seek(pos)
        data = fh.read(step) + carry
        lines = data.split(b"\n")
        # lines[0] may be the end of a longer line, unless the block starts at ``start``;
        # the last piece is what follows the last newline (a torn line, or nothing)
        whole = lines[1:-1] if pos > start else lines[:-1]
        for line in reversed(whole):
            record = _record(line + b"\n")
            if record is not None:
                return record
        carry = lines[0] + b"\n" if pos > start else b""
        if pos > start and len(lines) == 1:
            carry = data  # no newline in it yet: a long line, keep reading back
    return None


def _zst_span(name: str, next_first: float | None) -> Span | None:
    with _open_capture_file(name) as fh:
        head = _head(fh, name)
        if head is None:
            return None
        header, first, _ = head
        if next_first is not None:
            return Span(name, header, first, next_first)
        tail: dict[str, Any] | None = None
        previous = b""
        for line in fh:  # decompressed, not parsed: only the last complete line is
            if line.endswith(b"\n"):
                previous = line
        tail = _record(previous) if previous else None
    if tail is None:
        return Span(name, header, first, None if first is not None else header["t"], header)
    return Span(name, header, first, float(tail["t"]), tail)


def _capture_key(path: str) -> tuple[str, str]:
    """Which capture a file is a segment of (``expand_captures``'s grouping)."""
    return segment_key(Path(path))[:2]


def _groups(files: list[str]) -> list[list[str]]:
    """The files in runs of one capture's segments, in ``expand_captures``'s order."""
    out: list[list[str]] = []
    keys: list[tuple[str, str]] = []
    for f in files:
        key = _capture_key(f)
        if keys and keys[-1] == key:
            out[-1].append(f)
        else:
            out.append([f])
            keys.append(key)
    return out


def spans_of(segments: list[str]) -> list[Span] | None:
    """Each segment's span, in order (a ``.zst`` one ending where the next begins);
    None if any cannot be read so."""
    spans: list[Span | None] = [None] * len(segments)
    next_first: float | None = None
    for i in range(len(segments) - 1, -1, -1):
        span = segment_span(segments[i], next_first)
        if span is None:
            return None
        spans[i] = span
        if span.first is not None:
            next_first = span.first
    return [s for s in spans if s is not None]


@dataclass
class CapturePlan:
    """One capture's segments for a window: ``before`` not read, ``read`` read whole,
    ``after`` read only while requests read are still open."""

    spans: list[Span]
    before: list[Span]
    read: list[Span]
    after: list[Span]


@dataclass
class WindowPlan:
    since: float | None
    until: float | None
    captures: list[CapturePlan]
    origin: float | None = None  # the captures' first time and last, all segments'
    end: float | None = None
    # what reading did (``read``): counted for the output
    segments_read: int = 0
    segments_followed: int = 0
    segments_skipped: int = 0
    requests_cut: int = 0
    opened: list[str] = field(default_factory=list)  # the segments opened for records
    whole: set[str] = field(default_factory=set)  # those read to their end

    @property
    def skips(self) -> bool:
        return any(c.before or c.after for c in self.captures)

    def read(
        self, feed: Callable[[ev.Event], None], read_into: Callable[..., ReadStats]
    ) -> list[dict[str, Any]]:
        """Feed what the window needs to the analysis; each segment read, described as
        ``read_into``'s stats describe it. Each call reads afresh (a pre-pass may read
        the window too): the counts are the last call's."""
        self.segments_read = self.segments_followed = self.requests_cut = 0
        self.opened, self.whole = [], set()
        described: list[dict[str, Any]] = []
        for plan in self.captures:
            follow = Follow(feed) if plan.before or plan.after else None
            sink = follow.feed if follow is not None else feed
            if not plan.read:
                # no segment of this capture is in the window: it is a tap all the same
                _feed_record(feed, plan.spans[0].header)
            for span in plan.read:
                self.opened.append(span.path)
                described.append(read_into(span.path, sink).describe(Path(span.path).name))
                self.whole.add(span.path)
                self.segments_read += 1
            if follow is not None and plan.read:
                follow.following = True
                for span in plan.after:
                    if not follow.open_requests:
                        break
                    self.opened.append(span.path)
                    stats, whole = _follow(span.path, follow)
                    described.append(stats.describe(Path(span.path).name))
                    if whole:
                        self.whole.add(span.path)
                    self.segments_followed += 1
            last = plan.spans[-1]
            ended = last.tail is not None and last.tail.get("type") == ev.CaptureEnd.TYPE
            if ended and last.tail is not None and last.path not in self.whole:
                _feed_record(feed, last.tail)  # how the tap's capture ended, from its tail
            if follow is not None:
                self.requests_cut += follow.cut_total
        self.segments_skipped = (
            sum(len(c.spans) for c in self.captures) - self.segments_read - self.segments_followed
        )
        return described

    def to_json(self) -> dict[str, Any]:
        return {
            "read": self.segments_read,
            "followed": self.segments_followed,
            "skipped": self.segments_skipped,
            "requests_cut": self.requests_cut,
        }


def _feed_record(feed: Callable[[ev.Event], None], record: dict[str, Any]) -> None:
    """A header or a ``capture_end`` the span read, to the analysis (a record with
    wrong-typed fields is left out, as the reader leaves it out)."""
    try:
        event = event_from_record(dict(record))
    except (ev.InvalidRecord, TypeError, ValueError, KeyError, AttributeError):
        return
    if event is not None:
        feed(event)


def plan_window(files: list[str], since_text: str | None, until_text: str | None) -> WindowPlan:
    """The segments a window needs, its times parsed as ``parse_time`` does over the
    whole captures (``+SECONDS`` from their first time; a time more than a minute
    outside them refused). A plan with no capture in it (``captures`` empty) means the
    ranges could not all be read: read everything."""
    groups = [spans_of(g) for g in _groups(files)]
    if not groups or any(g is None for g in groups):
        return WindowPlan(None, None, [])
    spans = [s for g in groups if g is not None for s in g]
    times = [t for s in spans for t in (s.header["t"], s.first, s.last) if t is not None]
    origin, end = min(times), max(times)
    since = parse_time(since_text, origin, end, option="--since") if since_text else None
    until = parse_time(until_text, origin, end, option="--until") if until_text else None
    captures = []
    for g in groups:
        assert g is not None
        inside = [i for i, s in enumerate(g) if s.overlaps(since, until)]
        if not inside:
            captures.append(CapturePlan(g, g, [], []))
            continue
        lo, hi = inside[0], inside[-1] + 1
        captures.append(CapturePlan(g, g[:lo], g[lo:hi], g[hi:]))
    return WindowPlan(since, until, captures, origin, end)


def _follow(path: str, follow: Follow) -> tuple[ReadStats, bool]:
    """Read a segment after the window until the requests still open have ended (True:
    it was read to its end)."""
    stats = ReadStats()
    events: Iterator[ev.Event] = read_events(path, stats)
    try:
        for event in events:
            follow.feed(event)
            if not follow.open_requests:
                return stats, False
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
    return stats, True


ConnKey = tuple[str, int]


class Follow:
    """One capture's events as the window sees them, passed on to ``feed``.

    Before the window (segments not read): a request whose head was not read is cut —
    its events dropped and counted, never a row without a head (a response the tap made
    itself on a connection opened in the window is kept, as always). After the window
    (``following``): only the events of requests and connections already open pass;
    ``open_requests`` says when nothing is left to wait for. Memory: the connections and
    requests in flight."""

    def __init__(self, feed: Callable[[ev.Event], None]) -> None:
        self._feed = feed
        self.following = False
        self.opened: set[ConnKey] = set()  # connections opened in what was read
        self.headed: dict[ConnKey, tuple[int, int]] = {}  # first and last seq headed
        self.open_requests: set[tuple[str, int, int]] = set()
        self._cut: set[tuple[str, int, int]] = set()  # cut requests still going
        self.cut_total = 0

    def feed(self, event: ev.Event) -> None:
        conn = getattr(event, "conn", None)
        seq = getattr(event, "seq", None)
        if isinstance(event, ev.ConnOpen):
            if not self.following:
                self.opened.add((event.tap, event.conn))
                self._feed(event)
            return
        if isinstance(event, ev.RequestHead):
            if self.following:
                return  # a request after the window
            ck = (event.tap, event.conn)
            lo, _ = self.headed.get(ck, (event.seq, event.seq))
            self.headed[ck] = (lo, event.seq)
            self.open_requests.add((event.tap, event.conn, event.seq))
            self._feed(event)
            return
        if isinstance(conn, int) and isinstance(seq, int):
            self._request_event(event, (event.tap, conn), seq)
            return
        if isinstance(event, ev.ConnClose):
            ck = (event.tap, event.conn)
            known = ck in self.opened or ck in self.headed
            self.opened.discard(ck)
            self.headed.pop(ck, None)
            if known or not self.following:
                self._feed(event)
            return
        if self.following and not isinstance(event, ev.CaptureEnd):
            return  # the window is over: samples, probes ... are not its
        self._feed(event)

    def _request_event(self, event: ev.Event, ck: ConnKey, seq: int) -> None:
        key = (ck[0], ck[1], seq)
        lo, hi = self.headed.get(ck, (0, 0))
        if (0 < lo <= seq <= hi) or (ck in self.opened and not self.following):
            if isinstance(event, ev.ResponseEnd):
                self.open_requests.discard(key)
            self._feed(event)
            return
        if not self.following and key not in self._cut:
            self._cut.add(key)  # its head is in a segment not read
            self.cut_total += 1
        if isinstance(event, ev.ResponseEnd):
            self._cut.discard(key)
