"""What one request's row shows: predicates the analyzers and the join share.

Kept apart so that the join (``context``) and every analyzer read a row's signs — a
hang window, a stream in bursts, a failure that came from the client's side — by one
definition.
"""

from __future__ import annotations

import math
from typing import Any

from ..rows import ZERO_GAP, RequestRow

STREAM_RESET = "stream reset by client"  # mitmproxy's words for an HTTP/2 RST_STREAM
SLOW_FIRST_TOKEN = 2.0  # seconds: below this a first token is never "slow"
BURST_GAP = 0.25  # seconds: a wait between bursts no decode step explains
SILENT_MIN = 3.0  # seconds of silence before a request the capture's end cut counts as hung
EXPECT_WAIT = 1.0  # seconds: curl waits this long for a 100 before it sends anyway
IDLE_REUSE_RACE = 1.0  # seconds idle before a request for a stale-connection race
# the observer's detail for a request sent after the upstream's FIN or reset had been
# passed on, then "S s before" (captures before it: the words alone)
UPSTREAM_GONE = "upstream already closed"


def delivery_kind(r: RequestRow) -> str | None:
    """``coalesced`` or ``buffered`` when the stream's arrival statistics say so."""
    if not r.sse or r.event_gaps < 8 or r.first_event is None or r.last_event is None:
        return None
    zero = r.zero_gaps / r.event_gaps
    spread = r.last_event - r.first_event
    duration = (r.end or r.last_event) - r.start
    if zero >= 0.5 and r.bunch_gaps >= 2 and spread > 0.05:
        return "coalesced"
    if (
        duration > 1.0
        and spread < 0.05
        and r.events >= 5
        and zero >= 0.8
        and (r.first_event - r.start > 0.8 * duration)
    ):
        return "buffered"
    return None


def bursts(r: RequestRow) -> bool:
    """Events that came in a few bursts with long waits between (a hop releasing the
    stream buffer by buffer: nginx's 4 KiB pieces). Only told against a copy of the same
    stream that flowed at a tap behind (``_buffered_between``): alone it proves nothing."""
    return (
        r.sse
        and r.event_gaps >= 8
        and r.events >= 5
        and r.max_gap is not None
        and r.max_gap >= BURST_GAP
        and r.zero_gaps >= 0.8 * r.event_gaps
    )


def worth_keeping(r: RequestRow) -> bool:
    """Whether any analyzer could make a finding of this request (the union of what they
    look at, wider where that is cheaper to say): these rows stay in memory, the healthy
    rest is only counted and streamed past."""
    return (
        r.termination != "complete"  # hangs, aborts, truncations, the joins' front rows
        or r.capture_gap is not None  # a packet capture missed some of its bytes
        or bool(r.stalls)
        or r.after_close
        or r.detail is not None
        or bool(r.error)
        or r.by_tracer
        or (r.status is not None and r.status >= 500)
        or (r.sse and r.events > 0 and not r.done and r.finish_reason is None)
        or (r.first_token is not None and r.first_token >= SLOW_FIRST_TOKEN)
        or delivery_kind(r) is not None
        or bursts(r)
    )


def relevant_at_front(r: RequestRow, end: float | None) -> bool:
    return (
        hang_window(r, end) is not None
        or r.termination != "complete"
        or bool(r.stalls)
        or error_status(r)
    )


def error_status(r: RequestRow) -> bool:
    """A 5xx the tap passed on (not its own answer)."""
    return r.status is not None and r.status >= 500 and not r.by_tracer


def first_event_wait(r: RequestRow) -> float:
    """Seconds from a stream's response head to its first event (-1: not a stream)."""
    if not r.sse or r.first_event is None or r.ttfb is None:
        return -1.0
    return max(0.0, r.first_event - r.start - r.ttfb)  # (both rounded: -1e-7 is at once)


def hang_window(r: RequestRow, end: float | None) -> tuple[float, float] | None:
    """When the request sat with no bytes arriving from upstream, if it did."""
    if gone_before(r) is not None:
        return None  # sent after the upstream closed: the client's reuse, not a hang
    stall = upstream_silence(r)
    if stall is not None:
        return stall["start"], stall["end"] or r.end or end or stall["start"]
    if r.termination in ("in_flight", "truncated", "client_abort") and r.status is None:
        lasted = (r.end or end or r.start) - r.start
        if r.termination == "in_flight" and lasted < SILENT_MIN:
            return None  # the capture's end (a stop, a kill) cut it: not long enough to tell
        return r.start, r.end or end or r.start
    return None


def gone_before(r: RequestRow) -> float | None:
    """For a request sent after its tap had passed the upstream's close on to the client:
    how long before (``math.inf`` when the capture does not say); None for any other."""
    detail = r.detail
    if detail is None or not detail.startswith(UPSTREAM_GONE):
        return None
    try:
        return float(detail[len(UPSTREAM_GONE) :].split()[0])
    except (IndexError, ValueError):
        return math.inf


def stale_race(r: RequestRow, end: float | None) -> bool:
    """A request on a connection idle long enough for a keep-alive timeout, ended at once
    with nothing: the upstream closed the connection as it was written."""
    return (
        r.termination == "truncated"
        and r.response_bytes == 0
        and r.status is None
        and r.reused
        and r.idle_before >= IDLE_REUSE_RACE
        and hang_window(r, end) is not None
        and r.end is not None
        and (r.end - r.start) < 1.0
    )


def written_on_closed(r: RequestRow, end: float | None) -> bool:
    """The request was written on a connection its upstream had closed, or said it would
    close, or closed as it came (the race): the connection's end came before it, from
    behind the tap, and no hop held it."""
    return r.after_close or gone_before(r) is not None or stale_race(r, end)


def began_before(r: RequestRow, start: float) -> bool:
    """The response's body had begun before the silence at ``start``: a stall mid-stream,
    not a wait for the first token (a request queued behind others waits like that, and
    so does one whose head an engine sends before its first token)."""
    if r.sse:
        began = r.first_event
    else:
        began = r.start + r.ttfb if r.ttfb is not None and r.response_bytes > 0 else None
    return began is not None and began <= start + ZERO_GAP


def upstream_silence(r: RequestRow) -> dict[str, Any] | None:
    """The request's first ``upstream_silent`` stall."""
    return next((s for s in r.stalls if s["direction"] == "upstream_silent"), None)


def silent_failure(r: RequestRow) -> bool:
    """The request got nothing back, for long enough to be a hang (a stall was recorded, or
    it ended after a second or more): the way a hop that holds a request fails it. One that
    the capture's end cut a moment after it was sent is not one."""
    if r.termination == "in_flight":  # cut by the capture's end: how long is unknown
        silent = upstream_silence(r)
        lasted = (r.end or silent["start"]) - silent["start"] if silent else 0.0
        return r.status is None and r.response_bytes == 0 and lasted >= SILENT_MIN
    return (
        r.termination != "complete"
        and r.status is None
        and r.response_bytes == 0
        and bool(r.method)
        and (bool(r.stalls) or (r.end is not None and r.end - r.start >= 1.0))
    )


def expect_unanswered(r: RequestRow) -> bool:
    """The head asked ``Expect: 100-continue``, no interim 100 (nor an answer) came back,
    and the body never came: the client waited for the permission the next hop never
    gave (a hop that neither relays nor answers 100 Continue)."""
    return (
        r.expect_continue
        and not r.continued
        and r.status is None
        and r.request_complete is False
        and not r.request_bytes
        and (r.end is None or r.end - r.start >= EXPECT_WAIT)
    )


def multiplexed(r: RequestRow) -> bool:
    """An HTTP/2 (or 3) request: a stream among others, not a keep-alive turn."""
    return r.version is not None and r.version[:1] in ("2", "3")


def client_side(r: RequestRow) -> bool:
    """A failure that came from the client's side: it gave up, or stopped reading or
    sending, with the upstream not silent."""
    directions = {s["direction"] for s in r.stalls}
    return "upstream_silent" not in directions and (
        r.termination == "client_abort"
        or bool(directions & {"client_not_reading", "client_silent"})
    )


def same_failure(front: RequestRow, back: RequestRow) -> bool:
    """The request failed in front as it did behind: the same end, the same status, the
    same stalls (the taps in front only passed on what came to them)."""
    return (
        front.termination == back.termination
        and front.status == back.status
        and front.done == back.done
        and [s["direction"] for s in front.stalls] == [s["direction"] for s in back.stalls]
    )


def tls_words(detail: str | None) -> bool:
    """A connect failure in TLS's words (mitmproxy's: "The remote server does not speak
    TLS.", "Certificate verify failed: …", "TLS handshake failed: …")."""
    text = (detail or "").lower()
    return "tls" in text or "certificate" in text or "ssl" in text
