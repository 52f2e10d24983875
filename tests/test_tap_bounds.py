"""The tap's memory for request bodies is bounded as a whole, whatever clients send."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketStream

from tracer.capture import read_records

from .conftest import RawUpstream, UpConn, running_tap, wait_until

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
