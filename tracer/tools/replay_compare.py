"""How a replay's run compares with the original: request by request, and the verdict.

Sans-I/O: the original capture and the replay's own capture are read alike
(``replay_capture``: the same ``load`` and the same ``outcome`` rule), so the comparison
is like for like: both are what a tap saw. Its document is ``tracer.replay/1``, as text
for people or JSON.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from .replay_capture import Capture, CapturedRequest
from .replay_capture import load as load  # (re-exported: the tests')
from .replay_select import parse_only as parse_only  # (re-exported: the tests')

SCHEMA = "tracer.replay/1"


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
