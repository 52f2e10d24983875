"""--inject-request-id: every request gets an id, nothing else changes, any cut."""

from __future__ import annotations

import random

import pytest

from tracer.proxy.inject import RequestIdInjector

GET = b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n"


WITH_ID = b"GET /a HTTP/1.1\r\nHost: r\r\nX-Request-Id: mine\r\n\r\n"


POST = b'POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\ncontent-length: 13\r\n\r\n{"a": "b\r\n"}'


CHUNKED = (
    b"POST /u HTTP/1.1\r\nHost: r\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5\r\nGET /\r\n4\r\n\r\n\r\n\r\n0\r\n\r\n"
)


STREAM = GET + WITH_ID + POST + CHUNKED + GET


def expected() -> bytes:
    def add(head: bytes, n: int) -> bytes:
        line, rest = head.split(b"\r\n", 1)
        return line + b"\r\nx-request-id: t-1-%d\r\n" % n + rest

    return add(GET, 1) + WITH_ID + add(POST, 3) + add(CHUNKED, 4) + add(GET, 5)


@pytest.mark.parametrize("seed", range(25))
def test_ids_are_added_whatever_the_cuts(seed: int) -> None:
    rnd = random.Random(seed)
    cuts = sorted(rnd.sample(range(1, len(STREAM)), k=rnd.randint(0, 20)))
    if seed == 0:
        cuts = list(range(1, len(STREAM)))  # byte by byte
    injector = RequestIdInjector("t-1")
    out = b"".join(
        injector.feed(STREAM[a:b]) for a, b in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)
    )
    assert out == expected()
    assert injector.injected == 4


def test_what_it_cannot_follow_passes_unchanged() -> None:
    for junk in (b"\x16\x03\x01\x02\x00" + b"x" * 100, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"):
        injector = RequestIdInjector("t")
        assert injector.feed(junk) == junk
        assert injector.feed(GET) == GET  # and stays pass-through
    bad = b"POST / HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\nabc"
    injector = RequestIdInjector("t")
    assert injector.feed(bad) == bad  # a body it cannot frame: the head is left alone too
    assert injector.feed(GET) == GET
    assert injector.passed_through == "a Transfer-Encoding other than chunked"


SMUGGLE = b"GET /smuggled HTTP/1.1\r\nHost: r\r\n\r\n"


@pytest.mark.parametrize(
    ("head", "why"),
    [
        # a lenient upstream reads Content-Length on the bare-LF line; a CRLF-only
        # rewriter would not, and would take the body for the next request
        (b"POST / HTTP/1.1\r\nHost: r\nContent-Length: %d\r\n\r\n", "bare LF"),
        (b"POST / HTTP/1.1\r\nHost: r\r\nX-A: b\r\n Content-Length: %d\r\n\r\n", "obs-fold"),
        (b"POST / HTTP/1.1\r\nContent-Length: %d\r\nContent-Length: 0\r\n\r\n", "more than one"),
        (
            b"POST / HTTP/1.1\r\nContent-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n",
            "both",
        ),
        (b"POST / HTTP/1.1\r\nContent-Length : %d\r\n\r\n", "NAME: VALUE"),
        (b"POST / HTTP/1.1\r\nContent-Length: +%d\r\n\r\n", "not a number"),
        (b"POST / HTTP/1.1\rHost: r\r\nContent-Length: %d\r\n\r\n", "bare CR"),
        # empty lines before the request line: some servers skip them, some do not
        (b"\r\nPOST / HTTP/1.1\r\nContent-Length: %d\r\n\r\n", "request"),
    ],
)
def test_an_ambiguous_head_passes_untouched(head: bytes, why: str) -> None:
    """No injection where parsers may disagree on the head: what the upstream gets is
    what the client sent, byte for byte, so nothing can be smuggled by the rewrite."""
    stream = head % len(SMUGGLE) + SMUGGLE + GET
    for cut in (len(stream), 7, 1):
        injector = RequestIdInjector("t")
        out = b"".join(injector.feed(stream[i : i + cut]) for i in range(0, len(stream), cut))
        assert out == stream
        assert injector.passed_through is not None and why in injector.passed_through
        assert injector.injected == 0


def test_a_bare_lf_request_is_never_held() -> None:
    """A head in bare LFs has no CRLFCRLF: it goes on at once instead of being held."""
    injector = RequestIdInjector("t")
    data = b"GET / HTTP/1.1\nHost: r\n\n"
    assert injector.feed(data) == data
    assert injector.passed_through is not None and "bare LF" in injector.passed_through
