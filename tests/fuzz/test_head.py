"""The head parser (``tracer/protocol/head.py``): any bytes are a head, not yet one, or a
``HeadError``; and the same whether they come in one read or cut anywhere into many
(where the head ends, what it is, or the same error)."""

from __future__ import annotations

from contextlib import suppress

from hypothesis import example, given
from hypothesis import strategies as st

from tracer.protocol.head import (
    MAX_HEAD,
    HeadError,
    HeadReader,
    parse_request_head,
    parse_response_head,
    quick_request,
    quick_response,
)

from .support import budget, cut_up, no_hang, ran

EOL = st.sampled_from([b"\r\n", b"\n", b"\r", b"\n\r"])
TOKEN = st.sampled_from([b"GET", b"POST", b"HEAD", b"CONNECT", b"G\x00T", b"", b"get"])
TARGET = st.sampled_from([b"/", b"/v1/chat/completions", b"*", b"", b"/a b", b"/\xff"])
VERSION = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"http/1.1", b""])
STATUS = st.sampled_from([b"200", b"404", b"100", b"20", b"2000", b"abc", b""])
NAME = st.sampled_from([b"host", b"Content-Length", b"transfer-encoding", b" x", b"", b"a b"])
VALUE = st.sampled_from([b"x", b" 12 ", b"chunked", b"", b"\t", b"\xff\x00"]) | st.binary(
    max_size=12
)


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    """Heads of requests or responses, well formed or broken in the ways that matter,
    before the bytes that follow them."""
    eol = draw(EOL)
    if draw(st.booleans()):
        first = draw(TOKEN) + b" " + draw(TARGET) + b" " + draw(VERSION)
    else:
        first = draw(VERSION) + b" " + draw(STATUS) + draw(st.sampled_from([b" OK", b"", b" "]))
    lines = [draw(st.lists(EOL, max_size=2)), [first]]
    for _ in range(draw(st.integers(0, 4))):
        name, value = draw(NAME), draw(VALUE)
        sep = draw(st.sampled_from([b": ", b":", b" : ", b""]))
        lines.append([name + sep + value])
    head = b"".join(lines[0]) + eol.join(b for group in lines[1:] for b in group)
    end = draw(st.sampled_from([eol + eol, b"\r\n\r\n", b"\n\n", b"\n\r\n", eol, b""]))
    return head + end + draw(st.binary(max_size=8))


def long_head(delta: int, end: bool) -> bytes:
    """A request head ``delta`` bytes longer than ``MAX_HEAD``, with its end or not."""
    head = b"GET / HTTP/1.1\r\nx: "
    tail = b"\r\n\r\n" if end else b""
    return head + b"a" * (MAX_HEAD + delta - len(head) - len(tail)) + tail


HEADS = heads() | st.binary(max_size=80)


def outcome(reads: list[bytes], *, request: bool, pad: int) -> tuple[object, ...]:
    """What a ``HeadReader`` makes of the reads (each fed at ``pad`` in a longer buffer):
    ("head", where it ends in the whole, head, raw), ("open", held) or ("error", why)."""
    reader = HeadReader(request=request)
    consumed = 0
    for data in reads:
        try:
            end = reader.feed(b"\0" * pad + data, pad)
        except HeadError as exc:
            return ("error", str(exc))
        if end >= 0:
            assert pad <= end <= pad + len(data)
            return ("head", consumed + end - pad, reader.head, reader.raw)
        consumed += len(data)
    return ("open", reader.held)


@budget(1.0)
@given(reads=cut_up(HEADS), request=st.booleans(), pad=st.sampled_from([0, 3]))
@example(reads=[b"\r", b"\nGET / HTTP/1.1\r\n\r\n"], request=True, pad=0)  # an empty line cut
def test_a_head_read_whole_or_cut(reads: list[bytes], request: bool, pad: int) -> None:
    ran("head.reader")
    same_whole_or_cut(reads, request=request, pad=pad)


@budget(0.1)
@given(
    delta=st.integers(-6, 6),
    end=st.booleans(),
    cuts=st.lists(st.floats(0.0, 1.0), max_size=4),
)
@example(delta=4, end=True, cuts=[0.9999])  # one read: a head over MAX_HEAD was taken
def test_a_head_near_the_bound_whole_or_cut(delta: int, end: bool, cuts: list[float]) -> None:
    """A head over ``MAX_HEAD`` bytes is refused whether it came in one read or in many."""
    ran("head.reader")
    whole = long_head(delta, end)
    points = sorted(int(len(whole) * c) for c in cuts)
    reads = [whole[a:b] for a, b in zip([0, *points], [*points, len(whole)], strict=True)]
    result = same_whole_or_cut(reads, request=True, pad=0)
    assert (result[0] == "error") == (delta > 0), result[:2]


def same_whole_or_cut(reads: list[bytes], *, request: bool, pad: int) -> tuple[object, ...]:
    whole = b"".join(reads)
    with no_hang():
        one = outcome([whole], request=request, pad=0)
        many = outcome(reads, request=request, pad=pad)
    assert one[:2] == many[:2] and one == many
    if one[0] == "head":
        head = one[2]
        assert isinstance(head, bytes) and len(head) <= MAX_HEAD
        parse = parse_request_head if request else parse_response_head
        try:
            parse(head)
        except HeadError as exc:
            assert "\n" not in str(exc)
    return one


@budget(0.5)
@given(data=HEADS)
def test_any_bytes_parse_or_raise_head_error(data: bytes) -> None:
    ran("head.parse")
    with no_hang():
        for parse in (parse_request_head, parse_response_head):
            with suppress(HeadError):
                parse(data)
        for quick in (quick_request, quick_response):
            head = quick(data, MAX_HEAD)
            assert head is None or 0 < head.end <= len(data)
