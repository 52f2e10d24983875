"""What is not a fault: slow first tokens under load, and a hang reported while nothing
was outstanding.

Load is a note with the engine's figures (never a fault, never "cold start"); a
``--hang-at`` mark with nothing in flight rules the engine out and points at the client
or a proxy in front.
"""

from __future__ import annotations

from collections import defaultdict

from ...wording import counted
from ..rows import RequestRow
from .context import Context
from .model import EvidenceItem, Finding, RuledOut, finding
from .quotes import MAX_QUOTED, more_item, req_text, request_item, ts
from .signs import SLOW_FIRST_TOKEN


def analyze_load(ctx: Context) -> list[Finding]:
    """Slow first tokens while the engine was busy: load, with the figures — not a fault.

    One note per tap, over all its requests that waited (quoting the first
    ``MAX_QUOTED``), with the engine's figures over the whole span of the waits.
    """
    slow: dict[str, list[RequestRow]] = defaultdict(list)
    for r in ctx.interesting:
        if r.first_token is None or r.first_token < SLOW_FIRST_TOKEN:
            continue
        if ctx.engine_view(r.start, r.start + r.first_token).loaded:
            slow[r.tap].append(r)
    out: list[Finding] = []
    for tap, rows in sorted(slow.items()):
        waits = sorted(r.first_token or 0.0 for r in rows)
        start = min(r.start for r in rows)
        end = max(r.start + (r.first_token or 0.0) for r in rows)
        median = waits[len(waits) // 2]
        evidence = [ctx.engine_view(start, end).item()]
        evidence += [
            request_item(
                r,
                f"{req_text(r)}: first token after {r.first_token:.3f} s",
                first_token=r.first_token,
            )
            for r in rows[:MAX_QUOTED]
        ]
        if len(rows) > MAX_QUOTED:
            evidence.append(more_item(len(rows) - MAX_QUOTED, "request(s) like these"))
        out.append(
            finding(
                "engine_queueing",
                "engine",
                f"{counted(len(rows), 'request')} at tap {tap} waited {median:.2f} s (median; up to "
                f"{waits[-1]:.2f} s) for their first token because the engine was busy — "
                "load, not a fault, and not a cold start.",
                rows,
                evidence,
                [],
                "high",
                note=True,
                t=start,
            )
        )
    return out


def analyze_marks(ctx: Context) -> list[Finding]:
    """A hang reported at a time when no request was in flight at the front-most tap."""
    out: list[Finding] = []
    if not ctx.order:
        return out
    front = ctx.order[0]
    for mark in ctx.e.marks:
        before, incomplete, in_flight = ctx.mark_stats(front, mark)
        if in_flight:
            continue
        complete = incomplete == 0
        view = ctx.engine_view(mark - 5.0, mark)
        evidence = [
            EvidenceItem(
                text=f"hang reported at {ts(mark)}: no request in flight at tap {front}",
                t=mark,
                tap=front,
                figures={"in_flight": in_flight},
            ),
            EvidenceItem(
                text=f"{counted(before, 'request')} before it, "
                + ("all delivered completely" if complete else "not all complete"),
                t=mark,
                tap=front,
                figures={"before": before, "incomplete": incomplete},
            ),
        ]
        if view.known:
            evidence.append(view.item())
        ruled = [RuledOut("engine", "nothing was outstanding at the serving side")]
        if front in ctx.e.client_facing:
            out.append(
                finding(
                    "client_idle_hang",
                    "client",
                    "Every response had been delivered and the client sent nothing: the "
                    "client itself was stuck.",
                    [],
                    evidence,
                    ruled,
                    "high" if complete else "medium",
                    t=mark,
                )
            )
        else:
            out.append(
                finding(
                    "idle_at_hang",
                    "unknown",
                    "Nothing was outstanding at this tap when the hang was seen: client or a "
                    "proxy in front of the tap; the engine is ruled out.",
                    [],
                    evidence,
                    ruled,
                    "medium",
                    t=mark,
                    settle=f"place a tap on the client side of the proxy, or, if the harness "
                    f"talks to tap {front} directly, pass --client-facing {front}",
                )
            )
    return out
