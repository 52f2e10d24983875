"""``--inject-request-id``: give every request an ``x-request-id`` (opt-in, alters traffic).

With taps on both sides of a proxy, requests are joined by ``x-request-id``; a client
that sends none leaves only fingerprints (method, target, body hash, order). This
sans-I/O rewriter adds ``x-request-id: tracer-<tap>-<conn>-<n>`` after the request line
of every request head that has none, and passes everything else through unchanged.
It holds a request head until it is complete (at most ``MAX_HEAD`` bytes) — which is
why it is opt-in and named as altering traffic — collecting it with the fault layer's
``protocol.head.HeadReader``, and follows request bodies with the same strict framing
decoder as the observer (``protocol.framing``), so it knows where the next head starts.

Injection happens only where every parser reads the head the same way
(``ambiguity``): CRLF line endings only (a bare LF is a line ending to a lenient
upstream and not to a strict one: adding a line there could move the body's start), no
obs-fold, header names that are tokens with the colon right after them, at most one
Content-Length made of digits, a Transfer-Encoding of exactly ``chunked`` and never both.
Anything else — or anything it cannot follow (not HTTP/1.x, a head too large, bad
framing) — switches it to pass-through for the rest of the connection, with the reason
in ``passed_through``: it never holds, blocks or re-frames traffic it cannot frame.
"""

from __future__ import annotations

import re

from ..protocol.framing import BodyDecoder, FramingError, request_framing
from ..protocol.head import HeadError, HeadReader, parse_request_head

_REQUEST_LINE = re.compile(rb"[A-Z]{1,16} [^ \r\n]+ HTTP/1\.[01]\r\n")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_DIGITS = re.compile(rb"[0-9]{1,18}\Z")


class RequestIdInjector:
    """Rewrites one connection's client bytes; ``feed`` returns the bytes to forward."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.injected = 0
        self.passed_through: str | None = None  # why it stopped rewriting, once it has
        self._n = 0
        self._head = HeadReader(request=True)
        self._body: BodyDecoder | None = None

    def feed(self, data: bytes) -> bytes:
        if self.passed_through is not None:
            return data
        out: list[bytes] = []
        while data:
            if self._body is not None:
                try:
                    _, _, used = self._body.feed(data)
                except FramingError as exc:
                    self.give_up(f"request body framing: {exc}")
                    out.append(data)
                    break
                if not self._body.done:
                    out.append(data)
                    break
                out.append(data[:used])
                data = data[used:]
                self._body = None
                continue
            reader = self._head
            held = reader.held
            why: str | None
            body: BodyDecoder | None = None
            try:
                end = reader.feed(data)
            except HeadError as exc:
                end, why = -1, str(exc)
            else:
                head = reader.raw if end >= 0 else reader.held
                why = _bare_line_end(head)
                if why is None and end >= 0:
                    why = ambiguity(reader.raw)
                    if why is None:
                        body = _request_body(reader.raw)
                        if body is None:
                            why = "request body framing it cannot follow"
            if why is not None:
                self.give_up(why)
                reader.clear()
                out.append(held + data)
                break
            if end < 0:
                break  # held until the head is complete
            out.append(self._rewrite(reader.raw))
            reader.clear()
            data = data[end:]
            self._body = None if body is None or body.done else body
        return b"".join(out)

    def give_up(self, why: str = "the rewriter failed") -> None:
        """Pass everything through unchanged from now on."""
        if self.passed_through is None:
            self.passed_through = why

    def flush(self) -> bytes:
        """At the client's EOF: whatever is still held goes out as it is."""
        held = self._head.held
        self._head.clear()
        return held

    def _rewrite(self, head: bytes) -> bytes:
        self._n += 1
        lines = head.split(b"\r\n")
        if any(line.lower().startswith(b"x-request-id:") for line in lines[1:]):
            return head
        self.injected += 1
        rid = f"x-request-id: {self.prefix}-{self._n}".encode()
        return b"\r\n".join([lines[0], rid, *lines[1:]])


def _bare_line_end(buf: bytes) -> str | None:
    """A bare LF or CR in (the start of) a head: parsers disagree on where lines end."""
    if buf.count(b"\n") != buf.count(b"\r\n"):
        return "a bare LF line ending in the request head"
    if buf.count(b"\r") != buf.count(b"\r\n") + buf.endswith(b"\r"):
        return "a bare CR in the request head"
    return None


def ambiguity(head: bytes) -> str | None:
    """Why parsers could read this complete request head differently (None: they cannot)."""
    if not _REQUEST_LINE.match(head):
        return "not an HTTP/1.x request line"
    if b"\x00" in head:
        return "a NUL byte in the request head"
    lengths: list[bytes] = []
    encodings: list[bytes] = []
    for line in head[:-4].split(b"\r\n")[1:]:
        if line[:1] in (b" ", b"\t"):
            return "an obs-fold continuation line"
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):
            return "a header line that is not NAME: VALUE"
        lower = name.lower()
        if lower == b"content-length":
            lengths.append(value.strip(b" \t"))
        elif lower == b"transfer-encoding":
            encodings.append(value.strip(b" \t"))
    if len(lengths) > 1:
        return "more than one Content-Length"
    if lengths and not _DIGITS.match(lengths[0]):
        return "a Content-Length that is not a number"
    if encodings and lengths:
        return "both Content-Length and Transfer-Encoding"
    if len(encodings) > 1 or (encodings and encodings[0].lower() != b"chunked"):
        return "a Transfer-Encoding other than chunked"
    return None


def _request_body(head: bytes) -> BodyDecoder | None:
    """How the request body after this unambiguous head is delimited (None: not known)."""
    try:
        framing, length = request_framing(parse_request_head(head).headers)
    except (HeadError, FramingError):
        return None
    return BodyDecoder(framing, length)
