"""Typed, versioned event records: the one stream every tap emits.

Theory of operation
-------------------
A tap (the native proxy, the mitmproxy addon, a replay run) turns what it sees into
these records. The capture file is exactly this stream, one JSON object a line; the
analysis is a pure function of it. Every record carries:

* ``type``  -- its name (the class's ``TYPE``), stable across versions;
* ``t``     -- wall-clock seconds since the epoch (to join taps and engine samples);
* ``m``     -- monotonic seconds of the tap (for durations; only comparable within
  one tap run);
* ``tap``   -- the tap's name;
* ``conn``  -- the tap-local connection number (1, 2, ...), where it applies;
* ``seq``   -- the request's position on that connection (1, 2, ...), where it applies.

Records are slotted and keyword-only, and treated as immutable: nothing changes a
record once emitted. They are not ``frozen`` dataclasses because a frozen one costs
2.7x as much to build (measured: 1.7 µs vs 0.6 µs), and the taps build one per body
batch and several per request on the hot path. ``to_record`` / ``from_record`` convert
to and from plain dicts; unknown fields are ignored on read so that a newer capture
stays readable by older analysis code where it can be. ``CAPTURE_VERSION`` changes
when a field changes meaning; adding fields does not change it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

CAPTURE_VERSION = 1

Direction = Literal["client", "upstream"]
Termination = Literal[
    "complete",  # final chunk / full Content-Length / close-delimited end
    "truncated",  # upstream closed (FIN or reset) before the end
    "client_abort",  # the client closed first, before the response ended
    "in_flight",  # still going when the tap stopped
    "unparsed",  # the observer could not follow the framing (protocol anomaly)
    "tracer_response",  # answered by the tap itself (502 / 400)
]


@dataclass(slots=True, kw_only=True)
class Event:
    """Base of every record."""

    TYPE: ClassVar[str] = "event"
    t: float
    m: float
    tap: str

    def to_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE}
        for name in _FIELDS[type(self)]:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


_REGISTRY: dict[str, type[Event]] = {}
_FIELDS: dict[type[Event], tuple[str, ...]] = {}


def _register[E: type[Event]](cls: E) -> E:
    _REGISTRY[cls.TYPE] = cls
    _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return cls


def from_record(record: dict[str, Any]) -> Event | None:
    """Rebuild an event from a capture record; None for an unknown type."""
    cls = _REGISTRY.get(record.get("type", ""))
    if cls is None:
        return None
    names = _FIELDS[cls]
    kwargs = {k: v for k, v in record.items() if k in names}
    try:
        return cls(**kwargs)
    except TypeError:
        return None


def event_types() -> dict[str, type[Event]]:
    return dict(_REGISTRY)


@_register
@dataclass(slots=True, kw_only=True)
class CaptureStart(Event):
    """Header record: the first line of every capture file."""

    TYPE: ClassVar[str] = "capture_start"
    version: int = CAPTURE_VERSION
    tracer_version: str
    kind: str  # "proxy", "mitmproxy", "replay", "watch"
    listen: str | None = None
    upstream: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@_register
@dataclass(slots=True, kw_only=True)
class CaptureEnd(Event):
    """Last record of a capture closed cleanly (absent after kill -9)."""

    TYPE: ClassVar[str] = "capture_end"
    records: int
    dropped: int
    reason: str


@_register
@dataclass(slots=True, kw_only=True)
class CaptureLoss(Event):
    """Records the writer could not write (disk full or too slow)."""

    TYPE: ClassVar[str] = "capture_loss"
    dropped: int
    dropped_bytes: int
    reason: str


@_register
@dataclass(slots=True, kw_only=True)
class ConnOpen(Event):
    TYPE: ClassVar[str] = "conn_open"
    conn: int
    peer: str
    local: str


@_register
@dataclass(slots=True, kw_only=True)
class UpstreamConnect(Event):
    """Upstream connect phases: start, done (with local address) or failed."""

    TYPE: ClassVar[str] = "upstream_connect"
    conn: int
    phase: Literal["start", "done", "failed"]
    addr: str
    local: str | None = None
    error: str | None = None
    elapsed: float | None = None


@_register
@dataclass(slots=True, kw_only=True)
class ConnClose(Event):
    """End of a connection: who closed first, how, and what was in flight."""

    TYPE: ClassVar[str] = "conn_close"
    conn: int
    closed_by: Literal["client", "upstream", "tracer", "none"]
    how: Literal["fin", "reset", "tracer", "unknown"]  # unknown: mitmproxy does not tell
    half_close: Direction | None = None  # side that sent FIN while the other went on
    in_flight: bool
    requests: int
    bytes_from_client: int
    bytes_from_upstream: int
    upstream_opened: bool
    duration: float


@_register
@dataclass(slots=True, kw_only=True)
class RequestHead(Event):
    """A request's head, parsed from the client's bytes."""

    TYPE: ClassVar[str] = "request"
    conn: int
    seq: int
    idle_before: float  # since the previous response ended (or the connection opened)
    method: str
    target: str
    version: str
    headers: list[list[str]]
    request_id: str | None = None
    content_length: int | None = None
    chunked: bool = False
    expect_continue: bool = False
    pipelined: bool = False  # sent before the previous response had ended


@_register
@dataclass(slots=True, kw_only=True)
class RequestEnd(Event):
    """The request body ended (or was cut); size, hash, OpenAI fields, maybe the body."""

    TYPE: ClassVar[str] = "request_end"
    conn: int
    seq: int
    complete: bool
    body_bytes: int
    body_sha256: str
    body: str | None = None
    body_encoding: Literal["utf-8", "base64"] | None = None
    body_kept: bool = False
    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    messages: int | None = None


@_register
@dataclass(slots=True, kw_only=True)
class Informational(Event):
    """A 1xx response (100 Continue, 101 Switching Protocols)."""

    TYPE: ClassVar[str] = "informational"
    conn: int
    seq: int
    status: int


@_register
@dataclass(slots=True, kw_only=True)
class ResponseHead(Event):
    TYPE: ClassVar[str] = "response"
    conn: int
    seq: int
    status: int
    reason: str
    version: str
    headers: list[list[str]]
    ttfb: float  # seconds from the request head to the response head
    sse: bool = False
    content_length: int | None = None
    chunked: bool = False
    keep_alive: bool = True
    by_tracer: bool = False


@_register
@dataclass(slots=True, kw_only=True)
class BodyData(Event):
    """Response body reads from upstream, batched (at most ~0.1 s or 256 reads a record).

    ``t``/``m`` are the arrival time of the first read. ``reads`` lists every read as
    ``[dt, size, chunks]``: its arrival offset from ``m`` in seconds, its body bytes
    (framing excluded) and the data chunks that started in it. ``sse`` lists the
    Server-Sent Events completed, each as ``[dt, size, kind]`` or
    ``[dt, size, "finish", finish_reason]`` with the ``dt`` of the read that completed
    it; kinds: ``role`` (data with no content yet), ``content``, ``finish``, ``usage``,
    ``error``, ``done``, ``comment``, ``other`` (data that is not OpenAI JSON).
    """

    TYPE: ClassVar[str] = "body"
    conn: int
    seq: int
    size: int  # body bytes in these reads
    chunks: int = 0  # data chunks started in these reads (chunked framing)
    reads: list[list[Any]] = field(default_factory=list)
    sse: list[list[Any]] | None = None
    data: str | None = None  # only with --bodies all
    data_encoding: Literal["utf-8", "base64"] | None = None


@_register
@dataclass(slots=True, kw_only=True)
class ResponseEnd(Event):
    """How the response ended, with the figures analysis needs most."""

    TYPE: ClassVar[str] = "response_end"
    conn: int
    seq: int
    termination: Termination
    status: int | None = None
    body_bytes: int
    duration: float  # from the request head
    ttfb: float | None = None
    first_token: float | None = None  # from the request head to the first content event
    events: int = 0
    comments: int = 0
    done: bool = False  # data: [DONE] seen
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None  # SSE error event message
    max_gap: float | None = None  # largest silence between body reads
    close: Literal["fin", "reset"] | None = None
    mid_event: bool = False  # cut inside an SSE event
    detail: str | None = None


@_register
@dataclass(slots=True, kw_only=True)
class Stall(Event):
    """No bytes moving for a request in flight; start and end records."""

    TYPE: ClassVar[str] = "stall"
    conn: int
    seq: int
    phase: Literal["start", "end"]
    direction: Literal["upstream_silent", "client_not_reading", "client_silent"]
    silent_for: float  # seconds without bytes when the record was made
    unsent_bytes: int | None = None  # kernel send queue toward the client


@_register
@dataclass(slots=True, kw_only=True)
class Anomaly(Event):
    """Bytes the observer could not parse; forwarding went on regardless."""

    TYPE: ClassVar[str] = "anomaly"
    conn: int
    seq: int | None = None
    direction: Direction
    error: str
    offset: int  # bytes of that direction seen before the failure


@_register
@dataclass(slots=True, kw_only=True)
class EngineSample(Event):
    """One scrape of an engine's (or the router's) own metrics, normalised.

    ``state`` holds the normalised figures (``running``, ``queued``, ``token_usage``,
    ``gen_throughput``, ``generation_tokens_total``, ``prompt_tokens_total``,
    ``requests_total`` ... — see ``tracer/engines.py``), each summed over the series
    that make up the whole (never counting a per-priority and an aggregate series
    twice). ``deltas`` are counter increases since the previous sample of the same URL
    (``interval`` seconds apart); a counter that went down is a restart (``restarted``)
    and gives no delta. ``freshness`` says how old a figure may be (SGLang's gauges are
    refreshed only every 40 decode steps, and about every 30 s while idle).
    ``series``: the labelled series behind the figures (engine_type, dp_rank,
    model_name ...). A failed scrape has ``ok`` false and ``error`` (timeout, refused,
    HTTP status) and no figures: failures are evidence too.
    """

    TYPE: ClassVar[str] = "engine"
    url: str
    source: Literal["metrics", "loads"] = "metrics"
    ok: bool
    elapsed: float  # seconds the scrape took
    status: int | None = None  # HTTP status
    error: str | None = None
    profile: str | None = None  # sglang | vllm | llamacpp | smg | sgl_router | unknown
    state: dict[str, Any] = field(default_factory=dict)
    deltas: dict[str, Any] | None = None
    interval: float | None = None
    restarted: bool = False
    freshness: dict[str, str] | None = None
    series: list[dict[str, Any]] | None = None
    raw: dict[str, Any] | None = None  # unknown metrics, with --keep-raw-metrics


@_register
@dataclass(slots=True, kw_only=True)
class HealthSample(Event):
    """One poll of a health endpoint (``/health``, the router's ``/readiness``)."""

    TYPE: ClassVar[str] = "health"
    url: str
    ok: bool
    elapsed: float
    status: int | None = None
    error: str | None = None


@_register
@dataclass(slots=True, kw_only=True)
class Probe(Event):
    """A tiny request over a fresh connection, sent when a stall is detected.

    The automatic form of the decisive experiment: does a fresh connection get an
    answer while a reused one hangs? ``target``: ``upstream`` (the tap's own upstream)
    or ``engine`` (an engine URL directly). ``outcome``: ``ok``, ``error``, ``timeout``,
    or ``skipped`` (with ``reason``: rate limit, or the engine reported load above the
    threshold — probes never pile onto a loaded engine).
    """

    TYPE: ClassVar[str] = "probe"
    url: str
    target: Literal["upstream", "engine"]
    kind: Literal["models", "completion", "health"]
    outcome: Literal["ok", "error", "timeout", "skipped"]
    trigger_conn: int | None = None
    trigger_seq: int | None = None
    status: int | None = None
    latency: float | None = None
    first_byte: float | None = None
    reason: str | None = None


@_register
@dataclass(slots=True, kw_only=True)
class Mark(Event):
    """ "The harness was seen hung at about this time" — from the admin's ``POST /mark``."""

    TYPE: ClassVar[str] = "mark"
    note: str | None = None


@_register
@dataclass(slots=True, kw_only=True)
class FaultInjected(Event):
    """A fault the tap injected on purpose (``tracer proxy --fault SPEC``).

    Written when the fault acts, before its consequences (the stall, the cut, the
    tap's own answer): analysis reads it so that an injected fault is never taken for
    an external one. ``fault`` is the fault's name, ``spec`` the spec as given (with its
    rule), ``detail`` what was done.
    """

    TYPE: ClassVar[str] = "fault"
    conn: int
    seq: int | None = None
    fault: str
    spec: str
    detail: str | None = None
