"""Sans-I/O HTTP/1.1 message-body framing (RFC 9112 §6-7): the one body walker.

Why not h11 for bodies: h11 is a two-party state machine that turns every chunk into
an event through several layers; the observer only needs to know where a body's bytes
are and where the body ends, once per read, at a few microseconds. h11 still parses
every head the observer sees (``observe/wire.py``); this module takes over between a head
and the end of its body, and is as strict as h11 0.16 about chunk framing (CRLF after
the size line and after the data), so what it calls malformed is what h11-based clients
reject. The observer, the fault layer and the request-id injector all walk bodies with
``BodyDecoder``, so they agree on where a body ends and on what is malformed.

``BodyDecoder.feed(data)`` returns the body bytes found, the number of data chunks
that started, and, once the body has ended, how many of the fed bytes it used (the rest is the
start of the next message). ``BodyDecoder.walk(data, pos, parts)`` is the same walk
for code that passes the raw bytes on, cut where the framing is (the fault layer): it
says where the body ends and, in ``parts``, what each stretch of bytes is (``Part``).

``body_framing`` and ``request_framing`` say, from a head's headers, how its body is
delimited. The module is compiled with mypyc (``tracer/compiled.py``): the walk reads
byte values as ints and the usual chunk-size line in place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final, Literal

Framing = Literal["length", "chunked", "close", "none"]
PartKind = Literal["size", "data", "crlf", "end"]
Part = tuple[int, PartKind, bool]
"""What a stretch of a body's raw bytes is, for ``BodyDecoder.walk``: (where it ends in
the bytes walked, its kind, whether a chunk's data or its CRLF ends there). It starts
where the one before it ends (the first: where the walk started). Kinds: ``size`` a
chunk-size line, ``data`` body bytes, ``crlf`` the CRLF after a chunk's data, ``end``
the last chunk's size line and the trailer section. A line cut across reads is one part
in each read; a ``size`` part can be the start of the last chunk's line."""

MAX_CHUNK_LINE: Final = 4096  # a chunk-size line (with extensions) longer than this is malformed
MAX_TRAILERS: Final = 64 * 1024
_HEX: Final = re.compile(rb"[0-9A-Fa-f]{1,16}")
# the states of a chunked body
_SIZE: Final = 0  # a chunk-size line
_DATA: Final = 1  # a chunk's data
_DATA_CRLF: Final = 2  # the CRLF after it
_TRAILER: Final = 3  # the trailer section, after the last chunk


def chunk_size(line: bytes) -> int | None:
    """The size a chunk-size line (without its CRLF) gives, extensions ignored; None when
    it is not one."""
    return _chunk_size(line, 0, len(line))


def _chunk_size(buf: bytes, start: int, stop: int) -> int | None:
    """``chunk_size(buf[start:stop])``: the common line (hex digits only) read in place."""
    if 0 < stop - start <= 16:
        end, value = _hex(buf, start, stop)
        if end == stop:
            return value
    size_field = buf[start:stop].split(b";", 1)[0].strip(b" \t")
    return int(size_field, 16) if _HEX.fullmatch(size_field) else None


def _size_line(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The usual chunk-size line at ``pos`` (hex digits, then CRLF, before ``end``), read
    in place: (where its CRLF is, the size); (-1, 0) when it is not that (an extension,
    a cut line, a malformed one: ``_chunk_size`` reads those)."""
    at, value = _hex(buf, pos, min(end, pos + 17))
    if pos < at <= pos + 16 and at + 1 < end and buf[at] == 13 and buf[at + 1] == 10:
        return at, value
    return -1, 0


def _hex(buf: bytes, at: int, stop: int) -> tuple[int, int]:
    """The hex digits from ``at`` (before ``stop``): (where they end, their value)."""
    value = 0
    while at < stop:
        byte = buf[at]
        if 48 <= byte <= 57:  # 0-9
            value = value * 16 + byte - 48
        elif 97 <= byte <= 102:  # a-f
            value = value * 16 + byte - 87
        elif 65 <= byte <= 70:  # A-F
            value = value * 16 + byte - 55
        else:
            break
        at += 1
    return at, value


class FramingError(Exception):
    """The body's framing is not valid HTTP/1.1.

    ``at``: where the bad element starts, relative to the start of the bytes passed to
    the failing ``feed`` (negative when it began in an earlier read); ``pieces`` and
    ``chunks``: the body found in those bytes before it, so that what is reported does
    not depend on how the bytes were cut.
    """

    def __init__(self, message: str, at: int = 0) -> None:
        super().__init__(message)
        self.at = at
        self.pieces: list[bytes] = []
        self.chunks = 0


def body_framing(
    method: str, status: int, headers: Iterable[tuple[bytes, bytes]]
) -> tuple[Framing, int]:
    """How a response body is delimited: (framing, content length). ``headers``: names in
    lower case. A Content-Length that is not a number is a ``FramingError`` (h11 refuses
    it before the observer gets here; the fault layer's heads are not h11's)."""
    if method == "HEAD" or status < 200 or status in (204, 304):
        return "none", 0
    transfer_encoding: bytes | None = None
    length: int | None = None
    for name, value in headers:
        if name == b"transfer-encoding":
            transfer_encoding = value.lower()
        elif name == b"content-length":
            if not value.isdigit():
                raise FramingError(f"bad content-length {value[:40]!r}")
            length = int(value)
    if transfer_encoding is not None:
        codings = [c.strip() for c in transfer_encoding.split(b",")]
        if codings[-1] == b"chunked":
            return "chunked", 0
        return "close", 0
    if length is not None:
        return ("length", length) if length else ("none", 0)
    return "close", 0


def request_framing(headers: Iterable[tuple[bytes, bytes]]) -> tuple[Framing, int]:
    """How a request body is delimited: (framing, content length); a request cannot be
    read until close, so a Transfer-Encoding whose last coding is not chunked, and a
    Content-Length that is not a number, are a ``FramingError``. ``headers``: names in
    lower case; Transfer-Encoding wins over Content-Length, the last of each counts."""
    framing: Framing = "none"
    length = 0
    for name, value in headers:
        if name == b"transfer-encoding":
            if value.lower().split(b",")[-1].strip() != b"chunked":
                raise FramingError("request body without chunked framing")
            framing = "chunked"
        elif name == b"content-length" and framing != "chunked":
            if not value.isdigit():
                raise FramingError(f"bad content-length {value[:40]!r}")
            length = int(value)
            framing = "length" if length else "none"
    return framing, length


class BodyDecoder:
    """Finds one body's bytes and end in a stream of reads."""

    __slots__ = ("_count", "_line", "_remaining", "_state", "done", "framing")

    def __init__(self, framing: Framing, length: int = 0) -> None:
        self.framing = framing
        self._remaining = length
        self._line = b""  # a chunk-size / trailer line split across reads
        self._state = _SIZE  # of a chunked body
        self._count = 0  # data chunks started in the current feed
        self.done = framing == "none"

    def feed(self, data: bytes) -> tuple[list[bytes], int, int]:
        """Returns (body pieces, chunk headers seen, bytes used of ``data``)."""
        if self.done:
            return [], 0, 0
        if self.framing == "close":
            return [data], 0, len(data)
        if self.framing == "length":
            if len(data) < self._remaining:
                self._remaining -= len(data)
                return [data], 0, len(data)
            used = self._remaining
            self._remaining = 0
            self.done = True
            return [data[:used]], 0, used
        pieces: list[bytes] = []
        self._count = 0
        try:
            used = self._chunked(data, 0, pieces, None)
        except FramingError as exc:
            exc.pieces, exc.chunks = pieces, self._count
            raise
        return pieces, self._count, used

    def walk(self, data: bytes, pos: int, parts: list[Part] | None = None) -> int:
        """``feed`` for ``data[pos:]`` without copying the body out: returns where in
        ``data`` the body ends (``len(data)`` while it goes on). ``parts``, when given,
        gets what each stretch of those bytes is (``Part``), up to that end."""
        n = len(data)
        if self.done or pos >= n:
            return pos
        if self.framing == "close":
            if parts is not None:
                parts.append((n, "data", False))
            return n
        if self.framing == "length":
            take = min(self._remaining, n - pos)
            self._remaining -= take
            self.done = self._remaining == 0
            if parts is not None:
                parts.append((pos + take, "data", False))
            return pos + take
        self._count = 0
        if parts is None and self._state == _SIZE and not self._line:
            pos = self._skip_chunks(data, pos)
            if pos >= n:
                return pos
        return self._chunked(data, pos, None, parts)

    def whole_chunk(self, data: bytes) -> int:
        """Where the data of ``data`` starts when ``data`` is exactly one whole data chunk
        of this chunked body, read at a chunk boundary (hex digits, CRLF, the data,
        CRLF): a streamed token's read. Its data then ends 2 bytes before ``data`` does,
        and the decoder is where it was (``feed`` would have given that data as one piece,
        one chunk begun). Else 0, and ``feed`` is for ``data``."""
        if self.framing != "chunked" or self._state != _SIZE or self._line or self.done:
            return 0
        n = len(data)
        nl, size = _size_line(data, 0, n)
        if nl > 0 and size and nl + size + 4 == n and data[n - 2] == 13 and data[n - 1] == 10:
            return nl + 2
        return 0

    def _skip_chunks(self, data: bytes, pos: int) -> int:
        """Whole data chunks from ``data[pos:]``, a few byte operations each; stops at
        anything else (a chunk cut by the read's end, the last chunk, a malformed line),
        which is ``_chunked``'s to read."""
        n = len(data)
        while pos < n:
            eol = data.find(b"\r\n", pos, pos + MAX_CHUNK_LINE)
            if eol < 0:
                break
            size = _chunk_size(data, pos, eol)
            end = eol + 2 + (size or 0)
            if not size or data[end : end + 2] != b"\r\n":
                break
            self._count += 1
            pos = end + 2
        return pos

    def eof(self) -> None:
        """The connection ended: fine for a close-delimited body, a cut otherwise."""
        if self.done:
            return
        if self.framing == "close":
            self.done = True
            return
        if self.framing == "length":
            raise FramingError(f"peer closed with {self._remaining} body bytes still expected")
        raise FramingError("peer closed inside a chunked body (incomplete chunked read)")

    def _chunked(
        self, data: bytes, start: int, pieces: list[bytes] | None, parts: list[Part] | None
    ) -> int:
        """Chunked framing from ``data[start:]``: returns where in ``data`` the body ends
        (``len(data)`` if not there). ``pieces`` gets the body's bytes, ``parts`` what
        each stretch is (positions in ``data``)."""
        carried = len(self._line)
        if carried:  # a line begun in an earlier read: parsed again from its start
            buf = self._line + data[start:]
            self._line = b""
            pos = 0
            base = start - carried  # a position in buf is this one in data
        else:
            buf = data
            pos = start
            base = 0
        end = len(buf)
        while pos < end:
            state = self._state
            if state == _DATA:
                take = min(self._remaining, end - pos)
                if pieces is not None:
                    pieces.append(buf[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = _DATA_CRLF
                if parts is not None:
                    parts.append((pos + base, "data", self._remaining == 0))
                continue
            if state == _DATA_CRLF:
                if end - pos < 2:
                    if buf[pos:end] != b"\r"[: end - pos]:
                        raise FramingError("chunk data not followed by CRLF", pos + base - start)
                    self._line = buf[pos:end]
                    if parts is not None:
                        parts.append((end + base, "crlf", False))
                    pos = end
                    break
                if buf[pos] != 13 or buf[pos + 1] != 10:  # CRLF
                    raise FramingError("chunk data not followed by CRLF", pos + base - start)
                pos += 2
                self._state = _SIZE
                if parts is not None:
                    parts.append((pos + base, "crlf", True))
                continue
            nl = -1
            size: int | None = None
            if state == _SIZE:
                nl, size = _size_line(buf, pos, end)
            if nl < 0:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    rest = buf[pos:end]
                    # the line so far (a last CR may be its CRLF's): over the bound, it is
                    # as it would be in one read
                    length = len(rest) - 1 if buf[end - 1] == 13 else len(rest)
                    if state == _TRAILER:
                        if length > MAX_TRAILERS:
                            raise FramingError("chunk trailer line too long", pos + base - start)
                    elif length > MAX_CHUNK_LINE:
                        raise FramingError("chunk size line too long", pos + base - start)
                    self._line = rest
                    if parts is not None:
                        parts.append((end + base, "size" if state == _SIZE else "end", False))
                    pos = end
                    break
                if state == _SIZE:
                    size = _chunk_size(buf, pos, nl)
            kind: PartKind = "end"
            if state == _SIZE:
                if nl - pos > MAX_CHUNK_LINE or size is None:
                    line_at = pos + base - start
                    raise FramingError(f"illegal chunk header: {buf[pos:nl][:40]!r}", line_at)
                if size:
                    self._count += 1  # data chunks only: the last chunk is not counted
                    self._remaining = size
                    self._state = _DATA
                    kind = "size"
                else:
                    self._state = _TRAILER
            elif nl - pos > MAX_TRAILERS:
                raise FramingError("chunk trailer line too long", pos + base - start)
            elif nl == pos:  # trailer lines until an empty line
                self.done = True
            pos = nl + 2
            if parts is not None:
                parts.append((pos + base, kind, False))
            if self.done:
                return pos + base
        return end + base
