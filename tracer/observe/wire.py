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
from typing import Any

import h11

from .. import events as ev
from ..capture.bodies import BodyBudget, RequestBody
from ..protocol.framing import BodyDecoder, FramingError, body_framing
from ..protocol.sse import SseEvent, SseSplitter
from ..redact import redact_headers, redact_target, scrub_text
from .exchange import (
    MAX_BODY_KEEP,
    Bodies,
    Close,
    Emit,
    ExchangeTracker,
    ResponseState,
    request_head_facts,
    response_head_facts,
)

__all__ = ["Bodies", "ConnectionObserver", "Emit", "not_http"]

MAX_HEADER_BYTES = 64 * 1024
MAX_HEADER_LINES = 1024  # a head with more lines is not parsed (observation cost bounded)
MAX_HELD_BYTES = 1024 * 1024  # client bytes held while a protocol switch is undecided


def not_http(data: bytes) -> str | None:
    """What a client's bytes are when they are not HTTP/1.x but something known: a TLS
    handshake (an ``https://`` URL to a plain port: a record of type 22, version 3.x; its
    first byte alone already is no HTTP) or the HTTP/2 preface."""
    if data and b"\x16\x03".startswith(data[:2]):
        return "TLS handshake"
    if data.startswith(b"PRI * HTTP/2.0"):
        return "HTTP/2 preface"
    return None


class _Request(ResponseState[SseSplitter]):
    """Mutable per-request state while it is in flight."""

    __slots__ = ("body", "may_switch", "method", "mirror")

    def __init__(
        self, head_m: float, method: str, json_body: bool, body: RequestBody, *, keep: bool
    ) -> None:
        super().__init__(head_m, json_body)
        self.method = method
        self.mirror: list[tuple[bytes, bytes]] = [(b"host", b"t")]  # for the head parser
        self.may_switch = False  # Upgrade or CONNECT: a tunnel may follow the response
        self.body = body
        if keep:  # --bodies all: the response's bytes go into its body records
            self.kept = []


class ConnectionObserver(ExchangeTracker[_Request]):
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
        self._receiving: _Request | None = None  # request whose body is arriving
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
            req = self.begin(_Request(m, "", False, body, keep=False))
        self.tracer_answer(req, m, status, reason, detail or reason)
        self.blind = True

    # ---- requests ---------------------------------------------------------------------

    def _feed_requests(self, data: bytes, m: float) -> None:
        """Parse client bytes: each request on a fresh parser, the rest goes to the next.

        A head is parsed whole by h11, each header checked: a head of more than
        ``MAX_HEADER_LINES`` lines is not parsed at all (a header flood would hold the
        loop for every other connection): the connection goes on unobserved, with an
        anomaly. Its lines are counted as they arrive, a C-level count per read."""
        try:
            while data:
                if self._req is None:
                    self._req = h11.Connection(
                        h11.SERVER, max_incomplete_event_size=self._max_header
                    )
                    self._head_lines, self._head_tail = 0, b""
                    self.head_started_m = m
                if self._head_lines >= 0:  # the head's lines only, not the body's after it
                    self._count_head_lines(data)
                    if self._head_lines > MAX_HEADER_LINES:
                        raise h11.RemoteProtocolError(
                            f"a request head of over {MAX_HEADER_LINES} lines: not parsed"
                        )
                self._req.receive_data(data)
                data = self._pump_request(m)
        except h11.ProtocolError as exc:
            if self.pending and self._receiving is None:
                # Bad bytes behind requests still being answered: let their responses be
                # seen first; the anomaly is recorded when the last of them ends.
                self._deferred = (exc, m, self._client_offset())
            else:
                unparsed = self._req.trailing_data[0] if self._req is not None else data
                what = not_http(unparsed)
                if what is not None:  # h11's words say less: "illegal request line"
                    exc = h11.RemoteProtocolError(f"{what} on a plain HTTP/1.1 listener ({exc})")
                self._go_blind("client", exc, m)

    def _count_head_lines(self, data: bytes) -> None:
        """Add the newlines of ``data`` that come before the head's end (CRLFCRLF, which
        may span the previous read), without copying ``data``."""
        tail = self._head_tail
        end = data.find(b"\r\n\r\n")
        if tail and (tail + data[:3]).find(b"\r\n\r\n") >= 0:
            end = 0  # the head ended across the two reads: none of these lines are its
        self._head_lines += data.count(b"\n", 0, len(data) if end < 0 else end + 1)
        self._head_tail = (tail + data)[-3:] if len(data) < 3 else data[-3:]

    def _pump_request(self, m: float) -> bytes:
        """Events of the current request; returns the bytes after its end (if it ended)."""
        parser = self._req
        assert parser is not None
        while True:
            event = parser.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return b""
            if isinstance(event, h11.Request):
                self._on_request(event, m)
            elif isinstance(event, h11.Data):
                self._on_request_body(event.data)
            elif isinstance(event, h11.EndOfMessage):
                req = self._receiving
                if req is not None:
                    self._end_request(req, m, complete=True)
                rest = parser.trailing_data[0]
                self._req_base = self.client_bytes - len(rest)
                self._req = None
                if req is not None and req.may_switch and not req.ended:
                    self._held = rest  # parsed once the response says whether it switched
                    return b""
                return rest
            else:  # ConnectionClosed
                return b""

    def _release_held(self, m: float) -> None:
        """The response did not switch protocols: parse what the client sent meanwhile."""
        held, self._held = self._held, None
        if held:
            self._feed_requests(held, m)

    def _on_request(self, event: h11.Request, m: float) -> None:
        self._head_lines = -1  # the head is parsed: its body's newlines are not counted
        self.head_started_m = None
        size = len(event.method) + len(event.target) + 14  # "M T HTTP/1.1\r\n" + "\r\n"
        size += sum(len(name) + len(value) + 4 for name, value in event.headers.raw_items())
        if size > self._max_header:
            raise h11.RemoteProtocolError(
                f"request head of {size} bytes is over max_header_bytes ({self._max_header})"
            )
        facts = request_head_facts(event.headers)
        method = event.method.decode("latin-1")
        keep = facts.json_body or self.bodies != "none"  # for the record, or for its fields
        body = RequestBody(self._max_body_keep, keep=keep, budget=self._budget)
        req = _Request(m, method, facts.json_body, body, keep=self.keep_data)
        req.mirror += facts.hop  # so that the head parser accepts a 101 to an Upgrade
        req.may_switch = method == "CONNECT" or any(n == b"upgrade" for n, _ in facts.hop)
        self._receiving = req
        self.request_head(
            req,
            method=method,
            target=redact_target(event.target.decode("latin-1")),
            version=event.http_version.decode("latin-1"),
            headers=redact_headers(event.headers.raw_items()),
            facts=facts,
        )
        if self.upstream_closed_m is not None:  # nothing can answer it any more
            gone = m - self.upstream_closed_m  # how long the client could have known
            self.end_response(
                req,
                m,
                "truncated",
                close=self.upstream_close,
                detail=f"upstream already closed {gone:.6f} s before",
            )

    def _on_request_body(self, data: bytes) -> None:
        req = self._receiving
        if req is None:
            return
        req.body.add(data)

    def _end_request(self, req: _Request, m: float, *, complete: bool) -> None:
        self._receiving = None
        self.request_end(req, m, req.body, complete=complete)

    # ---- responses --------------------------------------------------------------------

    def _pump_responses(self, data: bytes, m: float) -> None:
        """Heads through h11, bodies through the decoder, body bytes batched per read."""
        body_req: _Request | None = None
        size = chunks = 0
        sse_events: list[SseEvent] | None = None
        raw: list[bytes] | None = [] if self.keep_data else None
        try:
            while data and not (self.blind or self.tunnel):
                body = self._body
                if body is not None:
                    req = self.pending[0]
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
                    raise h11.RemoteProtocolError("response without a request")
                data = self._parse_head(data, m)
        finally:  # bytes parsed before a failure are still reported
            if body_req is not None:
                self.add_read(body_req, m, size, chunks, sse_events, raw)

    def _parse_head(self, data: bytes, m: float) -> bytes:
        """Feed the head parser; returns the bytes after a complete head (the body's)."""
        req = self.pending[0]
        head = self._head
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
                self._on_response(event, req, m)
                if self.tunnel:
                    return b""
                framing, length = body_framing(req.method, event.status_code, event.headers)
                self._body = BodyDecoder(framing, length)
                if self._body.done:
                    self._body_ended(req, m)
                return rest
            return b""  # ConnectionClosed: nothing more to parse

    def _body_ended(self, req: _Request, m: float) -> None:
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

    def _on_informational(self, event: h11.InformationalResponse, req: _Request, m: float) -> None:
        self.record(ev.Informational, m, seq=req.seq, status=event.status_code)
        if event.status_code == 101:
            self.tunnel = True
            req.status, req.resp_head_m = 101, m
            self.end_response(req, m, "complete", detail="switched protocols")

    def _on_response(self, event: h11.Response, req: _Request, m: float) -> None:
        size = len(event.reason) + 15 + 2  # "HTTP/1.1 200 reason\r\n" + "\r\n"
        size += sum(len(name) + len(value) + 4 for name, value in event.headers.raw_items())
        if size > self._max_header:
            raise h11.RemoteProtocolError(
                f"response head of {size} bytes is over max_header_bytes ({self._max_header})"
            )
        content_length, chunked, sse, keep_alive = response_head_facts(
            event.headers, keep_alive=event.http_version == b"1.1"
        )
        if sse:
            req.sse = SseSplitter()
        self.response_head(
            req,
            m,
            status=event.status_code,
            reason=event.reason.decode("latin-1"),
            version=event.http_version.decode("latin-1"),
            headers=redact_headers(event.headers.raw_items()),
            sse=sse,
            content_length=content_length,
            chunked=chunked,
            keep_alive=keep_alive,
        )
        if req.method == "CONNECT" and 200 <= event.status_code < 300:
            self.tunnel = True
            self.end_response(req, m, "complete", detail="tunnel")
        elif self._held is not None and req.may_switch:
            self._release_held(m)

    def ended(self, st: _Request, m: float, *, oldest: bool) -> None:
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

    def _client_offset(self) -> int:
        unparsed = len(self._req.trailing_data[0]) if self._req is not None else 0
        return max(self._req_base, self.client_bytes - unparsed)

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
