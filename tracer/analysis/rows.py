"""The per-request and per-connection rows: what the analysis folds a capture into and
the findings read. Their own module so that ``analysis`` (which builds them and calls the
findings) and ``findings`` (which reads them) both import it, and not each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ZERO_GAP = 0.001  # events closer than this arrived together
BUNCH_GAP = (0.030, 0.060)  # the delayed-ACK hold of a hop without TCP_NODELAY


@dataclass(slots=True)
class RequestRow:
    id: str
    tap: str
    conn: int
    seq: int
    reused: bool
    idle_before: float
    start: float  # wall clock
    method: str
    target: str
    request_id: str | None = None
    # W3C trace context the client sent (``traceparent``): its trace and its span; a
    # value that breaks the grammar is ``trace_error``, never a trace id
    trace_id: str | None = None
    parent_span_id: str | None = None
    trace_error: str | None = None
    retry_count: int | None = None  # x-stainless-retry-count: the SDK's attempt, from 0
    version: str | None = None  # HTTP version of the request: 1.1, 1.0, 2.0 (mitmproxy's)
    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    messages: int | None = None
    prompt_chars: int | None = None
    request_bytes: int | None = None
    request_complete: bool | None = None
    body_kept: bool | None = None
    pipelined: bool = False
    status: int | None = None
    sse: bool = False
    ttfb: float | None = None
    first_token: float | None = None
    duration: float | None = None
    max_gap: float | None = None
    response_bytes: int = 0
    events: int = 0
    comments: int = 0
    done: bool = False
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    termination: str = "in_flight"
    close: str | None = None
    mid_event: bool = False
    detail: str | None = None
    stalls: list[dict[str, Any]] = field(default_factory=list)
    by_tracer: bool = False
    end: float | None = None  # wall clock of the response's end
    keep_alive: bool | None = None
    after_close: bool = False  # sent after the previous response said Connection: close
    body_sha256: str | None = None
    content_sha256: str | None = None  # what it asks, canonical (bodies.content_digest)
    # SSE arrival statistics (per event, from the body records)
    first_event: float | None = None
    last_event: float | None = None
    event_gaps: int = 0
    zero_gaps: int = 0
    bunch_gaps: int = 0  # gaps of 30-60 ms
    injected: list[str] = field(default_factory=list)  # faults the tap injected itself
    expect_continue: bool = False  # the head asked for 100 Continue before its body
    continued: bool = False  # an interim 100 Continue came back
    max_event_bytes: int = 0  # the largest SSE event's size, and when it arrived
    max_event_at: float | None = None
    # bytes of this request (or its response) a packet capture does not have (the size of
    # the gap that hit it): what it did past them is unknown
    capture_gap: int | None = None
    # the same request at the other taps (their ids), and what joined them: trace_id,
    # request_id, content (method, target and body, in order) or content_time (the same
    # body sent again, told apart by time on one clock)
    copies: list[str] = field(default_factory=list)
    joined_by: str | None = None


@dataclass(slots=True)
class ConnectionRow:
    id: str
    tap: str
    conn: int
    peer: str
    opened: float
    closed: float | None = None
    duration: float | None = None
    requests: int = 0
    closed_by: str | None = None
    how: str | None = None
    half_close: str | None = None
    in_flight_at_close: bool | None = None
    bytes_from_client: int | None = None
    bytes_from_upstream: int | None = None
    upstream: str | None = None  # host:port it connected to (the last, if several)
    upstream_local: str | None = None
    upstream_connect: float | None = None
    upstream_error: str | None = None
    anomalies: list[str] = field(default_factory=list)
    probes: int = 0  # requests on it that were a tap's own (``PROBE_HEADER``), not counted
