"""Bad input, resets, silent peers: a clear outcome, nothing lost, nothing leaked."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream

from tests.support.analyze import analyze_json
from tests.support.http import GET, OK_CL, POST, SSE_HEAD, chunk
from tests.support.net import recv_all, recv_until, wait_until
from tests.support.tap import RawUpstream, UpConn, both_loops, open_fds, running_tap
from tracer import events as ev

pytestmark = [pytest.mark.anyio, both_loops]


EVENT = chunk(b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n')


def _reset(stream: SocketStream) -> None:
    """Close with RST (SO_LINGER 0), as a crashed or impatient peer does."""
    sock = stream.extra(SocketAttribute.raw_socket)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def test_upstream_unreachable_gets_502_with_reason(tmp_path: Path, refused_port: int) -> None:
    port = refused_port
    async with running_tap(port, tmp_path) as tap:
        async with await anyio.connect_tcp("127.0.0.1", tap.port) as s:
            await s.send(GET)
            body, how = await recv_all(s)
        await tap.wait_for(ev.ConnClose)
    assert body.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
    assert b"unreachable" in body and b"refused" in body.lower()
    assert how == "fin"
    failed = [e for e in tap.events() if isinstance(e, ev.UpstreamConnect) and e.phase == "failed"]
    assert len(failed) == 1 and failed[0].error
    end = [e for e in tap.events() if isinstance(e, ev.ResponseEnd)]
    assert [e.termination for e in end] == ["tracer_response"]
    close = [e for e in tap.events() if isinstance(e, ev.ConnClose)][0]
    assert close.closed_by == "tracer" and not close.upstream_opened


async def test_tls_on_plain_port_gets_400(tmp_path: Path) -> None:
    upstream = RawUpstream(lambda s, c: c.wait_for(lambda c: c.eof))
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path) as tap:
            async with await anyio.connect_tcp("127.0.0.1", tap.port) as s:
                await s.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40)
                body, _ = await recv_all(s)
            await tap.wait_for(ev.ConnClose)
        tg.cancel_scope.cancel()
    assert body.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"TLS handshake" in body
    assert upstream.conns == []  # nothing was forwarded
    # the analysis blames the client: its connection never carried a request
    doc = analyze_json(tap.capture)
    (finding,) = doc["findings"]
    assert (finding["kind"], finding["party"]) == ("client_connection_failed", "client")
    assert "TLS" in finding["summary"] and doc["verdict"]["party"] == "client"


async def test_client_that_sends_nothing(tmp_path: Path) -> None:
    upstream = RawUpstream(lambda s, c: c.wait_for(lambda c: c.eof))
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path) as tap:
            s = await anyio.connect_tcp("127.0.0.1", tap.port)
            await tap.wait_for(ev.ConnOpen)
            await s.aclose()
            closes = await tap.wait_for(ev.ConnClose)
        tg.cancel_scope.cancel()
    assert closes[0].closed_by == "client" and closes[0].how == "fin"
    assert not closes[0].upstream_opened and closes[0].requests == 0
    assert upstream.conns == []


@pytest.mark.parametrize(
    "phase", ["before-request", "mid-request", "before-response", "mid-stream"]
)
async def test_client_reset_is_propagated(phase: str, tmp_path: Path) -> None:
    async def script(stream: SocketStream, conn: UpConn) -> None:
        if phase in ("before-response", "mid-stream"):
            await conn.wait_for(lambda c: len(c.received) >= len(POST))
        if phase == "mid-stream":
            await stream.send(SSE_HEAD + EVENT)
        await conn.wait_for(lambda c: c.eof or c.reset, timeout=10)

    upstream = RawUpstream(script)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path) as tap:
            s = await anyio.connect_tcp("127.0.0.1", tap.port)
            if phase == "before-request":
                await s.send(b"G")
            elif phase == "mid-request":
                await s.send(POST[:-10])
            else:
                await s.send(POST)
            await wait_until(lambda: bool(upstream.conns) and len(upstream.conns[0].received) > 0)
            if phase == "mid-stream":
                await recv_until(s, lambda b: b"content" in b)
            _reset(s)
            await s.aclose()
            closes = await tap.wait_for(ev.ConnClose)
            await upstream.conns[0].wait_for(lambda c: c.reset or c.eof)
        tg.cancel_scope.cancel()
    assert closes[0].closed_by == "client" and closes[0].how == "reset"
    assert upstream.conns[0].reset, "the client's reset must reach the upstream as a reset"
    if phase in ("before-response", "mid-stream"):
        ends = [e for e in tap.events() if isinstance(e, ev.ResponseEnd)]
        assert [e.termination for e in ends] == ["client_abort"]
    if phase == "mid-request":
        req_end = [e for e in tap.events() if isinstance(e, ev.RequestEnd)]
        assert req_end and not req_end[0].complete


@pytest.mark.parametrize("phase", ["before-response", "mid-stream"])
async def test_upstream_reset_is_propagated(phase: str, tmp_path: Path) -> None:
    async def script(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: len(c.received) >= len(POST))
        if phase == "mid-stream":
            await stream.send(SSE_HEAD + EVENT + EVENT[:20])
        _reset(stream)
        await stream.aclose()

    upstream = RawUpstream(script)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path) as tap:
            async with await anyio.connect_tcp("127.0.0.1", tap.port) as s:
                await s.send(POST)
                data, how = await recv_all(s)
            await tap.wait_for(ev.ConnClose)
        tg.cancel_scope.cancel()
    assert how == "reset"
    end = [e for e in tap.events() if isinstance(e, ev.ResponseEnd)][0]
    assert end.termination == "truncated" and end.close == "reset"
    if phase == "mid-stream":
        assert data.startswith(SSE_HEAD) and end.mid_event
    else:
        assert data == b"" and end.body_bytes == 0 and end.status is None
    close = [e for e in tap.events() if isinstance(e, ev.ConnClose)][0]
    assert close.closed_by == "upstream" and close.how == "reset" and close.in_flight


async def test_upstream_fin_mid_stream_is_truncated(tmp_path: Path) -> None:
    async def script(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: len(c.received) >= len(POST))
        await stream.send(SSE_HEAD + EVENT)
        await stream.aclose()

    upstream = RawUpstream(script)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path) as tap:
            async with await anyio.connect_tcp("127.0.0.1", tap.port) as s:
                await s.send(POST)
                data, how = await recv_all(s)
            await tap.wait_for(ev.ConnClose)
        tg.cancel_scope.cancel()
    assert how == "fin" and data == SSE_HEAD + EVENT
    end = [e for e in tap.events() if isinstance(e, ev.ResponseEnd)][0]
    assert end.termination == "truncated" and end.close == "fin" and not end.mid_event
    assert end.events == 1 and not end.done


async def test_upstream_that_never_answers_stalls(tmp_path: Path) -> None:
    upstream = RawUpstream(lambda s, c: c.wait_for(lambda c: c.eof or c.reset, timeout=30))
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path, stall_after=0.3) as tap:
            async with await anyio.connect_tcp("127.0.0.1", tap.port) as s:
                await s.send(POST)
                stalls = await tap.wait_for(ev.Stall, phase="start")
            await tap.wait_for(ev.ConnClose)
        tg.cancel_scope.cancel()
    assert stalls[0].direction == "upstream_silent" and stalls[0].silent_for >= 0.3
    end = [e for e in tap.events() if isinstance(e, ev.ResponseEnd)][0]
    assert end.termination == "client_abort" and end.status is None
    assert [e.phase for e in tap.events() if isinstance(e, ev.Stall)] == ["start", "end"]


async def test_client_not_reading_is_told_apart(tmp_path: Path) -> None:
    """The upstream keeps sending; the client stops reading: writes to it back up."""
    blob = chunk(b"data: " + b"x" * 16000 + b"\n\n")

    async def flood(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: len(c.received) >= len(POST))
        await stream.send(SSE_HEAD)
        with anyio.move_on_after(20):
            for _ in range(2000):  # bounded: at most ~32 MB
                await stream.send(blob)

    upstream = RawUpstream(flood)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path, stall_after=0.3) as tap:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", tap.port))  # loopback: immediate
            sock.sendall(POST)
            stalls = await tap.wait_for(ev.Stall, phase="start", timeout=10)
            sock.close()
            await tap.wait_for(ev.ConnClose)
        tg.cancel_scope.cancel()
    assert stalls[0].direction == "client_not_reading"
    end = [e for e in tap.events() if isinstance(e, ev.ResponseEnd)][0]
    assert end.termination == "client_abort"


async def test_shutdown_records_in_flight(tmp_path: Path) -> None:
    upstream = RawUpstream(lambda s, c: c.wait_for(lambda c: c.eof or c.reset, timeout=30))
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        s = None
        async with running_tap(port, tmp_path) as tap:
            s = await anyio.connect_tcp("127.0.0.1", tap.port)
            await s.send(POST)
            await tap.wait_for(ev.RequestEnd)
        _data, _ = await recv_all(s)
        await s.aclose()
        tg.cancel_scope.cancel()
    end = [e for e in tap.events() if isinstance(e, ev.ResponseEnd)][0]
    assert end.termination == "in_flight"
    close = [e for e in tap.events() if isinstance(e, ev.ConnClose)][0]
    assert close.closed_by == "tracer" and close.in_flight
    assert isinstance(tap.events()[-1], ev.CaptureEnd)


async def test_no_descriptor_or_task_leaks(tmp_path: Path) -> None:
    """Hundreds of connections of every kind: descriptors back to the baseline."""

    async def script(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: b"\r\n\r\n" in c.received or c.eof or c.reset)
        if b"reset-me" in conn.received:
            _reset(stream)
            await stream.aclose()
            return
        if conn.received.startswith(b"GET"):
            await stream.send(OK_CL)
        await conn.wait_for(lambda c: c.eof or c.reset)

    upstream = RawUpstream(script)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path) as tap:
            baseline = open_fds()

            async def one(i: int) -> None:
                s = await anyio.connect_tcp("127.0.0.1", tap.port)
                kind = i % 5
                if kind == 0:  # normal request
                    await s.send(GET)
                    await recv_until(s, lambda b: len(b) >= len(OK_CL))
                elif kind == 1:  # garbage
                    await s.send(b"\x00\x01garbage\r\n\r\n")
                elif kind == 2:  # upstream resets
                    await s.send(b"GET /reset-me HTTP/1.1\r\nhost: x\r\n\r\n")
                    await recv_all(s)
                elif kind == 3:  # client resets mid-request
                    await s.send(POST[:30])
                    _reset(s)
                # kind 4: connect and close
                await s.aclose()

            for batch in range(6):
                async with anyio.create_task_group() as clients:
                    for i in range(50):
                        clients.start_soon(one, batch * 50 + i)
            await wait_until(lambda: tap.tap.stats.connections_open == 0, timeout=10)
            await wait_until(lambda: open_fds() <= baseline, timeout=10)
            assert not tap.tap.live
        tg.cancel_scope.cancel()
    assert tap.tap.stats.connections_total == 300


async def test_idle_timeout_is_opt_in_and_spares_requests_in_flight(tmp_path: Path) -> None:
    """--idle-timeout closes idle keep-alive connections, never one with a request open."""

    async def slow_then_idle(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: b"\r\n\r\n" in c.received)
        await stream.send(SSE_HEAD)
        for _ in range(2):  # silences longer than the idle timeout, with a request open
            await anyio.sleep(0.45)
            await stream.send(EVENT)
        await stream.send(b"0\r\n\r\n")
        await conn.wait_for(lambda c: c.eof or c.reset, timeout=10)

    upstream = RawUpstream(slow_then_idle)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path, idle_timeout=0.3) as tap:
            async with await anyio.connect_tcp("127.0.0.1", tap.port) as s:
                await s.send(POST)
                data, how = await recv_all(s, timeout=10)
            await tap.wait_for(ev.ConnClose)
        tg.cancel_scope.cancel()
    assert how == "fin" and data.endswith(b"0\r\n\r\n")
    end = next(e for e in tap.events() if isinstance(e, ev.ResponseEnd))
    assert end.termination == "complete" and end.events == 2
    close = next(e for e in tap.events() if isinstance(e, ev.ConnClose))
    assert close.closed_by == "tracer" and not close.in_flight


def _black_hole() -> tuple[socket.socket, list[socket.socket]]:
    """A listener on 127.0.0.1 that never accepts, its queue filled: a connect to it gets
    no answer (the kernel drops the SYN), as to an upstream host that is down."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(listener.getsockname())
        fillers.append(s)
    return listener, fillers


async def test_an_upstream_that_never_answers_the_connect_gets_502_after_the_timeout(
    tmp_path: Path,
) -> None:
    listener, fillers = _black_hole()
    try:
        port = listener.getsockname()[1]
        async with running_tap(port, tmp_path, connect_timeout=0.5) as tap:
            async with await anyio.connect_tcp("127.0.0.1", tap.port) as s:
                await s.send(GET)
                body, _ = await recv_all(s)
            await tap.wait_for(ev.ConnClose)
    finally:
        for s in (listener, *fillers):
            s.close()
    assert body.startswith(b"HTTP/1.1 502 Bad Gateway\r\n") and b"timed out after 0.5s" in body
    failed = [e for e in tap.events() if isinstance(e, ev.UpstreamConnect) and e.phase == "failed"]
    assert len(failed) == 1 and failed[0].error == "connect timed out after 0.5s"


async def test_stopping_the_tap_ends_the_connects_in_flight(tmp_path: Path) -> None:
    listener, fillers = _black_hole()
    try:
        port = listener.getsockname()[1]
        async with running_tap(port, tmp_path, connect_timeout=60) as tap:
            client = await anyio.connect_tcp("127.0.0.1", tap.port)
            await client.send(GET)
            await tap.wait_for(ev.UpstreamConnect, phase="start")
            assert len(tap.tap._connects) == 1
        await wait_until(lambda: not tap.tap._connects, 5)  # cancelled, not left running
        with anyio.fail_after(5):
            body, _ = await recv_all(client)  # and the client's connection is closed
        await client.aclose()
    finally:
        for s in (listener, *fillers):
            s.close()
    assert body == b""
    close = [e for e in tap.events() if isinstance(e, ev.ConnClose)]
    assert len(close) == 1 and close[0].closed_by == "tracer" and not close[0].upstream_opened
