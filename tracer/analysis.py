"""From events to per-connection and per-request tables: a pure fold over a capture.

``Summary.feed(event)`` accepts events in capture order; ``Summary.result()`` gives the
rows. Nothing here reads files or clocks: the same events always give the same rows.
The full attribution (findings) builds on these rows in a later step; the JSON carries
an empty ``findings`` list until then. Schema: ``captures/ANALYSIS.md``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from . import events as ev

SCHEMA = "tracer.analysis/1"


@dataclass
class RequestRow:
    id: str
    tap: str
    conn: int
    seq: int
    reused: bool
    idle_before: float
    start: float  # wall clock
    method: str
    target: str
    request_id: str | None = None
    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    messages: int | None = None
    request_bytes: int | None = None
    request_complete: bool | None = None
    body_kept: bool | None = None
    pipelined: bool = False
    status: int | None = None
    sse: bool = False
    ttfb: float | None = None
    first_token: float | None = None
    duration: float | None = None
    max_gap: float | None = None
    response_bytes: int = 0
    events: int = 0
    comments: int = 0
    done: bool = False
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    termination: str = "in_flight"
    close: str | None = None
    mid_event: bool = False
    detail: str | None = None
    stalls: list[dict[str, Any]] = field(default_factory=list)
    by_tracer: bool = False


@dataclass
class ConnectionRow:
    id: str
    tap: str
    conn: int
    peer: str
    opened: float
    closed: float | None = None
    duration: float | None = None
    requests: int = 0
    closed_by: str | None = None
    how: str | None = None
    half_close: str | None = None
    in_flight_at_close: bool | None = None
    bytes_from_client: int | None = None
    bytes_from_upstream: int | None = None
    upstream_local: str | None = None
    upstream_connect: float | None = None
    upstream_error: str | None = None
    anomalies: list[str] = field(default_factory=list)


@dataclass
class Summary:
    """Fold of a capture into rows; memory holds the rows, not the events."""

    connections: dict[tuple[str, int], ConnectionRow] = field(default_factory=dict)
    requests: dict[tuple[str, int, int], RequestRow] = field(default_factory=dict)
    taps: dict[str, dict[str, Any]] = field(default_factory=dict)
    capture_losses: int = 0
    events: int = 0
    first_t: float | None = None
    last_t: float | None = None

    def feed(self, event: ev.Event) -> None:
        self.events += 1
        if self.first_t is None or event.t < self.first_t:
            self.first_t = event.t
        if self.last_t is None or event.t > self.last_t:
            self.last_t = event.t
        match event:
            case ev.CaptureStart():
                self.taps.setdefault(
                    event.tap,
                    {
                        "tap": event.tap,
                        "kind": event.kind,
                        "listen": event.listen,
                        "upstream": event.upstream,
                        "tracer_version": event.tracer_version,
                        "started": event.t,
                        "ended": None,
                        "dropped": 0,
                    },
                )
            case ev.CaptureEnd():
                tap = self.taps.get(event.tap)
                if tap is not None:
                    tap["ended"] = event.t
                    tap["dropped"] = event.dropped
            case ev.CaptureLoss():
                self.capture_losses += event.dropped
            case ev.ConnOpen():
                self.connections[(event.tap, event.conn)] = ConnectionRow(
                    id=f"{event.tap}/{event.conn}",
                    tap=event.tap,
                    conn=event.conn,
                    peer=event.peer,
                    opened=event.t,
                )
            case ev.UpstreamConnect():
                conn = self._conn(event.tap, event.conn)
                if conn is not None:
                    if event.phase == "done":
                        conn.upstream_local = event.local
                        conn.upstream_connect = event.elapsed
                    elif event.phase == "failed":
                        conn.upstream_error = event.error
                        conn.upstream_connect = event.elapsed
            case ev.ConnClose():
                conn = self._conn(event.tap, event.conn)
                if conn is not None:
                    conn.closed = event.t
                    conn.duration = event.duration
                    conn.closed_by = event.closed_by
                    conn.how = event.how
                    conn.half_close = event.half_close
                    conn.in_flight_at_close = event.in_flight
                    conn.bytes_from_client = event.bytes_from_client
                    conn.bytes_from_upstream = event.bytes_from_upstream
                    conn.requests = event.requests
            case ev.RequestHead():
                key = (event.tap, event.conn, event.seq)
                self.requests[key] = RequestRow(
                    id=f"{event.tap}/{event.conn}/{event.seq}",
                    tap=event.tap,
                    conn=event.conn,
                    seq=event.seq,
                    reused=event.seq > 1,
                    idle_before=event.idle_before,
                    start=event.t,
                    method=event.method,
                    target=event.target,
                    request_id=event.request_id,
                    pipelined=event.pipelined,
                )
                conn = self._conn(event.tap, event.conn)
                if conn is not None:
                    conn.requests = max(conn.requests, event.seq)
            case ev.RequestEnd():
                req = self.requests.get((event.tap, event.conn, event.seq))
                if req is not None:
                    req.request_bytes = event.body_bytes
                    req.request_complete = event.complete
                    req.body_kept = event.body_kept
                    req.model = event.model
                    req.stream = event.stream
                    req.max_tokens = event.max_tokens
                    req.messages = event.messages
            case ev.ResponseHead():
                req = self._request(event.tap, event.conn, event.seq, event.t)
                req.status = event.status
                req.sse = event.sse
                req.ttfb = event.ttfb
                req.by_tracer = event.by_tracer
            case ev.ResponseEnd():
                req = self._request(event.tap, event.conn, event.seq, event.t)
                req.termination = event.termination
                req.status = event.status if event.status is not None else req.status
                req.duration = event.duration
                req.first_token = event.first_token
                req.max_gap = event.max_gap
                req.response_bytes = event.body_bytes
                req.events = event.events
                req.comments = event.comments
                req.done = event.done
                req.finish_reason = event.finish_reason
                req.usage = event.usage
                req.error = event.error
                req.close = event.close
                req.mid_event = event.mid_event
                req.detail = event.detail
            case ev.Stall():
                req = self._request(event.tap, event.conn, event.seq, event.t)
                if event.phase == "start":
                    req.stalls.append(
                        {
                            "start": event.t - event.silent_for,
                            "direction": event.direction,
                            "end": None,
                            "duration": None,
                        }
                    )
                elif req.stalls and req.stalls[-1]["end"] is None:
                    req.stalls[-1]["end"] = event.t
                    req.stalls[-1]["duration"] = event.silent_for
            case ev.Anomaly():
                conn = self._conn(event.tap, event.conn)
                if conn is not None:
                    conn.anomalies.append(f"{event.direction}: {event.error}")
            case _:
                pass

    def _conn(self, tap: str, conn: int) -> ConnectionRow | None:
        return self.connections.get((tap, conn))

    def _request(self, tap: str, conn: int, seq: int, t: float) -> RequestRow:
        key = (tap, conn, seq)
        req = self.requests.get(key)
        if req is None:  # a tap-generated response before any parsed request
            req = RequestRow(
                id=f"{tap}/{conn}/{seq}",
                tap=tap,
                conn=conn,
                seq=seq,
                reused=seq > 1,
                idle_before=0.0,
                start=t,
                method="",
                target="",
            )
            self.requests[key] = req
        return req

    def result(self, *, captures: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        conns = sorted(self.connections.values(), key=lambda c: (c.tap, c.opened, c.conn))
        reqs = sorted(self.requests.values(), key=lambda r: (r.tap, r.conn, r.seq))
        terminations: dict[str, int] = {}
        for r in reqs:
            terminations[r.termination] = terminations.get(r.termination, 0) + 1
        return {
            "schema": SCHEMA,
            "captures": captures or [],
            "taps": [self.taps[k] for k in sorted(self.taps)],
            "time_range": {"start": self.first_t, "end": self.last_t},
            "totals": {
                "events": self.events,
                "connections": len(conns),
                "requests": len(reqs),
                "reused_requests": sum(1 for r in reqs if r.reused),
                "terminations": dict(sorted(terminations.items())),
                "stalls": sum(len(r.stalls) for r in reqs),
                "capture_records_lost": self.capture_losses,
            },
            "connections": [asdict(c) for c in conns],
            "requests": [asdict(r) for r in reqs],
            "findings": [],
        }
