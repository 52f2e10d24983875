"""The exchange as both observers see it: the state of a response in flight and the
records made from it (the response head's framing facts, SSE counts, the response end,
stall start and end), whatever tap follows it: ``wire.ConnectionObserver`` (bytes, the
native tap's) and ``flows.FlowObserver`` (mitmproxy's facts) share these, so that the
two write the same events for the same exchange."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from .. import events as ev
from ..protocol.sse import SseEvent, is_event_stream

MAX_BODY_KEEP = 16 * 1024 * 1024
BODY_BATCH_SECONDS = 0.1  # a body record covers the reads of at most this long
BODY_BATCH_READS = 256  # ... and at most this many reads
StallDirection = Literal["upstream_silent", "client_not_reading", "client_silent"]


class ResponseState[S]:
    """What a tap keeps about a response in flight, whatever tap follows it: the native
    observer's ``_Request`` and the mitmproxy addon's flow state extend it (``S``: how
    each splits SSE), and the records below read it."""

    __slots__ = (
        "comments",
        "done",
        "ended",
        "error",
        "events",
        "finish_reason",
        "first_token_m",
        "head_m",
        "last_data_m",
        "max_gap",
        "request_done",
        "resp_bytes",
        "resp_head_m",
        "seq",
        "sse",
        "stall_direction",
        "stall_start_m",
        "status",
        "usage",
    )

    def __init__(self, seq: int, head_m: float) -> None:
        self.seq = seq
        self.head_m = head_m
        self.request_done = False
        self.status: int | None = None
        self.resp_head_m: float | None = None
        self.resp_bytes = 0
        self.sse: S | None = None
        self.events = 0
        self.comments = 0
        self.first_token_m: float | None = None
        self.done = False
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.last_data_m: float | None = None
        self.max_gap = 0.0
        self.ended = False
        self.stall_start_m: float | None = None
        self.stall_direction: StallDirection | None = None


def response_head_facts(
    headers: Iterable[tuple[bytes, bytes]], *, keep_alive: bool
) -> tuple[int | None, bool, bool, bool]:
    """(Content-Length, chunked, SSE, keep-alive) from a response head's headers (names
    in lower case), whatever tap parsed it; ``keep_alive``: the HTTP version's default."""
    content_length: int | None = None
    chunked = sse = False
    for name, value in headers:
        if name == b"content-length":
            try:
                content_length = int(value)
            except ValueError:
                content_length = None
        elif name == b"transfer-encoding":
            chunked = True
        elif name == b"content-type":
            sse = is_event_stream(value)
        elif name == b"connection":
            lowered = value.lower()
            if b"close" in lowered:
                keep_alive = False
            elif b"keep-alive" in lowered:
                keep_alive = True
    return content_length, chunked, sse, keep_alive


def count_sse(state: ResponseState[Any], sse: SseEvent, m: float) -> None:
    """Account one SSE event: events, heartbeats, first token, [DONE], finish, usage, error."""
    kind = sse.kind
    if kind == "comment":
        state.comments += 1
        return
    state.events += 1
    if sse.content and state.first_token_m is None:
        state.first_token_m = m
    if kind == "done":
        state.done = True
    if sse.finish_reason is not None:
        state.finish_reason = sse.finish_reason
    if sse.usage is not None:
        state.usage = sse.usage
    if sse.error is not None:
        state.error = sse.error


def response_end(
    state: ResponseState[Any],
    m: float,
    termination: ev.Termination,
    *,
    tap: str,
    conn: int,
    wall: float,
    close: Literal["fin", "reset"] | None = None,
    detail: str | None = None,
) -> ev.ResponseEnd:
    """The ``response_end`` record of a response, whatever tap followed it."""
    head = state.head_m
    mid_event = bool(state.sse is not None and state.sse.pending)
    return ev.ResponseEnd(
        t=m + wall,
        m=m,
        tap=tap,
        conn=conn,
        seq=state.seq,
        termination=termination,
        status=state.status,
        body_bytes=state.resp_bytes,
        duration=round(m - head, 6),
        ttfb=None if state.resp_head_m is None else round(state.resp_head_m - head, 6),
        first_token=None if state.first_token_m is None else round(state.first_token_m - head, 6),
        events=state.events,
        comments=state.comments,
        done=state.done,
        finish_reason=state.finish_reason,
        usage=state.usage,
        error=state.error,
        max_gap=round(state.max_gap, 6) if state.resp_head_m is not None else None,
        close=close,
        mid_event=mid_event and termination != "complete",
        detail=detail,
    )


def stall_direction(
    state: ResponseState[Any], *, client_blocked: bool, unsent: int | None
) -> StallDirection:
    """Whom a silent request waits for: a client that does not read (the tap's writes to
    it blocked, or bytes unsent once a response has begun), a client that has not sent
    all of its request, else the upstream."""
    if client_blocked or (unsent is not None and unsent > 0 and state.status is not None):
        return "client_not_reading"
    if not state.request_done and state.status is None:
        return "client_silent"
    return "upstream_silent"


def start_stall(
    state: ResponseState[Any],
    m: float,
    since: float,
    direction: StallDirection,
    *,
    unsent: int | None,
    tap: str,
    conn: int,
    wall: float,
) -> ev.Stall:
    """The ``stall`` start record, the response marked stalled since ``since``."""
    state.stall_start_m = since
    state.stall_direction = direction
    return ev.Stall(
        t=m + wall,
        m=m,
        tap=tap,
        conn=conn,
        seq=state.seq,
        phase="start",
        direction=direction,
        silent_for=round(m - since, 6),
        unsent_bytes=unsent,
    )


def end_stall(
    state: ResponseState[Any], m: float, *, tap: str, conn: int, wall: float
) -> ev.Stall | None:
    """The ``stall`` end record when the response was stalled (and clear the stall)."""
    if state.stall_start_m is None or state.stall_direction is None:
        return None
    event = ev.Stall(
        t=m + wall,
        m=m,
        tap=tap,
        conn=conn,
        seq=state.seq,
        phase="end",
        direction=state.stall_direction,
        silent_for=round(m - state.stall_start_m, 6),
    )
    state.stall_start_m = None
    state.stall_direction = None
    return event
