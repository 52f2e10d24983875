"""Waiting on sockets and state, and ports for programs that cannot bind port 0 themselves."""

from __future__ import annotations

import socket
from collections.abc import Callable

import anyio
from anyio.abc import SocketStream


async def wait_until(
    predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01
) -> None:
    """Poll with a deadline (for state that offers no event to wait on)."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(interval)


async def recv_until(
    stream: SocketStream, predicate: Callable[[bytes], bool], timeout: float = 5.0
) -> bytes:
    buf = bytearray()
    with anyio.fail_after(timeout):
        while not predicate(bytes(buf)):
            try:
                buf += await stream.receive()
            except anyio.EndOfStream:
                break
    return bytes(buf)


async def recv_all(stream: SocketStream, timeout: float = 5.0) -> tuple[bytes, str]:
    """Read to the end; returns the bytes and how it ended: 'fin' or 'reset'."""
    buf = bytearray()
    with anyio.fail_after(timeout):
        while True:
            try:
                buf += await stream.receive()
            except anyio.EndOfStream:
                return bytes(buf), "fin"
            except (anyio.BrokenResourceError, OSError):
                return bytes(buf), "reset"


async def nothing_for(s: SocketStream, seconds: float) -> None:
    """Neither bytes nor an end arrive for this long (the connection is open and silent)."""
    with anyio.move_on_after(seconds) as scope:
        try:
            data = await s.receive()
        except anyio.EndOfStream:
            data = b"<EOF>"
        raise AssertionError(f"expected silence, got {data[:80]!r}")
    assert scope.cancelled_caught


def free_port() -> int:
    """A loopback port free a moment ago, for a program that must be told its port (smg,
    nginx, mitmweb's web port). It races with anything else binding meanwhile: whatever
    can listen on port 0 and say where it listens does that instead (the tap, the sim
    engine, ``tracer proxy --admin 127.0.0.1:0``, mitmdump); for a port where nothing
    listens, use the ``refused_port`` fixture, which holds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
