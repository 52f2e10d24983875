"""The tracer's capture from inside mitmproxy: the same events as the native tap.

    mitmdump -s addons/trace.py --mode reverse:http://127.0.0.1:30000 \\
        --set tracer_capture=front.jsonl [--set tracer_tap=NAME] \\
        [--set tracer_stall_after=5] [--set tracer_bodies=none|requests|all]

Theory of operation
-------------------
A thin adapter: mitmproxy parses HTTP and calls hooks; this addon turns each hook into
the tracer's typed events (``tracer/events.py``) and writes them with the tracer's
capture writer, classifying SSE with ``tracer/sse.py`` and redacting headers with
``tracer/redact.py``. ``tracer analyze`` reads the result like any other capture
(``capture_start.kind`` is ``mitmproxy``).

=========================  ===============================================================
mitmproxy hook             events
=========================  ===============================================================
``client_connected``       ``conn_open`` (connections numbered 1, 2 ... in accept order)
``server_connect`` /       ``upstream_connect`` ``start`` / ``done`` / ``failed`` (mitmproxy
``server_connected`` /     may open several upstream connections for one client connection:
``server_connect_error``   each gives its own records)
``requestheaders``         ``request`` (its position ``seq`` on the client connection)
``request``                ``request_end`` (size; the body per option, else its hash and
                           OpenAI fields: a reader derives those of a kept body)
``responseheaders``        ``response``; switches streaming on for ``text/event-stream``
                           (mitmproxy #4469) with a callable that observes each piece
                           and returns it unchanged
stream callable            ``body`` records, batched as the tap does (per piece: its time
                           and size; SSE events with their kinds, via ``SseObserver``, found
                           when the batch is written)
``response`` / ``error``   ``response_end`` with the termination
``client_disconnected``    ``conn_close``
``tls_failed_client`` /    ``anomaly`` on the connection (``client`` / ``upstream``): the
``tls_failed_server``      TLS handshake failed, in mitmproxy's words
a ticker (``running``)     ``stall`` start/end; flushes body batches
``done``                   ``response_end`` ``in_flight`` and ``conn_close`` for what is
                           open, then ``capture_end``
=========================  ===============================================================

Rules:

1. Observation never changes traffic, nor holds it back: the stream callable returns its
   input (or hands it on to a stream callable another addon set first) and leaves the
   writing of a batch it made due to the loop's next round; once the exchange has ended
   the flow's ``stream`` attributes get back what they held before; a failure in this
   addon is logged and forwarding goes on. Without ``tracer_capture`` the addon does
   nothing.
2. Times: ``m`` is this process's monotonic clock, ``t`` = ``m`` + a wall offset fixed at
   start, as in the tap. Heads and ends are timed by mitmproxy's own timestamps where it
   keeps them; body pieces when mitmproxy hands them over.
3. A termination is decided from what mitmproxy says: the end of the message
   (complete), its ``error`` text and which side's socket stopped reading (client abort
   or truncated), a kill (in flight), a parse failure (unparsed, with an ``anomaly``),
   an answer made by mitmproxy itself (``tracer_response``: its 502 when the upstream
   cannot be reached, or a response an addon set). On HTTP/2 from the client
   (``_Conn.multiplexed``) a stream's end is that stream's alone, each stream in flight
   is watched for stalls by its own last sign of life, and the bytes mitmproxy holds for
   the client under flow control are followed (``_delivery_check``): a streamed
   response ends when they have left.
4. What mitmproxy does not show is not invented: chunk boundaries (``chunks`` is 0),
   FIN versus reset (``close`` is absent; ``conn_close.how`` is ``unknown``), half-close.
   See ``addons/README.md``.
5. Cost: the stream callable is called once per piece of body, so it only takes the
   time and the size and keeps the piece; the pieces are looked at a batch at a time,
   when the batch is written (SSE events via ``SseObserver.batch``, with a shortcut past
   the classifier for the usual content chunk, ``ContentShape``), while that code is
   warm; nothing of a finished exchange waits for mitmproxy's garbage collector
   (``_let_go``). ``python -m bench.run --scenarios addon`` measures what the addon costs
   mitmdump, ``python -m bench.addon_hooks`` where it goes.
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib.util
import logging
import re
import struct
import sys
import termios
import time
from collections.abc import Callable, Iterable
from itertools import chain, islice, repeat
from operator import sub
from pathlib import Path
from typing import Any, Literal

if importlib.util.find_spec("tracer") is None:  # a mitmdump without tracer installed
    sys.path.append(str(Path(__file__).resolve().parent.parent))

from mitmproxy import connection, ctx, exceptions, http, tls
from mitmproxy import version as mitmproxy_version
from mitmproxy.addonmanager import Loader
from mitmproxy.flow import Error
from mitmproxy.proxy import server_hooks
from mitmproxy.proxy.layer import NextLayer
from mitmproxy.proxy.layers.http import HttpLayer
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from tracer import __version__
from tracer import events as ev
from tracer.bodies import RequestBody, encode_body
from tracer.capture import CaptureWriter, boot_id
from tracer.redact import redact_headers
from tracer.sniff import (
    BODY_BATCH_READS,
    BODY_BATCH_SECONDS,
    MAX_BODY_KEEP,
    ResponseState,
    count_sse,
    end_stall,
    response_end,
    response_head_facts,
    stall_direction,
    start_stall,
)
from tracer.sse import SseEvent, SseSplitter, classify

log = logging.getLogger(__name__)

BODIES = ("none", "requests", "all")
# The pieces of a batch kept until it is written (SSE, tracer_bodies=all) stay under about
# MAX_KEPT_BYTES: pieces under BIG_PIECE are bounded by BODY_BATCH_READS (256 x 4 KiB);
# a bigger one makes the batch due once the batch would pass the bound.
MAX_KEPT_BYTES = 1 << 20
BIG_PIECE = 4096
StreamFn = Callable[[bytes], Iterable[bytes] | bytes]
StallDirection = Literal["upstream_silent", "client_not_reading", "client_silent"]
# mitmproxy's words for the ends it reports only as text (mitmproxy/proxy/layers/http)
_CLIENT_GONE = ("Client disconnected", "Client closed connection")
_UPSTREAM_CUT = ("peer closed connection", "server closed connection")
# ... and its HTTP/2 layer's, for one stream or the whole connection (mitmproxy's
# proxy/layers/http/_http2.py: the same words whichever peer it speaks HTTP/2 with)
_H2_RESET = "stream reset by client"
_H2_ENDS = (_H2_RESET, "HTTP/2 connection closed", "HTTP/2 protocol error")
TLS_FAILED = "TLS handshake failed: "  # an anomaly's error, then mitmproxy's reason
_UNPARSED = ("HTTP/1 protocol error", "Cannot parse HTTP", "unexpected server response")


class _Conn:
    """One client connection as seen through mitmproxy."""

    __slots__ = (
        "cause",
        "client",
        "client_bytes",
        "conn",
        "h2",
        "h2_layer",
        "in_flight_at_cause",
        "last_activity_m",
        "last_end_m",
        "multiplexed",
        "opened_m",
        "pending",
        "seq",
        "shape",
        "upstream_bytes",
        "upstream_opened",
    )

    def __init__(self, conn: int, client: connection.Client, opened_m: float) -> None:
        self.conn = conn
        self.client = client
        self.opened_m = opened_m
        self.seq = 0
        self.last_end_m = opened_m
        self.last_activity_m = opened_m
        self.pending: list[_Flow] = []  # requests whose response has not ended, in order
        self.client_bytes = 0  # message bytes (heads + bodies) as mitmproxy assembled them
        self.upstream_bytes = 0
        self.upstream_opened = False
        # HTTP/2 (or 3) from the client: requests run at once, each as its own stream,
        # and one ending (a reset, a cut upstream) does not end the connection
        self.multiplexed = False
        # mitmproxy's HTTP layer and HTTP/2 connection for it, found on the first stream
        # (``_h2_of``; None when its internals are not as expected): where the bytes it
        # holds for the client under HTTP/2 flow control are
        self.h2_layer: Any = None
        self.h2: Any = None
        self.shape = ContentShape()  # of the content chunks on this connection
        # why the client connection is going to end, decided at the first sign of it
        self.cause: Literal["client", "upstream", "tracer"] | None = None
        self.in_flight_at_cause = False


class ContentShape:
    """The shape of a stream's plain content chunks: a shortcut past ``sse.classify``.

    An engine writes its content chunks alike: the same bytes before the generated
    text (``data: {"id":"…",…"delta":{"content":"``) and after it (``"},…}`` and the
    blank line). Once ``sse.classify`` has called one such one-line event a plain
    ``content`` chunk (no finish_reason, usage or error), any event made of the same
    prefix, a non-empty text without ``"``, CR or LF, and the same suffix gets the same
    answer from it: the classifier's patterns all begin with a ``"``, so none can start
    inside the text, and the suffix (which must go on with ``,`` or ``}`` after the
    closing quote) cannot complete one that began before. ``SseObserver`` checks that in
    a few byte comparisons per piece, or for a run of pieces at once.
    """

    __slots__ = ("prefix", "prefix_len", "quotes", "suffix", "suffix_len")

    def __init__(self) -> None:
        self.prefix = self.suffix = b""
        self.prefix_len = self.suffix_len = self.quotes = 0

    def learn(self, event: bytes, sse: SseEvent) -> None:
        """``event``: one whole event (its blank line included), ``sse``: its class."""
        if (
            sse.kind != "content"
            or sse.usage is not None
            or sse.error is not None
            or event.count(b"\n") != 2
            or b"\r" in event
        ):
            return
        start = event.find(b'"content":"') + 11
        end = event.find(b'"', start)
        if start < 11 or end <= start or event[end + 1 : end + 2] not in (b",", b"}"):
            return
        # the event's only LFs are its last two bytes (it ends with its blank line): the
        # suffix holds both, and neither part holds a CR
        self.prefix, self.suffix = event[:start], event[end:]
        self.prefix_len, self.suffix_len = start, len(event) - end
        self.quotes = self.prefix.count(b'"') + self.suffix.count(b'"')

    def fits(self, piece: bytes) -> bool:
        """Whether ``piece`` is one plain content chunk of this shape."""
        start = self.prefix_len
        end = len(piece) - self.suffix_len
        return (
            0 < start < end
            and piece.startswith(self.prefix)
            and piece.endswith(self.suffix)
            and _NOT_IN_TEXT.search(piece, start, end) is None
        )

    def all_fit(self, pieces: list[bytes]) -> bool:
        """``fits`` for every piece, at C speed: each piece begins with the prefix, ends
        with the suffix and is longer than both, so the quotes and LFs of the joined
        pieces are the prefixes' and suffixes' exactly when no text holds one."""
        n = len(pieces)
        if not self.prefix_len or min(map(len, pieces)) <= self.prefix_len + self.suffix_len:
            return False
        if not all(map(bytes.startswith, pieces, repeat(self.prefix))):
            return False
        if not all(map(bytes.endswith, pieces, repeat(self.suffix))):
            return False
        joined = b"".join(pieces)
        return (
            joined.count(b'"') == n * self.quotes
            and joined.count(b"\n") == 2 * n
            and joined.find(b"\r") < 0
        )


_NOT_IN_TEXT = re.compile(rb'["\r\n]')


class SseObserver:
    """The SSE events of a response, a batch of pieces at a time: ``sse.SseSplitter`` with
    shortcuts.

    ``batch`` gives the events of the pieces that are not plain content chunks of the
    connection's ``ContentShape`` (by index; each of the others is one ``content`` event
    with no finish_reason, usage or error), the same as ``SseSplitter.feed`` piece by
    piece would: a piece that is one whole event (an event per chunk: the usual) is
    classified alone and may teach the shape; anything else goes through the splitter.
    While the splitter holds the beginning of an event (``held``), every piece must go to
    it. The pieces between the first and the last plain chunk of a batch are tested
    together (``ContentShape.all_fit``): an engine's specials (role, finish, usage,
    ``[DONE]``) come first and last. ``tests/test_addon_trace.py`` checks ``batch``
    against the splitter.
    """

    __slots__ = ("held", "shape", "splitter")

    def __init__(self, shape: ContentShape) -> None:
        self.splitter = SseSplitter()
        self.shape = shape
        self.held = False  # the splitter holds the beginning of an event

    @property
    def pending(self) -> int:
        return self.splitter.pending

    def batch(self, pieces: list[bytes]) -> list[tuple[int, list[SseEvent]]]:
        """The events of the pieces that are not plain content chunks, by index."""
        specials: list[tuple[int, list[SseEvent]]] = []
        shape, n, i = self.shape, len(pieces), 0
        while i < n and (self.held or not shape.fits(pieces[i])):
            specials.append((i, self.feed(pieces[i])))
            i += 1
        last = n
        while last > i and not shape.fits(pieces[last - 1]):
            last -= 1
        if last - i > 2 and shape.all_fit(pieces[i:last]):
            i = last  # nothing held: plain chunks leave the splitter alone
        for j in range(i, n):
            piece = pieces[j]
            if self.held or not shape.fits(piece):
                specials.append((j, self.feed(piece)))
        return specials

    def feed(self, piece: bytes) -> list[SseEvent]:
        if self.held:
            found = self.splitter.feed(piece)
            self.held = self.splitter.pending > 0
            return found
        if len(piece) > 2 and piece.find(b"\n\n") == len(piece) - 2 and b"\r" not in piece:
            sse = classify(piece[:-2])
            self.shape.learn(piece, sse)
            return [sse]
        found = self.splitter.feed(piece)
        self.held = self.splitter.pending > 0
        return found


class _Stream:
    """The client's HTTP/2 stream that carries a flow, and the bytes mitmproxy holds for
    it under flow control (``TraceAddon._delivery_check``)."""

    __slots__ = ("delivered", "h2", "held", "held_since", "id", "upstream_end_m")

    def __init__(self, h2: Any, stream_id: int, since: float) -> None:
        self.h2 = h2  # mitmproxy's HTTP/2 connection to the client (BufferedH2Connection)
        self.id = stream_id
        self.held = 0  # bytes held for the client at the last look
        self.held_since = since  # since when the client has taken none of them
        self.delivered = 0  # bytes the client has taken
        # the upstream's end, while the last bytes wait for the client (the response
        # ends when they leave)
        self.upstream_end_m: float | None = None

    def held_now(self) -> int | None:
        """Bytes mitmproxy holds for the client on this stream, waiting for flow-control
        window; None when its internals cannot be looked at."""
        try:
            return sum(len(item.data) for item in self.h2.stream_buffers.get(self.id, ()))
        except Exception:
            return None

    def reset_by_client(self) -> bool:
        try:
            how = self.h2._stream_closed_by(self.id)
        except Exception:
            return False
        return how is not None and how.name == "RECV_RST_STREAM"


class _Flow(ResponseState[SseObserver]):
    """Mutable per-request state while it is in flight (``sniff._Request``'s counterpart)."""

    __slots__ = (
        "active_m",
        "body_end_m",
        "by_proxy",
        "closes",
        "conn",
        "due",
        "flow_id",
        "injected_stop",
        "json_body",
        "pieces",
        "req_body",
        "req_chain",
        "resp_chain",
        "sizes",
        "stream",
        "streamed_request",
        "streamed_response",
        "times",
    )

    def __init__(self, flow_id: str, conn: _Conn, seq: int, head_m: float, json_body: bool) -> None:
        super().__init__(seq, head_m)
        self.active_m = head_m  # its last sign of life (a stream's own, on HTTP/2)
        self.flow_id = flow_id
        self.conn = conn
        self.json_body = json_body
        self.streamed_request = False
        self.req_chain: StreamFn | bool = False  # what request.stream was before ours
        self.resp_chain: StreamFn | bool = False  # ... and response.stream
        self.req_body: RequestBody | None = None  # a streamed request body as it arrives
        self.by_proxy = False
        # who ends the connection after this exchange (Connection: close, HTTP/1.0)
        self.closes: Literal["upstream", "tracer"] | None = None
        self.streamed_response = False
        self.body_end_m: float | None = None
        # body pieces observed but not yet written (see _response_observer): arrival
        # times, sizes, and the pieces themselves for SSE (classified a batch at a time)
        # and with tracer_bodies=all
        self.times: list[float] = []
        self.sizes: list[int] = []
        self.pieces: list[bytes] | None = None
        self.due: int | None = None  # pieces of the batch due to be written (_write_due)
        self.stream: _Stream | None = None  # HTTP/2, when mitmproxy's stream is found
        # addons/faults.py stopped passing the body on (stall- or truncate-after-events):
        # the upstream's end is not the client's, the kill or hold that follows is
        self.injected_stop: str | None = None


class TraceAddon:
    """mitmproxy hooks in, tracer events out."""

    def __init__(self) -> None:
        self.writer: CaptureWriter | None = None
        self.tap = "mitmproxy"
        self.stall_after = 5.0
        self.bodies = "requests"
        self._wall = time.time() - time.monotonic()
        self._next_conn = 0
        self._conns: dict[str, _Conn] = {}  # by mitmproxy's client connection id
        self._flows: dict[str, _Flow] = {}  # by flow id
        self._ticker: asyncio.Task[None] | None = None

    # ---- options ----------------------------------------------------------------------

    def load(self, loader: Loader) -> None:
        loader.add_option(
            "tracer_capture",
            str,
            "",
            "Write the tracer's capture (JSON Lines) to this file; empty: tracing off.",
        )
        loader.add_option("tracer_tap", str, "mitmproxy", "The tap's name in the capture.")
        loader.add_option(  # a string: mitmproxy's --set has no float options
            "tracer_stall_after",
            str,
            "5",
            "Seconds without progress on a request in flight before a stall is recorded.",
        )
        loader.add_option(
            "tracer_bodies",
            str,
            "requests",
            "Bodies kept in the capture: none, requests (default) or all.",
            choices=list(BODIES),
        )

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        if "tracer_stall_after" in updated:
            try:
                stall_after = float(opts.tracer_stall_after)
            except ValueError:
                stall_after = float("nan")
            if not 0 < stall_after <= 86400:
                raise _options_error(
                    "tracer_stall_after must be seconds in (0, 86400], "
                    f"got {opts.tracer_stall_after!r}"
                )
            self.stall_after = stall_after
        if "tracer_tap" in updated:
            tap = str(opts.tracer_tap).strip()
            if not tap:
                raise _options_error("tracer_tap must not be empty")
            self.tap = tap
        if "tracer_bodies" in updated:
            if opts.tracer_bodies not in BODIES:  # choices are checked too; be explicit
                raise _options_error(f"tracer_bodies must be one of {', '.join(BODIES)}")
            self.bodies = opts.tracer_bodies
        if "tracer_capture" in updated:
            self._close_capture("capture file changed")
            if opts.tracer_capture:
                self._open_capture(opts.tracer_capture)

    def _open_capture(self, path: str) -> None:
        self._wall = time.time() - time.monotonic()
        header = self._header()
        try:
            writer = CaptureWriter(Path(path).expanduser())
        except OSError as exc:
            raise _options_error(
                f"tracer_capture: cannot open {path}: {exc.strerror or exc}"
            ) from exc
        writer.write(header)
        self.writer = writer

    def _header(self) -> ev.CaptureStart:
        opts = ctx.options
        now = time.monotonic()
        modes = list(opts.mode)
        specs = [ProxyMode.parse(m) for m in modes]  # "reverse:URL@PORT": URL, PORT
        # the server a reverse proxy sends to (replays go there), when there is one: an
        # upstream mode's next hop is a forward proxy, which origin-form requests cannot
        # be replayed to, and with several reverse modes each connection has its own
        upstream = [m.data for m in specs if isinstance(m, ReverseMode)]
        listen = [
            f"{m.custom_listen_host or opts.listen_host or '*'}:"
            f"{m.custom_listen_port or opts.listen_port or 'default'}"
            for m in specs
        ]
        return ev.CaptureStart(
            t=now + self._wall,
            m=now,
            tap=self.tap,
            tracer_version=__version__,
            kind="mitmproxy",
            listen=", ".join(dict.fromkeys(listen)),
            upstream=upstream[0] if len(upstream) == 1 else None,
            boot_id=boot_id(),
            options={
                "stall_after": self.stall_after,
                "bodies": self.bodies,
                "mitmproxy": mitmproxy_version.VERSION,
                "mode": modes,
                "connection_strategy": getattr(opts, "connection_strategy", None),
                "tcp_timeout": getattr(opts, "tcp_timeout", None),
            },
        )

    def _close_capture(self, reason: str) -> None:
        """Settle what is open (in flight, closed by the tap) and end the capture."""
        if self.writer is not None:
            now = time.monotonic()
            for conn in list(self._conns.values()):
                self._note_cause(conn, "tracer")
                for st in list(conn.pending):
                    self._end(st, now, "in_flight", detail="tap stopped")
                self._conn_close(conn, now)
        self._conns.clear()
        self._flows.clear()
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.finish(self.tap, reason)

    # ---- lifecycle --------------------------------------------------------------------

    def running(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())

    def done(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        self._close_capture("mitmproxy stopped")

    # ---- connections ------------------------------------------------------------------

    def client_connected(self, client: connection.Client) -> None:
        if self.writer is not None:
            self._conn_of(client, time.monotonic())

    def _conn_of(self, client: connection.Client, now: float) -> _Conn:
        conn = self._conns.get(client.id)
        if conn is None:
            self._next_conn += 1
            opened = client.timestamp_start - self._wall if client.timestamp_start else now
            conn = self._conns[client.id] = _Conn(self._next_conn, client, min(opened, now))
            self._emit(
                ev.ConnOpen(
                    t=conn.opened_m + self._wall,
                    m=conn.opened_m,
                    tap=self.tap,
                    conn=conn.conn,
                    peer=_addr(client.peername),
                    local=_addr(client.sockname),
                )
            )
        return conn

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        if self.writer is None:
            return
        now = time.monotonic()
        conn = self._conn_of(data.client, now)
        self._emit(
            ev.UpstreamConnect(
                t=now + self._wall,
                m=now,
                tap=self.tap,
                conn=conn.conn,
                phase="start",
                addr=_addr(data.server.address),
            )
        )

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        if self.writer is None:
            return
        server = data.server
        now = time.monotonic()
        conn = self._conn_of(data.client, now)
        conn.upstream_opened = True
        elapsed = None
        if server.timestamp_start and server.timestamp_tcp_setup:
            elapsed = round(server.timestamp_tcp_setup - server.timestamp_start, 6)
        self._emit(
            ev.UpstreamConnect(
                t=now + self._wall,
                m=now,
                tap=self.tap,
                conn=conn.conn,
                phase="done",
                addr=_addr(server.address),
                local=_addr(server.sockname),
                elapsed=elapsed,
            )
        )

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        if self.writer is None:
            return
        server = data.server
        now = time.monotonic()
        conn = self._conn_of(data.client, now)
        started = server.timestamp_start
        self._emit(
            ev.UpstreamConnect(
                t=now + self._wall,
                m=now,
                tap=self.tap,
                conn=conn.conn,
                phase="failed",
                addr=_addr(server.address),
                error=server.error or "connect failed",
                elapsed=round(now + self._wall - started, 6) if started else None,
            )
        )

    def tls_failed_client(self, data: tls.TlsData) -> None:
        self._tls_failed(data, "client")

    def tls_failed_server(self, data: tls.TlsData) -> None:
        self._tls_failed(data, "upstream")

    def _tls_failed(self, data: tls.TlsData, direction: Literal["client", "upstream"]) -> None:
        """A TLS handshake failed: no request can come (from the client) or go (to the
        upstream) on it. mitmproxy's text says why, e.g. that the client does not trust
        its certificate; the request that needed the upstream gets mitmproxy's 502."""
        if self.writer is None:
            return
        now = time.monotonic()
        conn = self._conn_of(data.context.client, now)
        self._emit(
            ev.Anomaly(
                t=now + self._wall,
                m=now,
                tap=self.tap,
                conn=conn.conn,
                seq=None,
                direction=direction,
                error=f"{TLS_FAILED}{data.conn.error or 'no reason given'}",
                offset=0,
            )
        )

    def client_disconnected(self, client: connection.Client) -> None:
        if self.writer is None:
            return
        conn = self._conns.get(client.id)
        if conn is None:
            return
        now = time.monotonic()
        if conn.cause is None:
            idle = now - conn.last_activity_m
            timeout = getattr(ctx.options, "tcp_timeout", None)
            closed_by_timeout = isinstance(timeout, int | float) and idle >= timeout - 1
            self._note_cause(conn, "tracer" if closed_by_timeout else "client")
        if conn.pending:  # no error hook for them (yet): settle them by what is known
            termination: ev.Termination = (
                "truncated"
                if conn.cause == "upstream"
                else "in_flight"
                if conn.cause == "tracer"
                else "client_abort"
            )
            for st in list(conn.pending):
                self._end(st, now, termination, detail="client connection closed")
        self._conn_close(conn, now)

    def _conn_close(self, conn: _Conn, now: float) -> None:
        self._conns.pop(conn.client.id, None)
        closed_by = conn.cause or "client"
        # mitmproxy does not tell FIN from reset, nor who half-closed (see README)
        how: Any = "tracer" if closed_by == "tracer" else "unknown"
        self._emit(
            ev.ConnClose(
                t=now + self._wall,
                m=now,
                tap=self.tap,
                conn=conn.conn,
                closed_by=closed_by,
                how=how,
                in_flight=conn.in_flight_at_cause,
                requests=conn.seq,
                bytes_from_client=conn.client_bytes,
                bytes_from_upstream=conn.upstream_bytes,
                upstream_opened=conn.upstream_opened,
                duration=round(now - conn.opened_m, 6),
            )
        )

    def _ended_by(self, conn: _Conn, cause: Literal["client", "upstream", "tracer"]) -> None:
        """An exchange ended in a way that ends an HTTP/1 connection; an HTTP/2 stream's
        end (a reset, a cut upstream, a kill) leaves its connection open."""
        if not conn.multiplexed:
            self._note_cause(conn, cause)

    def _note_cause(self, conn: _Conn, cause: Literal["client", "upstream", "tracer"]) -> None:
        if conn.cause is None:
            conn.cause = cause
            conn.in_flight_at_cause = bool(conn.pending)

    # ---- requests ---------------------------------------------------------------------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if self.writer is None:
            return
        req = flow.request
        now = time.monotonic()
        head_m = min(req.timestamp_start - self._wall, now)
        conn = self._conn_of(flow.client_conn, now)
        conn.seq += 1
        if req.http_version.startswith(("HTTP/2", "HTTP/3")) and not conn.multiplexed:
            conn.multiplexed = True
            conn.h2_layer, conn.h2 = _h2_of(flow.client_conn)
        content_length: int | None = None
        chunked = expect = json_body = False
        request_id: str | None = None
        connection: list[bytes] = []
        fields = req.headers.fields
        size = len(req.data.method) + len(req.data.path) + 14 + _fields_size(fields)
        for name, value in fields:
            lower = name.lower()
            if lower not in _REQUEST_HEADERS_READ:
                continue
            if lower == b"content-length":
                try:
                    content_length = int(value)
                except ValueError:
                    content_length = None
            elif lower == b"transfer-encoding":
                chunked = True
            elif lower == b"expect":
                expect = value.lower() == b"100-continue"
            elif lower == b"x-request-id":
                request_id = value.decode("latin-1")
            elif lower == b"content-type":
                json_body = b"json" in value.lower()
            elif lower == b"connection":
                connection.append(value)
        conn.client_bytes += size
        pipelined = bool(conn.pending)
        st = _Flow(flow.id, conn, conn.seq, head_m, json_body)
        if _client_closes(req.http_version, connection):
            st.closes = "tracer"  # mitmproxy closes the client connection after it
        if conn.h2 is not None:
            stream_id = _stream_id(conn.h2_layer, flow)
            if stream_id is not None:
                st.stream = _Stream(conn.h2, stream_id, head_m)
        conn.pending.append(st)
        self._flows[flow.id] = st
        self._activity(conn, head_m, st)
        idle = 0.0 if pipelined else max(0.0, head_m - conn.last_end_m)
        self._emit(
            ev.RequestHead(
                t=head_m + self._wall,
                m=head_m,
                tap=self.tap,
                conn=conn.conn,
                seq=st.seq,
                idle_before=round(idle, 6),
                method=req.method,
                target=req.path,
                version=_version(req.http_version),
                headers=redact_headers(fields),
                request_id=request_id,
                content_length=content_length,
                chunked=chunked,
                expect_continue=expect,
                pipelined=pipelined,
            )
        )
        if req.stream:  # another addon streams the request: count it as it goes by
            st.streamed_request = True
            keep = json_body or self.bodies != "none"  # for the record, or for its fields
            st.req_body = RequestBody(MAX_BODY_KEEP, keep=keep)
            st.req_chain = req.stream
            req.stream = self._request_observer(st, req.stream)

    def _request_observer(self, st: _Flow, chain: StreamFn | bool) -> StreamFn:
        def observe(data: bytes) -> Iterable[bytes] | bytes:
            if data:
                try:
                    if st.req_body is not None:
                        st.req_body.add(data)
                    self._activity(st.conn, time.monotonic(), st)
                except Exception:
                    log.exception("tracer: observing a request body failed")
            return chain(data) if callable(chain) else data

        return observe

    def request(self, flow: http.HTTPFlow) -> None:
        st = self._flows.get(flow.id)
        if st is None or st.request_done:
            return
        req = flow.request
        end_m = (req.timestamp_end or time.time()) - self._wall
        self._activity(st.conn, end_m, st)
        if flow.response is not None:  # an addon answered before the upstream was asked
            st.by_proxy = True
        self._request_end(st, req.raw_content, end_m, complete=True)

    def _request_end(self, st: _Flow, content: bytes | None, m: float, *, complete: bool) -> None:
        st.request_done = True
        body = st.req_body
        if body is None:  # buffered by mitmproxy: one piece
            body = RequestBody(MAX_BODY_KEEP)
            if content:
                body.add(content)
        st.req_body = None
        st.conn.client_bytes += body.size
        fields = body.record(keep=self.bodies != "none", json_body=st.json_body)
        self._emit(
            ev.RequestEnd(
                t=m + self._wall,
                m=m,
                tap=self.tap,
                conn=st.conn.conn,
                seq=st.seq,
                complete=complete,
                body_bytes=body.size,
                **fields,
            )
        )

    # ---- responses --------------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        st = self._flows.get(flow.id)
        resp = flow.response
        if st is None or resp is None or st.ended:
            return
        now = time.monotonic()
        head_m = min(resp.timestamp_start - self._wall, now) if resp.timestamp_start else now
        st.status = resp.status_code
        st.resp_head_m = st.last_data_m = head_m
        fields = resp.headers.fields
        content_length, chunked, sse, keep_alive = response_head_facts(
            ((name.lower(), value) for name, value in fields),
            keep_alive=resp.http_version != "HTTP/1.0",
        )
        size = len(resp.data.reason) + 15 + _fields_size(fields)
        st.conn.upstream_bytes += size
        if sse:
            st.sse = SseObserver(st.conn.shape)
        if sse or self.bodies == "all":
            st.pieces = []
        self._activity(st.conn, head_m, st)
        self._emit(
            ev.ResponseHead(
                t=head_m + self._wall,
                m=head_m,
                tap=self.tap,
                conn=st.conn.conn,
                seq=st.seq,
                status=resp.status_code,
                reason=resp.reason,
                version=_version(resp.http_version),
                headers=redact_headers(fields),
                ttfb=round(head_m - st.head_m, 6),
                sse=sse,
                content_length=content_length,
                chunked=chunked,
                keep_alive=keep_alive,
                by_tracer=st.by_proxy,
            )
        )
        if not keep_alive:
            st.closes = "upstream"
        if st.by_proxy:
            return
        if sse or resp.stream:  # SSE must not be buffered (mitmproxy #4469)
            st.streamed_response = True
            st.resp_chain = resp.stream
            resp.stream = self._response_observer(st, resp.stream)

    def _response_observer(self, st: _Flow, chain: StreamFn | bool) -> StreamFn:
        """The stream callable: the hot path, one call per piece of body.

        Each piece gets its time and size, and for SSE (or with tracer_bodies=all) is kept
        until its batch is written (``body``): when a piece comes ``BODY_BATCH_SECONDS``
        (or ``BODY_BATCH_READS`` pieces, or ``MAX_KEPT_BYTES``) after the batch's first,
        by the ticker, before a stall record and at the end of the response. The SSE
        events are found then, a batch at a time (``SseObserver.batch``): the work a
        piece costs is done while the code doing it is warm, not between mitmproxy's own
        work on every piece. A batch made due by a piece is written just after mitmproxy
        has sent that piece on (``_write_due``), not before: observation does not hold a
        token back.
        """
        times, sizes, pieces = st.times, st.sizes, st.pieces
        monotonic = time.monotonic
        then = chain if callable(chain) else None
        try:
            soon: Callable[..., Any] | None = asyncio.get_running_loop().call_soon
        except RuntimeError:  # called outside mitmproxy's loop: write at once
            soon = None

        def observe(data: bytes) -> Iterable[bytes] | bytes:
            if data:
                now = monotonic()
                size = len(data)
                if (
                    times
                    and st.due is None
                    and (
                        now - times[0] >= BODY_BATCH_SECONDS
                        or len(times) >= BODY_BATCH_READS
                        or (
                            size >= BIG_PIECE
                            and pieces is not None
                            and sum(sizes) + size > MAX_KEPT_BYTES
                        )
                    )
                ):
                    self._make_due(st, soon)
                times.append(now)
                sizes.append(size)
                if pieces is not None:
                    pieces.append(data)
            elif st.body_end_m is None:  # mitmproxy's end-of-message call
                st.body_end_m = monotonic()
            return data if then is None else then(data)

        return observe

    def _make_due(self, st: _Flow, soon: Callable[..., Any] | None) -> None:
        """The batch so far is due: write it in the loop's next round, or at once when
        there is no loop to hand it to (outside mitmproxy's loop, or a closed one)."""
        st.due = len(st.times)
        if soon is not None:
            try:
                soon(self._write_due, st)
                return
            except RuntimeError:
                pass
        self._write_due(st)

    def _write_due(self, st: _Flow) -> None:
        """Write the batch that was due (its first ``st.due`` pieces); the pieces that
        came since begin the next one. Nothing to do if it was written meanwhile (the end
        of the response, a stall: every write clears ``due``)."""
        due = st.due
        if due is None or st.ended:
            return
        times, sizes, pieces = st.times, st.sizes, st.pieces
        later_times, later_sizes = times[due:], sizes[due:]
        later_pieces = pieces[due:] if pieces is not None else []
        del times[due:], sizes[due:]
        if pieces is not None:
            del pieces[due:]
        self._flush_guarded(st)
        times += later_times
        sizes += later_sizes
        if pieces is not None:
            pieces += later_pieces

    def _flush_guarded(self, st: _Flow) -> None:
        st.due = None
        try:
            self._flush_body(st)
        except Exception:
            log.exception("tracer: writing a body record failed; forwarding unchanged")
        finally:
            st.times.clear()
            st.sizes.clear()
            if st.pieces:
                st.pieces.clear()

    def _flush_body(self, st: _Flow) -> None:
        """Write the pieces observed so far as one ``body`` record."""
        times, sizes, pieces = st.times, st.sizes, st.pieces
        if not times:
            return
        first, last = times[0], times[-1]
        if st.stall_start_m is not None and first > st.stall_start_m and not _held_back(st):
            self._end_stall(st, first)  # the first bytes after a stall end it
        dts = [((m - first) * 1e6 + 0.5) // 1 / 1e6 for m in times]  # round(…, 6), cheaper
        total = sum(sizes)
        prev = st.last_data_m
        gap = max(map(sub, islice(dts, 1, None), dts), default=0.0)  # within the batch
        if prev is not None and first - prev > gap:
            gap = first - prev
        if gap > st.max_gap:
            st.max_gap = gap
        st.last_data_m = last
        events: list[Any] | None = None
        if st.sse is not None and pieces is not None:
            try:
                specials = st.sse.batch(pieces)
            except Exception:
                specials = [(i, []) for i in range(len(pieces))]
                log.exception("tracer: observing a response body failed")
            events, plain = self._sse_records(st, dts, sizes, specials, times)
            st.events += len(times) - len(specials)
            if plain >= 0 and (st.first_token_m is None or times[plain] < st.first_token_m):
                st.first_token_m = times[plain]
        st.resp_bytes += total
        conn = st.conn
        conn.upstream_bytes += total
        if last > conn.last_activity_m:
            conn.last_activity_m = last
        if conn.multiplexed and last > st.active_m:
            st.active_m = last
        data_text = encoding = None
        if pieces:
            if self.bodies == "all":
                data_text, encoding = encode_body(b"".join(pieces))
            pieces.clear()
        self._emit(
            ev.BodyData(
                t=first + self._wall,
                m=first,
                tap=self.tap,
                conn=conn.conn,
                seq=st.seq,
                size=total,
                chunks=0,  # mitmproxy does not show chunk boundaries
                reads=list(zip(dts, sizes, repeat(0))),
                sse=events or None,
                data=data_text,
                data_encoding=encoding,
            )
        )
        times.clear()
        sizes.clear()

    def _sse_records(
        self,
        st: _Flow,
        dts: list[float],
        sizes: list[int],
        specials: list[tuple[int, list[SseEvent]]],
        times: list[float],
    ) -> tuple[list[Any], int]:
        """The batch's ``sse`` entries, and the index of its first plain content chunk.

        Pieces between the specials are plain content chunks, one ``content`` event
        each: they are zipped in runs (C speed); only the specials are looked at.
        """
        if not specials:
            return list(zip(dts, sizes, repeat("content"))), 0
        events: list[Any] = []
        plain = -1
        start = 0
        for i, found in specials:
            if i > start:
                events += zip(dts[start:i], sizes[start:i], repeat("content"))
                if plain < 0:
                    plain = start
            dt = dts[i]
            for sse in found:
                events.append([dt, *sse.as_record()])
                self._on_sse(st, sse, times[i])
            start = i + 1
        if start < len(dts):
            events += zip(dts[start:], sizes[start:], repeat("content"))
            if plain < 0:
                plain = start
        return events, plain

    def _on_sse(self, st: _Flow, sse: SseEvent, m: float) -> None:
        count_sse(st, sse, m)

    def response(self, flow: http.HTTPFlow) -> None:
        st = self._flows.get(flow.id)
        resp = flow.response
        if st is None or resp is None or st.ended:
            return
        if not st.request_done:  # the response came first (e.g. 413 during an upload)
            self._request_end(st, flow.request.raw_content, time.monotonic(), complete=True)
        if st.body_end_m is not None:
            end_m = st.body_end_m
        else:
            end_m = (resp.timestamp_end or time.time()) - self._wall
            end_m = min(end_m, time.monotonic())
        if not st.streamed_response and st.resp_head_m is not None:
            content = resp.raw_content  # buffered by mitmproxy: one piece, at the end
            if content:
                self._response_observer(st, False)(content)
                st.times[-1] = end_m
        self._flush_guarded(st)
        last = st.last_data_m
        if last is not None and end_m - last > st.max_gap:
            st.max_gap = end_m - last
        if st.injected_stop == "truncate-after-events":  # faults.py kills it right after
            self._ended_by(st.conn, "tracer")
            self._end(st, time.monotonic(), "truncated", detail="cut by an injected fault")
            _let_go(st, flow)
            return
        if st.injected_stop is not None:  # held for good by faults.py: in flight, stalls
            return
        if st.by_proxy:
            self._end(st, end_m, "tracer_response", detail="answered by a mitmproxy addon")
        elif st.stream is not None and self._still_held(st.stream, end_m):
            pass  # the response ends when its last bytes leave (tick, _delivery_check)
        elif resp.status_code == 101:
            self._end(st, end_m, "complete", detail="switched protocols")
        else:
            self._end(st, end_m, "complete")
        if st.closes is not None:  # the connection ends after this exchange
            self._ended_by(st.conn, st.closes)
        _let_go(st, flow)

    def error(self, flow: http.HTTPFlow) -> None:
        st = self._flows.get(flow.id)
        if st is None or st.ended:
            return
        self._error_end(st, flow)
        _let_go(st, flow)

    def _error_end(self, st: _Flow, flow: http.HTTPFlow) -> None:
        """End the response by what mitmproxy's error says (see rule 3)."""
        now = time.monotonic()
        err = flow.error
        msg = err.msg if err is not None else "error"
        m = min(err.timestamp - self._wall, now) if err is not None else now
        conn = st.conn
        if msg == Error.KILLED_MESSAGE:
            self._ended_by(conn, "tracer")
            if not st.request_done:
                self._request_end(st, flow.request.raw_content, m, complete=False)
            self._end(st, m, "in_flight", detail=f"killed in mitmproxy: {msg}")
            return
        termination = self._cut_termination(st, flow, msg)
        if not st.request_done:
            self._request_end(st, flow.request.raw_content, m, complete=False)
        if termination == "client_abort":
            if not msg.startswith(_H2_RESET):  # (a reset ends one HTTP/2 stream, no more)
                self._note_cause(conn, "client")  # the client's connection ends
            self._end(st, m, "client_abort", detail=msg)
            return
        if st.resp_head_m is None and (flow.server_conn.error or not flow.server_conn.peername):
            # mitmproxy answered the client itself (its 502: the upstream is unreachable)
            st.status = 502
            self._emit(
                ev.ResponseHead(
                    t=m + self._wall,
                    m=m,
                    tap=self.tap,
                    conn=conn.conn,
                    seq=st.seq,
                    status=502,
                    reason="Bad Gateway",
                    version="1.1",
                    headers=[],
                    ttfb=round(m - st.head_m, 6),
                    keep_alive=False,
                    by_tracer=True,
                )
            )
            self._end(st, m, "tracer_response", detail=msg)
            self._ended_by(conn, "tracer")  # after the answer: nothing is left in flight
            return
        self._ended_by(conn, "upstream")
        if msg.startswith(_UNPARSED) and not any(s in msg for s in _UPSTREAM_CUT):
            self._emit(
                ev.Anomaly(
                    t=m + self._wall,
                    m=m,
                    tap=self.tap,
                    conn=conn.conn,
                    seq=st.seq,
                    direction="upstream",
                    error=msg,
                    offset=st.resp_bytes,  # body bytes before it (mitmproxy hides framing)
                )
            )
            self._end(st, m, "unparsed", detail=msg)
            return
        self._end(st, m, "truncated", detail=msg)

    def _cut_termination(self, st: _Flow, flow: http.HTTPFlow, msg: str) -> ev.Termination:
        """Who went first: the client (mitmproxy says so, or its socket stopped reading)."""
        if msg.startswith(_CLIENT_GONE):
            return "client_abort"
        if st.conn.multiplexed and msg.startswith(_H2_ENDS) and flow.server_conn.alpn != b"h2":
            return "client_abort"  # HTTP/2 words, and only the client speaks HTTP/2 here
        if not st.conn.client.state & connection.ConnectionState.CAN_READ:
            return "client_abort"
        return "truncated"

    def _end(
        self,
        st: _Flow,
        m: float,
        termination: ev.Termination,
        *,
        detail: str | None = None,
    ) -> None:
        if st.ended:
            return
        st.ended = True
        self._flush_body(st)
        conn = st.conn
        pending = conn.pending
        if pending and pending[0] is st:  # the usual: responses end in order
            del pending[0]
        elif st in pending:
            pending.remove(st)
        self._flows.pop(st.flow_id, None)
        if st.stall_start_m is not None:
            self._end_stall(st, m)
        conn.last_end_m = m
        conn.last_activity_m = max(conn.last_activity_m, m)
        self._emit(
            response_end(
                st, m, termination, tap=self.tap, conn=conn.conn, wall=self._wall, detail=detail
            )
        )
        if termination != "complete":
            log.warning(
                "tracer: response ended %s (conn %d, request %d): %s",
                termination,
                conn.conn,
                st.seq,
                detail or "-",
            )

    # ---- stalls -------------------------------------------------------------------------

    def _activity(self, conn: _Conn, m: float, st: _Flow) -> None:
        """Something happened on ``st``'s exchange: on HTTP/1 that ends the stall of the
        connection's oldest request (the one the connection waits for), on HTTP/2 only
        ``st``'s own."""
        conn.last_activity_m = max(conn.last_activity_m, m)
        if conn.multiplexed:
            if m > st.active_m:
                st.active_m = m
            if st.stall_start_m is not None and not _held_back(st):
                self._end_stall(st, m)
        elif conn.pending:
            oldest = conn.pending[0]
            if oldest.stall_start_m is not None:
                self._end_stall(oldest, m)

    def _end_stall(self, st: _Flow, m: float) -> None:
        event = end_stall(st, m, tap=self.tap, conn=st.conn.conn, wall=self._wall)
        if event is None:
            return
        self._emit(event)
        log.info(
            "tracer: stall ended (conn %d, request %d) after %.3fs",
            st.conn.conn,
            st.seq,
            event.silent_for,
        )

    async def _tick_loop(self) -> None:
        while True:
            interval = max(0.05, min(0.25, self.stall_after / 4))
            await asyncio.sleep(interval)
            try:
                self.tick(time.monotonic())
            except Exception:  # observation must never stop mitmproxy
                log.exception("tracer: tick failed")

    def tick(self, now: float) -> None:
        """Flush old body batches; start stalls for requests gone silent (the tap's ticker)."""
        if self.writer is None:
            return
        for conn in list(self._conns.values()):
            for st in conn.pending:
                if st.times and (
                    now - st.times[0] >= BODY_BATCH_SECONDS or st.stall_start_m is not None
                ):
                    self._flush_guarded(st)
            # HTTP/1: the oldest request, silent while nothing happens on the connection;
            # HTTP/2: each stream by its own sign of life (the others may go on meanwhile),
            # unless mitmproxy holds bytes of it for the client
            if not conn.multiplexed:
                if conn.pending:
                    self._stall_check(conn, conn.pending[0], now)
                continue
            for st in list(conn.pending):
                if not self._delivery_check(conn, st, now):
                    self._stall_check(conn, st, now)

    def _still_held(self, stream: _Stream, end_m: float) -> bool:
        """HTTP/2, at the upstream's end of a response: whether mitmproxy still holds some
        of it for the client (flow control). Then the response ends when they leave."""
        held = stream.held_now()
        if not held:
            return False
        stream.held = held
        stream.upstream_end_m = end_m
        return True

    def _delivery_check(self, conn: _Conn, st: _Flow, now: float) -> bool:
        """HTTP/2: follow the bytes mitmproxy holds for the client on ``st``'s stream.

        The client taking none of them for ``stall_after`` is a ``client_not_reading``
        stall (ended when it takes some); a response whose upstream end has come ends
        when they have all left (``complete``), or when the client resets the stream
        instead (``client_abort``). True while bytes are held (or the stream ended here):
        the stream's silence towards the upstream is then not the question.
        """
        stream = st.stream
        if stream is None:
            return False
        held = stream.held_now()
        if held is None:  # cannot look (any more): end by what is known
            if stream.upstream_end_m is None:
                return False
            self._end(st, now, "complete", detail="mitmproxy's HTTP/2 state went away")
            return True
        delivered = st.resp_bytes + sum(st.sizes) - held
        if delivered > stream.delivered or not held:  # the client takes bytes
            stream.delivered = delivered
            stream.held_since = now
            if st.stall_start_m is not None and st.stall_direction == "client_not_reading":
                self._end_stall(st, now)
        stream.held = held
        if stream.upstream_end_m is not None and not held:
            if stream.reset_by_client():
                self._end(st, now, "client_abort", detail="stream reset by client (bytes held)")
            else:
                waited = now - stream.upstream_end_m
                detail = f"the client took the last bytes {waited:.3f} s after the upstream's end"
                self._end(st, now, "complete", detail=detail)
            return True
        if not held:
            return False
        if st.stall_start_m is None and now - stream.held_since >= self.stall_after:
            self._start_stall(conn, st, now, stream.held_since, "client_not_reading", held)
        return True

    def _stall_check(self, conn: _Conn, st: _Flow, now: float) -> None:
        """Start a stall for ``st`` when it has been silent for ``stall_after``."""
        last = st.active_m if conn.multiplexed else conn.last_activity_m
        if st.times and st.times[-1] > last:
            last = st.times[-1]
        silent = now - last
        if st.stall_start_m is not None or silent < self.stall_after:
            return
        blocked, unsent = _client_backlog(conn.client)
        # on HTTP/2 a backlog is the connection's: it holds this stream back only when
        # the other streams are held too (while they go on, the client reads)
        if conn.multiplexed and now - _last_sign(conn) < self.stall_after:
            direction = stall_direction(st, client_blocked=False, unsent=None)
        else:
            direction = stall_direction(st, client_blocked=blocked, unsent=unsent)
        self._start_stall(conn, st, now, last, direction, unsent)

    def _start_stall(
        self,
        conn: _Conn,
        st: _Flow,
        now: float,
        since: float,
        direction: StallDirection,
        unsent: int | None,
    ) -> None:
        self._flush_guarded(st)  # the last bytes before the stall go on record first
        self._emit(
            start_stall(
                st,
                now,
                since,
                direction,
                unsent=unsent,
                tap=self.tap,
                conn=conn.conn,
                wall=self._wall,
            )
        )
        log.warning(
            "tracer: stall started (conn %d, request %d): %s for %.3fs",
            conn.conn,
            st.seq,
            direction,
            now - since,
        )

    # ---- injected faults (from addons/faults.py) ------------------------------------------

    def record_fault(
        self, flow: http.HTTPFlow, seq: int, fault: str, spec: str, detail: str
    ) -> None:
        """A fault ``addons/faults.py`` injected into this flow, written as the tap writes it.

        Called by the faults addon when the fault acts, so that analysis never takes an
        injected fault for an external one. Works whichever addon mitmproxy loaded first:
        the connection is found (or opened) from the flow's client connection.
        """
        if self.writer is None:
            return
        now = time.monotonic()
        st = self._flows.get(flow.id)
        conn = st.conn if st is not None else self._conn_of(flow.client_conn, now)
        if st is not None and fault in ("stall-after-events", "truncate-after-events"):
            st.injected_stop = fault
        self._emit(
            ev.FaultInjected(
                t=now + self._wall,
                m=now,
                tap=self.tap,
                conn=conn.conn,
                seq=st.seq if st is not None else seq,
                fault=fault,
                spec=spec,
                detail=detail,
            )
        )

    def record_fault_plan(self, specs: list[str], change: Literal["replace", "clear"]) -> None:
        """The faults ``addons/faults.py`` applies from now on (``tracer_faults`` set, at
        the start or anew while mitmproxy runs), as a ``fault_plan`` record."""
        if self.writer is None:
            return
        now = time.monotonic()
        self._emit(
            ev.FaultPlanChanged(
                t=now + self._wall, m=now, tap=self.tap, faults=list(specs), change=change
            )
        )

    # ---- output ---------------------------------------------------------------------------

    def _emit(self, event: ev.Event) -> None:
        writer = self.writer
        if writer is not None:
            writer.write(event)


def _let_go(st: _Flow, flow: http.HTTPFlow) -> None:
    """Give the flow's stream attributes back what they held before the observers.

    Once the exchange has ended mitmproxy calls them no more, but the flow keeps them
    (and through them the request's state) until the garbage collector frees the flow:
    mitmproxy's flows are in reference cycles. Let go now, and that state is freed at
    once instead of adding to every collection (measured: the addon's extra GC work in
    the bench's plain scenario went to none).
    """
    if st.streamed_request:
        flow.request.stream = st.req_chain
    if st.streamed_response and flow.response is not None:
        flow.response.stream = st.resp_chain


def _h2_of(client: connection.Client) -> tuple[Any, Any]:
    """mitmproxy's HTTP layer for a client connection and the HTTP/2 connection it keeps
    for it, found through mitmproxy's internals (its proxyserver's connection handler and
    the layers under it, as ``_client_backlog``); (None, None) when they are not there."""
    try:
        proxyserver = ctx.master.addons.get("proxyserver")  # type: ignore[no-untyped-call]
        layer = proxyserver.connections[client.id].layer
        for _ in range(16):
            if isinstance(layer, HttpLayer):
                h2_conn = getattr(layer.connections.get(client), "h2_conn", None)
                return (layer, h2_conn) if h2_conn is not None else (None, None)
            layer = layer.layer if isinstance(layer, NextLayer) else layer.child_layer
    except Exception:
        pass
    return None, None


def _stream_id(http_layer: Any, flow: http.HTTPFlow) -> int | None:
    """The client's HTTP/2 stream that carries ``flow``."""
    try:
        return next((sid for sid, s in http_layer.streams.items() if s.flow is flow), None)
    except Exception:
        return None


def _held_back(st: _Flow) -> bool:
    """Whether mitmproxy held bytes of ``st`` for the client at the last look: then bytes
    from the upstream do not end its stall."""
    return st.stream is not None and st.stream.held > 0


def _last_sign(conn: _Conn) -> float:
    """The connection's last sign of life, its streams' pieces not yet written included."""
    return max([conn.last_activity_m, *(st.times[-1] for st in conn.pending if st.times)])


def _options_error(message: str) -> Exception:
    return exceptions.OptionsError(message)  # type: ignore[no-untyped-call]


def _version(http_version: str) -> str:
    return http_version.removeprefix("HTTP/")


def _addr(value: Any) -> str:
    if isinstance(value, tuple | list) and len(value) >= 2:
        host = str(value[0])
        return f"[{host}]:{value[1]}" if ":" in host else f"{host}:{value[1]}"
    return str(value) if value else "-"


_REQUEST_HEADERS_READ = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"expect",
        b"x-request-id",
        b"content-type",
        b"connection",
    }
)


def _fields_size(fields: tuple[tuple[bytes, bytes], ...]) -> int:
    """The bytes of a head's header lines (``name: value`` and CRLF each)."""
    return 4 * len(fields) + sum(map(len, chain.from_iterable(fields)))


def _client_closes(http_version: str, connection: list[bytes]) -> bool:
    """Whether mitmproxy ends the client connection after this request: its own
    ``http1.connection_close`` (``Connection`` tokens, else the version's default), from
    the header values the loop over the head already picked out."""
    if connection:
        tokens = [token.strip() for token in b", ".join(connection).split(b",")]
        if b"close" in tokens:
            return True
        if b"keep-alive" in tokens:
            return False
    return http_version not in ("HTTP/1.1", "HTTP/2.0")


def _client_backlog(client: connection.Client) -> tuple[bool, int | None]:
    """Whether mitmproxy holds bytes for the client, and the kernel's unsent bytes.

    Best effort through mitmproxy's internals (its proxyserver keeps the client's
    asyncio writer); (False, None) when they are not there.
    """
    try:
        proxyserver = ctx.master.addons.get("proxyserver")  # type: ignore[no-untyped-call]
        handler = proxyserver.connections[client.id]
        transport = handler.transports[client].writer.transport
        buffered = int(transport.get_write_buffer_size())
        sock = transport.get_extra_info("socket")
    except Exception:
        return False, None
    unsent: int | None = None
    if sock is not None:
        try:
            raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            unsent = int(struct.unpack("i", raw)[0])
        except (OSError, ValueError):
            unsent = None
    return buffered > 0, unsent


addons = [TraceAddon()]
