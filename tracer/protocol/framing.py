"""Sans-I/O HTTP/1.1 message-body framing decoder (RFC 9112 §6-7), for observing.

Why not h11 for bodies: h11 is a two-party state machine that turns every chunk into
an event through several layers; the observer only needs to know where a body's bytes
are and where the body ends, once per read, at a few microseconds. h11 still parses
every head (``sniff.py``); this module takes over between a head and the end of its
body, and is as strict as h11 0.16 about chunk framing (CRLF after the size line and
after the data), so what it calls malformed is what h11-based clients reject.

``BodyDecoder.feed(data)`` returns the body bytes found, the number of data chunks
that started, and, once the body has ended, how many of the fed bytes it used (the rest is the
start of the next message).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

Framing = Literal["length", "chunked", "close", "none"]

MAX_CHUNK_LINE = 4096  # a chunk-size line (with extensions) longer than this is malformed
MAX_TRAILERS = 64 * 1024
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


def chunk_size(line: bytes) -> int | None:
    """The size a chunk-size line (without its CRLF) gives, extensions ignored; None when
    it is not one."""
    size_field = line.split(b";", 1)[0].strip(b" \t")
    return int(size_field, 16) if _HEX.fullmatch(size_field) else None


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
    """How a response body is delimited: (framing, content length)."""
    if method == "HEAD" or status < 200 or status in (204, 304):
        return "none", 0
    transfer_encoding: bytes | None = None
    length: int | None = None
    for name, value in headers:
        if name == b"transfer-encoding":
            transfer_encoding = value.lower()
        elif name == b"content-length":
            length = int(value)
    if transfer_encoding is not None:
        codings = [c.strip() for c in transfer_encoding.split(b",")]
        if codings[-1] == b"chunked":
            return "chunked", 0
        return "close", 0
    if length is not None:
        return ("length", length) if length else ("none", 0)
    return "close", 0


class BodyDecoder:
    """Finds one body's bytes and end in a stream of reads."""

    __slots__ = ("_count", "_line", "_remaining", "_state", "done", "framing")

    def __init__(self, framing: Framing, length: int = 0) -> None:
        self.framing = framing
        self._remaining = length
        self._line = b""  # a chunk-size / trailer line split across reads
        # chunked states: size, data, data_crlf, trailer
        self._state = "size"
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
        return self._chunked(data)

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

    def _chunked(self, data: bytes) -> tuple[list[bytes], int, int]:
        pieces: list[bytes] = []
        self._count = 0
        try:
            used = self._chunked_into(data, pieces)
        except FramingError as exc:
            exc.pieces, exc.chunks = pieces, self._count
            raise
        return pieces, self._count, used

    def _chunked_into(self, data: bytes, pieces: list[bytes]) -> int:
        """Parse chunked framing; returns the bytes of ``data`` used."""
        pos = 0
        end = len(data)
        if self._line:
            data = self._line + data
            pos = 0
            end = len(data)
            carried = len(self._line)
            self._line = b""
        else:
            carried = 0
        while pos < end:
            state = self._state
            if state == "data":
                take = min(self._remaining, end - pos)
                pieces.append(data[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = "data_crlf"
                continue
            if state == "data_crlf":
                if end - pos < 2:
                    if data[pos:end] != b"\r"[: end - pos]:
                        raise FramingError("chunk data not followed by CRLF", pos - carried)
                    self._line = data[pos:end]
                    pos = end
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise FramingError("chunk data not followed by CRLF", pos - carried)
                pos += 2
                self._state = "size"
                continue
            nl = data.find(b"\r\n", pos)
            if nl < 0:
                rest = data[pos:end]
                if len(rest) > (MAX_TRAILERS if state == "trailer" else MAX_CHUNK_LINE):
                    raise FramingError(f"chunk {state} line too long", pos - carried)
                self._line = rest
                pos = end
                break
            line = data[pos:nl]
            line_at = pos - carried
            pos = nl + 2
            if state == "size":
                size = chunk_size(line)
                if len(line) > MAX_CHUNK_LINE or size is None:
                    raise FramingError(f"illegal chunk header: {line[:40]!r}", line_at)
                if size:
                    self._count += 1  # data chunks only: the last chunk is not counted
                    self._remaining = size
                    self._state = "data"
                else:
                    self._state = "trailer"
            else:  # trailer lines until an empty line
                if not line:
                    self.done = True
                    return pos - carried
        return end - carried
