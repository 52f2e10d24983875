"""From the analyzers' findings to the answer: run them, let the taps' join and the
injected faults replace what they explain, discount a starved tap's timings, group
identical findings, order them, and name the verdict.

The order is the verdict's rule (``captures/ANALYSIS.md``, "Verdict"): faults before
notes, what hung before the rest, hard evidence before timing heuristics.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ...wording import counted
from .abandoned import analyze_abandoned
from .claims import check_claims, one_story
from .client import analyze_client, analyze_client_connections
from .context import Context, Evidence
from .delivery import analyze_delivery, analyze_first_events, analyze_reused_first_events
from .endings import analyze_upstream_endings
from .engine_records import analyze_engine_records
from .hangs import analyze_request_hangs
from .incomplete import set_aside_gapped, set_aside_lost
from .injected import injected_by_the_tap
from .load import analyze_load
from .marks import analyze_marks
from .model import EvidenceItem, Finding
from .probe_marks import analyze_probe_marks
from .quotes import ts
from .taps import join_taps
from .topology import topology

CONFIDENCE = {"high": 0, "medium": 1, "low": 2}
# findings about connections that carried no request: listed, but the verdict only when
# nothing went wrong with a request (a port scanner's failed TLS handshake must not
# hide the stall that hung the harness)
NO_REQUEST_KINDS = {"client_connection_failed"}
MARK_KINDS = {
    "client_idle_hang",
    "idle_at_hang",
    "moving_at_hang",
    "silent_at_hang",
    "not_recording_at_hang",
}  # findings about a --hang-at mark
# findings read from timing statistics alone (bunching): they yield the verdict to hard
# evidence (a request never seen at the next tap, bytes that stopped, a status)
TIMING_KINDS = {"delivery_coalesced", "first_event_held"}
# a summary's figures are its request's own: findings whose summaries differ only in
# them are the same fault met by several requests
NUMBER = re.compile(r"\d+(?:\.\d+)?")
GROUP_EVIDENCE = 40  # evidence items kept in a finding that stands for several
LAG_LIMIT = 0.030  # a tap whose loop ran this late cannot tell 30-60 ms bunches apart
LAG_REACH = 5.0  # seconds after a finding's time that a starved window still bears on it

# each a small function from the evidence to findings (structlog's processors' shape)
ANALYZERS: list[Callable[[Context], list[Finding]]] = [
    analyze_request_hangs,
    analyze_client,
    analyze_client_connections,
    analyze_upstream_endings,
    analyze_delivery,
    analyze_first_events,
    analyze_reused_first_events,
    analyze_load,
    analyze_abandoned,
    analyze_marks,
    analyze_probe_marks,
]


def _lagged(ctx: Context, f: Finding) -> dict[str, Any] | None:
    """The worst window in which a tap of the finding was itself starved (its event loop
    blocked past ``LAG_LIMIT``) around the finding's time."""
    if not ctx.e.lags or f.t is None:
        return None
    taps = {c.split("/", 1)[0] for c in f.connections}
    t = float(f.t)
    around = [
        lag
        for lag in ctx.e.lags
        if lag["tap"] in taps
        and lag["max_lag"] >= LAG_LIMIT
        and lag["start"] - 1.0 <= t + LAG_REACH
        and t - 1.0 <= lag["end"]
    ]
    return max(around, key=lambda lag: lag["max_lag"], default=None)


def _discount_starved(ctx: Context, findings: list[Finding]) -> None:
    """A timing heuristic at a tap that was itself starved cannot testify about
    milliseconds: the finding becomes a note, with the lag quoted."""
    for f in findings:
        if f.kind not in TIMING_KINDS or f.note:
            continue
        lag = _lagged(ctx, f)
        if lag is None:
            continue
        f.note = True
        f.confidence = "low"
        f.evidence.append(
            EvidenceItem(
                text=f"tap {lag['tap']} itself ran late around then: its event loop was blocked "
                f"up to {lag['max_lag'] * 1000:.0f} ms ({ts(lag['blocked'][0])} to "
                f"{ts(lag['blocked'][1])}): its timings cannot testify about tens of ms",
                t=lag["blocked"][0],
                tap=lag["tap"],
                figures={"max_lag": lag["max_lag"]},
            )
        )
        f.summary += " (The tap itself was starved then: a note, not a verdict.)"


def _grouped(findings: list[Finding]) -> list[Finding]:
    """Identical findings (the same kind, party, confidence and summary but for its
    figures: the same fault met by several requests) as one (its summary the first's), naming all their requests; its evidence keeps the
    first ``GROUP_EVIDENCE`` items and says how many findings it stands for."""
    out: list[Finding] = []
    first: dict[tuple[Any, ...], Finding] = {}
    for f in findings:
        key = (f.kind, f.party, f.confidence, f.note, NUMBER.sub("#", f.summary))
        group = first.get(key)
        if group is None:
            first[key] = f
            out.append(f)
            continue
        group.requests += [q for q in f.requests if q not in group.requests]
        group.connections = sorted({*group.connections, *f.connections})
        group.grouped = (group.grouped or 1) + 1
        for item in f.evidence:
            if len(group.evidence) >= GROUP_EVIDENCE:
                break
            if item not in group.evidence:
                group.evidence.append(item)
        if f.t is not None and (group.t is None or f.t < group.t):
            group.t = f.t
    return out


def find(e: Evidence) -> tuple[list[Finding], dict[str, Any]]:
    """All findings (sorted, numbered) and the verdict."""
    ctx = Context(e)
    e.tap_pairs = ctx.join.tap_pairs()
    e.topology = topology(ctx)
    findings: list[Finding] = []
    for analyzer in ANALYZERS:
        findings += analyzer(ctx)
    findings = join_taps(ctx, findings)
    findings = injected_by_the_tap(ctx, findings)
    findings = analyze_engine_records(ctx, findings)  # the engines' own records
    _discount_starved(ctx, findings)
    findings = set_aside_lost(ctx, findings)
    findings = set_aside_gapped(ctx, findings)
    findings = check_claims(ctx, _grouped(findings))
    if any(not f.note and f.kind != "silent_at_hang" for f in findings):
        findings = [f for f in findings if f.kind != "silent_at_hang"]
    # what the user saw hang: requests that never completed (or stalled), and the marks
    hung = {r.id for r in ctx.interesting if r.termination != "complete" or r.stalls}
    # requests whose silence a finding explains with high confidence (a wedge): a hop's
    # timeout that met it comes second; a silence the figures cannot explain does not
    # outrank the status or cut the hop produced itself
    silences = {
        q
        for f in findings
        if not f.note and f.confidence == "high" and f.after_silence is None
        for q in f.requests
    }
    findings.sort(
        key=lambda f: (
            f.note,
            f.kind in NO_REQUEST_KINDS,
            not (f.kind in MARK_KINDS or hung.intersection(f.requests)),
            # a hop's timeout that met a silence behind it yields to that silence's finding
            f.after_silence in silences,
            f.kind in TIMING_KINDS,  # heuristics yield to hard evidence
            CONFIDENCE[f.confidence],
            f.party == "unknown",
            f.t if f.t is not None else 0.0,
            f.kind,
        )
    )
    for i, f in enumerate(findings, 1):
        f.id = f"F{i}"
    faults = [f for f in findings if not f.note]
    if not faults:
        notes = [f for f in findings if f.note]
        verdict: dict[str, Any] = {
            "party": "none",
            "kind": "healthy",
            "summary": "No fault found in the captures."
            + (
                f" {counted(len(notes), 'note')}: {', '.join(sorted({n.kind for n in notes}))}."
                if notes
                else ""
            ),
            "finding": None,
            "confidence": "high" if ctx.rows else "low",
        }
    else:
        top = faults[0]
        contradictions = one_story(findings, top, ctx.order)
        verdict = {
            "party": top.party,
            "kind": top.kind,
            "summary": top.summary,
            "finding": top.id,
            "confidence": top.confidence,
            "ruled_out": [r.to_json() for r in top.ruled_out],
        }
        if contradictions:
            verdict["contradicted_by"] = sorted({c.other.id or "" for c in contradictions})
    return findings, verdict
