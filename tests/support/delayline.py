"""A delay line: network latency between two processes on one machine, for tests.

Each accepted connection is forwarded to the upstream; what the upstream sends, and its
close (FIN or reset), reaches the client ``delay`` seconds late, as across a slow network
link. The other direction is not delayed. (This kernel has no netem qdisc.)
"""

from __future__ import annotations

import math
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.abc import SocketStream

_FIN, _RESET = b"", None


@asynccontextmanager
async def delay_line(upstream: str, delay: float) -> AsyncIterator[str]:
    """Listen on loopback; yields the URL to use instead of ``upstream`` (http://HOST:PORT)."""
    host, port = upstream.removeprefix("http://").rsplit(":", 1)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)

    async def handle(client: SocketStream) -> None:
        async with client:
            try:
                far = await anyio.connect_tcp(host, int(port))
            except OSError:
                return
            async with far, anyio.create_task_group() as tg:
                send, receive = anyio.create_memory_object_stream[tuple[float, bytes | None]](
                    math.inf
                )

                async def forward() -> None:  # client -> upstream, at once
                    try:
                        async for data in client:
                            await far.send(data)
                        await far.send_eof()
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        pass

                async def back() -> None:  # upstream -> queue, stamped
                    end: bytes | None = _FIN
                    with send:
                        try:
                            async for data in far:
                                send.send_nowait((anyio.current_time(), data))
                        except (anyio.BrokenResourceError, OSError):
                            end = _RESET
                        send.send_nowait((anyio.current_time(), end))

                async def deliver() -> None:  # queue -> client, `delay` late
                    async with receive:
                        async for stamp, data in receive:
                            await anyio.sleep_until(stamp + delay)
                            if data is _RESET:
                                linger = struct.pack("ii", 1, 0)
                                sock = client.extra(anyio.abc.SocketAttribute.raw_socket)
                                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                                await client.aclose()
                                break
                            if data == _FIN:
                                await client.send_eof()
                                break
                            await client.send(data)
                    tg.cancel_scope.cancel()

                tg.start_soon(forward)
                tg.start_soon(back)
                tg.start_soon(deliver)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        bound = listener.extra(anyio.abc.SocketAttribute.local_port)
        yield f"http://127.0.0.1:{bound}"
        tg.cancel_scope.cancel()
