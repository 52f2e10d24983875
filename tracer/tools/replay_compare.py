"""What a capture says about its requests, which of them `--only` selects, and how a
replay's run compares with the original.

Sans-I/O: a capture's events in, connections, requests and outcomes out. The original
capture and the replay's own capture go through the same ``load`` and the same
``outcome`` rule, so the comparison is like for like: both are what a tap saw.

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
import dataclasses
import fnmatch
import hashlib
import io
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from .. import events as ev
from ..analysis.summary import RequestRow, Summary
from ..capture.bodies import decode_body
from ..capture.files import (
    CaptureError,
    ReadStats,
    expand_captures,
    file_kind,
    not_a_capture,
    read_events,
)

SCHEMA = "tracer.replay/1"
HUNG_SILENCE = 1.0  # seconds of upstream silence before a client gave up: a hang


# ---- what a capture says --------------------------------------------------------------


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


def load(path: str | os.PathLike[str]) -> Capture:
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
        if kind not in ("capture", "text"):
            raise CaptureError(not_a_capture(name, kind))
    kind = "proxy"
    try:
        events = (e for seg in files for e in read_events(seg, stats))
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


# ---- outcomes -------------------------------------------------------------------------


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


# ---- the comparison -------------------------------------------------------------------


@dataclass(slots=True)
class Side:
    """One request's figures in one run (seconds; offsets from the run's first request)."""

    conn: int | None  # None: not sent
    seq: int | None
    outcome: str
    status: int | None = None
    ttfb: float | None = None
    first_token: float | None = None
    duration: float | None = None
    termination: str | None = None
    start_offset: float | None = None
    request_id: str | None = None
    detail: str | None = None
    read_time: float | None = None  # replay only: from sending to the client's last read
    injected: list[str] | None = None  # faults the capturing tap injected itself (--fault)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = round(value, 6) if isinstance(value, float) else value
        return out


def side(capture: Capture, req: CapturedRequest, origin_m: float) -> Side:
    row = capture.rows.get((req.conn, req.seq))
    return Side(
        conn=req.conn,
        seq=req.seq,
        outcome=capture.outcome(req),
        status=row.status if row else None,
        ttfb=row.ttfb if row else None,
        first_token=row.first_token if row else None,
        duration=row.duration if row else None,
        termination=row.termination if row else None,
        start_offset=req.head_m - origin_m,
        request_id=req.request_id,
        injected=list(row.injected) if row and row.injected else None,
    )


@dataclass
class Comparison:
    """Original and replay, request by request, with the verdict."""

    rows: list[tuple[Side, Side | None]]  # replay None: the replay has no such request
    mode: str
    speed: float
    structure: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def verdict(self) -> dict[str, Any]:
        differing = [(o, r) for o, r in self.rows if r is None or r.outcome != o.outcome]
        counts = Counter(o.outcome for o, _ in self.rows)
        if not differing:
            anomalies = {k: v for k, v in counts.items() if k != "complete"}
            detail = ", ".join(
                f"{v} {k} ({', '.join(f'{o.conn}:{o.seq}' for o, _ in self.rows if o.outcome == k)})"
                for k, v in sorted(anomalies.items())
            )
            text = f"reproduced: {_all(len(self.rows))} ended as in the original" + (
                f"; {detail} as in the original" if detail else ""
            )
            return {"reproduced": True, "diverged_at": None, "differing": 0, "summary": text}
        first, replayed = differing[0]
        got = replayed.outcome if replayed is not None else "not replayed"
        where = f"{first.conn}:{first.seq}"
        injected = (
            f" (injected by the capturing tap: {', '.join(first.injected)}; replay through "
            "a tracer proxy with the same --fault to have it again)"
            if first.injected
            else ""
        )
        text = (
            f"not reproduced: diverged at {where} (connection {first.conn}, request "
            f"{first.seq}): original {first.outcome}{injected}, replay {got}; "
            f"{len(differing)} of {len(self.rows)} requests differ"
        )
        return {
            "reproduced": False,
            "diverged_at": where,
            "differing": len(differing),
            "summary": text,
        }

    def document(self, **head: Any) -> dict[str, Any]:
        rows = []
        for original, replayed in self.rows:
            rows.append(
                {
                    "request": f"{original.conn}:{original.seq}",
                    "original": original.as_dict(),
                    "replay": replayed.as_dict() if replayed is not None else None,
                    "same": replayed is not None and replayed.outcome == original.outcome,
                    "start_offset_error": _offset_error(original, replayed, self.speed),
                }
            )
        return {
            "schema": SCHEMA,
            **head,
            "mode": self.mode,
            "speed": self.speed,
            "structure": self.structure,
            "requests": rows,
            "notes": self.notes,
            "verdict": self.verdict(),
        }


def _all(n: int) -> str:
    return "the 1 request" if n == 1 else f"all {n} requests"


def _offset_error(original: Side, replayed: Side | None, speed: float) -> float | None:
    """Replay start offset minus the original's (scaled by ``--speed``), seconds."""
    if replayed is None or replayed.start_offset is None or original.start_offset is None:
        return None
    return round(replayed.start_offset - original.start_offset / speed, 6)


def structure(capture: Capture) -> list[list[int]]:
    """Per connection in open order: the positions of its requests (``[[1, 2, 3], [1]]``)."""
    conns = sorted(capture.conns.values(), key=lambda c: c.open_m)
    return [[r.seq for r in c.requests] for c in conns]


@dataclass
class Sent:
    """The client's own account of one request."""

    peer: str | None = None  # local address of the connection it went on
    position: int = 0  # its place on that connection (the replay tap's seq)
    gave_up: str | None = None  # why the replay stopped waiting: reported hung
    not_sent: str | None = None
    detail: str | None = None
    read_time: float | None = None  # from sending to reading the end (paced)


def compare(
    original: Capture,
    replayed: Capture,
    planned: list[tuple[int, list[CapturedRequest]]],
    sent: dict[str, Sent],
    dropped: Counter[str],
    *,
    mode: str,
    speed: float,
) -> Comparison:
    """Original and replay side by side. ``planned``: per replay connection, the
    original connection and the requests it was to carry; ``sent``: the client's account
    of each request; ``dropped``: redacted headers left out. The replay's requests are
    found by the address of the connection each went on (the replay tap's
    ``conn_open.peer``) and their position on it."""
    by_peer: dict[str, list[int]] = {}
    for conn in sorted(replayed.conns.values(), key=lambda c: c.open_m):
        by_peer.setdefault(conn.peer, []).append(conn.conn)
    taken: dict[str, int] = {}  # peer -> the replay tap's conn it was matched to
    chosen = sorted((r for _, reqs in planned for r in reqs), key=lambda r: r.head_m)
    origin = chosen[0].head_m
    replay_origin = min((r.head_m for r in replayed.requests()), default=0.0)
    rows: list[tuple[Side, Side | None]] = []
    used: dict[int, list[int]] = {}  # job conn -> replay conns it used
    for req in chosen:
        account = sent.get(req.key, Sent(not_sent="not started"))
        o = side(original, req, origin)
        r = _replay_side(replayed, account, by_peer, taken, replay_origin)
        if r.conn is not None:
            used.setdefault(req.conn, [])
            if r.conn not in used[req.conn]:
                used[req.conn].append(r.conn)
        rows.append((o, r))
    original_shape = [[r.seq for r in reqs] for _, reqs in planned]
    replay_shape = structure(replayed)
    same = (
        mode == "original"
        and len(replay_shape) == len(planned)
        and all(
            len(used.get(conn, [])) == 1
            and len(replayed.conns[used[conn][0]].requests) == len(reqs)
            for conn, reqs in planned
            if reqs
        )
    )
    notes = _notes(chosen, dropped)
    if replayed.connect_errors:
        notes.append(
            f"the replay tap could not reach the target {len(replayed.connect_errors)} "
            f"time(s) (answered 502): {replayed.connect_errors[0]}"
        )
    return Comparison(
        rows=rows,
        mode=mode,
        speed=speed,
        structure={"original": original_shape, "replay": replay_shape, "same": same},
        notes=notes,
    )


def _replay_side(
    replayed: Capture,
    sent: Sent,
    by_peer: dict[str, list[int]],
    taken: dict[str, int],
    origin: float,
) -> Side:
    if sent.not_sent is not None or sent.peer is None:
        return Side(conn=None, seq=None, outcome="not_sent", detail=sent.not_sent)
    conn_id = taken.get(sent.peer)
    if conn_id is None or sent.position == 1:
        candidates = by_peer.get(sent.peer) or []
        conn_id = candidates.pop(0) if candidates else None
        if conn_id is not None:
            taken[sent.peer] = conn_id
    conn = replayed.conns.get(conn_id) if conn_id is not None else None
    req = (
        conn.requests[sent.position - 1]
        if conn is not None and len(conn.requests) >= sent.position
        else None
    )
    if req is None:
        return Side(
            conn=conn_id,
            seq=sent.position,
            outcome="unknown",
            detail="not in the replay's capture (records lost?)",
        )
    s = side(replayed, req, origin)
    s.read_time = sent.read_time
    if sent.gave_up is not None:
        s.outcome, s.detail = "hung", sent.gave_up
    elif sent.detail is not None:
        s.detail = sent.detail
    return s


def _notes(chosen: list[CapturedRequest], dropped: Counter[str]) -> list[str]:
    notes = []
    if dropped:
        names = ", ".join(f"{k} ({v} requests)" for k, v in sorted(dropped.items()))
        notes.append(
            f"headers redacted in the capture were not sent: {names}; set them with --header"
        )
    piped = [r.key for r in chosen if r.pipelined]
    if piped:
        notes.append(
            f"pipelined in the original, sent after the previous response: {', '.join(piped)}"
        )
    old = [r.key for r in chosen if r.version != "1.1"]
    if old:
        notes.append(f"sent as HTTP/1.1 (the original was not): {', '.join(old)}")
    return notes


# ---- rendering ------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _pair(a: float | None, b: float | None) -> str:
    return f"{_ms(a)} / {_ms(b)}"


def to_text(doc: dict[str, Any], *, width: int = 200) -> str:
    buf = io.StringIO()
    console = Console(
        file=buf, width=width, color_system=None, force_terminal=False, highlight=False
    )
    console.print(
        f"tracer replay: {doc['original']} -> {doc['target']} (connections: {doc['mode']}, "
        f"speed {doc['speed']:g})",
        markup=False,
    )
    console.print(f"replay capture: {doc['capture']}", markup=False)
    for note in doc["notes"]:
        console.print(f"note: {note}", markup=False, soft_wrap=True)
    table = Table(
        title="each cell: original / replay; ms from the request head (start: from the "
        "run's first request)",
        show_edge=False,
        pad_edge=False,
        title_justify="left",
    )
    for col in (
        "request",
        "replay",
        "outcome (original -> replay)",
        "status",
        "ttfb ms",
        "first token ms",
        "duration ms",
        "start ms",
        "replay detail",
    ):
        table.add_column(col, no_wrap=True)
    for row in doc["requests"]:
        o, r = row["original"], row["replay"] or {}
        mark = "" if row["same"] else "  <-- differs"
        table.add_row(
            row["request"],
            f"{r['conn']}:{r['seq']}" if r.get("conn") is not None else "-",
            f"{o['outcome']} -> {r.get('outcome', 'not replayed')}{mark}",
            f"{o['status'] or '-'} / {r.get('status') or '-'}",
            _pair(o["ttfb"], r.get("ttfb")),
            _pair(o["first_token"], r.get("first_token")),
            _pair(o["duration"], r.get("duration")),
            _pair(o["start_offset"], r.get("start_offset")),
            r.get("detail") or "",
        )
    console.print(table)
    s = doc["structure"]
    console.print(
        f"structure: original {len(s['original'])} connections {s['original']}; replay "
        f"{len(s['replay'])} connections {s['replay']}"
        + ("" if doc["mode"] == "fresh" else (" (same)" if s["same"] else " (DIFFERENT)")),
        markup=False,
        soft_wrap=True,
    )
    console.print(f"verdict: {doc['verdict']['summary']}", markup=False, soft_wrap=True)
    return buf.getvalue()


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ---- selection (--only) ---------------------------------------------------------------


@dataclass
class Selection:
    """``--only``: connections, requests (one or a range of positions), x-request-id globs.

    No criterion: everything. Several: a request is selected when any of them selects it.
    """

    conns: set[int] = field(default_factory=set)
    requests: set[tuple[int, int]] = field(default_factory=set)
    ranges: list[tuple[int, int, int]] = field(default_factory=list)  # conn, first, last
    ids: list[str] = field(default_factory=list)

    @property
    def everything(self) -> bool:
        return not (self.conns or self.requests or self.ranges or self.ids)

    def selects(self, req: CapturedRequest) -> bool:
        if self.everything or req.conn in self.conns or (req.conn, req.seq) in self.requests:
            return True
        if any(c == req.conn and a <= req.seq <= b for c, a, b in self.ranges):
            return True
        rid = req.request_id
        return rid is not None and any(fnmatch.fnmatchcase(rid, g) for g in self.ids)

    def check(self, capture: Capture) -> None:
        """Every criterion must select something: a typo is an error, not an empty run."""
        have = sorted(capture.conns)
        span = f"{have[0]}-{have[-1]}" if have else "none"
        for c in sorted(
            self.conns | {c for c, _ in self.requests} | {c for c, _, _ in self.ranges}
        ):
            if c not in capture.conns:
                raise ValueError(f"--only: the capture has no connection {c} (it has {span})")
        for c, s in sorted(self.requests):
            if s > len(capture.conns[c].requests):
                raise ValueError(
                    f"--only req={c}:{s}: connection {c} has "
                    f"{len(capture.conns[c].requests)} requests"
                )
        reqs = capture.requests()
        for glob in self.ids:
            if not any(r.request_id and fnmatch.fnmatchcase(r.request_id, glob) for r in reqs):
                raise ValueError(f"--only id={glob}: no request has an x-request-id matching it")


ONLY_HELP = (
    "select what to replay (repeatable; a request is replayed when any selects it): "
    "conn=N[,M...] whole connections; req=C:S a request (C:A-B positions A to B, or an "
    "analysis id TAP/C/S); id=GLOB requests whose x-request-id matches (e.g. id='s1-*' "
    "for session 1 of tracer sim harness)"
)


def parse_only(values: list[str]) -> Selection:
    sel = Selection()
    for value in values:
        key, sep, rest = value.partition("=")
        key = key.strip().lower()
        if not sep or not rest.strip():
            raise ValueError(f"--only {value!r}: expected KEY=VALUE (conn=, req= or id=)")
        for item in (x.strip() for x in rest.split(",")):
            if not item:
                continue
            if key == "conn":
                sel.conns.add(_positive(item, value))
            elif key == "req":
                _parse_req(item, value, sel)
            elif key == "id":
                sel.ids.append(item)
            else:
                raise ValueError(f"--only {value!r}: unknown key {key!r} (conn, req or id)")
    return sel


def _parse_req(item: str, value: str, sel: Selection) -> None:
    if "/" in item:  # an analysis id: TAP/CONN/SEQ
        parts = item.rsplit("/", 2)
        if len(parts) != 3:
            raise ValueError(f"--only {value!r}: {item!r} is not TAP/CONN/SEQ")
        sel.requests.add((_positive(parts[1], value), _positive(parts[2], value)))
        return
    conn, sep, pos = item.partition(":")
    if not sep:
        raise ValueError(f"--only {value!r}: {item!r} is not CONN:SEQ (e.g. req=3:2)")
    first, dash, last = pos.partition("-")
    c, a = _positive(conn, value), _positive(first, value)
    if dash:
        b = _positive(last, value)
        if b < a:
            raise ValueError(f"--only {value!r}: empty range {pos}")
        sel.ranges.append((c, a, b))
    else:
        sel.requests.add((c, a))


def _positive(text: str, value: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"--only {value!r}: {text!r} is not a number >= 1")
    return int(text)
