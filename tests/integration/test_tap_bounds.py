"""The tap's memory for request bodies is bounded as a whole, whatever clients send; so are
its connections and descriptors."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketStream

from tests.support.net import wait_until
from tests.support.tap import RawUpstream, UpConn, running_tap
from tracer.capture.files import read_records

pytestmark = pytest.mark.anyio

BUDGET = 256 * 1024


async def test_unfinished_json_bodies_stay_within_the_body_budget(tmp_path: Path) -> None:
    """Eight clients each start a 1 MiB JSON body and send half of it: the tap holds at
    most its budget; the bodies past it are hashed as they stream, and say so."""

    async def swallow(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: c.eof or c.reset, timeout=30)

    upstream = RawUpstream(swallow)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (1 << 20)
    )
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path, body_memory=BUDGET) as handle:
            clients = [await anyio.connect_tcp("127.0.0.1", handle.port) for _ in range(8)]
            for client in clients:
                await client.send(head + b"x" * (1 << 19))
            await wait_until(lambda: sum(len(c.received) for c in upstream.conns) >= 8 << 19, 20)
            budget = handle.tap.body_budget
            assert budget.held <= BUDGET and budget.exceeded >= 1
            for client in clients:
                await client.send(b"y" * (1 << 19))  # the bodies end
            await wait_until(lambda: sum(len(c.received) for c in upstream.conns) >= 8 << 20, 20)
            await wait_until(lambda: budget.held == 0, 10)
            for client in clients:
                await client.aclose()
        tg.cancel_scope.cancel()
    ends = [r for r in read_records(handle.capture) if r["type"] == "request_end"]
    assert len(ends) == 8
    over = [r for r in ends if r.get("body_note")]
    assert over and all(r["body_sha256"] and not r["body_kept"] for r in over)


async def test_past_max_connections_the_tap_answers_503_itself(tmp_path: Path) -> None:
    async def hold(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: c.eof or c.reset, timeout=30)

    upstream = RawUpstream(hold)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path, max_connections=2) as handle:
            kept = [await anyio.connect_tcp("127.0.0.1", handle.port) for _ in range(2)]
            await wait_until(lambda: handle.tap.stats.connections_open == 2)
            extra = await anyio.connect_tcp("127.0.0.1", handle.port)
            answer = b""
            with anyio.fail_after(5):
                try:
                    while True:
                        answer += await extra.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    pass
            assert answer.startswith(b"HTTP/1.1 503 ") and b"--max-connections (2)" in answer
            assert handle.tap.stats.connections_refused == 1
            for s in [*kept, extra]:
                await s.aclose()
        tg.cancel_scope.cancel()


async def test_out_of_descriptors_is_the_taps_own_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMFILE when the tap connects upstream: a 503 naming the tap, not a 502 blaming the
    upstream."""
    import asyncio
    import errno as errno_

    async def never(*args: object, **kwargs: object) -> None:
        raise OSError(errno_.EMFILE, "Too many open files")

    async def idle(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: c.eof or c.reset, timeout=30)

    upstream = RawUpstream(idle)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path) as handle:
            async with await anyio.connect_tcp("127.0.0.1", handle.port) as s:
                monkeypatch.setattr(asyncio.get_running_loop(), "create_connection", never)
                await s.send(b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n")
                answer = b""
                with anyio.fail_after(5):
                    try:
                        while True:
                            answer += await s.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        pass
        tg.cancel_scope.cancel()
    assert answer.startswith(b"HTTP/1.1 503 ") and b"the tap itself is out of resources" in answer
    assert b"EMFILE" in answer and b"unreachable" not in answer
    records = list(read_records(handle.capture))
    ends = [r for r in records if r["type"] == "response_end"]
    assert ends and ends[0]["status"] == 503


async def test_a_low_descriptor_limit_gives_late_clients_the_taps_503_not_an_eof(
    tmp_path: Path,
) -> None:
    """A real `tracer proxy` under a hard limit of 160 descriptors, no --max-connections:
    its default keeps a descriptor for every client and its upstream, so the clients past
    that get its 503 with the limit named, and none is dropped with an EOF."""
    import re
    import subprocess
    import sys

    async def hold(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: c.eof or c.reset, timeout=60)

    code = (
        "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160)); "
        "sys.argv = ['tracer', *sys.argv[1:]]; runpy.run_module('tracer', run_name='__main__')"
    )
    upstream = RawUpstream(hold)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        cmd = [sys.executable, "-c", code, "proxy", "--listen", "127.0.0.1:0"]
        cmd += ["--upstream", f"http://127.0.0.1:{port}", "--capture", str(tmp_path / "c.jsonl")]
        cmd += ["--no-fingerprint"]
        process = await anyio.open_process(cmd, stdout=subprocess.DEVNULL)
        try:
            assert process.stderr is not None
            text = ""
            with anyio.fail_after(20):
                while not (found := re.search(r"listening on 127\.0\.0\.1:(\d+)", text)):
                    text += (await process.stderr.receive()).decode()
            tap_port = int(found.group(1))
            clients = []
            for _ in range(60):
                client = await anyio.connect_tcp("127.0.0.1", tap_port)
                await client.send(b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n")
                clients.append(client)
            answers = []
            for client in clients[48:]:  # (160 - 64) // 2 = 48 are let through
                answer = b""
                with anyio.fail_after(10):
                    try:
                        while True:
                            answer += await client.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        pass
                answers.append(answer)
            assert all(a.startswith(b"HTTP/1.1 503 ") for a in answers), answers
            assert b"--max-connections (48)" in answers[0]
            # the tap connects upstream as each client comes: poll until the 48 are there
            await wait_until(lambda: len(upstream.conns) >= 48, 10)
            assert len(upstream.conns) == 48
            for client in clients:
                await client.aclose()
        finally:
            process.terminate()
            with anyio.fail_after(10):
                await process.wait()
        tg.cancel_scope.cancel()


async def test_a_request_head_left_unfinished_is_closed_after_the_header_timeout(
    tmp_path: Path,
) -> None:
    """Slowloris: a client that sends part of a head and goes quiet is closed by the tap
    after --header-timeout, both sides; a client idle between requests is not."""

    async def answer(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: b"\r\n\r\n" in c.received or c.eof, timeout=30)
        if not conn.eof:
            await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await conn.wait_for(lambda c: c.eof or c.reset, timeout=30)

    upstream = RawUpstream(answer)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path, header_timeout=0.5) as handle:
            slow = await anyio.connect_tcp("127.0.0.1", handle.port)
            await slow.send(b"GET /v1/models HTTP/1.1\r\nHost: r\r\nx-a: 1\r\n")  # no end
            idle = await anyio.connect_tcp("127.0.0.1", handle.port)
            await idle.send(b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n")
            got = b""
            with anyio.fail_after(10):
                while not got.endswith(b"ok"):
                    got += await idle.receive()
            with anyio.fail_after(10):
                try:
                    while await slow.receive():
                        pass
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    pass
            await wait_until(lambda: handle.tap.stats.header_timeouts == 1)
            assert handle.tap.stats.connections_open == 1  # the idle keep-alive one stays
            for s in (slow, idle):
                await s.aclose()
        tg.cancel_scope.cancel()
    closes = [r for r in read_records(handle.capture) if r["type"] == "conn_close"]
    assert any(r.get("first_closer") == "tracer" or r.get("closed_by") == "tracer" for r in closes)
