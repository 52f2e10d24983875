"""The body-framing decoder agrees with h11 on where bodies end, in any split."""

from __future__ import annotations

import random

import h11
import pytest

from tracer.protocol.framing import BodyDecoder, FramingError, body_framing

CHUNKED = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n"
NEXT = b"HTTP/1.1 200 OK\r\n"


def _feed_split(decoder: BodyDecoder, data: bytes, cuts: list[int]) -> tuple[bytes, int, int]:
    body = b""
    headers = 0
    pos = 0
    used_total = 0
    bounds = [*cuts, len(data)]
    for cut in bounds:
        piece = data[pos:cut]
        pos = cut
        if not piece:
            continue
        pieces, n, used = decoder.feed(piece)
        body += b"".join(pieces)
        headers += n
        used_total += used
        if decoder.done:
            break
    return body, headers, used_total


@pytest.mark.parametrize("seed", range(40))
def test_chunked_any_split(seed: int) -> None:
    data = CHUNKED + NEXT
    rnd = random.Random(seed)
    cuts = sorted(rnd.sample(range(1, len(data)), k=rnd.randint(0, 12)))
    if seed == 0:
        cuts = list(range(1, len(data)))  # one byte at a time
    decoder = BodyDecoder("chunked")
    body, headers, used = _feed_split(decoder, data, cuts)
    assert decoder.done
    assert body == b"hello world"
    assert headers == 2  # data chunks; the last chunk is not counted
    # whatever was fed beyond the body's end is returned as unused
    assert used == len(CHUNKED)


def test_chunked_reports_exact_end() -> None:
    decoder = BodyDecoder("chunked")
    pieces, headers, used = decoder.feed(CHUNKED + NEXT)
    assert decoder.done and used == len(CHUNKED) and headers == 2
    assert b"".join(pieces) == b"hello world"


def test_length_and_close_and_none() -> None:
    d = BodyDecoder("length", 5)
    assert d.feed(b"hel") == ([b"hel"], 0, 3) and not d.done
    assert d.feed(b"loNEXT") == ([b"lo"], 0, 2) and d.done
    c = BodyDecoder("close")
    assert c.feed(b"abc") == ([b"abc"], 0, 3)
    c.eof()
    assert c.done
    n = BodyDecoder("none")
    assert n.done and n.feed(b"x") == ([], 0, 0)


@pytest.mark.parametrize(
    "bad",
    [b"ZZZ\r\nx\r\n", b"5\r\nhelloXX", b"5\nhello\r\n", b"-1\r\n", b"1" * 17 + b"\r\n"],
)
def test_malformed_chunked_raises(bad: bytes) -> None:
    decoder = BodyDecoder("chunked")
    with pytest.raises(FramingError):
        decoder.feed(bad)
        decoder.feed(b"\r\n" * 3)


def test_h11_rejects_what_we_reject() -> None:
    """Strictness matches h11 0.16: what we call malformed, an h11 client refuses too."""
    for bad in (b"ZZZ\r\nx\r\n", b"5\r\nhelloXX"):
        client = h11.Connection(h11.CLIENT)
        client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        client.receive_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + bad)
        with pytest.raises(h11.RemoteProtocolError):
            while client.next_event() is not h11.NEED_DATA:
                pass


def test_eof_inside_body_is_a_cut() -> None:
    d = BodyDecoder("chunked")
    d.feed(b"5\r\nhel")
    with pytest.raises(FramingError, match="incomplete chunked"):
        d.eof()
    d2 = BodyDecoder("length", 10)
    d2.feed(b"abc")
    with pytest.raises(FramingError, match="7 body bytes"):
        d2.eof()


@pytest.mark.parametrize(
    ("method", "status", "headers", "expected"),
    [
        ("GET", 200, [(b"transfer-encoding", b"chunked")], ("chunked", 0)),
        ("GET", 200, [(b"content-length", b"12")], ("length", 12)),
        ("GET", 200, [(b"content-length", b"0")], ("none", 0)),
        ("GET", 200, [], ("close", 0)),
        ("HEAD", 200, [(b"content-length", b"12")], ("none", 0)),
        ("GET", 204, [], ("none", 0)),
        ("GET", 304, [(b"content-length", b"12")], ("none", 0)),
        ("GET", 200, [(b"transfer-encoding", b"gzip")], ("close", 0)),
        (
            "GET",
            200,
            [(b"transfer-encoding", b"chunked"), (b"content-length", b"3")],
            ("chunked", 0),
        ),
    ],
)
def test_body_framing_rules(
    method: str, status: int, headers: list[tuple[bytes, bytes]], expected: tuple[str, int]
) -> None:
    assert body_framing(method, status, headers) == expected
