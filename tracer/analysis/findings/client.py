"""What the client did: stopped reading, aborted, reused a connection the server had
closed, or failed before its first request.

Findings whose evidence is the client's own side of a tap (its reads, its close, its
timing against the upstream's FIN), kept together because they rule out the engine the
same way.
"""

from __future__ import annotations

import math

from ..rows import RequestRow
from .context import Context
from .model import EvidenceItem, Finding, RuledOut, finding
from .quotes import outcome_item, request_item, stall_item, ts
from .signs import STREAM_RESET, expect_unanswered, gone_before, hang_window, multiplexed

# SSE parsers' line limits: Go's bufio.Scanner (64 KiB), aiohttp's readline (128 KiB to
# 3.13, 512 KiB after): an event this large, just before the client closed, is suspect
LINE_LIMIT = 64 * 1024
LINE_REACH = 1.0  # seconds from that event to the client's close

# a request that came this soon after the FIN was passed on may have been on its way
# before the client could see it (the keep-alive race): not told from one that ignored it
RACE_WINDOW = 0.010


def analyze_client(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    for r in ctx.interesting:
        if not r.method:
            continue
        blocked = [s for s in r.stalls if s["direction"] == "client_not_reading"]
        if blocked:
            s = blocked[0]
            out.append(
                finding(
                    "client_not_reading",
                    "client",
                    "The client stopped reading: writes to it backed up"
                    + (f" for {s['duration']:.3g} s" if s["duration"] else "")
                    + " while data waited.",
                    [r],
                    [request_item(r), stall_item(r, s), outcome_item(r)],
                    [
                        RuledOut("engine", "upstream data was waiting to be written"),
                        RuledOut("proxy", "the tap's writes to the client were blocked"),
                    ],
                    "high",
                    t=s["start"],
                )
            )
        if r.request_complete is False and not expect_unanswered(r) and r.status is None:
            out.append(_body_stalled(r))
            continue
        if r.termination == "client_abort" and hang_window(r, ctx.e.end) is None:
            if line_too_long(r):
                out.append(_line_too_long(r))
                continue
            out.append(
                finding(
                    "client_abort",
                    "client",
                    (
                        "The client reset the HTTP/2 stream"
                        if multiplexed(r) and (r.detail or "").startswith(STREAM_RESET)
                        else "The client closed the connection"
                    )
                    + (f" {r.end - r.start:.3g} s after its request" if r.end is not None else "")
                    + (f", after {r.events} events," if r.sse else "")
                    + " while the response was still flowing.",
                    [r],
                    [request_item(r), outcome_item(r)],
                    [RuledOut("engine", "bytes were arriving until the client closed")],
                    "medium",
                    t=r.end,
                )
            )
        if r.after_close:
            out.append(
                finding(
                    "client_reused_closed_connection",
                    "client",
                    "The client sent a request on a connection the server had said it would "
                    "close (Connection: close).",
                    [r],
                    [request_item(r), outcome_item(r)],
                    [],
                    "high",
                    t=r.start,
                )
            )
        elif (gone := gone_before(r)) is not None:
            out.append(_reused_after_fin(r, gone))
    return out


def _reused_after_fin(r: RequestRow, gone: float) -> Finding:
    """A request the client wrote after the upstream had closed the connection (the tap
    passed the FIN on): the client's pool keeps idle connections longer than the upstream
    does. Written well after the FIN, the client missed the close; within
    ``RACE_WINDOW`` of it, it may have been on its way before the FIN could reach it."""
    evidence = [request_item(r), outcome_item(r)]
    confidence = "high"
    if math.isinf(gone):  # a capture that does not say when
        summary = (
            "The client sent a request on a connection the upstream had already closed "
            "(its FIN had been passed on to the client)."
        )
    elif gone < RACE_WINDOW:
        summary = (
            f"The client wrote a request on its keep-alive connection {gone * 1000:.1f} ms "
            f"after the tap passed on the upstream's close, after {r.idle_before:.3f} s idle: "
            "too soon to tell a client that ignored the close from the keep-alive race (the "
            "request already on its way); either way the upstream drops idle connections "
            "sooner than the client's pool."
        )
        confidence = "medium"
    else:
        summary = (
            f"The client sent a request on a connection the upstream had closed {gone:.3f} s "
            f"before (its FIN had been passed on to the client), after {r.idle_before:.3f} s "
            "idle: the client's pool kept it longer than the upstream keeps idle connections."
        )
    if not math.isinf(gone):
        evidence.append(
            EvidenceItem(
                text=f"the upstream's close had been passed on to the client {gone:.6f} s before",
                t=r.start - gone,
                tap=r.tap,
                request=r.id,
                figures={"upstream_closed_before": gone},
            )
        )
    return finding(
        "client_reused_closed_connection",
        "client",
        summary,
        [r],
        evidence,
        [],
        confidence,
        t=r.start,
    )


def analyze_client_connections(ctx: Context) -> list[Finding]:
    """Client connections that failed before a first request: bytes that are not HTTP
    (a TLS handshake sent to a plain HTTP/1.1 tap), a failed TLS handshake with a proxy
    that terminates TLS (a client that does not trust mitmproxy's certificate)."""
    failures, total = ctx.e.client_failures, ctx.e.client_failures_total
    if not failures:
        return []
    first = failures[0]
    shown = 5
    evidence = [
        EvidenceItem(
            text=f"connection {f['tap']}/{f['conn']} at {ts(f['t'])}: {f['error']}",
            t=f["t"],
            tap=f["tap"],
            figures={"conn": f["conn"], "error": f["error"]},
        )
        for f in failures[:shown]
    ]
    if total > shown:
        evidence.append(
            EvidenceItem(
                text=f"... {total - shown} more such connection(s)", figures={"more": total - shown}
            )
        )
    found = finding(
        "client_connection_failed",
        "client",
        f"A client connection failed before its first request: {first['error']}"
        if total == 1
        else f"{total} client connections failed before their first request; the first: "
        f"{first['error']}",
        [],
        evidence,
        [RuledOut("engine", "no request on these connections reached the upstream")],
        "high",
        t=first["t"],
    )
    found.connections = sorted({f"{f['tap']}/{f['conn']}" for f in failures})
    return [found]


def line_too_long(r: RequestRow) -> bool:
    """The client closed within ``LINE_REACH`` of the stream's largest event, one over the
    smallest line limit of common SSE parsers, while the stream was still coming."""
    return (
        r.sse
        and r.max_event_bytes >= LINE_LIMIT
        and r.max_event_at is not None
        and r.end is not None
        and 0.0 <= r.end - r.max_event_at <= LINE_REACH
        and not r.done
        and r.finish_reason is None
    )


def _line_too_long(r: RequestRow) -> Finding:
    after = (r.end or 0.0) - (r.max_event_at or 0.0)
    size = r.max_event_bytes
    return finding(
        "client_line_too_long",
        "client",
        f"The client closed {after * 1000:.0f} ms after an SSE event of {size / 1024:.0f} KiB "
        "arrived, with the stream still coming: larger than the line limit of common SSE "
        "parsers (Go's bufio.Scanner 64 KiB, aiohttp 128-512 KiB), which refuse such a line.",
        [r],
        [
            request_item(r),
            EvidenceItem(
                text=f"the stream's largest event: {size} bytes at {ts(r.max_event_at or 0.0)}, "
                f"{after * 1000:.0f} ms before the client closed",
                t=r.max_event_at,
                tap=r.tap,
                request=r.id,
                figures={"max_event_bytes": size, "closed_after": round(after, 6)},
            ),
            outcome_item(r),
        ],
        [
            RuledOut("engine", "the event arrived whole and the stream was still coming"),
            RuledOut("proxy", "the tap passed the event on to the client"),
        ],
        "medium",
        settle="the client's own error (aiohttp's LineTooLong, 'Chunk too big', Go's "
        "bufio.ErrTooLong) would confirm it; reading the body in chunks (iter_any) avoids it",
        t=r.end,
    )


def _body_stalled(r: RequestRow) -> Finding:
    """The client sent a head and part of its body, then nothing: the request never
    reached the tap whole, so no hop behind it could answer it."""
    silent = next((s for s in r.stalls if s["direction"] == "client_silent"), None)
    evidence = [
        request_item(r),
        EvidenceItem(
            text=f"request body: {r.request_bytes or 0} bytes came, the body never ended",
            t=r.start,
            tap=r.tap,
            request=r.id,
            figures={"request_bytes": r.request_bytes or 0, "request_complete": False},
        ),
        outcome_item(r),
    ]
    if silent is not None:
        evidence.append(stall_item(r, silent))
    return finding(
        "client_body_stalled",
        "client",
        f"The client sent {r.request_bytes or 0} bytes of its request body and then "
        "stopped: the request never reached the tap whole, so nothing behind it could "
        "answer.",
        [r],
        evidence,
        [
            RuledOut("engine", "the request never arrived whole"),
            RuledOut("proxy", "the tap had not received the whole request to forward"),
        ],
        "high" if silent is not None else "medium",
        t=r.start,
    )
