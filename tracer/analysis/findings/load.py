"""What is not a fault: slow first tokens under load.

Load is a note with the engine's figures (never a fault, never "cold start"). (A
``--hang-at`` mark is answered in ``marks``.)
"""

from __future__ import annotations

from collections import defaultdict

from ...wording import counted
from ..rows import RequestRow
from .context import Context
from .model import Finding, finding
from .quotes import MAX_QUOTED, more_item, req_text, request_item
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
