"""Body framing (``tracer/protocol/framing.py``): any bytes are a body's (its end found or
not yet) or a ``FramingError``; and the same body, the same end, the same error at the
same place whether they come in one read or cut anywhere into many, through ``feed`` or
``walk``."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tracer.protocol.framing import (
    MAX_CHUNK_LINE,
    MAX_TRAILERS,
    BodyDecoder,
    Framing,
    FramingError,
    Part,
    body_framing,
    request_framing,
)

from .support import budget, cut_up, no_hang, ran

SIZE_LINE = st.sampled_from(["{:x}", "{:X}", "{:04x}", " {:x}", "{:x} ", "{:x};a=b", "{:x}\t;x"])
EOL = st.sampled_from([b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r", b""])


@st.composite
def chunked(draw: st.DrawFn) -> bytes:
    """A chunked body, well formed or broken where parsers disagree, and what follows."""
    out = b""
    for _ in range(draw(st.integers(0, 4))):
        data = draw(st.binary(max_size=20))
        if not data:
            continue
        size = len(data) + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
        out += draw(SIZE_LINE).format(max(size, 0)).encode() + draw(EOL) + data + draw(EOL)
    out += b"0" + draw(st.sampled_from([b"", b";ext"])) + draw(EOL)
    for _ in range(draw(st.integers(0, 2))):
        out += b"x-trailer: " + draw(st.binary(max_size=8)) + draw(EOL)
    return out + draw(EOL) + draw(st.binary(max_size=8))


FRAMINGS = st.sampled_from(["chunked", "chunked", "length", "close", "none"])
BODIES = chunked() | st.binary(max_size=60)


def by_feed(decoder: BodyDecoder, reads: list[bytes]) -> tuple[Any, ...]:
    """("done", where the body ends in the whole, body, chunks), ("open", body, chunks,
    whether eof is an error) or ("error", where, the body before it, chunks before it)."""
    body: list[bytes] = []
    chunks = consumed = 0
    for data in reads:
        try:
            pieces, n, used = decoder.feed(data)
        except FramingError as exc:
            assert "\n" not in str(exc)
            return ("error", consumed + exc.at, b"".join(body + exc.pieces), chunks + exc.chunks)
        body += pieces
        chunks += n
        if decoder.done:
            assert 0 <= used <= len(data)
            return ("done", consumed + used, b"".join(body), chunks)
        assert used == len(data)
        consumed += len(data)
    try:
        decoder.eof()
    except FramingError:
        return ("open", b"".join(body), chunks, True)
    return ("open", b"".join(body), chunks, False)


def by_walk(decoder: BodyDecoder, reads: list[bytes], pad: int) -> tuple[Any, ...]:
    """``walk`` over the reads (each at ``pad`` in a longer buffer): ("done", where the
    body ends, body), ("open", body), ("error",); the body from its ``data`` parts."""
    body = b""
    consumed = 0
    for data in reads:
        buf = b"\0" * pad + data
        parts: list[Part] = []
        try:
            end = decoder.walk(buf, pad, parts)
        except FramingError:
            return ("error",)
        at = pad
        for stop, kind, _ in parts:
            assert at <= stop <= end, parts
            if kind == "data":
                body += buf[at:stop]
            at = stop
        assert at == end or (not parts and end == pad), (parts, end)
        if decoder.done:
            return ("done", consumed + end - pad, body)
        assert end == len(buf)
        consumed += len(data)
    return ("open", body)


@budget(1.5)
@given(framing=FRAMINGS, length=st.integers(1, 40), reads=cut_up(BODIES), pad=st.integers(0, 3))
def test_a_body_read_whole_or_cut(
    framing: Framing, length: int, reads: list[bytes], pad: int
) -> None:
    ran("framing.body")
    same_whole_or_cut(framing, length, reads, pad)


def same_whole_or_cut(framing: Framing, length: int, reads: list[bytes], pad: int) -> None:
    whole = b"".join(reads)
    with no_hang():
        one = by_feed(BodyDecoder(framing, length), [whole])
        many = by_feed(BodyDecoder(framing, length), reads)
        walked_one = by_walk(BodyDecoder(framing, length), [whole], 0)
        walked = by_walk(BodyDecoder(framing, length), reads, pad)
    assert one == many
    if one[0] == "done":
        assert walked_one == walked == one[:3]
    elif one[0] == "open":
        assert walked_one == walked == ("open", one[1])
    else:
        assert walked_one == walked == ("error",)


def test_lines_at_their_bound_whole_or_cut() -> None:
    """A chunk-size line of ``MAX_CHUNK_LINE`` bytes cut between its CR and LF was too
    long, and a trailer line over ``MAX_TRAILERS`` was refused only when cut (the
    whole-or-cut property, checked by reading the bounds; now fuzzed below)."""
    size_line = b"1;" + b"x" * (MAX_CHUNK_LINE - 2) + b"\r\na\r\n0\r\n\r\n"
    trailer = b"0\r\nx: " + b"a" * MAX_TRAILERS + b"\r\n\r\n"
    for body in (size_line, trailer, size_line.replace(b";", b";x", 1)):
        for cut in (len(body) - 16, len(body) - 9, len(body) - 8, len(body) - 3, 3):
            same_whole_or_cut("chunked", 0, [body[:cut], body[cut:]], 0)
    assert by_feed(BodyDecoder("chunked"), [size_line])[0] == "done"
    assert by_feed(BodyDecoder("chunked"), [trailer])[0] == "error"


@budget(0.1)
@given(
    over=st.integers(-3, 3),
    trailer=st.booleans(),
    cr_lf=st.booleans(),
    cuts=st.lists(st.integers(0, 24), max_size=3),
)
def test_lines_near_their_bound(over: int, trailer: bool, cr_lf: bool, cuts: list[int]) -> None:
    """A chunk-size or trailer line a few bytes either side of its bound, cut near its
    end: refused exactly when it is over the bound, however it is cut."""
    ran("framing.body")
    bound = MAX_TRAILERS if trailer else MAX_CHUNK_LINE
    line = b"x: " if trailer else b"1;"
    line += b"a" * (bound + over - len(line))
    body = (b"0\r\n" + line + b"\r\n\r\n") if trailer else (line + b"\r\na\r\n0\r\n\r\n")
    if not cr_lf:
        body = body.replace(b"\r\n", b"\r", 1) if trailer else body
    points = sorted({max(0, len(body) - 12 + c) for c in cuts})
    edges = [0, *points, len(body)]
    same_whole_or_cut("chunked", 0, [body[a:b] for a, b in pairwise(edges)], 0)
    if cr_lf or not trailer:
        assert (by_feed(BodyDecoder("chunked"), [body])[0] == "error") == (over > 0)


@budget(0.3)
@given(data=BODIES)
def test_one_whole_chunk(data: bytes) -> None:
    """``whole_chunk`` says where the data starts only when ``feed`` would give it."""
    ran("framing.body")
    decoder = BodyDecoder("chunked")
    at = decoder.whole_chunk(data)
    if at:
        assert decoder.feed(data) == ([data[at:-2]], 1, len(data))


HEADER_NAMES = st.sampled_from([b"content-length", b"transfer-encoding", b"host"])
HEADER_VALUES = st.sampled_from(
    [b"chunked", b"gzip, chunked", b"chunked, gzip", b"CHUNKED", b"12", b"0", b"-1", b"", b"1 2"]
) | st.binary(max_size=6)


@budget(0.3)
@given(
    headers=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=4),
    method=st.sampled_from(["GET", "HEAD", "POST"]),
    status=st.sampled_from([100, 101, 200, 204, 304, 404, 500]),
)
def test_framing_from_headers(headers: list[tuple[bytes, bytes]], method: str, status: int) -> None:
    ran("framing.headers")
    for response in (True, False):
        try:
            if response:
                framing, length = body_framing(method, status, headers)
            else:
                framing, length = request_framing(headers)
        except FramingError as exc:
            assert "\n" not in str(exc)
            continue
        assert framing in ("length", "chunked", "close", "none") and length >= 0
        BodyDecoder(framing, length)
