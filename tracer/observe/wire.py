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
   response body's reads are listed in ``BodyData`` records (batched: one record per
   ``BODY_BATCH_SECONDS`` of reads; every read and SSE event keeps its arrival time) (and, on malformed bytes, the wording
   and offset of h11's error, which may differ by a byte or two).
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import h11

from .. import events as ev
from ..capture.bodies import BodyBudget, RequestBody, encode_body
from ..protocol.framing import BodyDecoder, FramingError, body_framing
from ..protocol.sse import SseEvent, SseSplitter
from ..redact import redact_headers, redact_target, scrub_text
from .exchange import (
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

Emit = Callable[[ev.Event], None]
Bodies = Literal["none", "requests", "all"]

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

    __slots__ = (
        "batch_chunks",
        "batch_m",
        "batch_raw",
        "batch_reads",
        "batch_size",
        "batch_sse",
        "body",
        "content_type_json",
        "may_switch",
        "method",
        "mirror",
    )

    def __init__(
        self, seq: int, head_m: float, method: str, json_body: bool, body: RequestBody
    ) -> None:
        super().__init__(seq, head_m)
        self.method = method
        self.content_type_json = json_body
        self.mirror: list[tuple[bytes, bytes]] = [(b"host", b"t")]  # for the head parser
        self.may_switch = False  # Upgrade or CONNECT: a tunnel may follow the response
        self.body = body
        # response body reads not yet written as a record (see _add_read)
        self.batch_m: float | None = None
        self.batch_reads: list[list[Any]] = []
        self.batch_sse: list[list[Any]] = []
        self.batch_size = 0
        self.batch_chunks = 0
        self.batch_raw: list[bytes] = []


class ConnectionObserver:
    """Watches one downstream connection (and its pinned upstream one)."""

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
        self.tap = tap
        self._budget = budget  # the tap's: all the request bodies it holds
        self._redact_fields = redact_fields  # --redact-json-field, in kept JSON bodies
        self.conn = conn
        self._emit = emit
        self._wall = wall_offset
        self._bodies = bodies
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
        self.seq = 0
        self._pending: deque[_Request] = deque()  # requests whose response has not ended
        self._receiving: _Request | None = None  # request whose body is arriving
        self._last_end_m = opened_m
        self.client_bytes = 0
        self.upstream_bytes = 0
        self.last_activity_m = opened_m
        self.client_closed_m: float | None = None
        self.client_close: Literal["fin", "reset"] | None = None
        self.upstream_closed_m: float | None = None
        self.upstream_close: Literal["fin", "reset"] | None = None

    # ---- queries used by the relay and the admin endpoint -------------------------

    @property
    def in_flight(self) -> bool:
        return bool(self._pending)

    def in_flight_requests(self) -> list[dict[str, Any]]:
        return [
            {
                "seq": r.seq,
                "method": r.method,
                "started_m": r.head_m,
                "status": r.status,
                "events": r.events,
                "response_bytes": r.resp_bytes,
                "stalled": r.stall_direction,
            }
            for r in self._pending
        ]

    # ---- input --------------------------------------------------------------------

    def client_data(self, data: bytes, m: float) -> None:
        self.client_bytes += len(data)
        self._activity(m)
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
        self._activity(m)
        if not data or self.blind or self.tunnel or self.upstream_closed_m is not None:
            return  # (h11 would take b"" for EOF)
        if self.client_close == "reset" and not self._pending:  # torn down: nobody to answer
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
        close: Literal["fin", "reset"] = "reset" if reset else "fin"
        if not (self.blind or self.tunnel):
            try:
                if reset:
                    raise FramingError("connection reset by upstream")
                self._upstream_ended(m)
            except (h11.ProtocolError, FramingError) as exc:
                if self._pending:
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

    def tick(
        self, m: float, *, stall_after: float, client_blocked: bool, unsent: int | None
    ) -> None:
        """Called periodically by the relay: start stalls for requests gone silent."""
        if not self._pending:
            return
        req = self._pending[0]
        silent = m - self.last_activity_m
        if req.stall_start_m is not None or silent < stall_after:
            return
        direction = stall_direction(req, client_blocked=client_blocked, unsent=unsent)
        self._flush_body(req)  # the last bytes before the stall go on record first
        self._emit(
            start_stall(
                req,
                m,
                self.last_activity_m,
                direction,
                unsent=unsent,
                tap=self.tap,
                conn=self.conn,
                wall=self._wall,
            )
        )

    def tracer_response(
        self, m: float, status: int, reason: str, detail: str | None = None
    ) -> None:
        """Record a response the tap wrote itself (upstream unreachable, bad request);
        ``detail`` says why (the connect error), else the reason phrase does."""
        req = self._pending[0] if self._pending else None
        if req is None:
            self.seq += 1
            req = _Request(self.seq, m, "", False, RequestBody(self._max_body_keep))
            self._pending.append(req)
        req.status = status
        self._emit(
            ev.ResponseHead(
                t=m + self._wall,
                m=m,
                tap=self.tap,
                conn=self.conn,
                seq=req.seq,
                status=status,
                reason=reason,
                version="1.1",
                headers=[],
                ttfb=round(m - req.head_m, 6),
                keep_alive=False,
                by_tracer=True,
            )
        )
        self._end_response(req, m, "tracer_response", detail=detail or reason)
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
            if self._pending and self._receiving is None:
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
        start_m = m
        pipelined = bool(self._pending)  # sent before the previous response ended
        self.seq += 1
        headers = event.headers
        content_length: int | None = None
        chunked = expect = json_body = False
        request_id: str | None = None
        upgrade: list[tuple[bytes, bytes]] = []
        for name, value in headers:
            if name == b"content-length":
                content_length = int(value)
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"expect":
                expect = value.lower() == b"100-continue"
            elif name == b"x-request-id":
                request_id = value.decode("latin-1")
            elif name == b"content-type":
                json_body = b"json" in value.lower()
            elif name in (b"connection", b"upgrade"):
                upgrade.append((name, value))
        method = event.method.decode("latin-1")
        keep = json_body or self._bodies != "none"  # for the record, or for its fields
        body = RequestBody(self._max_body_keep, keep=keep, budget=self._budget)
        req = _Request(self.seq, start_m, method, json_body, body)
        req.mirror += upgrade  # so that the head parser accepts a 101 to an Upgrade
        req.may_switch = method == "CONNECT" or any(n == b"upgrade" for n, _ in upgrade)
        self._pending.append(req)
        self._receiving = req
        idle = max(0.0, start_m - self._last_end_m) if len(self._pending) == 1 else 0.0
        self._emit(
            ev.RequestHead(
                t=start_m + self._wall,
                m=start_m,
                tap=self.tap,
                conn=self.conn,
                seq=self.seq,
                idle_before=round(idle, 6),
                method=method,
                target=redact_target(event.target.decode("latin-1")),
                version=event.http_version.decode("latin-1"),
                headers=redact_headers(headers.raw_items()),
                request_id=request_id,
                content_length=content_length,
                chunked=chunked,
                expect_continue=expect,
                pipelined=pipelined,
            )
        )
        if self.upstream_closed_m is not None:  # nothing can answer it any more
            gone = m - self.upstream_closed_m  # how long the client could have known
            self._end_response(
                req,
                m,
                "truncated",
                close=self.upstream_close,
                detail=f"upstream already closed {gone:.6f} s before",
            )
            return

    def _on_request_body(self, data: bytes) -> None:
        req = self._receiving
        if req is None:
            return
        req.body.add(data)

    def _end_request(self, req: _Request, m: float, *, complete: bool) -> None:
        req.request_done = True
        self._receiving = None
        body = req.body.record(
            keep=self._bodies != "none",
            json_body=req.content_type_json,
            redact=self._redact_fields,
        )
        self._emit(
            ev.RequestEnd(
                t=m + self._wall,
                m=m,
                tap=self.tap,
                conn=self.conn,
                seq=req.seq,
                complete=complete,
                body_bytes=req.body.size,
                **body,
            )
        )

    # ---- responses --------------------------------------------------------------------

    def _pump_responses(self, data: bytes, m: float) -> None:
        """Heads through h11, bodies through the decoder, body bytes batched per read."""
        body_req: _Request | None = None
        size = chunks = 0
        sse_events: list[list[Any]] | None = None
        raw: list[bytes] | None = [] if self._bodies == "all" else None
        try:
            while data and not (self.blind or self.tunnel):
                body = self._body
                if body is not None:
                    req = self._pending[0]
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
                            for sse in splitter.feed(piece):
                                if sse_events is None:
                                    sse_events = []
                                sse_events.append(sse.as_record())
                                self._on_sse(req, sse, m)
                    if failure is not None:
                        raise failure
                    if not body.done:
                        return
                    data = data[used:]
                    if body_req is not None:
                        self._add_read(req, m, size, chunks, sse_events, raw)
                    body_req, size, chunks, sse_events = None, 0, 0, None
                    raw = [] if raw is not None else None
                    self._body_ended(req, m)
                    continue
                if not self._pending:
                    raise h11.RemoteProtocolError("response without a request")
                data = self._parse_head(data, m)
        finally:  # bytes parsed before a failure are still reported
            if body_req is not None:
                self._add_read(body_req, m, size, chunks, sse_events, raw)

    def _parse_head(self, data: bytes, m: float) -> bytes:
        """Feed the head parser; returns the bytes after a complete head (the body's)."""
        req = self._pending[0]
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
        self._note_gap(req, m)
        self._end_response(req, m, "complete")

    def _upstream_ended(self, m: float) -> None:
        """Upstream EOF: ends a close-delimited body; any other open body or head is cut."""
        body = self._body
        if body is not None:
            body.eof()  # raises FramingError unless the body is close-delimited
            self._body_ended(self._pending[0], m)
        elif self._head is not None and self._head.trailing_data[0]:
            raise FramingError("peer closed inside a response head")

    def _on_informational(self, event: h11.InformationalResponse, req: _Request, m: float) -> None:
        self._emit(
            ev.Informational(
                t=m + self._wall,
                m=m,
                tap=self.tap,
                conn=self.conn,
                seq=req.seq,
                status=event.status_code,
            )
        )
        if event.status_code == 101:
            self.tunnel = True
            req.status, req.resp_head_m = 101, m
            self._end_response(req, m, "complete", detail="switched protocols")

    def _on_response(self, event: h11.Response, req: _Request, m: float) -> None:
        size = len(event.reason) + 15 + 2  # "HTTP/1.1 200 reason\r\n" + "\r\n"
        size += sum(len(name) + len(value) + 4 for name, value in event.headers.raw_items())
        if size > self._max_header:
            raise h11.RemoteProtocolError(
                f"response head of {size} bytes is over max_header_bytes ({self._max_header})"
            )
        req.status = event.status_code
        req.resp_head_m = m
        req.last_data_m = m
        content_length, chunked, sse, keep_alive = response_head_facts(
            event.headers, keep_alive=event.http_version == b"1.1"
        )
        if sse:
            req.sse = SseSplitter()
        self._emit(
            ev.ResponseHead(
                t=m + self._wall,
                m=m,
                tap=self.tap,
                conn=self.conn,
                seq=req.seq,
                status=event.status_code,
                reason=event.reason.decode("latin-1"),
                version=event.http_version.decode("latin-1"),
                headers=redact_headers(event.headers.raw_items()),
                ttfb=round(m - req.head_m, 6),
                sse=sse,
                content_length=content_length,
                chunked=chunked,
                keep_alive=keep_alive,
            )
        )
        if req.method == "CONNECT" and 200 <= event.status_code < 300:
            self.tunnel = True
            self._end_response(req, m, "complete", detail="tunnel")
        elif self._held is not None and req.may_switch:
            self._release_held(m)

    def _on_sse(self, req: _Request, sse: SseEvent, m: float) -> None:
        count_sse(req, sse, m)

    def _add_read(
        self,
        req: _Request,
        m: float,
        size: int,
        chunks: int,
        sse: list[list[Any]] | None,
        raw: list[bytes] | None,
    ) -> None:
        """Account one read of body bytes; records are written per batch of reads.

        A paced stream is one read per token: one record per read would cost more than
        the read itself. Each read and each SSE event keeps its own arrival time (an
        offset from the record's ``m``), so nothing of the timing is lost.
        """
        req.resp_bytes += size
        self._note_gap(req, m)
        first = req.batch_m
        if first is not None and (
            m - first >= BODY_BATCH_SECONDS or len(req.batch_reads) >= BODY_BATCH_READS
        ):
            self._flush_body(req)
            first = None
        if first is None:
            req.batch_m = first = m
        dt = round(m - first, 6)
        req.batch_reads.append([dt, size, chunks])
        if sse:
            batch_sse = req.batch_sse
            for record in sse:
                batch_sse.append([dt, *record])
        req.batch_size += size
        req.batch_chunks += chunks
        if raw:
            req.batch_raw.extend(raw)

    def _flush_body(self, req: _Request) -> None:
        first = req.batch_m
        if first is None:
            return
        data = encoding = None
        if req.batch_raw:
            data, encoding = encode_body(b"".join(req.batch_raw))
        self._emit(
            ev.BodyData(
                t=first + self._wall,
                m=first,
                tap=self.tap,
                conn=self.conn,
                seq=req.seq,
                size=req.batch_size,
                chunks=req.batch_chunks,
                reads=req.batch_reads,
                sse=req.batch_sse or None,
                data=data,
                data_encoding=encoding,
            )
        )
        req.batch_m = None
        req.batch_reads, req.batch_sse, req.batch_raw = [], [], []
        req.batch_size = req.batch_chunks = 0

    def flush(self, m: float) -> None:
        """Write body records whose batch is old enough (the relay calls this periodically)."""
        for req in self._pending:
            if req.batch_m is not None and m - req.batch_m >= BODY_BATCH_SECONDS:
                self._flush_body(req)

    def _note_gap(self, req: _Request, m: float) -> None:
        if req.last_data_m is not None and m - req.last_data_m > req.max_gap:
            req.max_gap = m - req.last_data_m
        req.last_data_m = m

    def _end_response(
        self,
        req: _Request,
        m: float,
        termination: ev.Termination,
        *,
        close: Literal["fin", "reset"] | None = None,
        detail: str | None = None,
    ) -> None:
        if req.ended:
            return
        req.ended = True
        self._flush_body(req)
        if self._pending and self._pending[0] is req:
            self._pending.popleft()
            self._head = self._body = None  # whatever was parsing its response is done
        else:
            with contextlib.suppress(ValueError):
                self._pending.remove(req)
        self._end_stall(req, m)
        self._last_end_m = m
        self._emit(
            response_end(
                req,
                m,
                termination,
                tap=self.tap,
                conn=self.conn,
                wall=self._wall,
                close=close,
                detail=detail,
            )
        )
        if self._deferred is not None and not self._pending:
            exc, failed_m, offset = self._deferred
            self._deferred = None
            self._go_blind("client", exc, failed_m, offset)

    # ---- shared -----------------------------------------------------------------------

    def _activity(self, m: float) -> None:
        self.last_activity_m = m
        if self._pending:
            req = self._pending[0]
            if req.stall_start_m is not None:
                self._end_stall(req, m)

    def _end_stall(self, req: _Request, m: float) -> None:
        event = end_stall(req, m, tap=self.tap, conn=self.conn, wall=self._wall)
        if event is not None:
            self._emit(event)

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
        close: Literal["fin", "reset"] | None,
        detail: str | None = None,
    ) -> None:
        if self.blind and termination != "in_flight":
            termination = "unparsed"
        for req in list(self._pending):
            self._end_response(req, m, termination, close=close, detail=detail)

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
            seq = self._pending[0].seq if self._pending else None
            offset = self._up_offset
        self._emit(
            ev.Anomaly(
                t=m + self._wall,
                m=m,
                tap=self.tap,
                conn=self.conn,
                seq=seq,
                direction=direction,
                error=scrub_text(str(exc)) or type(exc).__name__,  # h11 quotes header lines
                offset=offset,
            )
        )


@functools.lru_cache(maxsize=64)
def _mirror_request(method: str, headers: tuple[tuple[bytes, bytes], ...]) -> h11.Request:
    """The request a response head parser is told about (events are immutable: cached)."""
    return h11.Request(method=method, target="/", headers=list(headers))
