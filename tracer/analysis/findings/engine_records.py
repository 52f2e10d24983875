"""The engines' own per-request records as evidence (``--engine-requests``).

An engine's record of a request (``tracer/evidence/engine_requests.py``: SGLang's request
metrics, vLLM's ``llm_request`` spans) is joined to the request's rows by request id — the
``x-request-id`` the client sent, which vLLM prefixes with ``chatcmpl-``/``cmpl-`` — or by
trace id (the W3C ``traceparent`` the request carried). Every finding about a request with
a record then quotes the engine's own account (queued for, first token at, finished how:
figures ``queue_s``, ``ttft_s``, ``e2e_s``, ``finish``), and busy against broken is decided
per request where the records say:

* ``lost_after_engine`` — the engine says it finished the request (``stop``/``length``,
  at a time) while the tap did not see its answer whole: the answer was lost after the
  engine — in the hop after the tap (proxy), or, where the tap's upstream is the serving
  stack, between the engine and the tap (the router: engine, medium);
* ``engine_queued`` (note) — the engine says it kept the request in its wait queue for
  ``QUEUED`` seconds or more before the tap saw any answer: load, not a wedge;
* ``lost_before_engine`` — the request got nothing back (``silent_failure``) and the
  engine has no record of it, while it recorded requests sent through the same tap in the
  ``AROUND`` seconds before it, and finished requests sent through the tap after it that
  the tap saw complete while it waited (they overtook it): it never reached the engine —
  the hop after the tap (proxy), or the serving stack in front of the engine where the
  tap's upstream is the router (engine, medium). High only when its client also left and
  the engine took new requests ``AFTER`` that (a request of its would have its abort
  recorded); else medium: an engine writes its record at the finish, so a request stuck
  inside it has none either (``settle``: the engine's log of what it received).

A request without a join key (no request id, no trace id) is never said to be missing from
the records.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import defaultdict

from ...evidence.engine_requests import EngineRequest
from ..rows import RequestRow
from .context import Context
from .model import EvidenceItem, Finding, RuledOut, finding
from .quotes import MAX_QUOTED, at_tap_item, ts
from .signs import silent_failure

QUEUED = 2.0  # seconds in the engine's queue that make a wait load (SLOW_FIRST_TOKEN)
AROUND = 120.0  # seconds: records of requests this close before and after a missing one
AFTER = 0.5  # the engine recorded a request received this long after the client left


CLOCK_SLACK = 5.0  # seconds an engine's clock may be from a tap's for its record to join


def fits(rec: EngineRequest, r: RequestRow) -> bool:
    """The record's times can be this request's: received after the tap saw it begin and
    before it ended there, finished after it began (within ``CLOCK_SLACK`` of clock
    difference); a record that says nothing of its times fits."""
    end = r.end if r.end is not None else math.inf
    if rec.received is not None and not (
        r.start - CLOCK_SLACK <= rec.received <= end + CLOCK_SLACK
    ):
        return False
    return rec.finished is None or rec.finished >= r.start - CLOCK_SLACK


class Records:
    """The records, by the ids they answer to and by trace id (all of them: ids repeat
    across runs, and a folder of exports holds many)."""

    def __init__(self, records: list[EngineRequest]) -> None:
        self.by_id: dict[str, list[EngineRequest]] = {}
        self.by_trace: dict[str, list[EngineRequest]] = {}
        for rec in sorted(records, key=lambda x: (x.received or 0.0, x.source)):
            for key in rec.ids():
                self.by_id.setdefault(key, []).append(rec)
            if rec.trace_id:
                self.by_trace.setdefault(rec.trace_id, []).append(rec)
        self.received = sorted(x.received for x in records if x.received is not None)

    def of(self, r: RequestRow) -> tuple[EngineRequest | None, str | None]:
        """The request's record and what joined it (``request_id`` or ``trace_id``): one
        whose times can be this request's (``fits``); a record of the same id from another
        time — another run, an id used again — is not this request's account."""
        keyed = (r.request_id, self.by_id, "request_id"), (r.trace_id, self.by_trace, "trace_id")
        for key, index, how in keyed:
            for rec in index.get(key, []) if key else []:
                if fits(rec, r):
                    return rec, how
        return None, None

    def recorded_after(self, t: float) -> bool:
        """The engine recorded a request it received at or after ``t``."""
        return bisect_left(self.received, t) < len(self.received)


class Around:
    """One tap's requests that have an engine record: when each began, and when each that
    completed at the tap ended (None: it did not)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float | None] = []
        self._rows: list[tuple[float, float | None]] = []

    def add(self, r: RequestRow) -> None:
        done = r.end if r.termination == "complete" and r.end is not None else None
        self._rows.append((r.start, done))

    def sort(self) -> None:
        self._rows.sort(key=lambda x: x[0])
        self.starts = [x[0] for x in self._rows]
        self.ends = [x[1] for x in self._rows]

    def of(self, r: RequestRow) -> tuple[int, int, int]:
        """Recorded requests in the ``AROUND`` s before the request began, in the ``AROUND``
        s after, and of these how many completed at the tap before it ended (overtook it)."""
        lo = bisect_left(self.starts, r.start - AROUND)
        mid = bisect_right(self.starts, r.start)
        hi = bisect_right(self.starts, r.start + AROUND)
        until = r.end if r.end is not None else math.inf
        overtaken = sum(1 for e in self.ends[mid:hi] if e is not None and e <= until)
        return mid - lo, hi - mid, overtaken


def account_item(r: RequestRow, rec: EngineRequest, joined_by: str) -> EvidenceItem:
    """The engine's own account of the request, as its record gives it."""
    parts = [f"the {rec.engine} engine's own record ({rec.source}, joined by {joined_by})"]
    if rec.received is not None:
        parts.append(f"received {ts(rec.received)}")
    if rec.queued is not None:
        parts.append(f"queued for {rec.queued:.3f} s")
    if rec.ttft is not None:
        parts.append(f"first token {rec.ttft:.3f} s after it arrived")
    if rec.finish is not None or rec.finished is not None:
        how = rec.finish or "unknown"
        at = f" at {ts(rec.finished)}" if rec.finished is not None else ""
        took = f", {rec.e2e:.3f} s end to end" if rec.e2e is not None else ""
        parts.append(f"finished ({how}){at}{took}")
    if rec.output_tokens is not None:
        parts.append(f"{rec.output_tokens} output tokens")
    if rec.status == "error":
        parts.append("span status error")
    return EvidenceItem(
        text=", ".join(parts),
        t=rec.received if rec.received is not None else r.start,
        tap=r.tap,
        request=r.id,
        figures=rec.figures() | {"joined_by": joined_by},
    )


def _keyed(r: RequestRow) -> bool:
    return bool(r.request_id or r.trace_id)


def _nothing_back(r: RequestRow) -> bool:
    return r.status is None and r.response_bytes == 0 and bool(r.method)


def analyze_engine_records(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """Each finding about requests with a record quotes the engine's account; the
    requests the records decide leave their finding for the records' own finding."""
    records: list[EngineRequest] = list(ctx.e.engine_requests)
    if not records:
        return findings
    index = Records(records)
    wanted = {q for f in findings for q in f.requests}
    joined: dict[str, tuple[EngineRequest, str]] = {}
    starts: dict[str, Around] = defaultdict(Around)  # per tap: requests with a record
    for r in ctx.e.requests:
        if not r.method or not _keyed(r):
            continue
        rec, how = index.of(r)
        if rec is None or how is None:
            continue
        starts[r.tap].add(r)
        if r.id in wanted:
            joined[r.id] = (rec, how)
    for s in starts.values():
        s.sort()
    ctx.e.engine_requests_joined = sum(len(s.starts) for s in starts.values())
    out: list[Finding] = []
    for f in findings:
        out += _decide(ctx, f, joined, starts, index)
    return out


def _decision(
    ctx: Context,
    r: RequestRow,
    got: tuple[EngineRequest, str] | None,
    starts: dict[str, Around],
    index: Records,
) -> str | None:
    if got is not None:
        rec, _ = got
        if rec.answered() and r.termination != "complete":
            return "lost_after_engine"
        if (
            rec.queued is not None
            and rec.queued >= QUEUED
            and (r.first_token is None or r.first_token >= rec.queued)
        ):
            return "engine_queued"
        return None
    if not _keyed(r) or not silent_failure(r):  # nothing back, long enough to be a hang
        return None
    before, after, overtaken = starts[r.tap].of(r) if r.tap in starts else (0, 0, 0)
    if before and after and overtaken:
        return "lost_before_engine"
    return None


def _decide(
    ctx: Context,
    f: Finding,
    joined: dict[str, tuple[EngineRequest, str]],
    starts: dict[str, Around],
    index: Records,
) -> list[Finding]:
    rows = [r for q in f.requests if (r := ctx.row(q)) is not None]
    accounts = [account_item(r, *joined[r.id]) for r in rows if r.id in joined]
    if f.note or f.kind in ("injected_fault", "capture_lost", "packet_gap"):
        f.evidence += accounts[:MAX_QUOTED]
        return [f]
    groups: dict[str, list[RequestRow]] = defaultdict(list)
    for r in rows:
        decided = _decision(ctx, r, joined.get(r.id), starts, index)
        if decided is not None:
            groups[decided].append(r)
    if not groups:
        f.evidence += accounts[:MAX_QUOTED]
        return [f]
    out: list[Finding] = []
    decided_ids = {r.id for rs in groups.values() for r in rs}
    rest = [q for q in f.requests if q not in decided_ids]
    if rest:
        f.requests = rest
        kept = {q.split("/", 2)[0] + "/" + q.split("/", 2)[1] for q in rest}
        f.connections = [c for c in f.connections if c in kept] or f.connections
        f.evidence += [a for a in accounts if a.request in rest][:MAX_QUOTED]
        out.append(f)
    context = [e for e in f.evidence if e.request is None or e.request in decided_ids]
    for kind, rs in groups.items():
        make = {
            "lost_after_engine": _after,
            "engine_queued": _queued,
            "lost_before_engine": _before,
        }[kind]
        new = make(ctx, rs, joined, starts, f, index)
        new.evidence += [
            EvidenceItem(
                text=f"context: {f.kind} ({f.party}): {f.summary}",
                t=f.t,
                figures={"replaced": f.kind},
            ),
            *[e for e in context if e not in new.evidence][: 2 * MAX_QUOTED],
        ]
        out.append(new)
    return out


def _hop(ctx: Context, r: RequestRow) -> tuple[str, str, str]:
    """(party, what, confidence) of what lies between the tap and the engine."""
    if ctx.upstream_is_serving(r):
        return (
            "engine",
            f"the serving stack between tap {r.tap} and the engine (the router)",
            "medium",
        )
    return "proxy", f"the hop after tap {r.tap}", "high"


def _after(
    ctx: Context,
    rs: list[RequestRow],
    joined: dict[str, tuple[EngineRequest, str]],
    starts: dict[str, Around],
    f: Finding,
    index: Records,
) -> Finding:
    tap = rs[0].tap
    party, where, confidence = _hop(ctx, rs[0])
    recs = [joined[r.id][0] for r in rs]
    e2es = [x.e2e for x in recs if x.e2e is not None]
    finishes = sorted({x.finish or "unknown" for x in recs})
    nothing = all(_nothing_back(r) for r in rs)
    seen = "nothing of the answer" if nothing else "the answer cut short"
    took = f", {max(e2es):.2f} s end to end at most" if e2es else ""
    evidence: list[EvidenceItem] = []
    for r in rs[:MAX_QUOTED]:
        evidence += [account_item(r, *joined[r.id]), at_tap_item(r)]
    ruled = (
        [RuledOut("engine", f"its own records say it finished them ({', '.join(finishes)})")]
        if party == "proxy"
        else []
    )
    return finding(
        "lost_after_engine",
        party,
        f"The engine's own records say it finished requests sent through tap {tap} "
        f"({', '.join(finishes)}{took}), while tap {tap} saw {seen}: the answer "
        f"was lost after the engine, in {where}.",
        rs,
        evidence,
        ruled,
        confidence,
        settle=None if party == "proxy" else "a tap between the router and the engine",
    )


def _queued(
    ctx: Context,
    rs: list[RequestRow],
    joined: dict[str, tuple[EngineRequest, str]],
    starts: dict[str, Around],
    f: Finding,
    index: Records,
) -> Finding:
    tap = rs[0].tap
    waits = sorted(joined[r.id][0].queued or 0.0 for r in rs)
    evidence: list[EvidenceItem] = []
    for r in rs[:MAX_QUOTED]:
        evidence += [account_item(r, *joined[r.id]), at_tap_item(r)]
    return finding(
        "engine_queued",
        "engine",
        f"The engine's own records say it kept requests from tap {tap} in its wait queue "
        f"for up to {waits[-1]:.2f} s before it started them — load "
        "(busy), not a wedge and not a fault.",
        rs,
        evidence,
        [],
        "high",
        note=True,
    )


def _before(
    ctx: Context,
    rs: list[RequestRow],
    joined: dict[str, tuple[EngineRequest, str]],
    starts: dict[str, Around],
    f: Finding,
    index: Records,
) -> Finding:
    tap = rs[0].tap
    party, where, confidence = _hop(ctx, rs[0])
    evidence: list[EvidenceItem] = []
    overtook = 0
    left_all = True
    for r in rs:
        before, after, overtaken = starts[tap].of(r)
        overtook = max(overtook, overtaken)
        left = r.termination != "in_flight" and index.recorded_after((r.end or r.start) + AFTER)
        left_all = left_all and left
        if len(evidence) >= 2 * MAX_QUOTED:
            continue
        key = f"x-request-id={r.request_id}" if r.request_id else f"trace {r.trace_id}"
        evidence += [
            at_tap_item(r),
            EvidenceItem(
                text=f"no engine record for it ({key}), while the engine recorded {before} "
                f"request(s) sent through tap {tap} in the {AROUND:.0f} s before it and {after} "
                f"in the {AROUND:.0f} s after it, {overtaken} of which it finished and tap {tap} "
                "saw complete while this one waited"
                + (
                    "; its client left, and the engine took new requests after that" if left else ""
                ),
                t=r.start,
                tap=r.tap,
                request=r.id,
                figures={
                    "engine_record": False,
                    "recorded_before": before,
                    "recorded_after": after,
                    "overtaken": overtaken,
                    "window_s": AROUND,
                    "client_left": left,
                },
            ),
        ]
    if party == "proxy" and not left_all:
        confidence = "medium"  # an engine writes a record at the finish: one still running?
    # what would contradict "never reached the engine": the engine holding them unfinished
    # (no record either). Its live gauges settle it where they exist: fewer running and
    # queued than the tap had in flight means some of them were not there.
    first = rs[0]
    short = ctx.engines.uncounted(first, first.start, first.end or ctx.e.end or first.start)
    if short is not None:
        evidence.append(
            EvidenceItem(
                text=f"the engines' live figures counted {short[1]} running and queued while tap "
                f"{tap} had {short[0]} request(s) in flight: these were not held in the engine",
                t=first.start,
                tap=tap,
                figures={"in_flight": short[0], "engine_counted": short[1]},
            )
        )
    elif party == "proxy":
        confidence = "low" if confidence != "high" else confidence
    ruled = (
        [
            RuledOut(
                "engine",
                f"its own records account for the requests sent before them and for {overtook} "
                "sent after them and answered while these waited; none for these",
            )
        ]
        if party == "proxy" and (short is not None or confidence == "high")
        else []
    )
    unsure = short is None and confidence != "high"
    return finding(
        "lost_before_engine",
        party,
        f"Requests at tap {tap} got nothing back and the engine has no record of them, while "
        f"it recorded requests sent through the same tap before them and "
        f"finished {overtook} sent after them while they waited: "
        + (
            f"lost in {where}, unless the engine still holds them unfinished (it writes a "
            "record when a request finishes, and no live figure here says it did not)."
            if unsure
            else f"they never reached the engine — lost in {where}."
        ),
        rs,
        evidence,
        ruled,
        confidence,
        settle="the engine's own log of the requests it received (an engine writes its record "
        "when a request finishes: one that never finished has none)"
        if confidence != "high"
        else None,
    )
