"""The tap forwards bytes unchanged, as they arrive, with the connection structure intact."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketStream

from tests.support.http import GET, OK_CL, POST, SSE_HEAD, chunk
from tests.support.net import recv_all, recv_until
from tests.support.tap import RawUpstream, UpConn, both_loops, running_tap
from tracer import events as ev

pytestmark = [pytest.mark.anyio, both_loops]


# A step is ("send", bytes), ("expect", n) — wait until n bytes in total arrived —,
# ("close",) or ("shutdown",) (half-close: FIN, keep reading).
Step = tuple[object, ...]


@dataclass
class Case:
    name: str
    client: list[Step]
    upstream: list[Step]
    anomaly: bool = False


def _total(steps: list[Step]) -> bytes:
    return b"".join(s[1] for s in steps if s[0] == "send")  # type: ignore[misc]


CHUNKED = (
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n"
)
SSE_EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]
EXPECT_HEAD = (
    b"POST /upload HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\ncontent-length: 5\r\n\r\n"
)
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
HTTP10_REQ = b"GET /old HTTP/1.0\r\n\r\n"
HTTP10_RESP = b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nread until close\n"
BAD_CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nZZZ\r\nnot chunked at all\r\n"
GARBAGE_REQ = b"GARB\x00GE / HTTP/9.9\r\n\x01\r\n\r\n"
BAD_400 = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"

CASES = [
    Case(
        "content-length",
        [("send", GET), ("expect", len(OK_CL)), ("close",)],
        [("expect", len(GET)), ("send", OK_CL)],
    ),
    Case(
        "chunked-trailers",
        [("send", GET), ("expect", len(CHUNKED)), ("close",)],
        [("expect", len(GET)), ("send", CHUNKED)],
    ),
    Case(
        "sse",
        [
            ("send", POST),
            ("expect", len(SSE_HEAD) + sum(len(chunk(e)) for e in SSE_EVENTS) + 5),
            ("close",),
        ],
        [("expect", len(POST)), ("send", SSE_HEAD)]
        + [("send", chunk(e)) for e in SSE_EVENTS]
        + [("send", b"0\r\n\r\n")],
    ),
    Case(
        "pipelined",
        [("send", GET + GET), ("expect", 2 * len(OK_CL)), ("close",)],
        [("expect", 2 * len(GET)), ("send", OK_CL), ("send", OK_CL)],
    ),
    Case(
        "expect-100-continue",
        [
            ("send", EXPECT_HEAD),
            ("expect", len(CONTINUE)),
            ("send", b"hello"),
            ("expect", len(CONTINUE) + len(OK_CL)),
            ("close",),
        ],
        [
            ("expect", len(EXPECT_HEAD)),
            ("send", CONTINUE),
            ("expect", len(EXPECT_HEAD) + 5),
            ("send", OK_CL),
        ],
    ),
    Case(
        "http10-read-until-close",
        [("send", HTTP10_REQ), ("expect", len(HTTP10_RESP))],
        [("expect", len(HTTP10_REQ)), ("send", HTTP10_RESP), ("close",)],
    ),
    Case(
        "malformed-chunked-response",
        [("send", GET), ("expect", len(BAD_CHUNKED))],
        [("expect", len(GET)), ("send", BAD_CHUNKED), ("close",)],
        anomaly=True,
    ),
    Case(
        "malformed-request",
        [("send", GARBAGE_REQ), ("expect", len(BAD_400))],
        [("expect", len(GARBAGE_REQ)), ("send", BAD_400), ("close",)],
        anomaly=True,
    ),
    Case(
        "half-close-after-request",
        [("send", GET), ("shutdown",), ("expect", len(OK_CL))],
        [("expect", len(GET)), ("send", OK_CL), ("close",)],
    ),
]


async def _run_upstream_steps(stream: SocketStream, conn: UpConn, steps: list[Step]) -> None:
    for step in steps:
        if step[0] == "send":
            await stream.send(step[1])  # type: ignore[arg-type]
        elif step[0] == "expect":
            n = step[1]
            await conn.wait_for(lambda c, n=n: len(c.received) >= n)  # type: ignore[misc]
        elif step[0] == "close":
            await stream.aclose()
            return
    await conn.wait_for(lambda c: c.eof or c.reset)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_bytes_pass_unchanged(case: Case, tmp_path: Path) -> None:
    upstream = RawUpstream(lambda s, c: _run_upstream_steps(s, c, case.upstream))
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path) as tap:
            stream = await anyio.connect_tcp("127.0.0.1", tap.port)
            received = bytearray()
            closed = False
            for step in case.client:
                if step[0] == "send":
                    await stream.send(step[1])  # type: ignore[arg-type]
                elif step[0] == "expect":
                    n = step[1]
                    received += await recv_until(stream, lambda b, n=n: len(received) + len(b) >= n)  # type: ignore[misc]
                elif step[0] == "shutdown":
                    await stream.send_eof()
                elif step[0] == "close":
                    closed = True
            if not closed:
                rest, _ = await recv_all(stream)
                received += rest
            await stream.aclose()
            await tap.wait_for(ev.ConnClose)
        tg.cancel_scope.cancel()
    assert len(upstream.conns) == 1
    assert bytes(upstream.conns[0].received) == _total(case.client)
    assert bytes(received) == _total(case.upstream)
    anomalies = [e for e in tap.events() if isinstance(e, ev.Anomaly)]
    assert bool(anomalies) == case.anomaly, anomalies


async def test_n_connections_keep_their_reuse_pattern(tmp_path: Path) -> None:
    """N client connections give N upstream connections, each with the same requests."""

    async def answer_each(stream: SocketStream, conn: UpConn) -> None:
        sent = 0
        while True:
            await conn.wait_for(lambda c: c.received.count(b"\r\n\r\n") > sent or c.eof)
            if conn.received.count(b"\r\n\r\n") <= sent:
                return
            sent += 1
            await stream.send(OK_CL)

    upstream = RawUpstream(answer_each)
    pattern = [1, 3, 2, 5, 1, 4]
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path) as tap:

            async def client(n: int) -> None:
                async with await anyio.connect_tcp("127.0.0.1", tap.port) as s:
                    for _ in range(n):
                        await s.send(GET)
                        got = await recv_until(s, lambda b: len(b) >= len(OK_CL))
                        assert got == OK_CL

            async with anyio.create_task_group() as clients:
                for n in pattern:
                    clients.start_soon(client, n)
            await tap.wait_for(ev.ConnClose, count=len(pattern))
        tg.cancel_scope.cancel()
    assert sorted(c.received.count(b"GET /v1/models") for c in upstream.conns) == sorted(pattern)
    heads = [e for e in tap.events() if isinstance(e, ev.RequestHead)]
    per_conn: dict[int, list[int]] = {}
    for h in heads:
        per_conn.setdefault(h.conn, []).append(h.seq)
    assert sorted(len(v) for v in per_conn.values()) == sorted(pattern)
    assert all(v == list(range(1, len(v) + 1)) for v in per_conn.values())
    # Secrets never reach the capture.
    assert b"sk-secret" not in tap.capture.read_bytes()


async def test_streaming_is_never_held_back(tmp_path: Path) -> None:
    """Event k+1 is only sent once the client has received event k (a side channel)."""
    n_events = 20
    got: list[anyio.Event] = [anyio.Event() for _ in range(n_events)]

    async def lockstep(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: len(c.received) >= len(POST))
        await stream.send(SSE_HEAD)
        for k in range(n_events):
            if k:
                await got[k - 1].wait()
            await stream.send(chunk(b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % k))
        await stream.send(b"0\r\n\r\n")
        await conn.wait_for(lambda c: c.eof)

    upstream = RawUpstream(lockstep)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path) as tap:
            async with await anyio.connect_tcp("127.0.0.1", tap.port) as s:
                await s.send(POST)
                buf = b""
                with anyio.fail_after(10):
                    for k in range(n_events):
                        marker = b'"t%d"' % k
                        while marker not in buf:
                            buf += await s.receive()
                        got[k].set()
                    while not buf.endswith(b"0\r\n\r\n"):
                        buf += await s.receive()
            ends = await tap.wait_for(ev.ResponseEnd)
        tg.cancel_scope.cancel()
    assert ends[0].termination == "complete"
    assert ends[0].events == n_events
