"""The hang mark always answered (issue 35): every client-facing connection's state at a
``--hang-at`` mark, and a harness that stopped sending amid other traffic.

At each mark, each connection of the front tap that carried a request by then is one of:
in flight and moving (bytes still arriving, no stall over the mark), in flight and
silent (a stall covers the mark: its direction says which side), idle since its last
answer ended (complete or not), or closed. A connection that carried a conversation (two
requests or more) and has been idle longer than ``QUIET_FACTOR`` times its own longest
gap between turns, and at least ``QUIET_MIN``, *went quiet*: its client sent nothing
more. When nothing at the tap is stuck at the mark and conversations went quiet, that is
the hang: the client's (``client_idle_hang``) at a client-facing tap, else client or a
proxy in front (``idle_at_hang``). When something is stuck, the hang analyzers name it;
when streams were still moving and nothing went quiet, ``moving_at_hang`` says the tap
saw no hang, so the verdict is never "healthy" at a mark.

Two passes over the rows per question (requests, then connections), only when there are
marks. A connection's state is kept for the first ``MAX_STATES`` connections per state
and mark; the rest are counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...wording import counted
from ..rows import RequestRow
from .context import Context
from .model import EvidenceItem, Finding, RuledOut, finding
from .quotes import MAX_QUOTED, ts

QUIET_MIN = 1.0  # seconds idle before a conversation can have gone quiet
QUIET_FACTOR = 2.0  # times the connection's own longest gap between turns
MAX_STATES = 200  # connections listed per state and mark (the rest counted)


@dataclass(slots=True)
class ConnState:
    """One connection at one mark."""

    connection: str
    state: str  # moving | silent | idle | closed
    since: float | None  # when it became so (the silence's start, the last answer's end)
    request: str | None  # the request in flight, or the last one answered
    requests: int  # requests it carried by the mark
    direction: str | None = None  # of a silence
    complete: bool | None = None  # whether the last answer was delivered whole (idle)
    quiet: bool = False  # a conversation whose client sent nothing more

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "connection": self.connection,
            "state": self.state,
            "since": self.since,
            "request": self.request,
            "requests": self.requests,
        }
        if self.direction is not None:
            out["direction"] = self.direction
        if self.complete is not None:
            out["complete"] = self.complete
        if self.quiet:
            out["quiet"] = True
        return out


@dataclass(slots=True)
class MarkStates:
    """The front tap's connections at one mark."""

    tap: str
    t: float
    states: list[ConnState] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)

    def add(self, s: ConnState) -> None:
        key = "quiet" if s.quiet else s.state
        self.counts[key] += 1
        if self.counts[key] <= MAX_STATES:
            self.states.append(s)

    def of(self, key: str) -> list[ConnState]:
        return [s for s in self.states if (s.quiet if key == "quiet" else s.state == key)]

    def to_json(self) -> dict[str, Any]:
        return {
            "tap": self.tap,
            "t": self.t,
            "counts": dict(sorted(self.counts.items())),
            "connections": [s.to_json() for s in self.states],
        }


def _state(rows: list[RequestRow], mark: float, closed: float | None) -> ConnState | None:
    """One connection's state at the mark from its requests (in order), None when it had
    carried none by then."""
    before = [r for r in rows if r.start <= mark]
    if not before:
        return None
    last = before[-1]
    cid = f"{last.tap}/{last.conn}"
    if last.end is None or last.end > mark:
        for s in last.stalls:
            if s["start"] <= mark and (s["end"] is None or mark <= s["end"]):
                return ConnState(
                    cid, "silent", s["start"], last.id, len(before), direction=s["direction"]
                )
        return ConnState(cid, "moving", last.start, last.id, len(before))
    complete = last.termination == "complete"
    if closed is not None and closed <= mark:
        return ConnState(cid, "closed", closed, last.id, len(before), complete=complete)
    gaps = [r.idle_before for r in before[1:]]
    quiet = (
        len(before) >= 2
        and complete
        and mark - last.end >= max(QUIET_MIN, QUIET_FACTOR * max(gaps, default=0.0))
    )
    return ConnState(cid, "idle", last.end, last.id, len(before), complete=complete, quiet=quiet)


def mark_states(ctx: Context, tap: str) -> list[MarkStates]:
    """The tap's connections at each mark (one pass over the requests, one over the
    connections)."""
    closed = {c.conn: c.closed for c in ctx.e.connections if c.tap == tap}
    out = [MarkStates(tap, m) for m in ctx.marks]
    conn: int | None = None
    rows: list[RequestRow] = []

    def flush() -> None:
        if conn is None:
            return
        for ms in out:
            s = _state(rows, ms.t, closed.get(conn))
            if s is not None:
                ms.add(s)

    for r in ctx.e.requests:
        if r.tap != tap or not r.method:
            continue
        if r.conn != conn:
            flush()
            conn, rows = r.conn, []
        rows.append(r)
    flush()
    return out


def _state_item(s: ConnState) -> EvidenceItem:
    words = {
        "moving": f"in flight and moving ({s.request})",
        "silent": f"in flight and silent since {ts(s.since or 0.0)} ({s.direction}, {s.request})",
        "idle": f"idle since {ts(s.since or 0.0)} after "
        + ("a complete answer" if s.complete else "an answer that was not complete")
        + f" ({s.request}, {counted(s.requests, 'request')})"
        + ("; its client sent nothing more" if s.quiet else ""),
        "closed": f"closed at {ts(s.since or 0.0)}",
    }[s.state]
    figures: dict[str, Any] = {"state": s.state, "requests": s.requests}
    if s.quiet:
        figures["quiet"] = True
    if s.complete is not None:
        figures["complete"] = s.complete
    return EvidenceItem(
        text=f"connection {s.connection}: {words}",
        t=s.since,
        tap=s.connection.split("/", 1)[0],
        request=s.request,
        figures=figures,
    )


def analyze_marks(ctx: Context) -> list[Finding]:
    """Each hang mark answered from the front tap's connections at it."""
    out: list[Finding] = []
    if not ctx.order or not ctx.marks:
        return out
    front = ctx.order[0]
    facing = front in ctx.e.client_facing
    for ms in mark_states(ctx, front):
        ctx.e.mark_states.append(ms.to_json())
        mark = ms.t
        before, incomplete, in_flight = ctx.mark_stats(front, mark)
        counts = ms.counts
        stuck = counts["silent"]
        quiet = ms.of("quiet")
        summary_item = EvidenceItem(
            text=f"hang reported at {ts(mark)}: at tap {front}, "
            f"{counted(counts['moving'], 'connection')} in flight and moving, {stuck} in "
            f"flight and silent, {counts['idle'] + counts['quiet']} idle ({counts['quiet']} "
            "of them conversations whose client sent nothing more), "
            f"{counts['closed']} closed; {counted(before, 'request')} before it, "
            f"{incomplete} not complete",
            t=mark,
            tap=front,
            figures={
                "in_flight": in_flight,
                "moving": counts["moving"],
                "silent": stuck,
                "idle": counts["idle"] + counts["quiet"],
                "quiet": counts["quiet"],
                "closed": counts["closed"],
                "before": before,
                "incomplete": incomplete,
            },
        )
        ended = ctx.e.taps.get(front, {}).get("ended")
        started = ctx.e.taps.get(front, {}).get("started")
        if (ended is not None and mark > ended + 1.0) or (started and mark < started - 1.0):
            out.append(_not_recording(front, mark, started, ended, summary_item))
            continue
        if stuck:
            # the hang analyzers name what was stuck; if all they have are notes (a wait,
            # load), the mark is still answered (``verdict.find`` keeps this only then)
            out.append(
                _silent(
                    front, mark, [summary_item, *map(_state_item, ms.of("silent")[:MAX_QUOTED])], ms
                )
            )
            continue
        view = ctx.engine_view(mark - 5.0, mark)
        evidence = [summary_item]
        shown = quiet if quiet else ms.of("moving")
        evidence += [_state_item(s) for s in shown[:MAX_QUOTED]]
        if view.known:
            evidence.append(view.item())
        if not quiet and in_flight:
            out.append(_moving(ctx, front, mark, evidence, ms))
            continue
        ruled = [RuledOut("engine", "nothing was outstanding at the serving side for them")]
        if quiet:
            who = f"{counted(counts['quiet'], 'connection')} that carried a conversation"
            also = (
                f", while {counted(counts['moving'], 'other connection')} still moved"
                if counts["moving"]
                else ""
            )
            told = f"{who} went quiet after complete answers{also}"
            settle: str | None = (
                "the harness's own state for those sessions: the tap sees that their client "
                "sent nothing more, not whether it had finished or was stuck on itself"
            )
        elif incomplete:
            told = (
                f"nothing was in flight; {incomplete} of the {before} requests before the "
                "mark had not completed"
            )
        else:
            told = "nothing was in flight and every response had been delivered"
        if not quiet:
            settle = None
        names = [s.connection for s in quiet] if quiet else []
        complete = incomplete == 0 or bool(quiet)
        if facing:
            f = finding(
                "client_idle_hang",
                "client",
                f"At tap {front}, {told}: the client itself was stuck (it sent nothing more).",
                [],
                evidence,
                ruled,
                "high" if complete and (not quiet or not counts["moving"]) else "medium",
                t=mark,
                settle=settle if counts["moving"] else None,
            )
        else:
            f = finding(
                "idle_at_hang",
                "unknown",
                f"At tap {front}, {told}: client or a proxy in front of the tap; the engine "
                "is ruled out.",
                [],
                evidence,
                ruled,
                "medium",
                t=mark,
                settle=f"place a tap on the client side of the proxy, or, if the harness "
                f"talks to tap {front} directly, pass --client-facing {front}",
            )
        f.connections = names
        f.requests = [s.request for s in quiet if s.request]
        out.append(f)
    return out


def _moving(
    ctx: Context, front: str, mark: float, evidence: list[EvidenceItem], ms: MarkStates
) -> Finding:
    """Streams in flight and moving at the mark, none silent, no conversation gone quiet:
    the tap saw no hang then — said as such, not as "healthy"."""
    f = finding(
        "moving_at_hang",
        "unknown",
        f"At tap {front}, {counted(ms.counts['moving'], 'connection')} had requests in flight and "
        "still receiving at the mark, none was silent and no conversation had gone quiet: "
        "nothing the tap saw was stuck then.",
        [],
        evidence,
        [],
        "low",
        t=mark,
        settle="the harness's own state at the mark (which call it waited on); a mark a few "
        "seconds later, or a tap nearer the client",
    )
    f.connections = [s.connection for s in ms.of("moving")][:MAX_STATES]
    return f


def _not_recording(
    front: str,
    mark: float,
    started: float | None,
    ended: float | None,
    item: EvidenceItem,
) -> Finding:
    """A mark outside the front tap's own capture: it cannot testify about it."""
    when = (
        f"ended at {ts(ended)}"
        if ended is not None and mark > ended
        else (f"started at {ts(started or mark)}")
    )
    return finding(
        "not_recording_at_hang",
        "unknown",
        f"Tap {front} was not recording at the hang mark (its capture {when}): what the "
        "harness saw then is not in its capture.",
        [],
        [
            item,
            EvidenceItem(
                text=f"tap {front}'s capture {when}",
                t=ended if ended is not None and mark > ended else started,
                tap=front,
                figures={"started": started, "ended": ended},
            ),
        ],
        [],
        "low",
        t=mark,
        settle=f"a capture of tap {front} that covers the mark",
    )


def _silent(front: str, mark: float, evidence: list[EvidenceItem], ms: MarkStates) -> Finding:
    """Requests in flight and silent at the mark: the hang analyzers' findings about them
    say why; this one answers the mark when all they have are notes."""
    f = finding(
        "silent_at_hang",
        "unknown",
        f"At tap {front}, {counted(ms.counts['silent'], 'connection')} had a request in flight "
        "and silent at the mark; what the analysis found of them is only notes (a wait, "
        "load), not a fault.",
        [],
        evidence,
        [],
        "low",
        t=mark,
        settle="the notes about those requests say what they waited on; the harness's own "
        "timeouts say how long it would wait",
    )
    f.connections = [s.connection for s in ms.of("silent")]
    f.requests = [s.request for s in ms.of("silent") if s.request]
    return f
