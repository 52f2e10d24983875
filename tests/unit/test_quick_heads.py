"""The observer's quick head path against h11, on a bounded random corpus of heads.

The invariant: whatever head ``quick_request`` / ``quick_response`` read, h11 reads the
same way (method, target, version, status, reason, header items raw and in lower case)
and where it ends; what h11 would refuse they leave to h11 (None). And they do read the
heads real clients and engines send, or they would save nothing.
"""

from __future__ import annotations

import random

import h11
import pytest

from tracer.protocol.head import MAX_HEAD, QuickHead, quick_request, quick_response

# pieces that are fine, and pieces parsers disagree on or h11 refuses
NAMES = [b"Content-Type", b"X-A", b"x-request-id", b"Accept", b"A!#$%&'*+.^_`|~"]
ODD_NAMES = [b"Bad Name", b"", b"X\x00", b"N\xe9", b"(x)"]
VALUES = [b"v", b" v ", b"\tv\t", b"a b", b"", b"  ", b"\xe9t\xe9", b"a,b", b"x" * 40]
ODD_VALUES = [b"a\x00b", b"a\x0bb", b"a\x01b", b"\x7f"]
FRAMING = [
    (b"Content-Length", b"5"),
    (b"content-length", b"007"),
    (b"Content-Length", b"5, 5"),
    (b"Content-Length", b"+5"),
    (b"Content-Length", b"5 5"),
    (b"Content-Length", b"9" * 19),
    (b"Transfer-Encoding", b"chunked"),
    (b"Transfer-Encoding", b"Chunked"),
    (b"Transfer-Encoding", b"gzip, chunked"),
    (b"Transfer-Encoding", b"identity"),
    (b"Upgrade", b"websocket"),
    (b"Connection", b"close"),
    (b"Expect", b"100-continue"),
]
METHODS = [b"GET", b"POST", b"HEAD", b"PUT", b"CONNECT", b"M-SEARCH", b"get", b"G T", b""]
TARGETS = [b"/", b"/v1/chat/completions?x=1", b"*", b"http://h/x", b"/\xe9", b"/a b", b""]
STATUS = [b"200 OK", b"200", b"200 ", b"204 No Content", b"404 Not \tFound", b"101 Switching"]
STATUS += [b"100 Continue", b"999 x", b"2000 x", b"20 x", b"500 \xe9", b"200 a\x00b"]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2", b"http/1.1", b"HTTP/1.1 "]


def _headers(rnd: random.Random) -> list[bytes]:
    lines = []
    for _ in range(rnd.randint(0, 5)):
        name = rnd.choice(ODD_NAMES) if rnd.random() < 0.08 else rnd.choice(NAMES)
        value = rnd.choice(ODD_VALUES) if rnd.random() < 0.08 else rnd.choice(VALUES)
        lines.append(name + b":" + value)
    for _ in range(rnd.choice([0, 0, 0, 1, 1, 2])):
        name, value = rnd.choice(FRAMING)
        lines.append(name + b": " + value)
    if rnd.random() < 0.05:
        lines.append(b" obs-fold")
    if rnd.random() < 0.05:
        lines.append(b"Name : v")
    rnd.shuffle(lines)
    return lines


def _head(rnd: random.Random, first: bytes, lines: list[bytes]) -> bytes:
    end = b"\n" if rnd.random() < 0.05 else b"\r\n"
    return first + end + b"".join(line + b"\r\n" for line in lines) + b"\r\n"


def _request(rnd: random.Random) -> bytes:
    method = rnd.choice(METHODS) if rnd.random() < 0.15 else b"POST"
    target = rnd.choice(TARGETS) if rnd.random() < 0.15 else b"/v1/completions"
    version = rnd.choice(VERSIONS) if rnd.random() < 0.1 else b"HTTP/1.1"
    lines = _headers(rnd)
    for _ in range(rnd.choice([0, 1, 1, 1, 1, 1, 1, 2])):
        lines.insert(rnd.randint(0, len(lines)), rnd.choice([b"Host: h", b"host:h "]))
    return _head(rnd, method + b" " + target + b" " + version, lines)


def _response(rnd: random.Random) -> bytes:
    version = rnd.choice(VERSIONS) if rnd.random() < 0.2 else b"HTTP/1.1"
    status = rnd.choice(STATUS) if rnd.random() < 0.3 else b"200 OK"
    return _head(rnd, version + b" " + status, _headers(rnd))


def _h11_request(data: bytes) -> QuickHead | None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    conn.receive_data(data)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return None
    if not isinstance(event, h11.Request):
        return None
    end = len(data) - len(conn.trailing_data[0])
    raw = list(event.headers.raw_items())
    return QuickHead(
        event.method, event.target, 0, b"", event.http_version, raw, list(event.headers), end
    )


def _h11_response(data: bytes) -> QuickHead | None:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "t")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return None
    if not isinstance(event, h11.Response):
        return None
    end = len(data) - len(conn.trailing_data[0])
    raw = list(event.headers.raw_items())
    return QuickHead(
        b"",
        b"",
        event.status_code,
        event.reason,
        event.http_version,
        raw,
        list(event.headers),
        end,
    )


@pytest.mark.parametrize("seed", range(4))
def test_what_the_quick_path_reads_h11_reads_the_same_way(seed: int) -> None:
    rnd = random.Random(seed)
    taken = refused = 0
    for _ in range(1500):
        body = rnd.choice([b"", b"hello", b"GET /next HTTP/1.1\r\n"])
        for make, quick, slow in (
            (_request, quick_request, _h11_request),
            (_response, quick_response, _h11_response),
        ):
            data = make(rnd) + body
            fast = quick(data, MAX_HEAD)
            if fast is None:
                refused += 1
                continue
            taken += 1
            assert fast == slow(data), data
    assert taken > 600 and refused > 1000  # both ways are taken: the corpus tests both


def test_heads_of_real_clients_and_engines_take_the_quick_path() -> None:
    sdk = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\nAccept: application/json\r\n"
        b"Content-Type: application/json\r\nUser-Agent: OpenAI/Python 1.99.1\r\n"
        b"X-Stainless-Retry-Count: 0\r\nAuthorization: Bearer sk-x\r\nContent-Length: 96\r\n\r\n"
    )
    engine = (
        b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 10:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    request, response = quick_request(sdk, MAX_HEAD), quick_response(engine, MAX_HEAD)
    assert request is not None and request.end == len(sdk)
    assert request.method == b"POST" and (b"content-length", b"96") in request.lower
    assert response is not None and response.status == 200 and response.end == len(engine)
    assert request == _h11_request(sdk) and response == _h11_response(engine)


def test_what_h11_must_judge_is_left_to_it() -> None:
    for data in (
        b"GET / HTTP/1.1\r\n\r\n",  # no Host
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
        b"CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\n\r\n",
        b"GET / HTTP/1.1\nHost: a\n\n",
        b"GET / HTTP/1.1\r\nHost: a\r\n",  # not complete yet
    ):
        assert quick_request(data, MAX_HEAD) is None, data
    assert quick_response(b"HTTP/1.1 100 Continue\r\n\r\n", MAX_HEAD) is None
    head = b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"y" * 100 + b"\r\n\r\n"
    assert quick_request(head, 64) is None  # over the size h11 is given: its verdict
