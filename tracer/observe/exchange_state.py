"""The state of one exchange as a tracker follows it (``ResponseState``), and what a
tracker reads from its heads and events: the request's and the response's head facts,
an SSE event's counts, whom a silent exchange waits for. Compiled with the tracker
(``tracer/compiled.py``); ``exchange.py`` is the tracker itself."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final, Literal, NamedTuple

from ..protocol.sse import SseEvent, is_event_stream

StallDirection = Literal["upstream_silent", "client_not_reading", "client_silent"]


class ResponseState[S]:
    """A request in flight and its response, whatever tap follows it: ``wire_requests.WireRequest``
    and ``flow_conn.Flow`` extend it (``S``: how each splits SSE). The batch of body reads not yet written is ``times``, ``sizes``, ``chunks`` (per
    read), ``sse_entries`` (as the record has them) and ``kept`` (the bytes, when
    kept: ``None`` otherwise)."""

    __slots__ = (
        "chunks",
        "comments",
        "done",
        "ended",
        "error",
        "events",
        "finish_reason",
        "first_token_m",
        "head_m",
        "json_body",
        "kept",
        "kept_bytes",
        "last_data_m",
        "max_gap",
        "request_done",
        "resp_bytes",
        "resp_head_m",
        "seq",
        "sizes",
        "sse",
        "sse_entries",
        "stall_direction",
        "stall_start_m",
        "status",
        "times",
        "usage",
    )

    def __init__(self, head_m: float, json_body: bool) -> None:
        self.seq = 0  # numbered by the tracker
        self.head_m = head_m
        self.json_body = json_body
        self.request_done = False
        self.status: int | None = None
        self.resp_head_m: float | None = None
        self.resp_bytes = 0  # body bytes written in records (the batch's not yet)
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
        self.times: list[float] = []
        self.sizes: list[int] = []
        self.chunks: list[int] = []  # (empty when the tap does not see chunks)
        self.sse_entries: list[Any] = []
        self.kept: list[bytes] | None = None
        self.kept_bytes = 0

    def clear_batch(self) -> None:
        self.times.clear()
        self.sizes.clear()
        self.chunks.clear()
        self.sse_entries = []  # (the record written holds the old list)
        if self.kept:
            self.kept.clear()
        self.kept_bytes = 0


class RequestHeadFacts(NamedTuple):
    """What a request head's headers say, whatever tap parsed them."""

    content_length: int | None
    chunked: bool
    expect_continue: bool
    request_id: str | None
    json_body: bool
    hop: list[tuple[bytes, bytes]]  # its Connection and Upgrade headers


_REQUEST_HEADERS_READ: Final = frozenset(
    (b"content-length", b"transfer-encoding", b"expect", b"x-request-id", b"content-type")
)


def request_head_facts(headers: Iterable[tuple[bytes, bytes]]) -> RequestHeadFacts:
    """The request head's facts from its headers (names in lower case)."""
    content_length: int | None = None
    chunked = expect = json_body = False
    request_id: str | None = None
    hop: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name not in _REQUEST_HEADERS_READ:
            if name == b"connection" or name == b"upgrade":
                hop.append((name, value))
        elif name == b"content-length":
            try:
                content_length = int(value)
            except ValueError:
                content_length = None
        elif name == b"transfer-encoding":
            chunked = True
        elif name == b"expect":
            expect = value.lower() == b"100-continue"
        elif name == b"x-request-id":
            request_id = value.decode("latin-1")
        else:  # content-type
            json_body = value.lower().find(b"json") >= 0  # (find: see response_head_facts)
    return RequestHeadFacts(content_length, chunked, expect, request_id, json_body, hop)


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
            # (find, not ``in``: ``bytes in bytes`` raises and clears a TypeError inside)
            if lowered.find(b"close") >= 0:
                keep_alive = False
            elif lowered.find(b"keep-alive") >= 0:
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
