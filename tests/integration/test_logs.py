"""Log lines are data: JSON for machines, and every line inside a connection has its id."""

from __future__ import annotations

import io
import json
from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketStream

from tests.support.http import POST
from tests.support.tap import RawUpstream, UpConn, running_tap
from tracer import events as ev
from tracer import logs

pytestmark = pytest.mark.anyio


async def test_stall_log_lines_carry_the_connection(tmp_path: Path) -> None:
    buf = io.StringIO()
    logs.configure(json=True, level="info", stream=buf)

    async def silent(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: c.eof or c.reset, timeout=30)

    upstream = RawUpstream(silent)
    try:
        async with anyio.create_task_group() as tg:
            port = await tg.start(upstream.serve)
            async with running_tap(port, tmp_path, stall_after=0.2, name="logtap") as tap:
                async with await anyio.connect_tcp("127.0.0.1", tap.port) as s:
                    await s.send(POST)
                    await tap.wait_for(ev.Stall, phase="start")
                await tap.wait_for(ev.ConnClose)
            tg.cancel_scope.cancel()
    finally:
        logs.configure(json=False)
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    stall = next(line for line in lines if line["event"] == "stall started")
    assert stall["conn"] == 1 and stall["tap"] == "logtap" and stall["level"] == "warning"
    assert stall["direction"] == "upstream_silent"
    ended = next(line for line in lines if line["event"].startswith("response ended"))
    assert ended["conn"] == 1 and ended["event"] == "response ended client_abort"
