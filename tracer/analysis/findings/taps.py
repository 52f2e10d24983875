"""Between taps: a request that stopped, was answered, held or cut between two of them
blames the hop there; a failure seen the same at every tap is told once.

Runs after the per-tap analyzers, on their findings and the join (``Context.join``):
it replaces the findings a tap could only place "somewhere upstream of me".
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from ..rows import RequestRow
from .context import Context
from .hangs import expect_finding
from .join import JOIN_SLACK
from .model import EvidenceItem, Finding, RuledOut, finding
from .quotes import (
    at_tap_item,
    never_seen_item,
    outcome,
    outcome_item,
    outcome_text,
    probe_item,
    request_item,
    reused_words,
)
from .signs import (
    client_side,
    delivery_kind,
    error_status,
    expect_unanswered,
    hang_window,
    relevant_at_front,
    same_failure,
    upstream_silence,
    written_on_closed,
)


def join_taps(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """With several taps: a request that stopped between two of them blames the hop there."""
    if len(ctx.order) < 2:
        return findings
    rank = {tap: i for i, tap in enumerate(ctx.order)}
    replaced: set[str] = set()
    extra: list[Finding] = []
    folded: dict[str, list[RequestRow]] = {}  # the telling tap's request -> it at the others
    for seen in ctx.join.joined():
        taps = sorted(seen, key=lambda t: rank.get(t, 0))
        rows = [seen[t] for t in taps]  # client side first
        front = rows[0]
        if not relevant_at_front(front, ctx.e.end):
            continue
        window = hang_window(front, ctx.e.end)
        legs = [t for t in taps[1:] if t in ctx.join.next_taps(taps[0])]
        same = [t for t in legs if same_failure(seen[t], front)]
        if len(legs) > 1 and same:  # side by side (PD's legs): the one that failed as the
            taps = [t for t in taps if t not in legs or t == same[0]]  # front did is its path
            rows = [seen[t] for t in taps]
        if len(taps) > 1 and all(same_failure(seen[t], seen[taps[-1]]) for t in taps[:-1]):
            # told by the tap nearest the side it came from
            teller = taps[0] if client_side(front) else taps[-1]
            folded[seen[teller].id] = [seen[t] for t in taps if t != teller]
            continue
        last = taps[-1]
        behind = ctx.join.next_taps(last)
        if len(taps) < len(ctx.order):  # never reached the taps behind
            # at a hop (none of the taps one hop behind the last that saw it got it), not
            # at a tap that saw it
            stopped = bool(behind) and not any(t in seen for t in behind)
            if stopped and written_on_closed(seen[last], ctx.e.end):
                continue  # its own tap tells it (the connection's close came first)
            after = " or tap ".join(behind)
            never = never_seen_item(behind, ctx.counts)
            if stopped and error_status(seen[last]):
                extra.append(_answered_alone(seen[last], after, never))
                replaced.update(r.id for r in rows)
                continue
            if stopped and expect_unanswered(seen[last]):
                hop = f"the hop between tap {last} and tap {after}"
                extra.append(expect_finding(seen[last], [request_item(seen[last]), never],
                                            serving=False, hop=hop))  # fmt: skip
                replaced.update(r.id for r in rows)
                continue
            if stopped:
                view = ctx.engine_view(*(window or (front.start, front.end or front.start)))
                fresh, _ = ctx.fresh_completed(seen[last])
                reuse = ctx.reuse_implicated(seen[last], bool(fresh))
                kind = "proxy_hung_on_reuse" if reuse else "proxy_swallowed_request"
                evidence = [request_item(seen[t]) for t in taps] + [never, outcome_item(front)]
                if view.known:
                    evidence.append(view.item())
                if window is not None:  # what the tap's own probes found meanwhile
                    evidence += [probe_item(p) for p in ctx.probes_during(*window, seen[taps[0]])]
                ruled = [
                    *(
                        [RuledOut("client", f"the request reached tap {last} complete")]
                        if seen[last].request_complete is not False
                        else []
                    ),
                    RuledOut(
                        "engine",
                        f"the request never reached tap {after}, in "
                        "front of the serving stack" + (f"; {view.quote()}" if view.known else ""),
                    ),
                ]
                extra.append(
                    finding(
                        kind,
                        "proxy",
                        f"The hop between tap {last} and tap {after} "
                        + (
                            f"held the {reused_words(seen[last])}"
                            if reuse
                            else "swallowed the request"
                        )
                        + ": it never reached the next tap.",
                        [seen[t] for t in taps],
                        evidence,
                        ruled,
                        "high",
                        t=window[0] if window else front.start,
                    )
                )
                replaced.update(seen[t].id for t in taps)
                continue
        answered = _answered_between(rows)
        if answered is not None:
            extra.append(answered)
            replaced.add(front.id)  # the tap behind keeps its own findings (the cause)
            continue
        held = _held_between(rows)
        if held is not None:
            extra.append(held)
            replaced.update(r.id for r in rows)
            continue
        back = seen[taps[-1]]
        # the stream was whole (or still flowing: the hop then closed that side too) behind
        # the hop, and cut in front of it
        if back.termination in ("complete", "client_abort") and front.termination == "truncated":
            waited = _waited(back)
            extra.append(_cut_between(front, back, waited))
            # a hop that gave up on a silent upstream: the silence is told at the back tap
            replaced.update({front.id} if waited else {front.id, back.id})
    kept = [f for f in findings if not (set(f.requests) & replaced)]
    return [_unseen_by_client(ctx, f, rank) for f in _fold(kept, folded)] + extra


def _unseen_by_client(ctx: Context, f: Finding, rank: dict[str, int]) -> Finding:
    """A fault at a tap behind the front one, in requests whose front copies were answered
    well: a hop in front retried them (the SGLang router sends a request that got a 5xx
    to another engine) or answered anyway. Still told, as a note: it is not what the
    client saw."""
    groups = [ctx.join.masked(rid) for rid in f.requests]
    if f.note or not groups or not all(groups):
        return f
    lines: list[EvidenceItem] = []
    how = " The client did not see it: a hop in front answered the client anyway."
    for rid, seen in zip(f.requests, groups, strict=True):
        front = seen[min(seen, key=lambda t: rank.get(t, 0))]
        failed = next(r for r in seen.values() if r.id == rid)
        text = (
            f"{rid}: its copy at tap {front.tap} ({front.id}) was answered: {outcome_text(front)}"
        )
        figures = outcome(front) | {"answered_copy_of": rid}
        others = [r for r in seen.values() if r.tap not in (front.tap, failed.tap)]
        answered = [r for r in others if not relevant_at_front(r, ctx.e.end)]
        if answered and failed.end is not None and answered[0].start >= failed.end:
            text += f"; sent again to tap {answered[0].tap}, which answered it"
            figures |= {"sent_to": answered[0].tap, "sent": "again"}
            how = (
                " The client did not see it: a hop in front sent the request again to another "
                "engine, which answered."
            )
        elif answered:  # sent to both at once (the prefill and decode legs of PD)
            text += f"; sent at the same time to tap {answered[0].tap}, which answered it"
            figures |= {"sent_to": answered[0].tap, "sent": "at_once"}
            how = (
                " The client did not see it: a hop in front sent the request to another "
                "engine at the same time, which answered."
            )
        lines.append(
            EvidenceItem(text=text, t=front.end, tap=front.tap, request=front.id, figures=figures)
        )
    return replace(
        f,
        summary=f.summary + how,
        settle=None,  # the tap in front answers what it asked
        evidence=f.evidence + lines,
        note=True,
    )


def _answered_alone(r: RequestRow, after: str, never: EvidenceItem) -> Finding:
    """An error status for a request the next tap toward the engine never saw: the hop
    answered it without forwarding it (a rate limit, an overload page, no upstream)."""
    return finding(
        "proxy_error_status",
        "proxy",
        f"The hop between tap {r.tap} and tap {after} answered {r.status} itself: the "
        f"request never reached tap {after}.",
        [r],
        [request_item(r), outcome_item(r), never],
        [RuledOut("engine", f"the request never reached tap {after}")],
        "high",
        t=r.end,
    )


def _waited(r: RequestRow) -> dict[str, Any] | None:
    """The upstream silence a request was in when its client (a hop) closed it."""
    return upstream_silence(r) if r.termination == "client_abort" else None


def _cut_between(front: RequestRow, back: RequestRow, waited: dict[str, Any] | None) -> Finding:
    """The stream cut in front of a hop while whole, or still flowing, behind it; or cut
    by the hop after the tap behind had ``waited`` on a silent upstream (a proxy's read
    timeout meeting an engine's pause: both are findings)."""
    evidence = [request_item(front), outcome_item(front), outcome_item(back)]
    if waited is not None:
        cut = finding(
            "proxy_cut_stream",
            "proxy",
            f"The hop between tap {front.tap} and tap {back.tap} cut the stream after tap "
            f"{back.tap} had waited {waited['duration'] or 0:.3g} s on its upstream: a "
            "proxy's read timeout (as nginx's proxy_read_timeout) met that silence.",
            [front, back],
            evidence,
            [],
            "high",
            settle=f"the findings at tap {back.tap} say why its upstream was silent; the "
            "hop's timeout may be shorter than the engine's pauses",
            t=front.end,
        )
        cut.after_silence = back.id  # the silence behind came first
        return cut
    whole = "ended complete" if back.termination == "complete" else "was still flowing"
    return finding(
        "proxy_cut_stream",
        "proxy",
        f"The stream {whole} at tap {back.tap} but was cut at tap {front.tap}.",
        [front, back],
        evidence,
        [RuledOut("engine", f"the stream {whole} at tap {back.tap}")],
        "high",
        t=front.end,
    )


def _answered_between(rows: list[RequestRow]) -> Finding | None:
    """An error status at one tap that the next tap toward the engine never got: the hop
    between them answered it itself (a proxy's 502/504 after its own timeout, as nginx's
    ``proxy_read_timeout``, or its own error)."""
    for front, back in itertools.pairwise(rows):
        status = front.status
        if not error_status(front) or back.status == status:
            continue
        if back.status is None:
            what = (
                f"tap {back.tap} got no answer from upstream in "
                f"{(back.end or front.end or back.start) - back.start:.3g} s, then "
                f"the hop closed the request ({back.termination})"
            )
        else:
            what = f"tap {back.tap} got {back.status} ({back.termination})"
        answered = finding(
            "proxy_error_status",
            "proxy",
            f"The hop between tap {front.tap} and tap {back.tap} answered {status} itself: {what}.",
            [front, back],
            [request_item(front), outcome_item(front), at_tap_item(back, f"at tap {back.tap}: ")],
            # after a silence behind it the hop's timeout met it: why the answer was slow
            # is the silence's to say (it is this finding's context), nothing is ruled out
            []
            if back.status is None and upstream_silence(back) is not None
            else [RuledOut("engine", f"tap {back.tap} never got a {status} from upstream")],
            "high",
            settle="if the hop timed out waiting, the findings at tap "
            f"{back.tap} say why the answer was slow; the hop's timeout may be shorter "
            "than the engine's time to first token",
            t=front.end,
        )
        if back.status is None and upstream_silence(back) is not None:
            answered.after_silence = back.id  # the silence behind came first
        return answered
    return None


def _held_between(rows: list[RequestRow]) -> Finding | None:
    """A stream silent at one tap for longer than any gap at the next one toward the
    engine, which was receiving it when the silence began and saw no such silence: the
    bytes came that far and the hop between the two held them (a buffering or stuck
    proxy). "When the silence began" is read within ``JOIN_SLACK`` (the taps' clocks may
    differ), and not through the pair's median delay: a request joined to the wrong one
    (its body sent again after a first attempt that a hop dropped: fingerprints are
    paired by their count at each tap) makes that delay itself."""
    for front, back in itertools.pairwise(rows):
        silent = upstream_silence(front)
        if (
            silent is None
            or silent["duration"] is None
            or back.ttfb is None
            or back.max_gap is None
            or back.max_gap >= silent["duration"]
            or upstream_silence(back) is not None
            or back.start > silent["start"] + JOIN_SLACK
            or (back.end is not None and back.end < silent["start"] - JOIN_SLACK)
        ):
            continue
        buffered = delivery_kind(front) == "buffered"
        return finding(
            "buffered_response" if buffered else "proxy_held_stream",
            "proxy",
            f"The whole stream arrived at tap {front.tap} in one burst at its end while tap "
            f"{back.tap} received it as it came, with no gap over {back.max_gap:.3g} s: the "
            "hop between them buffered it (as nginx with proxy_buffering on does)."
            if buffered
            else f"Tap {front.tap} got nothing for {silent['duration']:.3g} s"
            + (
                f" after all {front.events} events and data: [DONE] (the body's end never came)"
                if front.done
                else f" after {front.events} events"
                if front.events
                else ""
            )
            + f" while tap {back.tap} received the stream"
            + (" to its end" if back.termination == "complete" else "")
            + f" with no gap over {back.max_gap:.3g} s: the hop between them held it.",
            [front, back],
            [
                request_item(front),
                EvidenceItem(
                    text=f"stall t={silent['start']:.3f} upstream_silent for "
                    f"{silent['duration']:.3g} s at tap {front.tap}",
                    t=silent["start"],
                    tap=front.tap,
                    request=front.id,
                    figures={"direction": "upstream_silent", "duration": silent["duration"]},
                ),
                outcome_item(front),
                at_tap_item(
                    back,
                    f"the same at tap {back.tap}: ",
                    f"; longest gap {back.max_gap:.3g} s, no stall",
                    max_gap=back.max_gap,
                    stalls=0,
                ),
            ],
            [
                RuledOut("engine", f"the bytes reached tap {back.tap} in time"),
                RuledOut("client", f"tap {front.tap} had nothing to send it"),
            ],
            "high",
            t=silent["start"],
        )
    return None


def _fold(findings: list[Finding], folded: dict[str, list[RequestRow]]) -> list[Finding]:
    """A failure seen the same at every tap is told once, by the finding at the tap nearest
    the side it came from (the engine's, or the client's), which names the request at
    the others too; their own findings, which could only say "upstream of me" (or "my
    client", of a proxy), go."""
    teller_of = {r.id: teller for teller, others in folded.items() for r in others}
    told = {rid for f in findings if not f.note for rid in f.requests if rid in folded}
    out = []
    for f in findings:
        ids = f.requests
        if f.note:
            out.append(f)
            continue
        if ids and all(teller_of.get(i) in told for i in ids):
            continue  # told by the teller's finding
        for r in [r for rid in ids if rid in folded for r in folded[rid] if r.id not in ids]:
            ids.append(r.id)
            f.connections = sorted({*f.connections, f"{r.tap}/{r.conn}"})
            f.evidence.append(at_tap_item(r, f"the same at tap {r.tap}: ", same_failure=True))
        out.append(f)
    return out
