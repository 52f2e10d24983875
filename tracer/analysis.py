"""From events to per-connection and per-request tables: a pure fold over a capture.

``Summary.feed(event)`` accepts events in capture order (several captures one after the
other); ``Summary.result()`` gives the rows, the evidence timelines (engine samples,
probes, health, injected faults, hang marks) and the findings of ``tracer/findings.py``.
Nothing here reads files or clocks: the same events always give the same output. Memory
holds one row per request and connection plus per-request statistics of event timing,
never the events themselves. Schema: ``captures/ANALYSIS.md``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from . import events as ev

SCHEMA = "tracer.analysis/2"
ZERO_GAP = 0.001  # events closer than this arrived together
BUNCH_GAP = (0.030, 0.060)  # the delayed-ACK hold of a hop without TCP_NODELAY


@dataclass(slots=True)
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
    end: float | None = None  # wall clock of the response's end
    keep_alive: bool | None = None
    after_close: bool = False  # sent after the previous response said Connection: close
    body_sha256: str | None = None
    # SSE arrival statistics (per event, from the body records)
    first_event: float | None = None
    last_event: float | None = None
    event_gaps: int = 0
    zero_gaps: int = 0
    bunch_gaps: int = 0  # gaps of 30-60 ms
    injected: list[str] = field(default_factory=list)  # faults the tap injected itself


@dataclass(slots=True)
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
    engine: list[dict[str, Any]] = field(default_factory=list)  # engine samples, compact
    probes: list[dict[str, Any]] = field(default_factory=list)
    health: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    marks: list[float] = field(default_factory=list)  # "the harness was seen hung" times
    _closing: dict[tuple[str, int], bool] = field(default_factory=dict)

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
                    after_close=self._closing.get((event.tap, event.conn), False),
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
                    req.body_sha256 = event.body_sha256
            case ev.ResponseHead():
                req = self._request(event.tap, event.conn, event.seq, event.t)
                req.status = event.status
                req.sse = event.sse
                req.ttfb = event.ttfb
                req.by_tracer = event.by_tracer
                req.keep_alive = event.keep_alive
                if not event.keep_alive:
                    self._closing[(event.tap, event.conn)] = True
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
                req.end = event.t
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
            case ev.BodyData():
                if event.sse:
                    self._event_times(event)
            case ev.EngineSample():
                self.engine.append(
                    {
                        "t": event.t,
                        "tap": event.tap,
                        "url": event.url,
                        "source": event.source,
                        "ok": event.ok,
                        "error": event.error,
                        "profile": event.profile,
                        "state": event.state,
                        "deltas": event.deltas,
                        "interval": event.interval,
                        "restarted": event.restarted,
                    }
                )
            case ev.Probe():
                self.probes.append(
                    {
                        "t": event.t,
                        "tap": event.tap,
                        "url": event.url,
                        "target": event.target,
                        "outcome": event.outcome,
                        "status": event.status,
                        "latency": event.latency,
                        "reason": event.reason,
                        "trigger": [event.trigger_conn, event.trigger_seq],
                    }
                )
            case ev.HealthSample():
                self.health.append(
                    {
                        "t": event.t,
                        "tap": event.tap,
                        "url": event.url,
                        "ok": event.ok,
                        "status": event.status,
                        "error": event.error,
                    }
                )
            case ev.Anomaly():
                conn = self._conn(event.tap, event.conn)
                if conn is not None:
                    conn.anomalies.append(f"{event.direction}: {event.error}")
            case _:
                if event.TYPE == "fault":  # injected by the tap itself (--fault)
                    record = event.to_record()
                    self.faults.append(record)
                    conn, seq = record.get("conn"), record.get("seq")
                    if isinstance(conn, int) and isinstance(seq, int):
                        req = self._request(event.tap, conn, seq, event.t)
                        req.injected.append(str(record.get("spec") or record.get("fault")))
                elif event.TYPE == "mark":
                    self.marks.append(event.t)

    def _event_times(self, event: ev.BodyData) -> None:
        req = self._request(event.tap, event.conn, event.seq, event.t)
        for item in event.sse or []:
            if item[2] == "comment":
                continue
            at = event.t + item[0]
            if req.last_event is not None:
                gap = at - req.last_event
                req.event_gaps += 1
                if gap < ZERO_GAP:
                    req.zero_gaps += 1
                elif BUNCH_GAP[0] <= gap <= BUNCH_GAP[1]:
                    req.bunch_gaps += 1
            else:
                req.first_event = at
            req.last_event = at

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

    def result(
        self,
        *,
        captures: list[dict[str, Any]] | None = None,
        hang_at: list[float] | None = None,
        client_facing: list[str] | None = None,
        raw_rows: bool = False,
    ) -> dict[str, Any]:
        """The analysis document; ``raw_rows`` leaves the rows as dataclasses (for
        ``render.write_json``, which converts them one at a time)."""
        from .findings import Evidence, find

        conns = sorted(self.connections.values(), key=lambda c: (c.tap, c.opened, c.conn))
        reqs = sorted(self.requests.values(), key=lambda r: (r.tap, r.conn, r.seq))
        marks = sorted([*self.marks, *(hang_at or [])])
        evidence = Evidence(
            taps=self.taps,
            connections=conns,
            requests=reqs,
            engine=self.engine,
            probes=self.probes,
            health=self.health,
            faults=self.faults,
            marks=marks,
            client_facing=set(client_facing or []),
            end=self.last_t,
        )
        findings, verdict = find(evidence)
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
            "connections": conns if raw_rows else [asdict(c) for c in conns],
            "requests": reqs if raw_rows else [asdict(r) for r in reqs],
            "verdict": verdict,
            "findings": findings,
            "evidence": {
                "engine_samples": len(self.engine),
                "engine_urls": sorted({e["url"] for e in self.engine}),
                "probes": self.probes,
                "health_samples": len(self.health),
                "injected_faults": len(self.faults),
                "marks": marks,
            },
        }
