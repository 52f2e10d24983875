"""Sans-I/O observer of one HTTP/1.1 connection: bytes of both directions in, events out.

Theory of operation
-------------------
The observer is fed exactly the bytes the relay forwards, with their arrival time; it
never touches a socket or a clock. h11 is a two-party state machine; a passive observer
is neither party, so instead of one long-lived connection per direction (and mirroring
each side's messages into the other to keep its state machine going) it uses a fresh,
cheap ``h11.Connection`` per message:

* each request is parsed, head and body, by a new server-role connection; the bytes
  after its end start the next request at once (so pipelined requests are seen when
  they arrive, and a request sent after ``Connection: close`` or after the upstream
  closed is still recorded; if the upstream has already closed, its response is
  settled at once as truncated). After a request that may switch protocols (Upgrade,
  CONNECT), the client's bytes are held until the response says whether it did.
* each response head is parsed by a new client-role connection told only the request's
  method (and its Upgrade headers). Responses are the hot path (one read per SSE event
  on a paced stream), so from the end of the head to the end of the body
  ``framing.BodyDecoder`` finds the body's bytes and end (as strict as h11 about chunk
  framing) at a few microseconds per read; bytes after the end start the next response.
* a plain head that arrives whole in one read (most heads) skips h11: h11 costs about
  45 µs a head, most of a small request's observation. ``protocol.head.quick_request``
  and ``quick_response`` take only heads h11 takes, and give what h11 gives for them
  (``tests/unit/test_quick_heads.py``); anything else (a head cut across reads, bare
  LFs, odd framing headers, 1xx, protocol switches) is h11's, whose verdict and words
  an anomaly records. The client's side is ``wire_requests.RequestReader``.

Rules:

1. Observation never affects forwarding. Any parse failure (``RemoteProtocolError``,
   ``FramingError``) is recorded once as an ``Anomaly`` and the observer goes *blind*: it
   only counts bytes from then on.
2. Requests are numbered 1, 2, 3 ... in order on the connection; ``idle_before`` is the
   time since the previous response ended (or since the connection opened).
3. A response's termination is decided where the evidence is: the end of its framing
   (complete), an upstream EOF or reset before it (truncated), a client close before it
   (client abort), the tap stopping (in flight), or a parse failure (unparsed). A
   tunnel (``101`` or a ``2xx`` to ``CONNECT``) ends its response, complete, when it
   starts; its bytes are only counted.
4. Memory per connection is bounded: bytes held behind a possible protocol switch by
   ``MAX_HELD_BYTES``, header size by h11's ``max_incomplete_event_size``
   (a complete head larger than ``max_header_bytes`` is a parse failure too, so that the
   outcome does not depend on how the bytes were cut), request bodies kept up to
   ``max_body_keep``, SSE fragments by ``sse.MAX_EVENT``.
5. Events do not depend on how the bytes were cut into reads, apart from how the
   response body's reads are listed in ``BodyData`` records (batched by the tracker:
   every read and SSE event keeps its arrival time) (and, on malformed bytes, the
   wording and offset of h11's error, which may differ by a byte or two).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Final

import h11

from .. import events as ev
from ..capture.bodies import BodyBudget, RequestBody
from ..protocol.framing import BodyDecoder, FramingError, body_framing
from ..protocol.head import quick_response
from ..protocol.sse import SseEvent, SseSplitter
from ..redact import redact_headers, scrub_text
from .exchange import (
    MAX_BODY_KEEP,
    Bodies,
    Close,
    Emit,
)
from .exchange_state import response_head_facts
from .wire_requests import (
    MAX_HEADER_LINES,
    MAX_HELD_BYTES,
    Head,
    RequestReader,
    WireRequest,
    head_size,
    lower_items,
    not_http,
    raw_items,
)

__all__ = [
    "MAX_HEADER_LINES",
    "MAX_HELD_BYTES",
    "Bodies",
    "ConnectionObserver",
    "Emit",
    "not_http",
]

MAX_HEADER_BYTES: Final = 64 * 1024


class ConnectionObserver(RequestReader):
    """Watches one downstream connection (and its pinned upstream one): h11 and the body
    decoder read the bytes, the ``ExchangeTracker`` it extends keeps the exchanges."""

    def __init__(
        self,
        *,
        tap: str,
        conn: int,
        emit: Emit,
        wall_offset: float,
        opened_m: float,
        bodies: Bodies = "requests",
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_body_keep: int = MAX_BODY_KEEP,
        budget: BodyBudget | None = None,
        redact_fields: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(
            tap=tap,
            conn=conn,
            emit=emit,
            wall=wall_offset,
            opened_m=opened_m,
            bodies=bodies,
            redact_fields=redact_fields,
        )
        self._budget = budget  # the tap's: all the request bodies it holds
        self._max_body_keep = max_body_keep
        self._max_header = max_header_bytes
        self._req: h11.Connection | None = None  # parses the current request
        self._req_body: BodyDecoder | None = None  # ... or its body, when its head was plain
        self._req_base = 0  # client bytes before the current request parser's first byte
        self._held: bytes | None = None  # client bytes behind an undecided protocol switch
        self._head_lines = 0  # lines of the request head being read (-1: it was parsed)
        self._head_tail = b""  # its last 3 bytes (a CRLFCRLF may span two reads)
        # when the first bytes of a request head still unfinished came (the tap's
        # --header-timeout closes a connection whose head takes longer: slowloris)
        self.head_started_m: float | None = None
        self._deferred: tuple[Exception, float, int] | None = None  # client parse failure
        self._head: h11.Connection | None = None  # parses the head of the next response
        self._body: BodyDecoder | None = None  # finds the end of the current body
        self._up_offset = 0  # upstream bytes consumed by parsing (for anomaly offsets)
        self.blind = False
        self.tunnel = False
        # a packet capture's gap (``passive``): response bytes with no request left to
        # answer are handed back in ``orphans`` (for a request the gap swallowed) when set
        self.catch_orphans = False
        self.orphans: bytes | None = None
        self._receiving: WireRequest | None = None  # request whose body is arriving
        self.client_bytes = 0
        self.upstream_bytes = 0
        self.client_closed_m: float | None = None
        self.client_close: Close | None = None
        self.upstream_closed_m: float | None = None
        self.upstream_close: Close | None = None

    # ---- queries used by the relay and the admin endpoint -------------------------

    @property
    def in_flight(self) -> bool:
        return bool(self.pending)

    def in_flight_requests(self) -> list[dict[str, Any]]:
        return [
            {
                "seq": r.seq,
                "method": r.method,
                "started_m": r.head_m,
                "status": r.status,
                "events": r.events,
                "response_bytes": r.resp_bytes + sum(r.sizes),
                "stalled": r.stall_direction,
            }
            for r in self.pending
        ]

    # ---- input --------------------------------------------------------------------

    def client_data(self, data: bytes, m: float) -> None:
        self.client_bytes += len(data)
        self.activity(m)
        if (
            not data
            or self.blind
            or self.tunnel
            or self.client_closed_m is not None
            or self._deferred is not None
        ):
            return  # (h11 would take b"" for EOF)
        if self._held is not None:
            self._held += data
            if len(self._held) > MAX_HELD_BYTES:
                self._go_blind(
                    "client",
                    h11.RemoteProtocolError(f"over {MAX_HELD_BYTES} bytes sent behind an upgrade"),
                    m,
                )
            return
        self._feed_requests(data, m)

    def upstream_data(self, data: bytes, m: float) -> None:
        self.upstream_bytes += len(data)
        self.activity(m)
        if not data or self.blind or self.tunnel or self.upstream_closed_m is not None:
            return  # (h11 would take b"" for EOF)
        if self.client_close == "reset" and not self.pending:  # torn down: nobody to answer
            return
        try:
            self._pump_responses(data, m)
        except (h11.ProtocolError, FramingError) as exc:
            self._go_blind("upstream", exc, m)

    def client_eof(self, m: float, *, reset: bool) -> None:
        """The client sent FIN (half-close) or reset the connection."""
        if self.client_closed_m is None:
            self.client_closed_m = m
            self.client_close = "reset" if reset else "fin"
        if self._req_body is not None and not (self.blind or self.tunnel):
            self._req_body = None  # a request body cut by the client's end
            if self._receiving is not None and not self._receiving.request_done:
                self._end_request(self._receiving, m, complete=False)
        if not (self.blind or self.tunnel) and self._req is not None:
            try:
                self._req.receive_data(b"")
                self._pump_request(m)
            except h11.ProtocolError as exc:
                cut = self._receiving
                if cut is not None and not cut.request_done:
                    self._end_request(cut, m, complete=False)
                else:
                    self._go_blind("client", exc, m)
        if reset:
            self._finish_all(m, "client_abort", close="reset")

    def upstream_eof(self, m: float, *, reset: bool) -> None:
        """The upstream sent FIN or reset: ends a close-delimited body, or truncates."""
        if self.upstream_closed_m is None:
            self.upstream_closed_m = m
            self.upstream_close = "reset" if reset else "fin"
        close: Close = "reset" if reset else "fin"
        if not (self.blind or self.tunnel):
            try:
                if reset:
                    raise FramingError("connection reset by upstream")
                self._upstream_ended(m)
            except (h11.ProtocolError, FramingError) as exc:
                if self.pending:
                    self._finish_all(m, self._cut_termination(), close=close, detail=str(exc))
                return
        self._finish_all(m, self._cut_termination(), close=close)

    def close(self, m: float, *, shutdown: bool) -> None:
        """The relay is done with the connection: settle whatever is still open."""
        if self._receiving is not None and not self._receiving.request_done:
            self._end_request(self._receiving, m, complete=False)
        if shutdown:
            self._finish_all(m, "in_flight", close=None, detail="tap stopped")
        else:
            self._finish_all(m, self._cut_termination(), close=None)

    def tracer_response(
        self, m: float, status: int, reason: str, detail: str | None = None
    ) -> None:
        """Record a response the tap wrote itself (upstream unreachable, bad request);
        ``detail`` says why (the connect error), else the reason phrase does."""
        req = self.pending[0] if self.pending else None
        if req is None:
            body = RequestBody(self._max_body_keep)
            req = self.begin(WireRequest(m, "", False, body, keep=False))
        self.tracer_answer(req, m, status, reason, detail or reason)
        self.blind = True

    # ---- a packet capture's gaps (``passive``: bytes the capture does not have) -------

    def client_position(self) -> tuple[WireRequest | None, int | None, bool]:
        """Where the client's parse is: the request whose body is being read (None:
        between requests or inside a head not read yet), the bytes that body still
        expects when its length is known, and whether parsing can pick up again after a
        gap (not behind a protocol switch or a parse failure held back)."""
        if self.blind or self.tunnel or self._held is not None or self._deferred is not None:
            return None, None, False
        req = self._receiving
        if req is None or req.request_done:
            return None, None, True
        body = self._req_body
        if body is not None and body.framing == "length" and not body.done:
            return req, body._remaining, True
        return req, None, True

    def upstream_remaining(self) -> int | None:
        """The bytes the response body being read still expects, when its length is
        known (None: unknown, or no body being read)."""
        body = self._body
        if body is not None and body.framing == "length" and not body.done:
            return body._remaining
        return None

    def restart_client(self, m: float) -> None:
        """The client's next bytes parsed are not those after the ones read (a gap):
        the request whose body was being read ends cut (``request_end`` incomplete), and
        the next byte fed starts a request head."""
        req = self._receiving
        if req is not None and not req.request_done:
            self._end_request(req, m, complete=False)
        self._receiving = None
        self._req = self._req_body = None
        self._head_lines, self._head_tail = 0, b""
        self.head_started_m = None
        self._req_base = self.client_bytes

    def restart_upstream(self) -> None:
        """The upstream's next bytes fed start a response head (after a gap)."""
        self._head = self._body = None
        self._up_offset = self.upstream_bytes

    def skip_client(self, size: int, m: float) -> None:
        """Client bytes counted, not parsed (skipped after a gap)."""
        self.client_bytes += size
        self.activity(m)

    def skip_upstream(self, size: int, m: float) -> None:
        """Upstream bytes counted, not parsed (skipped after a gap)."""
        self.upstream_bytes += size
        self.activity(m)

    def unpaired(self, m: float, detail: str) -> None:
        """Responses can no longer be told apart (after a gap): every request in flight
        ends ``unparsed`` (``detail`` why), and bytes are only counted from now on."""
        self.blind = True
        self.head_started_m = None
        for req in list(self.pending):
            self.end_response(req, m, "unparsed", detail=detail)

    # ---- responses --------------------------------------------------------------------

    def _pump_responses(self, data: bytes, m: float) -> None:
        """Heads through h11, bodies through the decoder, body bytes batched per read."""
        body_req: WireRequest | None = None
        size = chunks = 0
        sse_events: list[SseEvent] | None = None
        raw: list[bytes] | None = [] if self.keep_data else None
        try:
            while data and not (self.blind or self.tunnel):
                body = self._body
                if body is not None:
                    req = self.pending[0]
                    if raw is None and req.sse is not None and body_req is None:
                        # a streamed token's read: one chunk, one content event (the
                        # shortcut gives what the walk below would, without building it)
                        start = body.whole_chunk(data)
                        if start:
                            payload = data[start:-2]
                            if req.sse.whole_content(payload):
                                self._up_offset += len(data)
                                self.add_content_read(req, m, len(payload))
                                return
                    try:
                        pieces, headers, used = body.feed(data)
                    except FramingError as exc:  # report what came before the bad bytes
                        self._up_offset += exc.at
                        pieces, headers, used = exc.pieces, exc.chunks, 0
                        failure: FramingError | None = exc
                    else:
                        failure = None
                    self._up_offset += used
                    if pieces or headers:
                        body_req = req
                    chunks += headers
                    splitter = req.sse
                    for piece in pieces:
                        size += len(piece)
                        if raw is not None:
                            raw.append(piece)
                        if splitter is not None:
                            found = splitter.feed(piece)
                            if found:
                                if sse_events is None:
                                    sse_events = found
                                else:
                                    sse_events += found
                    if failure is not None:
                        raise failure
                    if not body.done:
                        return
                    data = data[used:]
                    if body_req is not None:
                        self.add_read(req, m, size, chunks, sse_events, raw)
                    body_req, size, chunks, sse_events = None, 0, 0, None
                    raw = [] if raw is not None else None
                    self._body_ended(req, m)
                    continue
                if not self.pending:
                    if self.catch_orphans:
                        self.orphans = data
                        return
                    raise h11.RemoteProtocolError("response without a request")
                data = self._parse_head(data, m)
        finally:  # bytes parsed before a failure are still reported
            if body_req is not None:
                self.add_read(body_req, m, size, chunks, sse_events, raw)

    def _parse_head(self, data: bytes, m: float) -> bytes:
        """Feed the head parser; returns the bytes after a complete head (the body's)."""
        req = self.pending[0]
        head = self._head
        if head is None and not req.may_switch and req.method != "CONNECT":
            quick = quick_response(data, self._max_header)  # (as _quick_request)
            size = 0 if quick is None else head_size(len(quick.reason) + 17, quick)
            if quick is not None and size <= self._max_header:
                self._up_offset += quick.end
                self._on_response(quick.status, quick.reason, quick.version, quick, size, req, m)
                return self._body_starts(req, quick.status, quick.lower, data[quick.end :], m)
        if head is None:
            head = self._head = h11.Connection(
                h11.CLIENT, max_incomplete_event_size=self._max_header
            )
            head.send(_mirror_request(req.method or "GET", tuple(req.mirror)))
            head.send(h11.EndOfMessage())
        head.receive_data(data)
        while True:
            event = head.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                self._up_offset += len(data)
                return b""
            if isinstance(event, h11.InformationalResponse):
                self._on_informational(event, req, m)
                if self.tunnel:
                    return b""
                continue
            if isinstance(event, h11.Response):
                rest = head.trailing_data[0]
                self._up_offset += len(data) - len(rest)
                self._head = None
                status, reason, headers = event.status_code, event.reason, event.headers
                size = head_size(len(reason) + 17, headers)  # "HTTP/1.1 200 reason\r\n\r\n"
                self._on_response(status, reason, event.http_version, headers, size, req, m)
                if self.tunnel:
                    return b""
                return self._body_starts(req, status, headers, rest, m)
            return b""  # ConnectionClosed: nothing more to parse

    def _body_starts(
        self,
        req: WireRequest,
        status: int,
        headers: Iterable[tuple[bytes, bytes]],
        rest: bytes,
        m: float,
    ) -> bytes:
        """After a final response head: its body's framing; returns the bytes after it."""
        framing, length = body_framing(req.method, status, headers)
        self._body = BodyDecoder(framing, length)
        if self._body.done:
            self._body_ended(req, m)
        return rest

    def _body_ended(self, req: WireRequest, m: float) -> None:
        self._body = None
        self.body_done(req, m)
        self.end_response(req, m, "complete")

    def _upstream_ended(self, m: float) -> None:
        """Upstream EOF: ends a close-delimited body; any other open body or head is cut."""
        body = self._body
        if body is not None:
            body.eof()  # raises FramingError unless the body is close-delimited
            self._body_ended(self.pending[0], m)
        elif self._head is not None and self._head.trailing_data[0]:
            raise FramingError("peer closed inside a response head")

    def _on_informational(
        self, event: h11.InformationalResponse, req: WireRequest, m: float
    ) -> None:
        self.record(ev.Informational, m, seq=req.seq, status=event.status_code)
        if event.status_code == 101:
            self.tunnel = True
            req.status, req.resp_head_m = 101, m
            self.end_response(req, m, "complete", detail="switched protocols")

    def _on_response(
        self,
        status: int,
        reason: bytes,
        version: bytes,
        headers: Head,
        size: int,
        req: WireRequest,
        m: float,
    ) -> None:
        """A final response head, read by h11 or the quick path (``size``: its
        ``head_size``)."""
        if size > self._max_header:
            raise h11.RemoteProtocolError(
                f"response head of {size} bytes is over max_header_bytes ({self._max_header})"
            )
        content_length, chunked, sse, keep_alive = response_head_facts(
            lower_items(headers), keep_alive=version == b"1.1"
        )
        if sse:
            req.sse = SseSplitter()
        self.response_head(
            req,
            m,
            status=status,
            reason=reason.decode("latin-1"),
            version=version.decode("latin-1"),
            headers=redact_headers(raw_items(headers)),
            sse=sse,
            content_length=content_length,
            chunked=chunked,
            keep_alive=keep_alive,
        )
        if req.method == "CONNECT" and 200 <= status < 300:
            self.tunnel = True
            self.end_response(req, m, "complete", detail="tunnel")
        elif self._held is not None and req.may_switch:
            self._release_held(m)

    def ended(self, st: WireRequest, m: float, *, oldest: bool) -> None:
        if oldest:
            self._head = self._body = None  # whatever was parsing its response is done
        if self._deferred is not None and not self.pending:
            exc, failed_m, offset = self._deferred
            self._deferred = None
            self._go_blind("client", exc, failed_m, offset)

    # ---- shared -----------------------------------------------------------------------

    def _cut_termination(self) -> ev.Termination:
        client, upstream = self.client_closed_m, self.upstream_closed_m
        if client is not None and (upstream is None or client <= upstream):
            return "client_abort"
        return "truncated"

    def _finish_all(
        self,
        m: float,
        termination: ev.Termination,
        *,
        close: Close | None,
        detail: str | None = None,
    ) -> None:
        if self.blind and termination != "in_flight":
            termination = "unparsed"
        for req in list(self.pending):
            self.end_response(req, m, termination, close=close, detail=detail)

    def _go_blind(
        self, direction: ev.Direction, exc: Exception, m: float, offset: int | None = None
    ) -> None:
        if self.blind:
            return
        self.blind = True
        self.head_started_m = None  # not HTTP (or no longer read): no head to wait for
        if direction == "client":
            seq = None if self._receiving is None else self._receiving.seq
            offset = self._client_offset() if offset is None else offset
        else:
            seq = self.pending[0].seq if self.pending else None
            offset = self._up_offset
        self.record(
            ev.Anomaly,
            m,
            seq=seq,
            direction=direction,
            error=scrub_text(str(exc)) or type(exc).__name__,  # h11 quotes header lines
            offset=offset,
        )


@functools.lru_cache(maxsize=64)
def _mirror_request(method: str, headers: tuple[tuple[bytes, bytes], ...]) -> h11.Request:
    """The request a response head parser is told about (events are immutable: cached)."""
    return h11.Request(method=method, target="/", headers=list(headers))
