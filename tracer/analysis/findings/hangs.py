"""Requests that sat with nothing from upstream: whose silence it was.

The one analyzer that decides between an engine that wedged or lost the request, a hop
that held it, and "unknown" — by the engine's own figures over the silence, probes and
fresh connections that answered meanwhile, and what the tap's upstream is.
"""

from __future__ import annotations

from ...wording import counted as counted_words
from ..rows import RequestRow
from .context import TOGETHER, Context
from .engine_view import EngineView
from .model import EvidenceItem, Finding, RuledOut, finding
from .quotes import (
    injected_items,
    outcome_item,
    probe_item,
    request_item,
    reused_words,
    stall_item,
    ts,
)
from .signs import began_before, expect_unanswered, hang_window


def analyze_request_hangs(ctx: Context) -> list[Finding]:
    """Requests that sat with nothing from upstream: engine wedge, lost, or a hop on reuse."""
    out: list[Finding] = []
    for r in ctx.interesting:
        if not r.method:
            continue
        window = hang_window(r, ctx.e.end)
        if window is None:
            continue
        start, end = window
        view = ctx.engine_view(start, end)
        evidence = [request_item(r), outcome_item(r)]
        evidence += [stall_item(r, s) for s in r.stalls]
        evidence.append(
            EvidenceItem(
                text=f"nothing from upstream from {ts(start)} to {ts(end)} ({end - start:.3g} s)",
                t=start,
                tap=r.tap,
                request=r.id,
                figures={"silent_for": round(end - start, 6)},
            )
        )
        evidence += injected_items(r)
        if view.known:
            evidence.append(view.item())
        probes = ctx.probes_during(start, end, r)
        fresh_ok = [p for p in probes if p["outcome"] == "ok"]
        evidence += [probe_item(p) for p in probes]
        fresh, example = ctx.fresh_completed(r)
        if example is not None:
            evidence.append(
                EvidenceItem(
                    text=f"{counted_words(fresh, 'request')} on fresh connections completed meanwhile "
                    f"(e.g. {example.id}, {example.duration or 0:.3f} s)",
                    tap=r.tap,
                    request=example.id,
                    figures={"fresh_completed": fresh, "duration": example.duration},
                )
            )
        mid_stream = began_before(r, start)
        if expect_unanswered(r):
            out.append(expect_finding(r, evidence, serving=ctx.upstream_is_serving(r)))
            continue
        if r.request_complete is False:
            continue  # its body never came whole: the client's (client.analyze_client)
        client_ok = RuledOut(
            "client",
            "the request reached the tap complete and the tap forwarded it; the client "
            "was waiting for the answer",
        )
        if view.wedged:
            kind = "engine_stall_mid_stream" if mid_stream else "engine_stall"
            out.append(
                finding(
                    kind,
                    "engine",
                    f"The engine held the request running (running≤{view.running_max}) while its "
                    f"decode progress stayed flat over {view.progress_span:.3g} s.",
                    [r],
                    evidence,
                    [
                        client_ok,
                        RuledOut(
                            "proxy",
                            "the engine reports requests running and its decode "
                            "progress figure did not move",
                        ),
                    ],
                    "high",
                    t=start,
                )
            )
            continue
        if view.idle and not mid_stream:
            if view.router_in_flight:
                out.append(
                    finding(
                        "engine_lost_request",
                        "engine",
                        "The router counts the request in flight while no engine runs or "
                        "queues anything: it was lost in the serving stack.",
                        [r],
                        evidence,
                        [client_ok, RuledOut("proxy", "the router received it")],
                        "high",
                        t=start,
                    )
                )
                continue
            serving = ctx.upstream_is_serving(r)
            answered = bool(fresh_ok or fresh)
            reuse = ctx.reuse_implicated(r, answered)
            kind = "proxy_hung_on_reuse" if reuse else "proxy_swallowed_request"
            party = "engine" if serving else "proxy"
            if serving:  # the tap's upstream is the serving stack: it lost the request
                kind = "engine_lost_request"
            what = f"held the {reused_words(r)}" if reuse else "swallowed the request"
            # the tap's upstream is a hop in between, or the serving stack's own front
            # (the router's or the engine's HTTP server): say which
            who = "The serving stack behind tap" if serving else "The hop after tap"
            summary = f"{who} {r.tap} {what}: the engine was idle the whole time" + (
                " and fresh connections answered." if answered else "."
            )
            ruled = [
                client_ok,
                RuledOut(
                    "engine" if party == "proxy" else "proxy",
                    view.quote()
                    if party == "proxy"
                    else "the tap's upstream is the serving stack itself",
                ),
            ]
            out.append(
                finding(
                    kind,
                    party,
                    summary,
                    [r],
                    evidence,
                    ruled,
                    "high" if answered else "medium",
                    t=start,
                    settle=None
                    if answered
                    else "probes on fresh connections (--probe-on-stall) would show whether "
                    f"{'it' if serving else 'the hop'} answers at all",
                )
            )
            continue
        serving = ctx.upstream_is_serving(r)
        uncounted = (
            ctx.engines.uncounted(r, start, end)
            if serving and not mid_stream and r.status is None and (view.producing or fresh)
            else None
        )
        if uncounted is not None:
            in_flight, counted = uncounted
            out.append(
                finding(
                    "engine_lost_request",
                    "engine",
                    f"The serving stack behind tap {r.tap} lost the request: with {in_flight} "
                    f"request(s) in flight at the tap the engines counted {counted} running "
                    "or queued, and answered others meanwhile.",
                    [r],
                    [
                        *evidence,
                        EvidenceItem(
                            text=f"{counted_words(in_flight, 'request')} in flight at tap {r.tap} while the "
                            f"engines' live running + queued said {counted}, at most moments "
                            f"from {ts(start)} to {ts(end)}",
                            t=start,
                            tap=r.tap,
                            figures={"in_flight": in_flight, "counted": counted},
                        ),
                    ],
                    [
                        client_ok,
                        RuledOut("proxy", "the tap's upstream is the serving stack itself"),
                    ],
                    "high",
                    t=start,
                    settle=None
                    if ctx.role(r.tap) == "engine"
                    else "the router's own metrics (in flight per worker) would tell the "
                    "router from an engine",
                )
            )
            continue
        answered_late = r.status is not None and (
            r.response_bytes > 0 or r.termination == "complete"
        )
        if view.loaded and not mid_stream and answered_late:
            continue  # it was answered, late: queued under load (the load analyzer's note)
        if not mid_stream and r.stream is False and not r.sse and view.generating:
            # a non-streamed answer is silent until it is done, by design: with the engine
            # decoding meanwhile, the silence is a wait, not a request held unanswered
            out.append(_waited_on_answer(r, evidence, view, start, end))
            continue
        if mid_stream and serving:
            # its bytes stopped mid-stream with no hop between the tap and the serving stack
            together = ctx.stopped_together(r, start)
            if together:
                evidence.append(
                    EvidenceItem(
                        text=f"{together} other stream(s) at tap {r.tap} went silent within "
                        f"{TOGETHER:g} s of it, and no request there completed meanwhile",
                        t=start,
                        tap=r.tap,
                        figures={"stopped_together": together},
                    )
                )
            out.append(
                finding(
                    "engine_stall_mid_stream",
                    "engine",
                    "The stream stopped mid-way together with the others from the serving "
                    "stack, at a tap whose upstream is the serving stack itself."
                    if together
                    else "The stream stopped mid-way at a tap whose upstream is the serving "
                    "stack itself.",
                    [r],
                    evidence,
                    [
                        client_ok,
                        RuledOut(
                            "proxy",
                            "there is no hop between the tap and the serving stack",
                        ),
                    ],
                    "high" if view.producing or together else "medium",
                    t=start,
                )
            )
            continue
        if (
            mid_stream
            and r.done
            and r.termination != "complete"
            and r.last_event is not None
            and r.last_event <= start + 0.001  # every event, [DONE] too, before the silence
            and not serving
            and r.status is not None
        ):
            # [DONE] reached the tap: whoever wrote it had finished the stream; only the
            # body's end was missing, and it is the hop after the tap that holds it
            idle = f"; {view.quote()}" if view.known else ""
            out.append(
                finding(
                    "proxy_held_stream",
                    "proxy",
                    f"The hop after tap {r.tap} held the body's end: "
                    + _held_words(r, start, end, view, done_only=True),
                    [r],
                    evidence,
                    [
                        client_ok,
                        RuledOut(
                            "engine",
                            f"the stream's data: [DONE] reached tap {r.tap}: its writer had "
                            f"finished it{idle}",
                        ),
                    ],
                    "medium",
                    t=start,
                    settle=f"a tap behind the hop after tap {r.tap} would show the body's end "
                    "reaching it",
                )
            )
            continue
        if mid_stream and view.producing:
            out.append(
                finding(
                    "proxy_held_stream",
                    "proxy",
                    _held_words(r, start, end, view),
                    [r],
                    evidence,
                    [client_ok],
                    "medium",
                    t=start,
                )
            )
            continue
        if serving:
            out.append(
                finding(
                    "upstream_silent",
                    "engine",
                    "The serving stack held the request without answering; its figures do not "
                    "tell a stall from a wait.",
                    [r],
                    evidence,
                    [
                        client_ok,
                        RuledOut("proxy", "the tap's upstream is the serving stack itself"),
                    ],
                    "medium",
                    settle="a decode-progress figure (SGLang's realtime_tokens_total with "
                    "--enable-metrics, vLLM's generation_tokens_total) or /v1/loads would tell "
                    "a stalled engine from a busy one"
                    if view.known
                    else "give --engine-metrics so the engine's own state during the silence "
                    "can tell a stall from a wait",
                    t=start,
                )
            )
            continue
        settle = (
            "give --engine-metrics (and --probe-on-stall) so the engine's own state during "
            "the silence can decide between the engine and a hop in between"
            if not view.known
            else f"place a second tap behind the hop after tap {r.tap}, in front of the "
            "serving stack"
        )
        out.append(
            finding(
                "upstream_silent",
                "unknown",
                f"Nothing came back from upstream for {end - start:.3g} s; the evidence does not "
                "say which hop held it.",
                [r],
                evidence,
                [client_ok],
                "low",
                settle=settle,
                t=start,
            )
        )
    return out


def _held_words(
    r: RequestRow, start: float, end: float, view: EngineView, *, done_only: bool = False
) -> str:
    """The held stream's summary, from its own figures: what had reached the tap before
    the silence (never "none" when events came), how long nothing came, what the engine
    produced meanwhile (``done_only``: nothing said of the engine)."""
    span = f"{end - start:.3g} s"
    if r.events == 0:
        came = f"no event reached the tap for {span}"
    elif r.done:
        came = (
            f"all {r.events} events and data: [DONE] reached the tap, then nothing for "
            f"{span}: the body's end never came"
        )
    else:
        came = f"{counted_words(r.events, 'event')} reached the tap, then nothing for {span}"
    if done_only:
        return came + "."
    made = (
        f"decode progress +{view.progress:g} tokens"
        if view.progress
        else f"finished-request tokens +{view.finished or 0:g}"
    )
    return f"{came[0].upper()}{came[1:]} while the engine produced tokens ({made})."


def _waited_on_answer(
    r: RequestRow, evidence: list[EvidenceItem], view: EngineView, start: float, end: float
) -> Finding:
    """A non-streamed request that got nothing back while the engine decoded: a note (its
    answer comes whole when it is done), saying who closed it, if someone did."""
    closed = {
        "client_abort": f"; the tap's client closed it after {end - start:.3g} s",
        "truncated": f"; its upstream closed it after {end - start:.3g} s",
    }.get(r.termination, "")
    return finding(
        "answer_in_progress",
        "engine",
        f"The request is not streamed: nothing comes back until its answer is done, and "
        f"the engine was generating meanwhile (running≤{view.running_max}, decode progress "
        f"+{view.progress:g} tokens){closed}: a wait, not a stall.",
        [r],
        evidence,
        [],
        "medium",
        note=True,
        t=start,
    )


def expect_finding(
    r: RequestRow, evidence: list[EvidenceItem], *, serving: bool, hop: str | None = None
) -> Finding:
    """A request whose client waited for a 100 Continue that never came: the next hop
    neither relayed one nor answered (``hop``: the taps it lies between, when known)."""
    where = hop or ("the serving stack behind tap " if serving else "the hop after tap ") + r.tap
    waited = (r.end or r.start) - r.start
    return finding(
        "expect_continue_unanswered",
        "engine" if serving and hop is None else "proxy",
        f"The client sent Expect: 100-continue and waited {waited:.3g} s for it: {where} "
        "neither relayed nor answered 100 Continue, so the request body never came "
        f"(0 of its bytes reached tap {r.tap}).",
        [r],
        [
            *evidence,
            *([] if any(e.figures.get("termination") for e in evidence) else [outcome_item(r)]),
            EvidenceItem(
                text=f"the head asked Expect: 100-continue; no 100 Continue came back in "
                f"{waited:.3g} s; request body bytes at the tap: {r.request_bytes or 0}",
                t=r.start,
                tap=r.tap,
                request=r.id,
                figures={
                    "expect_continue": True,
                    "continued": False,
                    "waited": round(waited, 6),
                    "request_bytes": r.request_bytes or 0,
                    "request_complete": False,
                },
            ),
        ],
        [RuledOut("client", "a client that asks Expect: 100-continue waits for the 100 by design")],
        "high" if hop else "medium",
        settle=None
        if hop
        else "a tap behind the hop would show whether the head reached it; curl sends Expect "
        "for bodies over 1 MiB (-H 'Expect:' turns it off)",
        t=r.start,
    )
