"""A scripted raw upstream and a tap in-process, on 127.0.0.1 with ports the kernel picks."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

from tests.support.net import wait_until
from tracer import events as ev
from tracer.capture.files import CaptureWriter, read_events
from tracer.proxy.relay import Tap, TapConfig

# ---- a scripted raw upstream ----------------------------------------------------------


@dataclass
class UpConn:
    """One connection the upstream accepted: what it received, and how it ended."""

    index: int
    received: bytearray = field(default_factory=bytearray)
    eof: bool = False
    reset: bool = False
    changed: anyio.Event = field(default_factory=anyio.Event)

    def _bump(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    async def wait_for(self, predicate: Callable[[UpConn], bool], timeout: float = 5.0) -> None:
        with anyio.fail_after(timeout):
            while not predicate(self):
                await self.changed.wait()


Script = Callable[[SocketStream, UpConn], Awaitable[None]]


class RawUpstream:
    """A TCP server whose per-connection behaviour is a test-provided coroutine.

    A background reader records everything received, so scripts can wait for bytes
    with ``conn.wait_for(...)`` while they write whatever they like.
    """

    def __init__(self, script: Script) -> None:
        self.script = script
        self.conns: list[UpConn] = []
        self.port = 0
        self.accepted = anyio.Event()

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = int(listener.extra(SocketAttribute.local_port))
        task_status.started(self.port)
        async with listener:
            await listener.serve(self._handle)

    async def _handle(self, stream: SocketStream) -> None:
        conn = UpConn(index=len(self.conns) + 1)
        self.conns.append(conn)
        self.accepted.set()
        async with stream, anyio.create_task_group() as tg:

            async def reader() -> None:
                while True:
                    try:
                        data = await stream.receive()
                    except anyio.EndOfStream:
                        conn.eof = True
                        conn._bump()
                        return
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        conn.reset = True
                        conn._bump()
                        return
                    conn.received += data
                    conn._bump()

            tg.start_soon(reader)
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                await self.script(stream, conn)
            tg.cancel_scope.cancel()


# ---- a tap in-process -----------------------------------------------------------------


@dataclass
class TapHandle:
    tap: Tap
    port: int
    capture: Path
    live: list[ev.Event] = field(default_factory=list)  # every event, as emitted

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def events(self) -> list[ev.Event]:
        """The capture file's events (complete once the tap context has exited)."""
        return list(read_events(self.capture))

    def of(self, cls: type[Any]) -> list[Any]:
        """Live events of one type, in emission order."""
        return [e for e in self.live if isinstance(e, cls)]

    async def wait_for(
        self, cls: type[Any], count: int = 1, timeout: float = 5.0, **match: Any
    ) -> list[Any]:
        """Wait until ``count`` live events of ``cls`` (with matching fields) were emitted."""

        def found() -> list[Any]:
            return [e for e in self.of(cls) if all(getattr(e, k) == v for k, v in match.items())]

        await wait_until(lambda: len(found()) >= count, timeout)
        return found()


@asynccontextmanager
async def running_tap(
    upstream_port: int, tmp_path: Path, **config: Any
) -> AsyncIterator[TapHandle]:
    path = tmp_path / f"tap-{time.monotonic_ns()}.jsonl"
    writer = CaptureWriter(path, flush_interval=0.005)
    cfg = TapConfig(
        "127.0.0.1", 0, "127.0.0.1", upstream_port, name=config.pop("name", "t"), **config
    )
    tap = Tap(cfg, capture=writer)
    writer.write(tap.header())
    handle: TapHandle | None = None
    try:
        async with anyio.create_task_group() as tg:
            bound = await tg.start(tap.serve)
            handle = TapHandle(tap=tap, port=bound[0][1], capture=path)
            tap.bus.add("test", handle.live.append)
            yield handle
            tap.stop()
            tg.cancel_scope.cancel()
    finally:
        writer.finish(cfg.name, "test done")


async def wait_closed(handle: TapHandle, count: int, timeout: float = 5.0) -> None:
    """Wait until the tap has recorded ``count`` closed connections."""

    def closed() -> bool:
        return handle.tap.stats.connections_total - handle.tap.stats.connections_open >= count

    await wait_until(closed, timeout)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# the relay's tests run on the default asyncio loop and on uvloop (what `tracer proxy` uses)
both_loops = pytest.mark.parametrize(
    "anyio_backend", ["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
