"""Requests whose evidence the capture does not hold whole: what a finding would say of
them rests on records that are not there, so it is not said.

Two ways a capture misses what it should hold, each worded as its own, never as the
other's: a tap's capture writer that dropped records (``capture_lost``), and a packet
capture that missed bytes of a stream (``packet_gap``).

A tap's capture writer that could not write (its disk full, or too slow) drops records
and says when, in ``capture_loss`` records (``first_t`` .. ``last_t``). A request open in
such a window may have lost its end, its stall's end or its events: a silence read from
it would be the tap's own loss, read as someone's fault. Such a request that did not
complete in the capture, and a completed one whose finding concerns the window itself,
leave the findings they were in; one ``capture_lost`` finding (party unknown) names them
with the window quoted. The tap's own losses are never another party's fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...wording import counted
from ..rows import RequestRow
from .context import Context
from .model import EvidenceItem, Finding
from .quotes import MAX_QUOTED, req_text, request_item, ts

REACH = 1.0  # seconds around a loss window that a finding's time still falls in it


@dataclass(frozen=True, slots=True)
class LossWindow:
    """When a tap's capture writer dropped records (``first`` None: since the start)."""

    tap: str
    first: float | None
    last: float
    dropped: int
    reason: str
    resumed: bool | None

    def overlaps(self, r: RequestRow, end: float | None) -> bool:
        """The request was open while records were being dropped."""
        after_start = self.first is None or end is None or end >= self.first
        return r.tap == self.tap and r.start <= self.last and after_start

    def holds(self, t: float | None) -> bool:
        if t is None:
            return False
        return (self.first is None or t >= self.first - REACH) and t <= self.last + REACH


def loss_windows(losses: list[dict[str, Any]]) -> list[LossWindow]:
    """The writer's loss windows from what ``Summary`` kept of ``capture_loss`` records."""
    return [
        LossWindow(
            tap=str(w["tap"]),
            first=w.get("first"),
            last=float(w["last"]),
            dropped=int(w.get("dropped") or 0),
            reason=str(w.get("reason") or "writer too slow"),
            resumed=w.get("resumed"),
        )
        for w in losses
    ]


def _window_of(
    windows: list[LossWindow], r: RequestRow, f: Finding, end: float | None
) -> LossWindow | None:
    """The loss window that makes this finding's claim about ``r`` rest on missing records."""
    for w in windows:
        if not w.overlaps(r, end):
            continue
        if r.termination != "complete" or w.holds(f.t):
            return w
    return None


def set_aside_lost(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """Findings without the requests whose records the capture lost; those requests in
    one ``capture_lost`` finding per tap, quoting the windows."""
    windows = loss_windows(ctx.e.losses)
    if not windows:
        return findings
    lost: dict[str, RequestRow] = {}
    used: dict[str, set[LossWindow]] = {}
    out: list[Finding] = []
    for f in findings:
        keep: list[str] = []
        for rid in f.requests:
            r = ctx.row(rid)
            w = None if r is None else _window_of(windows, r, f, r.end or ctx.e.end)
            if r is None or w is None:
                keep.append(rid)
                continue
            lost[rid] = r
            used.setdefault(r.tap, set()).add(w)
        if len(keep) == len(f.requests):
            out.append(f)
        elif keep:
            f.requests = keep
            f.evidence.append(
                EvidenceItem(
                    text=f"{counted(len(f.requests) - len(keep), 'request')} left out of it: "
                    "the capture lost records while they were open (see capture_lost)",
                    figures={"left_out": len(f.requests) - len(keep)},
                )
            )
            out.append(f)
    # and the requests no finding named: any that did not complete in the capture while
    # its tap lost records is the capture's to explain, said so
    for r in ctx.interesting:
        if r.id in lost or not r.method or r.termination == "complete":
            continue
        for w in windows:
            if w.overlaps(r, r.end or ctx.e.end):
                lost[r.id] = r
                used.setdefault(r.tap, set()).add(w)
                break
    for tap in sorted(used):
        rows = sorted((r for r in lost.values() if r.tap == tap), key=lambda r: r.start)
        out.append(_lost_finding(tap, rows, sorted(used[tap], key=lambda w: w.last)))
    return out


def _lost_finding(tap: str, rows: list[RequestRow], windows: list[LossWindow]) -> Finding:
    dropped = sum(w.dropped for w in windows)
    first = min((w.first for w in windows if w.first is not None), default=None)
    only = windows[0] if len(windows) == 1 else None
    span = (
        f" over {only.last - only.first:.3f} s"
        if only is not None and only.first is not None
        else f" in {len(windows)} windows"
        if only is None
        else ""
    )
    summary = (
        f"Tap {tap}'s capture writer lost {counted(dropped, 'record')}{span} "
        f"({windows[-1].reason}); {counted(len(rows), 'request')} open then did not "
        "leave their whole story in the capture: how they ended, and whose fault any "
        "hang among them was, is unknown from this capture."
    )
    evidence = [
        EvidenceItem(
            text=f"capture_loss: {counted(w.dropped, 'record')} dropped "
            + (f"from {ts(w.first)} " if w.first is not None else "")
            + f"to {ts(w.last)} ({w.reason})"
            + (
                ", writing resumed after it"
                if w.resumed
                else ", not resumed before the capture's end"
                if w.resumed is False
                else ""
            ),
            t=w.first if w.first is not None else w.last,
            tap=tap,
            figures={
                "dropped": w.dropped,
                "span": round(w.last - w.first, 3) if w.first is not None else None,
                "first_t": w.first,
                "last_t": w.last,
                "resumed": w.resumed,
            },
        )
        for w in windows
    ]
    evidence += [request_item(r, termination=r.termination) for r in rows[:MAX_QUOTED]]
    return Finding(
        party="unknown",
        kind="capture_lost",
        summary=summary,
        requests=[r.id for r in rows],
        connections=sorted({f"{r.tap}/{r.conn}" for r in rows}),
        evidence=evidence,
        ruled_out=[],
        confidence="medium",
        settle="a capture on a disk with room for it (another filesystem, or "
        "--capture-max-bytes with --capture-compress), or the client's own log of these "
        "requests",
        t=rows[0].start if rows else first,
    )


def set_aside_gapped(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """Requests with bytes a packet capture missed leave the findings they were in (what
    they did past the gap is unknown); one ``packet_gap`` finding per tap names them.
    A finding left standing on a connection where a gap was is at most low confidence,
    and says so: the pairing of requests and answers there rests on the resync."""
    gapped = {r.id: r for r in ctx.interesting if r.capture_gap is not None}
    headless = ctx.e.headless
    ctx.e.gapped = bool(gapped or ctx.e.headless_total)
    if not ctx.e.gapped:
        return findings
    gapped_conns = {f"{r.tap}/{r.conn}" for r in gapped.values()}
    gapped_conns |= {h["id"].rsplit("/", 1)[0] for h in headless}
    out: list[Finding] = []
    for f in findings:
        keep = [q for q in f.requests if q not in gapped]
        if f.requests and not keep:
            continue
        if len(keep) < len(f.requests):
            f.evidence.append(
                EvidenceItem(
                    text=f"{counted(len(f.requests) - len(keep), 'request')} left out of it: "
                    "the packet capture missed some of their bytes (see packet_gap)",
                    figures={"left_out": len(f.requests) - len(keep)},
                )
            )
            f.requests = keep
        on_gapped = sorted(gapped_conns.intersection(f.connections))
        if on_gapped and not f.note:
            f.confidence = "low"
            f.evidence.append(
                EvidenceItem(
                    text=f"the packet capture missed bytes on {', '.join(on_gapped[:3])}: "
                    "its requests were paired with their answers again after the gap",
                    figures={"gapped_connections": len(on_gapped)},
                )
            )
            f.summary += " (The packet capture has gaps on its connection: low confidence.)"
        out.append(f)
    taps = sorted({r.tap for r in gapped.values()} | {h["id"].split("/", 1)[0] for h in headless})
    for tap in taps:
        rows = sorted((r for r in gapped.values() if r.tap == tap), key=lambda r: r.start)
        lost = [h for h in headless if h["id"].startswith(f"{tap}/")]
        out.append(_gap_finding(tap, rows, lost))
    return out


def _gap_finding(tap: str, rows: list[RequestRow], headless: list[dict[str, Any]]) -> Finding:
    n = len(rows) + len(headless)
    summary = (
        f"The packet capture of tap {tap} missed bytes of {counted(n, 'request')}: "
        "what they did past the missing bytes is unknown, and no party is named for them "
        "(a packet capture's gap, not a tap's lost records)."
    )
    evidence = [
        request_item(
            r,
            f"{req_text(r)}: {r.capture_gap} byte(s) of it missing from the packet capture, "
            f"termination={r.termination}",
            gap=r.capture_gap,
            termination=r.termination,
        )
        for r in rows[:MAX_QUOTED]
    ]
    evidence += [
        EvidenceItem(
            text=f"{ts(h['t'])} request {h['id']}: its head is not in the packet capture "
            f"({h['gap']} byte(s) missing)",
            t=h["t"],
            tap=tap,
            request=h["id"],
            figures={"gap": h["gap"]},
        )
        for h in headless[:MAX_QUOTED]
    ]
    return Finding(
        party="unknown",
        kind="packet_gap",
        summary=summary,
        requests=[r.id for r in rows],
        connections=sorted(
            {f"{r.tap}/{r.conn}" for r in rows} | {h["id"].rsplit("/", 1)[0] for h in headless}
        ),
        evidence=evidence,
        ruled_out=[],
        confidence="low",
        settle="a capture without drops: a larger capture buffer (tcpdump -B, tracer sniff "
        "--buffer-size), a full snap length, or an inline tap (tracer proxy)",
        t=min([*(r.start for r in rows), *(h["t"] for h in headless)], default=None),
    )
