"""How a stream's events arrived: bunched ~40 ms apart, held to the end, in bursts, or a
first event held after the response head.

Timing findings: read from arrival statistics, at one tap or against a copy of the same
stream at the tap behind (which places the hold on the hop between them).
"""

from __future__ import annotations

from ...wording import counted
from ..rows import RequestRow
from .context import Context
from .first_events import FIRST_EVENT_PROMPT, Holds
from .model import EvidenceItem, Finding, RuledOut, finding
from .quotes import gap_item, req_text, request_item
from .signs import bursts, delivery_kind, first_event_wait


def analyze_delivery(ctx: Context) -> list[Finding]:
    """Coalesced (≈40 ms bunches) and buffered (all at the end) streams."""
    out: list[Finding] = []
    for r in ctx.interesting:
        kind = delivery_kind(r)
        if r.first_event is None or r.last_event is None or (kind is None and not bursts(r)):
            continue
        spread = r.last_event - r.first_event
        duration = (r.end or r.last_event) - r.start
        seen = ctx.join.seen_with(r)
        steady = next((seen[t] for t in ctx.join.next_taps(r.tap) if t in seen), None)
        if (
            steady is not None
            and steady.event_gaps >= 8
            and delivery_kind(steady) is None
            and not bursts(steady)
        ):
            if kind == "coalesced":
                out.append(_coalesced_between(r, steady))
            elif kind == "buffered" or (steady.max_gap or 0.0) * 4 < (r.max_gap or 0.0):
                out.append(_buffered_between(r, steady))
        elif kind is None:
            continue  # bursts alone prove nothing
        elif kind == "coalesced":
            out.append(
                finding(
                    "delivery_coalesced",
                    "proxy" if not ctx.upstream_is_serving(r) else "engine",
                    f"Events arrived in bunches at tap {r.tap} ({_bunching(r)}): a hop "
                    "upstream of it without TCP_NODELAY meeting a delayed ACK.",
                    [r],
                    [request_item(r), gap_item(r)],
                    [RuledOut("client", "bunching is seen before the client")],
                    "medium",
                    t=r.first_event,
                )
            )
        else:
            view = ctx.engine_view(r.start, r.end or r.last_event)
            party = "proxy" if view.producing and not ctx.upstream_is_serving(r) else "unknown"
            out.append(
                finding(
                    "buffered_response",
                    party,
                    "The whole stream arrived in one burst at the end: a hop upstream held it "
                    "(as nginx with proxy_buffering on does).",
                    [r],
                    [
                        request_item(r),
                        EvidenceItem(
                            text=f"{r.events} events within {spread * 1000:.1f} ms, "
                            f"{duration:.3f} s after the request",
                            t=r.first_event,
                            tap=r.tap,
                            request=r.id,
                            figures={"events": r.events, "spread": spread, "duration": duration},
                        ),
                        *([view.item()] if view.known else []),
                    ],
                    [RuledOut("client", "the burst is seen before the client")],
                    "medium" if party != "unknown" else "low",
                    settle=None
                    if party != "unknown"
                    else "engine metrics showing tokens "
                    "generated steadily would place it on the hop in between",
                    t=r.first_event,
                )
            )
    return out


def _bunching(r: RequestRow) -> str:
    """The figures that make a stream bunched, as ``gap_item`` quotes them."""
    zero = r.zero_gaps / r.event_gaps if r.event_gaps else 0.0
    return f"{zero:.0%} of gaps < 1 ms, {r.bunch_gaps} gaps of 30-60 ms"


def _coalesced_between(r: RequestRow, steady: RequestRow) -> Finding:
    """Bunched at one tap, steady at the next one toward the engine: the hop between."""
    return finding(
        "delivery_coalesced",
        "proxy",
        f"Events arrived in bunches at tap {r.tap} ({_bunching(r)}) but steadily at tap "
        f"{steady.tap}: the hop between tap {r.tap} and tap {steady.tap} holds them (no "
        "TCP_NODELAY meeting a delayed ACK).",
        [r, steady],
        [
            request_item(r),
            gap_item(r, f"at tap {r.tap}: "),
            request_item(steady),
            gap_item(steady, f"at tap {steady.tap}: "),
        ],
        [
            RuledOut("client", "bunching is seen before the client"),
            RuledOut("engine", f"the events passed tap {steady.tap} steadily"),
        ],
        "high",
        t=r.first_event,
    )


def _buffered_between(r: RequestRow, steady: RequestRow) -> Finding:
    """In one burst at one tap, spread over the stream at the next one toward the engine
    (whatever the hop did to the framing between: chunked in front, close-delimited
    behind an HTTP/1.0 upstream): the hop between buffered it."""
    assert r.first_event is not None and r.last_event is not None
    spread = r.last_event - r.first_event
    steady_spread = (steady.last_event or 0.0) - (steady.first_event or 0.0)
    whole = delivery_kind(r) == "buffered"
    return finding(
        "buffered_response",
        "proxy",
        f"The stream arrived at tap {r.tap} "
        + ("in one burst at its end" if whole else "in bursts with long waits between")
        + f" while tap {steady.tap} received it as it came: the hop between tap {r.tap} and "
        f"tap {steady.tap} buffered it (as nginx with proxy_buffering on does).",
        [r, steady],
        [
            request_item(r),
            EvidenceItem(
                text=f"at tap {r.tap}: {r.events} events over {spread:.3f} s, "
                f"{r.zero_gaps} of {r.event_gaps} gaps < 1 ms, longest gap "
                f"{r.max_gap or 0.0:.3g} s, first {(r.first_event - r.start):.3f} s after "
                "the request",
                t=r.first_event,
                tap=r.tap,
                request=r.id,
                figures={
                    "events": r.events,
                    "spread": spread,
                    "zero_gaps": r.zero_gaps,
                    "event_gaps": r.event_gaps,
                    "max_gap": r.max_gap,
                    "first_event_after": r.first_event - r.start,
                },
            ),
            request_item(steady),
            EvidenceItem(
                text=f"at tap {steady.tap}: {steady.events} events over {steady_spread:.3f} s, "
                f"longest gap {steady.max_gap or 0.0:.3g} s"
                + (f", HTTP/{steady.version}" if steady.version else ""),
                t=steady.first_event,
                tap=steady.tap,
                request=steady.id,
                figures={
                    "events": steady.events,
                    "spread": steady_spread,
                    "max_gap": steady.max_gap,
                },
            ),
        ],
        [
            RuledOut("client", "the burst is seen before the client"),
            RuledOut("engine", f"the events passed tap {steady.tap} as they came"),
        ],
        "high",
        t=r.first_event,
    )


def _held_first_events(ctx: Context) -> dict[str, tuple[str, Holds]]:
    """Per tap in front: the tap one hop behind it where the first events it got late
    came at once, where that happened to at least 2 streams and a tenth of those both
    taps saw (the one that shows it most: the same request may reach two taps behind a
    router, the legs of PD)."""
    best: dict[str, tuple[str, Holds]] = {}
    for (a, b), holds in sorted(ctx.join.first_held.items()):
        if (
            b not in ctx.join.next_taps(a)
            or holds.count < 2
            or holds.count * 10 < ctx.join.shared(a, b)
        ):
            continue
        if a not in best or holds.count > best[a][1].count:
            best[a] = (b, holds)
    return best


def _ms_spread(seconds: list[float]) -> tuple[str, str, dict[str, float]]:
    """The median in ms, "median; LO to HI ms", and those three as figures, of a sample
    of waits (whole ms, as quoted)."""
    ordered = sorted(seconds)
    median = f"{ordered[len(ordered) // 2] * 1000:.0f}"
    lo, hi = f"{ordered[0] * 1000:.0f}", f"{ordered[-1] * 1000:.0f}"
    figures = {"median_ms": float(median), "min_ms": float(lo), "max_ms": float(hi)}
    return median, f"median; {lo} to {hi} ms", figures


def analyze_first_events(ctx: Context) -> list[Finding]:
    """First events held ~40 ms by the hop between two taps (no TCP_NODELAY meeting a
    delayed ACK): late after the response head at one tap, at once at the next toward the
    engine, for the same requests (``_held_first_events``). A note: a latency the hop
    adds to every such stream, not why anything hung."""
    out: list[Finding] = []
    for a, (b, holds) in sorted(_held_first_events(ctx).items()):
        rows = ctx.rows_at(p for pair in holds.examples for p in pair)
        examples = sorted(
            ((rows[p], rows[q]) for p, q in holds.examples if p in rows and q in rows),
            key=lambda pair: pair[0].start,
        )
        median, spread, ms = _ms_spread(holds.delays)
        evidence = [
            EvidenceItem(
                text=f"{holds.count} of the {ctx.join.shared(a, b)} requests both taps saw; the "
                f"first event {median} ms later at tap {a} than at tap {b} ({spread})",
                tap=a,
                figures={
                    "held": holds.count,
                    "shared": ctx.join.shared(a, b),
                    **ms,
                    "behind": b,
                },
            )
        ]
        for held, prompt in examples:
            evidence += [
                request_item(
                    held,
                    f"{req_text(held)}: first event "
                    f"{first_event_wait(held) * 1000:.1f} ms after the response head",
                    first_event_wait=first_event_wait(held),
                ),
                EvidenceItem(
                    text=f"at tap {b}: {first_event_wait(prompt) * 1000:.1f} ms after its "
                    "response head",
                    t=prompt.start,
                    tap=b,
                    request=prompt.id,
                    figures={"first_event_wait": first_event_wait(prompt)},
                ),
            ]
        out.append(
            finding(
                "first_event_held",
                "proxy",
                f"The hop between tap {a} and tap {b} held the first event of {holds.count} "
                f"stream(s) about {median} ms after the response head, which tap "
                f"{b} got at once: it writes the two separately without TCP_NODELAY, and the "
                "delayed ACK of the host in front holds the second (the SGLang router does "
                "not set TCP_NODELAY).",
                [r for pair in examples for r in pair],
                evidence,
                [RuledOut("engine", f"tap {b}, nearer the engine, got it at once")],
                "high",
                note=True,
                t=examples[0][0].start if examples else None,
            )
        )
    return out


def analyze_reused_first_events(ctx: Context) -> list[Finding]:
    """One tap alone: first events held 30-220 ms after the head on reused connections and
    not on fresh ones (which start in quick-ACK mode: the delayed ACK that holds a write
    Nagle keeps back comes only later on a connection). The engine's first token does not
    depend on which connection a request came on. A note, medium confidence; not told
    for a tap that ``analyze_first_events`` told it for already."""
    told = _held_first_events(ctx)
    out: list[Finding] = []
    for tap, stats in sorted(ctx.first_waits.items()):
        if tap in told or not stats.pattern:
            continue
        rows = ctx.rows_at(stats.examples[True] + stats.examples[False])
        quoted = sorted(rows.values(), key=lambda r: r.start)
        median, spread, ms = _ms_spread(stats.waits)
        party = "engine" if quoted and ctx.upstream_is_serving(quoted[0]) else "proxy"
        evidence = [
            EvidenceItem(
                text=f"reused connections: the first event of {stats.reused_held} of "
                f"{stats.reused} streams {median} ms after the response head ({spread})",
                tap=tap,
                figures={
                    "reused_held": stats.reused_held,
                    "reused": stats.reused,
                    **ms,
                },
            ),
            EvidenceItem(
                text=f"fresh connections: {stats.fresh_prompt} of {stats.fresh} within "
                f"{FIRST_EVENT_PROMPT * 1000:.0f} ms",
                tap=tap,
                figures={"fresh_prompt": stats.fresh_prompt, "fresh": stats.fresh},
            ),
        ]
        evidence += [
            request_item(
                r,
                f"{req_text(r)}: first event {first_event_wait(r) * 1000:.1f} ms after the "
                "response head",
                first_event_wait=first_event_wait(r),
            )
            for r in quoted
        ]
        out.append(
            finding(
                "first_event_held",
                party,
                f"On reused connections the first event of {counted(stats.reused_held, 'stream')} "
                f"came about {median} ms after the response head at tap {tap}, on "
                "fresh ones at once: the hop upstream writes the two separately without "
                "TCP_NODELAY and the tap's delayed ACK holds the second (the SGLang router "
                "does not set TCP_NODELAY). A tap behind that hop would confirm it.",
                quoted,
                evidence,
                [],
                "medium",
                note=True,
                t=quoted[0].start if quoted else None,
            )
        )
    return out
