"""The facts ``addons/trace.py`` takes from mitmproxy's hooks for ``flows.FlowObserver``:
one named tuple per kind, imported by both sides (nothing of mitmproxy here).

Times: ``now`` is the monotonic clock of mitmproxy's process when the hook ran, ``ts``
a mitmproxy timestamp (wall clock). Between the two processes a fact travels as a plain
tuple, ``(tag, *fields)`` (``marshal`` takes no tuple subclass): ``to_wire`` and
``from_wire``, the tag being the kind's place in ``KINDS``.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

Fields = tuple[tuple[bytes, bytes], ...]  # a head's header pairs, as mitmproxy keeps them


class Open(NamedTuple):
    """The capture process's first fact: the capture to write."""

    path: str
    settings: dict[str, Any]  # flows.Settings as a dict
    header: dict[str, Any]  # the capture_start record's fields


class Conn(NamedTuple):
    """``client_connected`` (or the first hook of a connection not seen yet)."""

    cid: str
    now: float
    ts: float | None
    peer: Any
    local: Any


class Upstream(NamedTuple):
    """``server_connect`` / ``server_connected`` / ``server_connect_error``."""

    cid: str
    now: float
    phase: Literal["start", "done", "failed"]
    addr: Any
    local: Any
    ts_start: float | None
    ts_setup: float | None
    error: str | None


class UpstreamClosed(NamedTuple):
    """``server_disconnected`` while the client connection stays open."""

    cid: str
    now: float
    ts: float | None
    addr: Any
    local: Any
    error: str | None


class TlsFailed(NamedTuple):
    """``tls_failed_client`` / ``tls_failed_server``."""

    cid: str
    now: float
    direction: Literal["client", "upstream"]
    error: str | None


class ClientGone(NamedTuple):
    """``client_disconnected``."""

    cid: str
    now: float


class Request(NamedTuple):
    """``requestheaders``; ``line``: the request line's method and path bytes."""

    fid: str
    cid: str
    now: float
    ts: float
    method: str
    path: str
    version: str
    fields: Fields
    line: int
    streamed: bool  # another addon streams the request body
    h2: bool  # its HTTP/2 stream was found (the bytes held for it can be looked at)


class RequestPieces(NamedTuple):
    """A streamed request body's pieces and their arrival times."""

    fid: str
    times: list[float]
    pieces: list[bytes]


class RequestEnd(NamedTuple):
    """``request``; ``content``: the body, when mitmproxy buffered it."""

    fid: str
    now: float
    ts: float | None
    content: bytes | None
    answered: bool  # an addon answered before the upstream was asked


class Response(NamedTuple):
    """``responseheaders``; ``line``: the reason phrase's bytes."""

    fid: str
    now: float
    ts: float | None
    status: int
    reason: str
    version: str
    fields: Fields
    line: int
    streamed: bool


class Pieces(NamedTuple):
    """Response body pieces and their arrival times (sizes only when not needed)."""

    fid: str
    times: list[float]
    pieces: list[bytes | int]


class ResponseEnd(NamedTuple):
    """``response``: see ``FlowObserver._on_response_end``."""

    fid: str
    now: float
    ts: float | None
    body_end: float | None
    content: bytes | int | None
    request: bytes | None
    held: int | None


class Error(NamedTuple):
    """``error``: mitmproxy's message and which side's sockets stood how."""

    fid: str
    now: float
    msg: str
    ts: float | None
    server_error: str | None
    server_peer: bool
    server_h2: bool
    client_reads: bool
    request: bytes | None


class Fault(NamedTuple):
    """A fault ``addons/faults.py`` injected."""

    fid: str
    cid: str
    now: float
    seq: int
    fault: str
    spec: str
    detail: str


class FaultPlan(NamedTuple):
    """The faults ``addons/faults.py`` applies from now on."""

    now: float
    specs: list[str]
    change: Literal["replace", "clear"]


class Tick(NamedTuple):
    """The addon's ticker: by client connection, whether mitmproxy holds bytes for the
    client and the kernel's unsent bytes; by HTTP/2 flow, the bytes held for the client
    (None: cannot look) and whether the client reset the stream."""

    now: float
    backlog: dict[str, tuple[bool, int | None]]
    streams: dict[str, tuple[int | None, bool]]


class Lost(NamedTuple):
    """Facts mitmproxy's process dropped (the capture process fell behind)."""

    now: float
    facts: int
    size: int


class Close(NamedTuple):
    """The capture ends."""

    now: float
    reason: str


Fact = (
    Open
    | Conn
    | Upstream
    | UpstreamClosed
    | TlsFailed
    | ClientGone
    | Request
    | RequestPieces
    | RequestEnd
    | Response
    | Pieces
    | ResponseEnd
    | Error
    | Fault
    | FaultPlan
    | Tick
    | Lost
    | Close
)
KINDS: tuple[type[Fact], ...] = (
    Open,
    Conn,
    Upstream,
    UpstreamClosed,
    TlsFailed,
    ClientGone,
    Request,
    RequestPieces,
    RequestEnd,
    Response,
    Pieces,
    ResponseEnd,
    Error,
    Fault,
    FaultPlan,
    Tick,
    Lost,
    Close,
)
TAGS: dict[type[Fact], int] = {kind: tag for tag, kind in enumerate(KINDS)}
_PREFIX: dict[type[Fact], tuple[int]] = {kind: (tag,) for kind, tag in TAGS.items()}


def to_wire(facts: list[Fact]) -> list[tuple[Any, ...]]:
    """Facts as plain tuples, their tag first (a tuple plus a named tuple is a tuple: the
    cheapest copy, and this runs in mitmproxy's process)."""
    prefix = _PREFIX
    return [prefix[type(fact)] + fact for fact in facts]


def from_wire(raw: list[tuple[Any, ...]]) -> list[Fact]:
    """The facts back from ``to_wire``'s tuples (as each kind's ``_make`` would, at C
    speed: the capture process does this for every fact)."""
    new, kinds = tuple.__new__, KINDS
    facts: list[Fact] = [new(kinds[r[0]], r[1:]) for r in raw]
    return facts
