"""From events to per-connection and per-request tables: a pure fold over a capture.

``Summary.feed(event)`` accepts events in capture order (several captures one after the
other); ``Summary.result()`` gives the rows, the evidence timelines (engine samples,
probes, health, injected faults, hang marks) and the findings of ``tracer/analysis/findings/``.
Nothing here reads files or clocks: the same events always give the same output.

Memory is bounded by what is in flight, not by the capture's size: a request's row stays
in memory while the request is open and for ``recent`` finished requests after it (late
events, e.g. a stall's end after the response's end, still land on it); then it goes to a
``SortedSpool`` (sorted runs on disk once more than ``spill_rows`` are waiting) and its
key to a bounded list of finished keys, so that an event arriving later still is counted
(``late_events``) and ignored rather than starting a ghost row. Connections likewise,
from their close. Engine and health samples go to a ``ChunkLog`` (chunks on disk, read
back by time window). The tables are read back in table order, merged, one row at a
time. Schema and memory model: ``captures/ANALYSIS.md``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any

from .. import events as ev
from ..evidence.ranges import out_of_range
from ..protocol.probe_mark import PROBE_HEADER, KnownTaps
from ..redact import redact_target, scrub_text
from ..times import iso
from .caveats import _caveats
from .findings import Evidence, find
from .findings.clocks import Clocks, clock_caveats, shift_clock
from .request_headers import _header, _retry_count, _trace_fields
from .rows import BUNCH_GAP as BUNCH_GAP
from .rows import ZERO_GAP as ZERO_GAP
from .rows import ConnectionRow as ConnectionRow
from .rows import RequestRow as RequestRow
from .spill import ChunkLog
from .tables import (
    _CONNECTION_VALUES,
    _REQUEST_VALUES,
    ConnKey,
    RequestKey,
    Rows,
    Table,
    _connection_from,
    _request_from,
    connection_order,
    request_order,
)

SCHEMA = "tracer.analysis/6"
SPILL_ROWS = 4096  # finished rows held in memory before a sorted run goes to disk
RECENT_ROWS = 1024  # finished rows that late events can still update
FINISHED_KEYS = 16384  # keys of rows written out, remembered to ignore late events
CLIENT_FAILURES_KEPT = 20  # client connections failed before a first request, quoted
MAX_LAGS = 10_000  # tap_lag records kept (one a second at most per tap)
GAPS_KEPT = 20  # requests whose head a packet capture lost, named
UNVOUCHED_KEPT = 20  # requests with an x-tracer-probe no capture vouches for, named


def _declared(start: ev.CaptureStart) -> dict[str, Any] | None:
    """The header's declared role (``--upstream-role``, ``--client-facing``), if any."""
    if start.upstream_role is None and not start.client_facing:
        return None
    return {
        "upstream_role": start.upstream_role or "unknown",
        "basis": "declared" if start.upstream_role else "unknown",
        "evidence": ["declared with --upstream-role"] if start.upstream_role else [],
        "client_facing": bool(start.client_facing),
        "server": None,
    }


class _Totals:
    """Counts over finished-for-good requests, kept as they are written out."""

    def __init__(self) -> None:
        self.reused = 0
        self.stalls = 0
        self.terminations: Counter[str] = Counter()

    def add(self, r: RequestRow) -> None:
        self.reused += r.reused
        self.stalls += len(r.stalls)
        self.terminations[r.termination] += 1


class Summary:
    """Fold of a capture into rows; memory holds the open rows, not the events.

    ``spill_rows``, ``recent_rows``, ``finished_keys`` and ``spill_samples`` set the
    memory model's bounds (see the module docstring); the output does not depend on them
    as long as no event arrives more than ``recent_rows`` finished requests late.
    """

    def __init__(
        self,
        *,
        spill_rows: int = SPILL_ROWS,
        recent_rows: int = RECENT_ROWS,
        finished_keys: int = FINISHED_KEYS,
        spill_samples: int = 512,
        known_taps: KnownTaps | None = None,
        clocks: Clocks | None = None,
    ) -> None:
        if recent_rows < 0 or finished_keys < 0:
            raise ValueError("recent_rows and finished_keys must not be negative")
        bounds = {"spill": spill_rows, "recent": recent_rows, "remember": finished_keys}
        self.requests: Table[RequestKey, RequestRow] = Table(
            request_order, request_order, _REQUEST_VALUES, _request_from, **bounds
        )
        self.connections: Table[ConnKey, ConnectionRow] = Table(
            lambda c: (c.tap, c.conn),
            connection_order,
            _CONNECTION_VALUES,
            _connection_from,
            **bounds,
        )
        self.taps: dict[str, dict[str, Any]] = {}
        self.capture_losses = 0
        self.loss_windows: list[dict[str, Any]] = []  # when each tap's writer dropped records
        self.packet_losses: list[str] = []  # what a packet capture says it missed
        self.events = 0
        self.late_events = 0  # events for a row already written out: counted, ignored
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.engine_samples = ChunkLog(limit=spill_samples)  # compact records
        self.health_samples = ChunkLog(limit=spill_samples)
        self.probes: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.fault_plans: list[dict[str, Any]] = []  # the faults changed at run time
        self.marks: list[float] = []  # "the harness was seen hung" times
        # client connections that failed before a first request (not HTTP, a failed TLS
        # handshake): the first few, and how many in all
        self.client_failures: list[dict[str, Any]] = []
        self.client_failures_total = 0
        self.engine_urls: set[str] = set()
        self.health_urls: set[str] = set()
        # engine samples dropped for a figure out of its range (evidence/ranges.py): the
        # count of samples, and per figure how many samples had it out of range
        self.samples_out_of_range = 0
        self.figures_out_of_range: Counter[str] = Counter()
        self.request_taps: set[str] = set()  # taps that parsed at least one request
        self._totals = _Totals()
        self._closing: dict[ConnKey, bool] = {}
        self._own: set[RequestKey] = set()  # the taps' own requests in flight (probes)
        self.own_requests = 0
        # whose x-tracer-probe to believe: the nonces of the captures in the analysis
        self.known_taps = known_taps if known_taps is not None else KnownTaps()
        # taps whose wall clocks disagree: their times shifted onto the front tap's
        self.clocks = clocks if clocks is not None else Clocks()
        self._shift = self.clocks.applied
        # requests that carried x-tracer-probe no capture here vouches for: the client's
        self.unvouched: list[str] = []  # (the first few ids)
        self.unvouched_total = 0
        # requests a packet capture's gap swallowed whole (no head, so no row)
        self.headless: list[dict[str, Any]] = []
        self.headless_gaps = 0
        self.lags: list[dict[str, Any]] = []  # windows where a tap's own loop ran late
        self._engine_list: list[dict[str, Any]] | None = None
        self._copies: Iterable[tuple[Any, ...]] = ()  # the join's, read with the rows
        self._health_list: list[dict[str, Any]] | None = None

    @property
    def engine(self) -> list[dict[str, Any]]:
        """All engine samples as one list (in memory: for consumers that need a list)."""
        if self._engine_list is None or len(self._engine_list) != len(self.engine_samples):
            self._engine_list = list(self.engine_samples)
        return self._engine_list

    @property
    def health(self) -> list[dict[str, Any]]:
        """All health samples as one list (in memory)."""
        if self._health_list is None or len(self._health_list) != len(self.health_samples):
            self._health_list = list(self.health_samples)
        return self._health_list

    def close(self) -> None:
        """Free the temporary files now (they go away with the process anyway)."""
        close = getattr(self._copies, "close", None)
        if close is not None:
            close()
        self.requests.close()
        self.connections.close()
        self.engine_samples.close()
        self.health_samples.close()

    def __enter__(self) -> Summary:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def feed(self, event: ev.Event) -> None:
        self.events += 1
        if self._shift and event.tap in self._shift:
            shift_clock(event, self._shift[event.tap])
        if self.first_t is None or event.t < self.first_t:
            self.first_t = event.t
        if self.last_t is None or event.t > self.last_t:
            self.last_t = event.t
        if self._own and self._own_traffic(event):
            return
        match event:
            case ev.BodyData():
                if event.sse:
                    self._event_times(event)
            case ev.RequestHead():
                key = (event.tap, event.conn, event.seq)
                ckey = (event.tap, event.conn)
                probe = _header(event.headers, PROBE_HEADER)
                if probe is not None and not self.known_taps.own(probe, event.tap):
                    self.unvouched_total += 1  # stays a client request, with a note
                    if len(self.unvouched) < UNVOUCHED_KEPT:
                        self.unvouched.append(f"{event.tap}/{event.conn}/{event.seq}")
                elif probe is not None:
                    self._own.add(key)
                    self.own_requests += 1
                    conn = self._conn(event.tap, event.conn)
                    if conn is not None:
                        conn.probes += 1
                    return
                trace_id, parent_span_id, trace_error = _trace_fields(event.headers)
                self.requests.start(
                    key,
                    RequestRow(
                        trace_id=trace_id,
                        parent_span_id=parent_span_id,
                        trace_error=trace_error,
                        id=f"{event.tap}/{event.conn}/{event.seq}",
                        tap=event.tap,
                        conn=event.conn,
                        seq=event.seq,
                        reused=event.seq > 1,
                        idle_before=event.idle_before,
                        start=event.t,
                        method=event.method,
                        target=redact_target(event.target),  # captures older than the policy
                        request_id=event.request_id,
                        retry_count=_retry_count(event.headers),
                        version=event.version,
                        pipelined=event.pipelined,
                        expect_continue=event.expect_continue,
                        after_close=self._closing.get(ckey, False),
                    ),
                )
                self.request_taps.add(event.tap)
                conn = self._conn(event.tap, event.conn)
                if conn is not None:
                    conn.requests = max(conn.requests, event.seq)
                    if trace_error is not None:  # kept as an anomaly, never trusted
                        conn.anomalies.append(f"client: request {event.seq}: {trace_error}")
            case ev.RequestEnd():
                req, written = self.requests.lookup((event.tap, event.conn, event.seq))
                self.late_events += written
                if req is not None:
                    req.request_bytes = event.body_bytes
                    req.request_complete = event.complete
                    req.body_kept = event.body_kept
                    req.model = event.model
                    req.stream = event.stream
                    req.max_tokens = event.max_tokens
                    req.messages = event.messages
                    req.prompt_chars = event.prompt_chars
                    req.body_sha256 = event.body_sha256
                    req.content_sha256 = event.content_sha256
            case ev.Informational():
                req, written = self.requests.lookup((event.tap, event.conn, event.seq))
                self.late_events += written
                if req is not None and event.status == 100:
                    req.continued = True
            case ev.ResponseHead():
                req = self._request(event.tap, event.conn, event.seq, event.t)
                if req is not None:
                    req.status = event.status
                    req.sse = event.sse
                    req.ttfb = event.ttfb
                    req.by_tracer = event.by_tracer
                    req.keep_alive = event.keep_alive
                if not event.keep_alive:
                    self._closing[(event.tap, event.conn)] = True
            case ev.ResponseEnd():
                req = self._request(event.tap, event.conn, event.seq, event.t)
                if req is not None:
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
                    self._finish_request((event.tap, event.conn, event.seq))
            case ev.Stall():
                req = self._request(event.tap, event.conn, event.seq, event.t)
                if req is None:
                    pass  # late: counted
                elif event.phase == "start":
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
            case ev.ConnOpen():
                self.connections.start(
                    (event.tap, event.conn),
                    ConnectionRow(
                        id=f"{event.tap}/{event.conn}",
                        tap=event.tap,
                        conn=event.conn,
                        peer=event.peer,
                        opened=event.t,
                    ),
                )
            case ev.UpstreamConnect():
                conn = self._conn(event.tap, event.conn)
                if conn is not None:
                    conn.upstream = event.addr
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
                self._finish_connection((event.tap, event.conn))
            case ev.EngineSample():
                self.engine_urls.add(event.url)
                bad = out_of_range(event.state, event.deltas, event.interval)
                if bad:  # not evidence: dropped here, for every reader of the samples
                    self.samples_out_of_range += 1
                    self.figures_out_of_range.update(bad)
                    return
                self.engine_samples.append(
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
                self.health_urls.add(event.url)
                self.health_samples.append(
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
                if event.gap is not None and event.seq is not None:
                    self._gapped(event)
                elif event.gap is not None and len(self.packet_losses) < 5:
                    # a connection the packet capture joined mid-way: said beside the verdict
                    self.packet_losses.append(
                        f"tap {event.tap}: connection {event.conn}: {event.error}"
                    )
                conn = self._conn(event.tap, event.conn)
                if conn is not None:
                    conn.anomalies.append(f"{event.direction}: {scrub_text(event.error)}")
                    failed = event.gap is None and event.seq is None  # (not a capture's gap)
                    if event.direction == "client" and failed and not conn.requests:
                        self._client_failed(event)
            case ev.CaptureStart():
                self.known_taps.add(event.tap, event.kind, event.probe_nonce)
                self.taps.setdefault(
                    event.tap,
                    {
                        "tap": event.tap,
                        "kind": event.kind,
                        "listen": event.listen,
                        "upstream": event.upstream,
                        "tracer_version": event.tracer_version,
                        "boot_id": event.boot_id,
                        # the tap's own clock, as it wrote it (not as shifted onto the
                        # front tap's): which taps read one clock is a fact of the headers
                        "wall_offset": round(
                            event.t + self._shift.get(event.tap, 0.0) - event.m, 6
                        ),
                        "started": event.t,
                        "ended": None,
                        "dropped": 0,
                        "topology": _declared(event),
                    },
                )
            case ev.Topology():
                tap = self.taps.get(event.tap)
                if tap is not None and (
                    tap.get("topology") is None or tap["topology"]["basis"] != "declared"
                ):  # a declared role wins over the fingerprint
                    tap["topology"] = {
                        "upstream_role": event.upstream_role,
                        "basis": event.basis,
                        "evidence": list(event.evidence),
                        "client_facing": event.client_facing,
                        "server": event.server,
                    }
            case ev.TapLag():
                if len(self.lags) < MAX_LAGS:
                    blocked_at = event.t - (event.m - event.max_lag_at)  # wall time
                    self.lags.append(
                        {
                            "tap": event.tap,
                            "start": event.t - (event.m - event.window_start),
                            "end": event.t,
                            "max_lag": event.max_lag,
                            "blocked": [blocked_at - event.max_lag, blocked_at],
                        }
                    )
            case ev.CaptureEnd():
                tap = self.taps.get(event.tap)
                if tap is not None:
                    tap["ended"] = event.t
                    tap["dropped"] = event.dropped
            case ev.CaptureLoss() if event.reason.startswith("packet capture"):
                # a pcap's own losses (kernel drops, snaplen, gaps), not the writer's
                if len(self.packet_losses) < 5:
                    self.packet_losses.append(f"tap {event.tap}: {event.reason}")
            case ev.CaptureLoss():
                self.capture_losses += event.dropped
                self.loss_windows.append(
                    {
                        "tap": event.tap,
                        "first": event.first_t,
                        "last": event.last_t if event.last_t is not None else event.t,
                        "dropped": event.dropped,
                        "reason": event.reason,
                        "resumed": event.resumed,
                    }
                )
            case _:
                if event.TYPE == "fault":  # injected by the tap itself (--fault)
                    record = event.to_record()
                    self.faults.append(record)
                    conn_id, seq = record.get("conn"), record.get("seq")
                    if isinstance(conn_id, int) and isinstance(seq, int):
                        req = self._request(event.tap, conn_id, seq, event.t)
                        if req is not None:
                            req.injected.append(str(record.get("spec") or record.get("fault")))
                elif event.TYPE == "mark":
                    self.marks.append(event.t)
                elif isinstance(event, ev.FaultPlanChanged):
                    self.fault_plans.append(
                        {
                            "tap": event.tap,
                            "t": event.t,
                            "change": event.change,
                            "faults": list(event.faults),
                        }
                    )

    def _event_times(self, event: ev.BodyData) -> None:
        req = self._request(event.tap, event.conn, event.seq, event.t)
        if req is None:
            return
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
            if item[1] > req.max_event_bytes:  # the largest event: a client's line limit
                req.max_event_bytes, req.max_event_at = item[1], at

    def _conn(self, tap: str, conn: int) -> ConnectionRow | None:
        row, written = self.connections.lookup((tap, conn))
        self.late_events += written
        return row

    def _request(self, tap: str, conn: int, seq: int, t: float) -> RequestRow | None:
        """The request's row; a new one for a response before any parsed request; None
        (and counted) for an event after the row was written out."""
        key = (tap, conn, seq)
        req, written = self.requests.lookup(key)
        if written:
            self.late_events += 1
            return None
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
            self.requests.start(key, req)
        return req

    def _own_traffic(self, event: ev.Event) -> bool:
        """An event of a tap's own request (kept out of the tables); its end forgets it."""
        seq = getattr(event, "seq", None)
        if seq is None:
            return False
        key = (event.tap, getattr(event, "conn", -1), seq)
        if key not in self._own:
            return False
        if isinstance(event, ev.ResponseEnd):
            self._own.discard(key)
        return True

    def _gapped(self, event: ev.Anomaly) -> None:
        """A packet capture missed bytes of this request: its row says so; a request whose
        head was lost whole has no row, and is named in the ``packet_gap`` finding."""
        assert event.seq is not None
        key = (event.tap, event.conn, event.seq)
        req, written = self.requests.lookup(key)
        self.late_events += written
        if req is not None:
            req.capture_gap = max(req.capture_gap or 0, event.gap or 0)
        elif not written:
            self.headless_gaps += 1
            if len(self.headless) < GAPS_KEPT:
                self.headless.append(
                    {"id": f"{event.tap}/{event.conn}/{event.seq}", "t": event.t, "gap": event.gap}
                )

    def _client_failed(self, event: ev.Anomaly) -> None:
        self.client_failures_total += 1
        if len(self.client_failures) < CLIENT_FAILURES_KEPT:
            self.client_failures.append(
                {
                    "t": event.t,
                    "tap": event.tap,
                    "conn": event.conn,
                    "error": scrub_text(event.error),
                }
            )

    def _finish_request(self, key: RequestKey) -> None:
        written = self.requests.finish(key)
        if written is not None:
            self._totals.add(written)

    def _finish_connection(self, key: ConnKey) -> None:
        """The connection closed: its row is complete (a request that never ended stays
        in memory: it is in flight, or an anomaly that a finding will name)."""
        written = self.connections.finish(key)
        if written is not None:
            self._closing.pop((written.tap, written.conn), None)

    def result(
        self,
        *,
        captures: list[dict[str, Any]] | None = None,
        hang_at: list[float] | None = None,
        client_facing: list[str] | None = None,
        raw_rows: bool = False,
        engine_requests: list[Any] | None = None,
    ) -> dict[str, Any]:
        """The analysis document. ``requests`` and ``connections`` are ``Rows``: iterable
        (several times, in table order, each row read back one at a time) with ``len()``;
        their items are dicts, or the dataclasses with ``raw_rows`` (for
        ``render.write_json``, which converts them one at a time)."""
        conns = self.connections.values()
        reqs = self.requests.values()
        marks = sorted([*self.marks, *(hang_at or [])])
        evidence = Evidence(
            taps=self.taps,
            connections=conns,
            requests=reqs,
            engine=self.engine_samples,
            probes=self.probes,
            health=self.health_samples,
            faults=self.faults,
            marks=marks,
            client_facing=set(client_facing or []),
            end=self.last_t,
            request_taps=self.request_taps,
            sample_urls=self.engine_urls | self.health_urls,
            client_failures=self.client_failures,
            client_failures_total=self.client_failures_total,
            lags=self.lags,
            losses=self.loss_windows,
            unvouched=self.unvouched,
            unvouched_total=self.unvouched_total,
            headless=self.headless,
            headless_total=self.headless_gaps,
            engine_requests=list(engine_requests or []),  # --engine-requests
        )
        findings, verdict = find(evidence)
        close = getattr(self._copies, "close", None)  # (a result asked for before)
        if close is not None and self._copies is not evidence.copies:
            close()
        self._copies = evidence.copies
        reqs = _with_copies(reqs, evidence.copies)
        caveats = _caveats(
            captures or [],
            self.taps,
            self.capture_losses,
            self.packet_losses,
            out_of_range=(self.samples_out_of_range, self.figures_out_of_range),
        )
        caveats += clock_caveats(evidence.clock_pairs, verdict)
        if caveats:
            verdict["caveats"] = caveats
            if verdict["party"] == "none":  # an all-clear over missing records is not high
                lost = (
                    self.capture_losses
                    or any(c.get("bad_lines") for c in captures or [])
                    or evidence.gapped
                )
                verdict["confidence"] = "low" if lost else "medium"
        totals = _Totals()
        totals.reused, totals.stalls = self._totals.reused, self._totals.stalls
        totals.terminations.update(self._totals.terminations)
        for r in self.requests.live():
            totals.add(r)
        return {
            "schema": SCHEMA,
            "captures": captures or [],
            "taps": [self.taps[k] for k in sorted(self.taps)],
            "time_range": {
                "start": self.first_t,
                "end": self.last_t,
                "start_iso": iso(self.first_t) if self.first_t is not None else None,
                "end_iso": iso(self.last_t) if self.last_t is not None else None,
            },
            "totals": {
                "events": self.events,
                "connections": len(conns),
                "requests": len(reqs),
                "reused_requests": totals.reused,
                "terminations": dict(sorted(totals.terminations.items())),
                "stalls": totals.stalls,
                "capture_records_lost": self.capture_losses,
                **({"tap_own_requests": self.own_requests} if self.own_requests else {}),
                **({"late_events_ignored": self.late_events} if self.late_events else {}),
            },
            "connections": conns if raw_rows else _as_dicts(conns),
            "requests": reqs if raw_rows else _as_dicts(reqs),
            "verdict": verdict,
            "findings": [f.to_json() for f in findings],  # the output edge: typed -> JSON
            "evidence": {
                "engine_samples": len(self.engine_samples),
                "engine_urls": sorted(self.engine_urls),
                "probes": self.probes,
                "health_samples": len(self.health_samples),
                "injected_faults": len(self.faults),
                "fault_plans": sorted(self.fault_plans, key=lambda p: (p["t"], p["tap"])),
                "marks": marks,
                "mark_states": evidence.mark_states,
                "tap_pairs": evidence.tap_pairs,
                "tap_lags": self.lags,
                **(
                    {
                        "engine_requests": {
                            "records": len(engine_requests),
                            "joined": evidence.engine_requests_joined,
                        }
                    }
                    if engine_requests
                    else {}
                ),
            },
            "topology": evidence.topology,
            "clocks": self.clocks.to_json(evidence.clock_pairs),
        }


def _with_copies(rows: Rows[RequestRow], copies: Iterable[tuple[Any, ...]]) -> Rows[RequestRow]:
    """The rows, each with the ids of its copies at the other taps and what joined them
    (``copies`` is in row order: merged as the rows are read back)."""

    def read() -> Iterator[RequestRow]:
        joined = iter(copies)
        nxt = next(joined, None)
        for pos, row in enumerate(rows):
            if nxt is not None and nxt[0] == pos:
                row.copies, row.joined_by = list(nxt[2]), nxt[3]
                nxt = next(joined, None)
            yield row

    return Rows(read, len(rows))


def _as_dicts(rows: Rows[Any]) -> Rows[dict[str, Any]]:
    return Rows(lambda: (asdict(r) for r in rows), len(rows))
