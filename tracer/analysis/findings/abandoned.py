"""An engine that goes on generating for a client that left (vLLM #9428: "Running: 1
reqs" minutes after the disconnect): zombie load that the requests after it wait on.

The client's abort stays the client's (``client_abort``). What is the engine's is what
came after: at a tap in front of the serving stack, from ``SETTLE`` after the abort until
the tap's next request (at most ``REACH``), nothing was in flight at the tap while the
engine's live figures said it ran requests and its decode progress moved, for at least
``MIN_SPAN``. Another tap's request in flight then ends the quiet; a client of the engine that
no tap saw would explain it too: the finding is medium and says what would settle it.
"""

from __future__ import annotations

from ..rows import RequestRow
from .context import Context
from .model import EvidenceItem, Finding, RuledOut, finding
from .quotes import outcome_item, request_item, ts

SETTLE = 0.5  # seconds after the abort for the engine to notice it
REACH = 30.0  # seconds after the abort looked at
MIN_SPAN = 1.5  # seconds the tap must have been empty for it to mean anything
MAX_CHECKED = 16  # aborts checked (each a window of the engine's samples)


def analyze_abandoned(ctx: Context) -> list[Finding]:
    aborts = [
        r
        for r in ctx.interesting
        if r.method
        and r.termination == "client_abort"
        and r.end is not None
        and (r.response_bytes > 0 or r.status is not None)
        and ctx.upstream_is_serving(r)
    ][:MAX_CHECKED]
    if not aborts:
        return []
    quiet = _quiet_after(ctx, aborts)
    out: list[Finding] = []
    for r in aborts:
        end = quiet.get(r.id)
        start = (r.end or r.start) + SETTLE
        if end is None or end - start < MIN_SPAN:
            continue
        view = ctx.engine_view(start, end)
        if not view.generating or view.progress_span < MIN_SPAN:
            continue
        out.append(
            finding(
                "engine_kept_generating",
                "engine",
                f"The engine went on generating after the client left {r.id}: for "
                f"{end - start:.3g} s nothing was in flight at tap {r.tap} while it ran "
                f"≤{view.running_max} request(s) and decoded +{view.progress:g} tokens — "
                "load for nobody.",
                [r],
                [
                    request_item(r),
                    outcome_item(r),
                    EvidenceItem(
                        text=f"nothing in flight at tap {r.tap} from {ts(start)} to {ts(end)}",
                        t=start,
                        tap=r.tap,
                        figures={"in_flight": 0, "span": round(end - start, 6)},
                    ),
                    view.item(),
                ],
                [
                    RuledOut("proxy", "the tap's upstream is the serving stack itself"),
                ],
                "medium",  # a client of the engine that no tap saw would explain it too
                settle="the engine's own per-request records (its abort log, or "
                "num_aborted_requests_total) would show it, and whether clients no tap saw "
                "ran requests on the engine then",
                t=start,
            )
        )
    return out


def _quiet_after(ctx: Context, aborts: list[RequestRow]) -> dict[str, float]:
    """For each abort, until when its tap had nothing in flight after it (its next
    request's start, or the end of ``REACH``): one pass over the rows."""
    until = {r.id: min((r.end or r.start) + REACH, ctx.e.end or r.start) for r in aborts}
    by_tap: dict[str, list[RequestRow]] = {}
    for r in aborts:
        by_tap.setdefault(r.tap, []).append(r)
    everyone = [r for rs in by_tap.values() for r in rs]
    for o in ctx.e.requests:
        if not o.method:
            continue
        # a request in flight at any tap may be the engine's load (another client's)
        for r in everyone:
            if o.id == r.id or r.end is None:
                continue
            o_end = o.end if o.end is not None else float("inf")
            if o_end <= r.end or o.start >= until[r.id]:
                continue
            # in flight at some moment after the abort: the quiet ends when it began
            until[r.id] = min(until[r.id], max(o.start, r.end))
    return until
