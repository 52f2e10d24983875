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
from typing import Final, NamedTuple

MAX_HEAD: Final = 64 * 1024

Headers = list[tuple[bytes, bytes]]

_HEAD_END: Final = re.compile(rb"\n\r?\n")
# empty lines, then the method: a token (RFC 9110), which a space must follow
_REQUEST_START: Final = re.compile(rb"(?:\r?\n)*([!#$%&'*+.^_`|~0-9A-Za-z-]*)")


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
            if (
                after < len(buf)
                and (buf[after : after + 1] != b" " or not method.group(1))
                and (method.group(1) or buf[after:] != b"\r")  # (a last CR: an empty line's?)
            ):
                raise HeadError("not an HTTP/1.x request")
            start = method.start(1)
        hit = _HEAD_END.search(buf, max(start, old - 3))
        if hit is None or hit.end() > MAX_HEAD:  # (the same whether it came in one read)
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


# ---- the quick path of the observer ----------------------------------------------------
#
# The observer (``observe/wire.py``) reads heads with h11, whose verdicts it records (an
# anomaly in h11's words when a head is bad). h11 costs about 45 µs a head, most of a
# plain request's observation; ``quick_request`` and ``quick_response`` read the common
# head in a few: one regular expression over the whole head, then the checks h11 makes
# of its headers. They accept a strict subset of what h11 accepts, and give what h11
# would give for it (``tests/unit/test_quick_heads.py`` compares the two); anything else
# (None) is h11's to read: bare LF line ends, obs-text in a target, duplicate or odd
# Content-Length and Transfer-Encoding, a missing Host, 1xx responses, protocol switches.

_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_FIELDS = rb"((?:" + _TOKEN + rb":[\t \x21-\x7e\x80-\xff]*\r\n)*)\r\n"
_QUICK_REQUEST: Final = re.compile(
    rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/(1\.[01])\r\n" + _FIELDS, re.DOTALL
)
_QUICK_RESPONSE: Final = re.compile(
    rb"HTTP/(1\.[01]) ([2-9][0-9]{2})(?: ([\t \x21-\x7e\x80-\xff]*))?\r\n" + _FIELDS, re.DOTALL
)
_MAX_LENGTH_DIGITS: Final = 18


class QuickHead(NamedTuple):
    """A head as h11 reads it: its ``raw_items`` (names as sent, values without the
    spaces around them; Transfer-Encoding's in lower case) and the same with the names
    in lower case (h11's ``headers``)."""

    method: bytes  # a request's (b"" for a response)
    target: bytes
    status: int  # a response's (0 for a request)
    reason: bytes
    version: bytes  # b"1.1" or b"1.0"
    raw: list[tuple[bytes, bytes]]
    lower: list[tuple[bytes, bytes]]
    end: int  # where the head ends in the bytes it was read from


def quick_request(data: bytes, max_size: int) -> QuickHead | None:
    """The request head at the start of ``data`` when it is all there, at most
    ``max_size`` bytes, and plain (see above); else None: h11 reads it."""
    end = data.find(b"\r\n\r\n", 0, max_size)
    if end < 0:
        return None
    match = _QUICK_REQUEST.fullmatch(data, 0, end + 4)
    if match is None:
        return None
    method, target, version, block = match.groups()
    if method == b"CONNECT":
        return None
    fields = _fields(block)
    if fields is None or fields[2] > 1 or (version == b"1.1" and fields[2] != 1):
        return None  # h11 asks for one Host in HTTP/1.1, and never takes two
    return QuickHead(method, target, 0, b"", version, fields[0], fields[1], end + 4)


def quick_response(data: bytes, max_size: int) -> QuickHead | None:
    """The final (2xx-5xx) response head at the start of ``data``, as ``quick_request``."""
    end = data.find(b"\r\n\r\n", 0, max_size)
    if end < 0:
        return None
    match = _QUICK_RESPONSE.fullmatch(data, 0, end + 4)
    if match is None:
        return None
    version, status, reason, block = match.groups()
    fields = _fields(block)
    if fields is None:
        return None
    return QuickHead(b"", b"", int(status), reason or b"", version, fields[0], fields[1], end + 4)


def _fields(
    block: bytes,
) -> tuple[list[tuple[bytes, bytes]], list[tuple[bytes, bytes]], int] | None:
    """(raw, lower) header items as h11 has them and the number of Host headers, or None
    where h11 is to judge: more than one Content-Length or Transfer-Encoding, both, one
    h11 would refuse or rewrite, an Upgrade."""
    raw: list[tuple[bytes, bytes]] = []
    lower: list[tuple[bytes, bytes]] = []
    hosts = framing = 0
    for line in block.split(b"\r\n")[:-1]:
        name, _, value = line.partition(b":")
        value = value.strip(b" \t")
        key = name.lower()
        if key == b"host":
            hosts += 1
        elif key == b"content-length":
            framing += 1
            if not (value.isdigit() and len(value) <= _MAX_LENGTH_DIGITS):
                return None
        elif key == b"transfer-encoding":
            framing += 1
            value = value.lower()
            if value != b"chunked":
                return None
        elif key == b"upgrade":
            return None
        raw.append((name, value))
        lower.append((key, value))
    if framing > 1:
        return None
    return raw, lower, hosts
