"""What a capture says about its requests, for a replay: connections, requests, outcomes.

Sans-I/O: a capture's events in, connections, requests and outcomes out. The original
capture and the replay's own capture go through the same ``load`` and the same
``outcome`` rule, so the comparison (``replay_compare``) is like for like: both are what
a tap saw.

Outcomes (one word per request, the unit of the verdict):

* ``complete``  -- the framing ended cleanly (for SSE: with ``[DONE]`` or a finish reason);
* ``error``     -- an HTTP status >= 400, an SSE error event, or the tap's own 502/400;
* ``truncated`` -- the upstream closed before the end (or an SSE stream ended without
  ``[DONE]`` nor a finish reason);
* ``hung``      -- the response never ended and nothing came from upstream for the last
  ``HUNG_SILENCE`` seconds before the client gave up or the capture stopped (or the tap
  recorded an upstream-silent stall still open at the end); in a replay, every request
  the replay gave up on (``--stall-timeout``, ``--timeout``);
* ``aborted``   -- the client closed while bytes were still flowing;
* ``in_flight`` -- still flowing when the capture stopped;
* ``unparsed``  -- the tap could not follow the framing;
* ``not_sent``  -- (replay only) the request could not be sent: its connection was
  closed by the target, or given up on, before its turn.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import os
from dataclasses import dataclass, field

from .. import events as ev
from ..analysis.summary import RequestRow, Summary
from ..capture.bodies import decode_body
from ..capture.files import (
    PACKETS,
    CaptureError,
    PacketOptions,
    ReadStats,
    expand_captures,
    file_kind,
    not_a_capture,
    read_events,
)

HUNG_SILENCE = 1.0  # seconds of upstream silence before a client gave up: a hang


@dataclass(slots=True)
class CapturedRequest:
    """One request as captured: enough to send it again and to pace its reading."""

    conn: int
    seq: int
    head_m: float
    head_t: float
    idle_before: float
    method: str
    target: str
    version: str
    headers: list[list[str]]
    request_id: str | None = None
    pipelined: bool = False
    content_length: int | None = None
    chunked: bool = False
    body: bytes | None = None  # None: not kept (see body_problem)
    body_bytes: int = 0
    body_problem: str | None = None
    read_times: list[float] = field(default_factory=list)  # from head_m, per body read
    read_totals: list[int] = field(default_factory=list)  # body bytes received by then
    last_activity_m: float = 0.0  # last byte from upstream (or the head itself)
    end_m: float | None = None  # the response's end as the tap recorded it

    @property
    def key(self) -> str:
        return f"{self.conn}:{self.seq}"

    def allowed_bytes(self, elapsed: float) -> int | None:
        """Body bytes the original client had received ``elapsed`` s after its request
        head; None once past the last read (no more pacing to follow)."""
        if not self.read_times or elapsed >= self.read_times[-1]:
            return None
        i = bisect.bisect_right(self.read_times, elapsed)
        return self.read_totals[i - 1] if i else 0

    def time_for(self, received: int) -> float:
        """When (from its head) the original had received ``received`` body bytes; the
        time of its last read when it never received as many; 0 without reads."""
        if not self.read_times:
            return 0.0
        i = bisect.bisect_left(self.read_totals, received)
        return self.read_times[min(i, len(self.read_times) - 1)]


@dataclass(slots=True)
class CapturedConn:
    conn: int
    open_m: float
    peer: str
    close_m: float | None = None
    requests: list[CapturedRequest] = field(default_factory=list)


@dataclass
class Capture:
    """One tap's capture, folded: connections with their requests, and analysis rows."""

    path: str
    tap: str
    kind: str
    conns: dict[int, CapturedConn]
    rows: dict[tuple[int, int], RequestRow]
    end_m: float
    stats: ReadStats
    connect_errors: list[str] = field(default_factory=list)  # upstream connects that failed

    def requests(self) -> list[CapturedRequest]:
        return sorted((r for c in self.conns.values() for r in c.requests), key=lambda r: r.head_m)

    def outcome(self, req: CapturedRequest) -> str:
        return outcome(self.rows.get((req.conn, req.seq)), req, self.end_m)


def load(path: str | os.PathLike[str], packets: PacketOptions = PACKETS) -> Capture:
    """Fold a capture file (or the segments of a rotated one: its folder); raises
    CaptureError (unreadable) or ValueError (not one tap)."""
    stats = ReadStats()
    summary = Summary()
    conns: dict[int, CapturedConn] = {}
    reqs: dict[tuple[int, int], CapturedRequest] = {}
    taps: set[str] = set()
    connect_errors: list[str] = []
    kind = "proxy"
    end_m = -math.inf
    files = expand_captures([path])
    for name in files or [str(path)]:
        kind = file_kind(name)
        if kind not in ("capture", "text", "pcap", "pcapng"):  # a pcap: read as its tap
            raise CaptureError(not_a_capture(name, kind))
    kind = "proxy"
    try:
        events = (e for seg in files for e in read_events(seg, stats, packets))
        for event in events:
            summary.feed(event)
            end_m = max(end_m, event.m)
            _fold(event, conns, reqs, taps)
            if isinstance(event, ev.CaptureStart):
                kind = event.kind
            elif isinstance(event, ev.UpstreamConnect) and event.phase == "failed":
                connect_errors.append(f"{event.addr}: {event.error}")
    except OSError as exc:
        raise CaptureError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if stats.version is None:
        what = f"{stats.bad_lines} unparseable line(s)" if stats.bad_lines else "empty"
        raise CaptureError(f"{path}: not a tracer capture: no capture_start, {what}")
    if len(taps) > 1:
        raise ValueError(
            f"{path} holds the captures of several taps ({', '.join(sorted(taps))}); "
            "replay one tap's capture"
        )
    tap = next(iter(taps), "")
    rows = {(c, s): row for (_, c, s), row in summary.requests.items()}
    return Capture(
        path=str(path),
        tap=tap,
        kind=kind,
        conns=conns,
        rows=rows,
        end_m=end_m if conns else 0.0,
        stats=stats,
        connect_errors=connect_errors,
    )


def _fold(
    event: ev.Event,
    conns: dict[int, CapturedConn],
    reqs: dict[tuple[int, int], CapturedRequest],
    taps: set[str],
) -> None:
    match event:
        case ev.CaptureStart():
            taps.add(event.tap)
        case ev.ConnOpen():
            conns[event.conn] = CapturedConn(conn=event.conn, open_m=event.m, peer=event.peer)
        case ev.ConnClose():
            if event.conn in conns:
                conns[event.conn].close_m = event.m
        case ev.RequestHead():
            req = CapturedRequest(
                conn=event.conn,
                seq=event.seq,
                head_m=event.m,
                head_t=event.t,
                idle_before=event.idle_before,
                method=event.method,
                target=event.target,
                version=event.version,
                headers=event.headers,
                request_id=event.request_id,
                pipelined=event.pipelined,
                content_length=event.content_length,
                chunked=event.chunked,
                last_activity_m=event.m,
            )
            if not event.chunked and not event.content_length:
                req.body = b""  # no body to keep
            else:
                req.body_problem = "its body never ended in the capture"
            reqs[(event.conn, event.seq)] = req
            conn = conns.setdefault(
                event.conn, CapturedConn(conn=event.conn, open_m=event.m, peer="?")
            )
            conn.requests.append(req)
        case ev.RequestEnd():
            req_or_none = reqs.get((event.conn, event.seq))
            if req_or_none is not None:
                _body(req_or_none, event)
        case ev.ResponseHead():
            req_or_none = reqs.get((event.conn, event.seq))
            if req_or_none is not None:
                req_or_none.last_activity_m = max(req_or_none.last_activity_m, event.m)
        case ev.BodyData():
            req_or_none = reqs.get((event.conn, event.seq))
            if req_or_none is not None:
                total = req_or_none.read_totals[-1] if req_or_none.read_totals else 0
                for read in event.reads:
                    total += int(read[1])
                    at = event.m + float(read[0])
                    req_or_none.read_times.append(at - req_or_none.head_m)
                    req_or_none.read_totals.append(total)
                    req_or_none.last_activity_m = max(req_or_none.last_activity_m, at)
        case ev.ResponseEnd():
            req_or_none = reqs.get((event.conn, event.seq))
            if req_or_none is not None:
                req_or_none.end_m = event.m
        case _:
            pass


def _body(req: CapturedRequest, end: ev.RequestEnd) -> None:
    req.body_bytes = end.body_bytes
    if not end.complete:
        req.body, req.body_problem = None, "its body was cut short in the capture"
        return
    if end.body_bytes == 0:
        req.body, req.body_problem = b"", None
        return
    if not end.body_kept or end.body is None:
        req.body, req.body_problem = None, "its body was not kept"
        return
    raw = decode_body(end.body, end.body_encoding)
    if hashlib.sha256(raw).hexdigest() != end.body_sha256:
        req.body, req.body_problem = None, "its kept body does not match its sha256"
        return
    req.body, req.body_problem = raw, None


def outcome(row: RequestRow | None, req: CapturedRequest, capture_end_m: float) -> str:
    """The one-word outcome of a request (module docstring), from what its tap saw."""
    if row is None:
        return "in_flight"
    term = row.termination
    if term == "complete":
        failed = (row.status is not None and row.status >= 400) or row.error is not None
        if failed:
            return "error"
        if row.sse and row.events and not row.done and row.finish_reason is None:
            return "truncated"
        return "complete"
    if term == "truncated":
        return "truncated"
    if term == "tracer_response":
        return "error"
    if term == "unparsed":
        return "unparsed"
    # the response never ended: the client left (client_abort) or the capture stopped
    open_stall = bool(
        row.stalls
        and row.stalls[-1]["end"] is None
        and row.stalls[-1]["direction"] == "upstream_silent"
    )
    end = req.end_m if req.end_m is not None else capture_end_m
    if open_stall or end - req.last_activity_m >= HUNG_SILENCE:
        return "hung"
    return "aborted" if term == "client_abort" else "in_flight"
