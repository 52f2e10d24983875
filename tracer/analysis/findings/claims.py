"""Every claim checked against what would contradict it, before it is told (issue 35).

The analyzers fire on patterns; this pass, over all their findings, asks what else the
captures show (``captures/ANALYSIS.md``, "Claims and their counter-evidence"):

* what the failed requests of a finding share against the completed ones of their tap
  (``contrast``), quoted in its evidence; a ``*_on_reuse`` claim whose requests reuse
  does not separate from the completed ones (a request on a fresh connection got
  nothing back too) becomes the claim that does not name reuse;
* one story: a fault finding that rules out the verdict's party for a request the
  verdict's finding concerns contradicts it. A hop's own status or cut after its own
  timeout takes the silence behind it as its context, not as a second fault; what still
  contradicts is said in both findings and lowers the verdict's confidence.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rows import RequestRow
from .context import Context
from .contrast import Contrast, contrast_all
from .model import EvidenceItem, Finding
from .quotes import ts
from .signs import hang_window

# the kinds that claim a request failed because its connection was reused, and what they
# claim without the reuse
REUSE_KINDS = {"proxy_hung_on_reuse": "proxy_swallowed_request"}
# the kinds about requests that failed (hung, cut, errored): their requests are compared
# with the completed ones of their tap
FAILURE_KINDS = {
    "proxy_hung_on_reuse",
    "proxy_swallowed_request",
    "proxy_cut_stream",
    "proxy_error_status",
    "proxy_held_stream",
    "engine_lost_request",
    "engine_stall",
    "engine_stall_mid_stream",
    "engine_truncated",
    "engine_error_status",
    "engine_error_event",
    "stream_cut",
    "upstream_silent",
    "stale_connection_race",
    "client_abort",
    "client_not_reading",
    "lost_before_engine",  # decided by the engines' own records (engine_records)
    "lost_after_engine",
}
HUNG_KINDS = {
    "proxy_hung_on_reuse",
    "proxy_swallowed_request",
    "engine_lost_request",
    "lost_before_engine",
}
LOWER = {"high": "medium", "medium": "low", "low": "low"}


@dataclass(slots=True)
class Contradiction:
    """Two findings that cannot both be right about the same request."""

    verdict: Finding
    other: Finding
    request: str
    party: str


def check_claims(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """Findings whose claims their counter-evidence does not contradict: each failure
    finding quotes what its requests share; reuse claims hold only where reuse separates."""
    findings = _triggers_as_context(_silences_as_context(ctx, findings))
    rank = {tap: i for i, tap in enumerate(ctx.order)}
    # the findings that failed requests the same way at the same tap are compared as one
    # group: a hop that swallowed two requests, one finding each, swallowed both
    members: dict[tuple[str, str], list[Finding]] = {}
    rows_of: dict[tuple[str, str], dict[str, RequestRow]] = {}
    for f in findings:
        if f.note or f.kind not in FAILURE_KINDS or not f.requests:
            continue
        rows = [r for rid in f.requests if (r := ctx.row(rid)) is not None]
        if not rows:
            continue
        front = min(rows, key=lambda r: rank.get(r.tap, 0)).tap  # the client's side
        key = ("hung" if f.kind in HUNG_KINDS else f.kind, front)
        members.setdefault(key, []).append(f)
        rows_of.setdefault(key, {}).update({r.id: r for r in rows if r.tap == front})
    if not members:
        return findings
    for (kind, tap), fs in members.items():
        if kind in CUT_KINDS:
            _same_age(fs, tap, list(rows_of[(kind, tap)].values()), ctx.longest_complete[tap])
    keys = list(members)
    groups = [list(rows_of[k].values()) for k in keys]
    whats = ["hung" if k[0] == "hung" else "failed" for k in keys]
    for key, c in zip(keys, contrast_all(ctx.e.requests, groups, whats), strict=True):
        if c is None:
            continue
        for f in members[key]:
            _contrasted(f, c)
    return findings


CUT_KINDS = {"proxy_cut_stream", "stream_cut", "engine_truncated"}
AGE_SLACK = 0.1  # seconds (or 2 %): cuts this close in age were cut at one age


def _same_age(
    fs: list[Finding], front: str, rows: list[RequestRow], longest_complete: float
) -> None:
    """Streams cut at one tap at the same age after their request, having started at
    different times: a total request timeout (Envoy's route timeout, Go's WriteTimeout),
    not an idle one. Said in the findings, with the age."""
    cut = {r.id: r for r in rows if r.tap == front and r.termination == "truncated"}
    ages = sorted(r.end - r.start for r in cut.values() if r.end is not None)
    starts = sorted(r.start for r in cut.values())
    if len(ages) < 2 or ages[-1] - ages[0] > max(AGE_SLACK, 0.02 * ages[0]):
        return
    if starts[-1] - starts[0] <= max(AGE_SLACK, 0.02 * ages[0]):
        return  # started together: they may just have stopped together
    age = ages[len(ages) // 2]
    if longest_complete >= ages[0]:
        return  # a request at the tap completed after longer than that: no such timeout
    if len({(r.events, r.response_bytes) for r in cut.values()}) == 1:
        return  # cut after the same bytes: the same size, as much as the same age
    item = EvidenceItem(
        text=f"all {len(ages)} streams cut at tap {front} were cut at the same age, "
        f"{ages[0]:.2f}-{ages[-1]:.2f} s after their request, though they started "
        f"{starts[-1] - starts[0]:.2f} s apart: a total request timeout of about {age:.1f} s",
        tap=front,
        figures={"same_age": round(age, 6), "cut": len(ages), "spread": ages[-1] - ages[0]},
    )
    for f in fs:
        f.evidence.append(item)
        f.summary += f" All {len(ages)} were cut {age:.1f} s after their request: a total timeout."


def _contrasted(f: Finding, c: Contrast) -> None:
    """The contrast quoted in the finding; a reuse claim it does not bear out loses it."""
    f.evidence.append(c.item())
    if f.kind in REUSE_KINDS and not c.reuse_separates:
        f.kind = REUSE_KINDS[f.kind]
        f.summary = _without_reuse(f.summary)


# what a tap behind a hop may say of a silence that the hop's own timeout then met; told
# as that hop's context unless it settles the silence (a wedge, a lost request: high)
SILENCE_KINDS = {"upstream_silent", "answer_in_progress", "engine_queueing"}


def _silences_as_context(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """A hop's own status or cut after its own timeout (``after_silence``) takes what
    happened behind it as its context: the silence's finding, unless it settles why (a
    high-confidence wedge or loss, which stays and outranks the hop's), becomes evidence
    of the hop's finding, with the engines' figures over the silence, and is no longer a
    finding of its own."""
    hops = [f for f in findings if f.after_silence is not None and not f.note]
    if not hops:
        return findings
    folded: set[int] = set()
    for hop in hops:
        rid = hop.after_silence
        behind = ctx.row(rid or "")
        if behind is None:
            continue
        window = hang_window(behind, ctx.e.end)
        if window is None:
            continue
        start, end = window
        view = ctx.engine_view(start, end)
        waited = end - start
        if view.known:
            what = (
                f"the engine decoded meanwhile (running≤{view.running_max}, decode progress "
                f"+{view.progress:g} tokens over {view.progress_span:.1f} s)"
                if view.generating
                else f"the engine ran≤{view.running_max} and queued≤{view.queued_max} "
                "requests meanwhile, "
                + (
                    "with no progress figure"
                    if view.progress is None
                    else f"decode progress +{view.progress:g} tokens"
                )
            )
        else:
            what = "no engine figures cover it"
        hop.evidence.append(
            EvidenceItem(
                text=f"context: tap {behind.tap} had waited {waited:.3g} s on its upstream "
                f"when the hop gave up ({ts(start)} to {ts(end)}); {what}",
                t=start,
                tap=behind.tap,
                request=behind.id,
                figures={"waited": round(waited, 6), "generating": view.generating},
            )
        )
        if view.known:
            hop.evidence.append(view.item())
        if view.generating and view.progress_span:
            rate = (view.progress or 0.0) / view.progress_span
            hop.summary = (
                hop.summary.rstrip(".") + f" — the hop gave up after {waited:.3g} s while the "
                f"engine decoded at {rate:.0f} tok/s."
            )
            hop.settle = (
                f"the hop's own timeout ({waited:.3g} s) is shorter than the engine takes to "
                "answer: raise it (nginx's proxy_read_timeout, haproxy's timeout server), or "
                "stream the answer"
            )
        for other in findings:
            if (
                other is not hop
                and rid in other.requests
                and other.kind in SILENCE_KINDS
                and other.confidence != "high"
            ):
                folded.add(id(other))
                hop.evidence += [e for e in other.evidence if e not in hop.evidence][:4]
                hop.evidence.append(
                    EvidenceItem(
                        text=f"told here as context: tap {behind.tap}'s own reading of the "
                        f"silence was {other.kind} ({other.party}, {other.confidence})",
                        tap=behind.tap,
                        request=behind.id,
                        figures={"context_of": other.kind},
                    )
                )
    return [f for f in findings if id(f) not in folded]


# a finding about what followed a request's failure, and the finding about the failure
# itself that it takes as its context (the client left; the engine went on for nobody)
TRIGGERS = {"engine_kept_generating": "client_abort"}


def _triggers_as_context(findings: list[Finding]) -> list[Finding]:
    """The trigger of a consequence told inside it: one story, not two findings about the
    same request that rule out each other's party (the client's abort rules out the
    engine for the abort, not for what the engine did after it)."""
    folded: set[int] = set()
    for f in findings:
        trigger = TRIGGERS.get(f.kind)
        if trigger is None or f.note:
            continue
        for other in findings:
            if other.kind == trigger and set(other.requests) <= set(f.requests):
                folded.add(id(other))
                f.evidence.append(
                    EvidenceItem(
                        text=f"context: {other.summary} ({other.party}, {other.kind}: what set "
                        "it off, not a fault of its own here)",
                        t=other.t,
                        tap=other.requests[0].split("/", 1)[0] if other.requests else None,
                        request=other.requests[0] if other.requests else None,
                        figures={"context_of": other.kind},
                    )
                )
    return [f for f in findings if id(f) not in folded]


def _without_reuse(summary: str) -> str:
    """The summary of a reuse claim, without the reuse it can no longer claim."""
    for words in ("held the reused keep-alive connection", "held the reused HTTP/2 connection"):
        summary = summary.replace(words, "swallowed the request")
    return summary


def one_story(findings: list[Finding], verdict: Finding, order: list[str]) -> list[Contradiction]:
    """Fault findings that rule out the verdict's party for one of the verdict's requests,
    seen from the same side: each is said in both findings, and the verdict's confidence
    is lowered. A finding only about a tap behind the verdict's front-most one speaks of
    what lies behind that tap (a hop between two taps is not "the hop after" the second
    one), and does not contradict it."""
    rank = {tap: i for i, tap in enumerate(order)}
    taps = {rid.split("/", 1)[0] for rid in verdict.requests}
    front = min(taps, key=lambda t: rank.get(t, 0)) if taps else None
    mine = {rid for rid in verdict.requests if rid.split("/", 1)[0] == front}
    out: list[Contradiction] = []
    for f in findings:
        if f is verdict or f.note:
            continue
        shared = mine.intersection(f.requests)
        if not shared:
            continue
        if any(r.party == verdict.party for r in f.ruled_out):
            out.append(Contradiction(verdict, f, sorted(shared)[0], verdict.party))
    for c in out:
        c.verdict.evidence.append(
            EvidenceItem(
                text=f"contradicted by {c.other.id} ({c.other.kind}), which rules out "
                f"{c.party} for {c.request}",
                tap=c.request.split("/", 1)[0],
                request=c.request,
                figures={"contradicted_by": c.other.id, "ruled_out": c.party},
            )
        )
        c.other.evidence.append(
            EvidenceItem(
                text=f"contradicts the verdict {c.verdict.id} ({c.verdict.kind}) for {c.request}",
                tap=c.request.split("/", 1)[0],
                request=c.request,
                figures={"contradicts": c.verdict.id},
            )
        )
    if out:
        verdict.confidence = LOWER[verdict.confidence]
    return out
