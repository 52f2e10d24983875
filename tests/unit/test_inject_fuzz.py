"""--inject-request-id against a bounded random corpus of hostile request streams.

The invariant (issue 24): with injection on, the upstream's parse of what it received
equals the client's request plus exactly one header, or the bytes are identical. Checked
with h11 (strict) and with a lenient parser that takes bare LF line endings, obs-fold,
``Name :`` and the first of several Content-Lengths, as lenient servers do: every line
the injector added must sit right after a request line where both parsers see one, and
no parser may see more requests in what went upstream than in what the client sent.
"""

from __future__ import annotations

import random
import re

import h11
import pytest

from tracer.proxy.inject import RequestIdInjector

PREFIX = "zz9"
ADDED = re.compile(rb"x-request-id: zz9-[0-9]+\r\n")
SMUGGLE = b"GET /smuggled HTTP/1.1\r\nHost: r\r\n\r\n"


def _chunked(body: bytes, rnd: random.Random) -> bytes:
    out, i = b"", 0
    while i < len(body):
        n = rnd.randint(1, 9)
        out += b"%x\r\n" % len(body[i : i + n]) + body[i : i + n] + b"\r\n"
        i += n
    return out + b"0\r\n\r\n"


def _request(rnd: random.Random, n: int) -> bytes:
    """One request, well formed or with one of the shapes parsers disagree on."""
    body = rnd.choice([b"", b'{"a": 1}', SMUGGLE, b"x" * rnd.randint(1, 40)])
    method = b"POST" if body else rnd.choice([b"GET", b"POST"])
    lines = [b"%s /r%d HTTP/1.1" % (method, n), b"Host: r"]
    if rnd.random() < 0.2:
        lines.append(b"X-Request-Id: mine-%d" % n)
    chunked = bool(body) and rnd.random() < 0.3
    framing = [b"Transfer-Encoding: chunked"] if chunked else [b"Content-Length: %d" % len(body)]
    odd = rnd.choice(["none"] * 4 + ["lf", "fold", "two_cl", "cl_te", "space", "nul", "cr"])
    if odd == "two_cl":
        framing.append(b"Content-Length: 0")
    elif odd == "cl_te":
        framing.append(b"Content-Length: 3" if chunked else b"Transfer-Encoding: chunked")
    elif odd == "space":
        framing = [f.replace(b":", b" :", 1) for f in framing]
    elif odd == "fold":
        lines.append(b"X-Fold: a")
        framing = [b" " + framing[0], *framing[1:]] if rnd.random() < 0.5 else framing
        lines.append(b" continued")
    elif odd == "nul":
        lines.append(b"X-Nul: a\x00b")
    lines += framing
    head = b""
    for i, line in enumerate(lines):
        end = b"\r\n"
        if odd == "lf" and i == len(lines) - 1:
            end = b"\n"
        elif odd == "cr" and i == 1:
            end = b"\r"
        head += line + end
    return head + b"\r\n" + (_chunked(body, rnd) if chunked else body)


def _lenient(data: bytes) -> list[tuple[int, bytes, bytes]]:
    """(offset just after the request line, request line, body) per request, as a
    lenient server reads them; stops where it cannot."""
    out: list[tuple[int, bytes, bytes]] = []
    pos = 0
    while pos < len(data):
        m = re.search(rb"\r?\n\r?\n", data[pos:])
        if m is None:
            break
        head = data[pos : pos + m.start()]
        lines = re.split(rb"\r?\n", head)
        line_end = (
            pos
            + len(lines[0])
            + (2 if data[pos + len(lines[0]) : pos + len(lines[0]) + 2] == b"\r\n" else 1)
        )
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers.setdefault(name.strip().lower(), value.strip())
        pos += m.end()
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            body = b""
            while True:
                size_end = data.find(b"\n", pos)
                if size_end < 0:
                    return out
                try:
                    size = int(data[pos:size_end].strip() or b"x", 16)
                except ValueError:
                    return out
                pos = size_end + 1
                if size == 0:
                    pos = data.find(b"\n", pos) + 1 if data.find(b"\n", pos) >= 0 else len(data)
                    break
                body += data[pos : pos + size]
                pos += size + 2
        else:
            try:
                length = int(headers.get(b"content-length", b"0") or b"0")
            except ValueError:
                return out
            body, pos = data[pos : pos + length], pos + length
        out.append((line_end, lines[0], body))
    return out


def _strict(data: bytes) -> list[tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes]]:
    """(method, target, headers less x-request-id, body) per request, as h11 reads them,
    as far as it can."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    conn.receive_data(b"")
    out = []
    current: list[object] = []
    body = b""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return out
        if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
            return out
        if event is h11.PAUSED:
            return out
        if isinstance(event, h11.Request):
            headers = [(k, v) for k, v in event.headers if k != b"x-request-id"]
            current, body = [event.method, event.target, headers], b""
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            method, target, headers = current
            out.append((method, target, headers, body))  # type: ignore[arg-type]
            conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
            conn.send(h11.EndOfMessage())
            conn.start_next_cycle()


def _inject(stream: bytes, rnd: random.Random) -> bytes:
    cuts = sorted(rnd.sample(range(1, len(stream)), k=min(len(stream) - 1, rnd.randint(0, 12))))
    injector = RequestIdInjector(PREFIX)
    out = b"".join(
        injector.feed(stream[a:b]) for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)
    )
    return out + injector.flush()


@pytest.mark.parametrize("seed", range(12))
def test_injection_never_changes_how_any_parser_reads_the_stream(seed: int) -> None:
    rnd = random.Random(seed)
    for _ in range(250):  # bounded: 3,000 streams in all
        stream = b"".join(_request(rnd, n) for n in range(rnd.randint(1, 4)))
        out = _inject(stream, rnd)
        if out == stream:
            continue
        # what was added is whole lines, and nothing else changed
        added = [m.start() for m in ADDED.finditer(out)]
        assert ADDED.sub(b"", out) == stream
        at: list[int] = []
        shift = 0
        for m in ADDED.finditer(out):
            at.append(m.start() - shift)
            shift += m.end() - m.start()
        assert len(added) == len(at)
        # every added line sits right after a request line the lenient parser sees
        lenient_in, lenient_out = _lenient(stream), _lenient(out)
        assert set(at) <= {line_end for line_end, _, _ in lenient_in}, (stream, out)
        assert [(line, body) for _, line, body in lenient_out] == [
            (line, body) for _, line, body in lenient_in
        ]
        # and h11 reads the same requests, bodies and headers, less the one added
        strict_in, strict_out = _strict(stream), _strict(out)
        assert strict_out[: len(strict_in)] == strict_in
        assert len(strict_out) == len(strict_in)
