"""HTTP/1.x message heads, sans-I/O: where one ends in a stream of reads, and what it says.

The one head parser of the code that passes a connection's bytes on itself (the fault
layer; the observer reads heads through h11, ``observe/wire.py``):

* ``HeadReader`` collects one head from reads, at most ``MAX_HEAD`` bytes, and says where
  in a read it ends. A request head may follow empty lines (RFC 9112 §2.2), which are
  kept with it; what cannot start a request line (a token, then a space) is refused at
  once, before the head is complete.
* ``parse_request_head`` and ``parse_response_head`` read a complete head: a start line
  of HTTP/1.0 or HTTP/1.1, then ``NAME: VALUE`` lines, ending in LF or CRLF. Header
  names come back in lower case, values without the spaces around them. Anything else
  is a ``HeadError``.

Bodies are ``framing``'s (``request_framing``, ``body_framing``, ``BodyDecoder``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_HEAD = 64 * 1024

Headers = list[tuple[bytes, bytes]]

_HEAD_END = re.compile(rb"\n\r?\n")
# empty lines, then the method: a token (RFC 9110), which a space must follow
_REQUEST_START = re.compile(rb"(?:\r?\n)*([!#$%&'*+.^_`|~0-9A-Za-z-]*)")


class HeadError(Exception):
    """Bytes that are not an HTTP/1.x head, or a head over ``MAX_HEAD`` bytes."""


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str
    target: str
    headers: Headers  # names in lower case, values stripped


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    reason: bytes
    headers: Headers  # names in lower case, values stripped


class HeadReader:
    """Collects one head (a request's or a response's) from the reads of a connection.

    ``feed(data, pos)`` takes ``data[pos:]``: when the head ends there, it returns where
    it ends in ``data`` and ``head`` is the head (without the empty lines before a request
    line; ``raw`` with them); otherwise it returns -1 and holds the bytes (``held``).
    Between two heads, ``clear`` forgets the one read."""

    __slots__ = ("head", "held", "raw", "request")

    def __init__(self, *, request: bool) -> None:
        self.request = request
        self.held = b""  # the head so far, from earlier reads
        self.head = b""  # the head completed by the last feed
        self.raw = b""  # ... with the empty lines before it

    def feed(self, data: bytes, pos: int = 0) -> int:
        """Where the head ends in ``data`` (-1: not in it); raises ``HeadError``. ``held``
        stays as it was until ``clear``."""
        old = len(self.held)
        buf = self.held + data[pos:] if old else data[pos:]
        start = 0
        if self.request:
            method = _REQUEST_START.match(buf)
            assert method is not None  # (the pattern matches the empty string)
            after = method.end()
            if after < len(buf) and (buf[after : after + 1] != b" " or not method.group(1)):
                raise HeadError("not an HTTP/1.x request")
            start = method.start(1)
        hit = _HEAD_END.search(buf, max(start, old - 3))
        if hit is None:
            if len(buf) > MAX_HEAD:
                raise HeadError(f"{'request' if self.request else 'response'} head too long")
            self.held = buf
            return -1
        self.raw = buf[: hit.end()]
        self.head = buf[start : hit.end()]
        return pos + hit.end() - old

    def clear(self) -> None:
        self.held = self.head = self.raw = b""


def parse_request_head(head: bytes) -> RequestHead:
    method, target, headers = _parse(head, request=True)
    return RequestHead(method.decode("latin-1"), target.decode("latin-1"), headers)


def parse_response_head(head: bytes) -> ResponseHead:
    status, reason, headers = _parse(head, request=False)
    return ResponseHead(int(status), reason, headers)


def _parse(head: bytes, *, request: bool) -> tuple[bytes, bytes, Headers]:
    """(method, target) or (status, reason), and the headers."""
    lines = head.rstrip(b"\r\n").split(b"\n")
    first = lines[0].rstrip(b"\r")
    parts = first.split(b" ", 2)
    if len(parts) < (3 if request else 2):
        raise HeadError(f"bad start line {first[:60]!r}")
    version = parts[2] if request else parts[0]
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise HeadError(f"not HTTP/1.x: {first[:60]!r}")
    headers: Headers = []
    for line in lines[1:]:
        name, colon, value = line.rstrip(b"\r").partition(b":")
        if not colon or not name or name != name.strip():
            raise HeadError(f"bad header line {line[:60]!r}")
        headers.append((name.lower(), value.strip()))
    if request:
        return parts[0], parts[1], headers
    if not (parts[1].isdigit() and len(parts[1]) == 3):
        raise HeadError(f"bad status line {first[:60]!r}")
    return parts[1], parts[2] if len(parts) > 2 else b"", headers
