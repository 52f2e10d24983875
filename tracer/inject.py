"""``--inject-request-id``: give every request an ``x-request-id`` (opt-in, alters traffic).

With taps on both sides of a proxy, requests are joined by ``x-request-id``; a client
that sends none leaves only fingerprints (method, target, body hash, order). This
sans-I/O rewriter adds ``x-request-id: tracer-<tap>-<conn>-<n>`` after the request line
of every request head that has none, and passes everything else through unchanged.
It holds a request head until it is complete (at most ``MAX_HEAD`` bytes) — which is
why it is opt-in and named as altering traffic — and follows request bodies with the
same strict framing decoder as the observer, so it knows where the next head starts.
Anything it cannot follow (not HTTP/1.x, a head too large, bad framing) switches it to
pass-through for the rest of the connection: it never blocks or breaks traffic.
"""

from __future__ import annotations

import re

from .framing import BodyDecoder, FramingError

MAX_HEAD = 64 * 1024
_REQUEST_LINE = re.compile(rb"[A-Z]{1,16} [^ \r\n]+ HTTP/1\.[01]\r\n")


class RequestIdInjector:
    """Rewrites one connection's client bytes; ``feed`` returns the bytes to forward."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.injected = 0
        self._n = 0
        self._head = b""
        self._body: BodyDecoder | None = None
        self._passthrough = False

    def feed(self, data: bytes) -> bytes:
        if self._passthrough:
            return data
        out: list[bytes] = []
        while data:
            if self._body is not None:
                try:
                    _, _, used = self._body.feed(data)
                except FramingError:
                    self._passthrough = True
                    out.append(data)
                    break
                if not self._body.done:
                    out.append(data)
                    break
                out.append(data[:used])
                data = data[used:]
                self._body = None
                continue
            buf = self._head + data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD or not _could_be_request(buf):
                    self._passthrough = True
                    self._head = b""
                    out.append(buf)
                    break
                self._head = buf  # hold until the head is complete
                break
            self._head = b""
            head, data = buf[: end + 4], buf[end + 4 :]
            if not _REQUEST_LINE.match(head):
                self._passthrough = True
                out.append(head + data)
                break
            out.append(self._rewrite(head))
            self._body = _request_body(head)
            if self._body is None:  # unknown framing: stop following
                self._passthrough = True
                out.append(data)
                break
            if self._body.done:
                self._body = None
        return b"".join(out)

    def give_up(self) -> None:
        """Pass everything through unchanged from now on."""
        self._passthrough = True

    def flush(self) -> bytes:
        """At the client's EOF: whatever is still held goes out as it is."""
        held, self._head = self._head, b""
        return held

    def _rewrite(self, head: bytes) -> bytes:
        self._n += 1
        lines = head.split(b"\r\n")
        if any(line.lower().startswith(b"x-request-id:") for line in lines[1:]):
            return head
        self.injected += 1
        rid = f"x-request-id: {self.prefix}-{self._n}".encode()
        return b"\r\n".join([lines[0], rid, *lines[1:]])


def _could_be_request(buf: bytes) -> bool:
    """An incomplete head that still starts like a request line."""
    first = buf[:18]
    return bool(re.match(rb"[A-Z]{0,16}( |$)", first)) and not first.startswith(b"PRI ")


def _request_body(head: bytes) -> BodyDecoder | None:
    """How the request body after this head is delimited (None: cannot tell)."""
    length: int | None = None
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            try:
                length = int(value.strip())
            except ValueError:
                return None
        elif name == b"transfer-encoding":
            if value.strip().lower().split(b",")[-1].strip() != b"chunked":
                return None
            chunked = True
    if chunked:
        return BodyDecoder("chunked")
    if length:
        return BodyDecoder("length", length)
    return BodyDecoder("none")
