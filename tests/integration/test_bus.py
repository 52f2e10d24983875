"""The event bus in a real tap: a sink that raises is switched off alone; the tap forwards
and captures all the same."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketStream

from tests.support.net import wait_until
from tests.support.tap import RawUpstream, UpConn, running_tap
from tracer import events as ev
from tracer.capture.files import read_records


@pytest.mark.anyio
async def test_a_tap_whose_sink_raises_still_forwards_and_captures(tmp_path: Path) -> None:
    async def answer(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: b"\r\n\r\n" in c.received, timeout=10)
        await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await conn.wait_for(lambda c: c.eof or c.reset, timeout=10)

    def explode(event: ev.Event) -> None:
        raise ValueError("a sink's bug")

    upstream = RawUpstream(answer)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path) as handle:
            handle.tap.bus.add("exploding", explode)
            async with await anyio.connect_tcp("127.0.0.1", handle.port) as s:
                await s.send(b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n")
                got = b""
                with anyio.fail_after(10):
                    while not got.endswith(b"ok"):
                        got += await s.receive()
            await wait_until(lambda: handle.tap.stats.connections_open == 0)
            assert "exploding" in handle.tap.bus.disabled
        tg.cancel_scope.cancel()
    kinds = [r["type"] for r in read_records(handle.capture)]
    assert "request" in kinds and "response_end" in kinds and "conn_close" in kinds
