"""How responses from upstream ended badly: truncated, an error status or event, an
upstream the tap could not reach, a keep-alive connection closed as it was written.

Each is read from one request's row at one tap; whether the engine or a hop is to blame
depends only on what the tap's upstream is (``Context.upstream_is_serving``).
"""

from __future__ import annotations

from .context import Context
from .model import EvidenceItem, Finding, RuledOut, finding
from .quotes import injected_items, outcome_item, request_item
from .signs import stale_race, tls_words, upstream_silence


def analyze_upstream_endings(ctx: Context) -> list[Finding]:
    """Truncations, errors, unreachable upstreams, stale-connection races."""
    out: list[Finding] = []
    for r in ctx.interesting:
        if not r.method:
            continue
        serving = ctx.upstream_is_serving(r)
        hop = "engine" if serving else "unknown"
        evidence = [request_item(r), outcome_item(r), *injected_items(r)]
        if r.by_tracer and r.status == 502:
            tls = tls_words(r.detail)
            out.append(
                finding(
                    "upstream_unreachable",
                    "engine" if serving else "unknown",
                    "The tap's TLS handshake with its upstream failed."
                    if tls
                    else "The tap could not connect to its upstream.",
                    [r],
                    [
                        *evidence,
                        EvidenceItem(
                            text=f"the tap's connect to its upstream failed: {r.detail}",
                            t=r.start,
                            tap=r.tap,
                            request=r.id,
                            figures={"connect_failed": r.detail, "tls": tls},
                        ),
                    ]
                    if r.detail
                    else evidence,
                    [RuledOut("client", "the request reached the tap")],
                    "high",
                    settle="does the upstream speak TLS (an https:// URL to a plain HTTP port, "
                    "or the reverse), and is its certificate trusted by the proxy?"
                    if tls
                    else None
                    if serving
                    else "is the tap's upstream a proxy or the router?",
                )
            )
            continue
        if r.error:
            out.append(
                finding(
                    "engine_error_event",
                    "engine",
                    f"The stream carried an error event: {r.error}",
                    [r],
                    evidence,
                    [
                        RuledOut("client", "the error came from upstream"),
                        RuledOut("proxy", "proxies do not write OpenAI error events"),
                    ],
                    "high",
                    t=r.end,
                )
            )
        elif r.status is not None and r.status >= 500 and not r.by_tracer:
            out.append(
                finding(
                    "engine_error_status",
                    hop,
                    f"Upstream answered {r.status}"
                    + (f" after {r.ttfb:.3g} s." if r.ttfb is not None else "."),
                    [r],
                    evidence,
                    [RuledOut("client", "the error came from upstream")],
                    "high" if serving else "medium",
                    settle=None
                    if serving
                    else "a tap in front of the router would show whether the router sent it",
                    t=r.end,
                )
            )
        if stale_race(r, ctx.e.end):
            out.append(
                finding(
                    "stale_connection_race",
                    "proxy" if not serving else "engine",
                    "The hop after the tap closed an idle keep-alive connection just as a "
                    "request was written on it (keep-alive timeouts do not match).",
                    [r],
                    evidence,
                    [RuledOut("client", "the connection was open when it wrote")],
                    "medium",
                    t=r.start,
                )
            )
        elif (
            r.termination == "truncated"
            and (r.response_bytes > 0 or r.status is not None)
            and upstream_silence(r) is None
        ):  # (a cut after a silence: the silence is the finding)
            out.append(
                finding(
                    "engine_truncated" if serving else "stream_cut",
                    hop,
                    f"Upstream closed the response after {r.response_bytes} bytes"
                    + (f" and {r.events} events" if r.sse else "")
                    + ", before its end.",
                    [r],
                    evidence,
                    [RuledOut("client", "upstream closed first")],
                    "high" if serving else "medium",
                    settle=None
                    if serving
                    else "a tap in front of the router would show which hop cut it",
                    t=r.end,
                )
            )
        elif (
            r.termination == "complete"
            and r.sse
            and r.events
            and not r.done
            and r.finish_reason is None
            and not r.error
        ):
            out.append(
                finding(
                    "logical_truncation",
                    hop,
                    f"The body ended cleanly after {r.events} events but without [DONE] or a "
                    "finish_reason.",
                    [r],
                    evidence,
                    [RuledOut("client", "upstream ended the body")],
                    "medium",
                    t=r.end,
                )
            )
    return out
