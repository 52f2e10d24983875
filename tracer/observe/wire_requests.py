"""The client's side of ``wire.ConnectionObserver``: request heads and bodies.

``RequestReader`` reads what the client sends, one request after the other (see the
theory of operation in ``wire``): a plain head that is all in one read takes the quick
path (``protocol.head.quick_request``, with its body followed by ``framing.BodyDecoder``),
anything else a fresh server-role ``h11.Connection`` per request. Both give the same
records (``tests/unit/test_quick_heads.py`` holds the quick path to h11's reading);
``ConnectionObserver`` extends this class with the upstream's side.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final, cast

import h11

from .. import events as ev
from ..capture.bodies import BodyBudget, RequestBody
from ..protocol.framing import BodyDecoder, FramingError, request_framing
from ..protocol.head import QuickHead, quick_request
from ..protocol.sse import SseSplitter
from ..redact import redact_headers, redact_target
from .exchange import Close, ExchangeTracker
from .exchange_state import ResponseState, request_head_facts

MAX_HEADER_LINES: Final = 1024  # a head with more lines is not parsed (observation cost bounded)
MAX_HELD_BYTES: Final = 1024 * 1024  # client bytes held while a protocol switch is undecided


def not_http(data: bytes) -> str | None:
    """What a client's bytes are when they are not HTTP/1.x but something known: a TLS
    handshake (an ``https://`` URL to a plain port: a record of type 22, version 3.x; its
    first byte alone already is no HTTP) or the HTTP/2 preface."""
    if data and b"\x16\x03".startswith(data[:2]):
        return "TLS handshake"
    if data.startswith(b"PRI * HTTP/2.0"):
        return "HTTP/2 preface"
    return None


class WireRequest(ResponseState[SseSplitter]):
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


class RequestReader(ExchangeTracker[WireRequest]):
    """The request side of a connection's observer (its state is set by
    ``ConnectionObserver.__init__``)."""

    _budget: BodyBudget | None
    _max_body_keep: int
    _max_header: int
    _req: h11.Connection | None
    _req_body: BodyDecoder | None
    _req_base: int
    _held: bytes | None
    _head_lines: int
    _head_tail: bytes
    head_started_m: float | None
    _deferred: tuple[Exception, float, int] | None
    _receiving: WireRequest | None
    client_bytes: int
    upstream_closed_m: float | None
    upstream_close: Close | None

    def _go_blind(
        self, direction: ev.Direction, exc: Exception, m: float, offset: int | None = None
    ) -> None:
        raise NotImplementedError  # (the observer's: it stops reading both sides)

    # ---- requests ---------------------------------------------------------------------

    def _feed_requests(self, data: bytes, m: float) -> None:
        """Parse client bytes: each request on a fresh parser, the rest goes to the next.

        A head is parsed whole by h11, each header checked: a head of more than
        ``MAX_HEADER_LINES`` lines is not parsed at all (a header flood would hold the
        loop for every other connection): the connection goes on unobserved, with an
        anomaly. Its lines are counted as they arrive, a C-level count per read."""
        try:
            while data:
                if self._req_body is not None:
                    data = self._quick_body(data, m)
                    continue
                if self._req is None:
                    rest = self._quick_request(data, m)
                    if rest is not None:
                        data = rest
                        continue
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

    def _quick_request(self, data: bytes, m: float) -> bytes | None:
        """A plain request head that is all in ``data``, read without h11 (it is most of
        a small request's observation; ``protocol.head.quick_request`` takes only what h11
        takes, read the same way); returns the bytes after what it read, None: h11 reads
        it."""
        quick = quick_request(data, self._max_header)
        if quick is None:
            return None
        size = head_size(len(quick.method) + len(quick.target) + 14, quick)
        lines = data.count(b"\n", 0, quick.end)
        if lines > MAX_HEADER_LINES or size > self._max_header:
            return None  # h11's verdict, in its words
        self._start_request(quick.method, quick.target, quick.version, quick, size, m)
        framing, length = request_framing(quick.lower)
        self._req_body = BodyDecoder(framing, length)
        return self._quick_body(data[quick.end :], m)

    def _quick_body(self, data: bytes, m: float) -> bytes:
        """The body of a request whose head the quick path read; returns the bytes after
        its end. Bad framing is h11's error (the connection goes blind), as it would be."""
        decoder = self._req_body
        assert decoder is not None
        rest = data
        if not decoder.done:
            try:
                pieces, _, used = decoder.feed(data)
            except FramingError as exc:
                self._req_body = None
                raise h11.RemoteProtocolError(f"request body: {exc}") from exc
            for piece in pieces:
                self._on_request_body(piece)
            if not decoder.done:
                return b""
            rest = data[used:]
        self._req_body = None
        if self._receiving is not None:
            self._end_request(self._receiving, m, complete=True)
        self._req_base = self.client_bytes - len(rest)
        return rest

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
                method, target, headers = event.method, event.target, event.headers
                size = head_size(len(method) + len(target) + 14, headers)  # "M T HTTP/1.1\r\n"
                self._start_request(method, target, event.http_version, headers, size, m)
            elif isinstance(event, h11.Data):
                # a bytearray, though h11 says bytes (compiled code checks: a copy)
                self._on_request_body(bytes(cast(Any, event).data))
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

    def _start_request(
        self,
        method_b: bytes,
        target: bytes,
        version: bytes,
        headers: Head,
        size: int,
        m: float,
    ) -> None:
        """A request head, read by h11 or the quick path (``headers``: either's; ``size``:
        its ``head_size``)."""
        self._head_lines = -1  # the head is parsed: its body's newlines are not counted
        self.head_started_m = None
        if size > self._max_header:
            raise h11.RemoteProtocolError(
                f"request head of {size} bytes is over max_header_bytes ({self._max_header})"
            )
        facts = request_head_facts(lower_items(headers))
        method = method_b.decode("latin-1")
        keep = facts.json_body or self.bodies != "none"  # for the record, or for its fields
        body = RequestBody(self._max_body_keep, keep=keep, budget=self._budget)
        req = WireRequest(m, method, facts.json_body, body, keep=self.keep_data)
        req.mirror += facts.hop  # so that the head parser accepts a 101 to an Upgrade
        req.may_switch = method == "CONNECT"
        for name, _ in facts.hop:
            if name == b"upgrade":
                req.may_switch = True
                break
        self._receiving = req
        self.request_head(
            req,
            method=method,
            target=redact_target(target.decode("latin-1")),
            version=version.decode("latin-1"),
            headers=redact_headers(raw_items(headers)),
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

    def _end_request(self, req: WireRequest, m: float, *, complete: bool) -> None:
        self._receiving = None
        self.request_end(req, m, req.body, complete=complete)

    def _client_offset(self) -> int:
        unparsed = len(self._req.trailing_data[0]) if self._req is not None else 0
        return max(self._req_base, self.client_bytes - unparsed)


Head = h11._headers.Headers | QuickHead  # a head's headers as h11 or the quick path has them


def raw_items(headers: Head) -> list[tuple[bytes, bytes]]:
    """The header items as sent (names in their case)."""
    return headers.raw if isinstance(headers, QuickHead) else list(headers.raw_items())


def lower_items(headers: Head) -> Iterable[tuple[bytes, bytes]]:
    """The header items, names in lower case."""
    return headers.lower if isinstance(headers, QuickHead) else headers


def head_size(start_line: int, headers: Head) -> int:
    """A head's size as h11 would have written it: the start line, then ``NAME: VALUE``."""
    return start_line + sum(len(name) + len(value) + 4 for name, value in raw_items(headers))
