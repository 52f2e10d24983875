"""HTTP/1.x request lines in raw bytes, where a packet capture gives no message bounds:
whether a client's stream starts with one (``passive``: is a connection HTTP/1.x, and
which side is its client), and where the next one is (``gaps``: where parsing picks up
again after bytes the capture lost)."""

from __future__ import annotations

import re

PROBE_BYTES = 8192  # client bytes read to tell whether a stream is HTTP/1.x

_REQUEST_LINE = re.compile(rb"[A-Z][A-Z0-9_-]{0,31} [!-~]+ HTTP/1\.[01]\Z")
# what may still become a request line: a method, maybe a target, maybe a version's start
_REQUEST_PREFIX = re.compile(rb"[A-Z][A-Z0-9_-]{0,31}(?: [!-~]*(?: H?T?T?P?/?1?\.?[01]?)?)?\r?\Z")
# a request line of a method in use, inside a stream
_REQUEST_AT = re.compile(
    rb"(?:GET|POST|PUT|DELETE|PATCH|HEAD|OPTIONS|CONNECT|TRACE) [!-~]+ HTTP/1\.[01]\r\n"
)


def looks_like_request(data: bytes) -> bool | None:
    """Whether bytes start with an HTTP/1.x request line (None: too few to tell)."""
    end = data.find(b"\r\n", 0, PROBE_BYTES)
    if end >= 0:
        return _REQUEST_LINE.match(data, 0, end) is not None
    if len(data) >= PROBE_BYTES:
        return False
    return None if _REQUEST_PREFIX.match(data) else False


def find_request(data: bytes) -> int:
    """Where the first request line in ``data`` starts (-1: none whole in it)."""
    pos = 0
    while (line := _REQUEST_AT.search(data, pos)) is not None:
        if looks_like_request(data[line.start() : line.start() + PROBE_BYTES]):
            return line.start()
        pos = line.start() + 1
    return -1
