"""The simulated engine's HTTP/1.1 on a socket: read a request, send a response, hang up.

h11 over an anyio stream, as uvicorn answers (its headers, its 400 for bytes that are
not HTTP/1.x, its idle keep-alive close), apart from the engine's endpoints so that the
playback engine serves with the same code.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from email.utils import formatdate
from typing import Any

import anyio
import h11
from anyio.abc import SocketAttribute, SocketStream

from .openai_bodies import _dumps


class _Hangup(Exception):
    """End the connection without a complete response (FIN, or RST when ``reset``)."""

    def __init__(self, reset: bool) -> None:
        super().__init__("reset" if reset else "close")
        self.reset = reset


_SOCKET_ERRORS = (
    anyio.BrokenResourceError,
    anyio.EndOfStream,
    anyio.ClosedResourceError,
    OSError,
)


def _server_headers() -> list[tuple[str, str]]:
    return [("date", formatdate(usegmt=True)), ("server", "uvicorn")]


async def _send_body(
    conn: h11.Connection, stream: SocketStream, status: int, ctype: str, body: bytes
) -> None:
    head = h11.Response(
        status_code=status,
        headers=[
            *_server_headers(),
            ("content-length", str(len(body))),
            ("content-type", ctype),
        ],
    )
    await stream.send((conn.send(head) or b"") + (conn.send(h11.Data(data=body)) or b""))
    await stream.send(conn.send(h11.EndOfMessage()) or b"")


async def _send_json(conn: h11.Connection, stream: SocketStream, status: int, obj: Any) -> None:
    await _send_body(conn, stream, status, "application/json", _dumps(obj))


async def _bad_request(conn: h11.Connection, stream: SocketStream) -> None:
    """What uvicorn answers to bytes that are not HTTP/1.x."""
    body = b"Invalid HTTP request received."
    try:
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await _send_body(conn, stream, 400, "text/plain; charset=utf-8", body)
    except (*_SOCKET_ERRORS, h11.LocalProtocolError):
        pass


async def _watch_client(
    conn: h11.Connection, stream: SocketStream, scope: anyio.CancelScope
) -> None:
    """While a response is produced: a client that closes aborts the request."""
    try:
        while True:
            conn.receive_data(await stream.receive())  # pipelined bytes wait in h11
    except (*_SOCKET_ERRORS, h11.RemoteProtocolError):
        scope.cancel()


def _set_linger_zero(stream: SocketStream) -> None:
    try:
        sock = stream.extra(SocketAttribute.raw_socket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except (OSError, anyio.TypedAttributeLookupError):
        pass


async def _read_request(
    conn: h11.Connection, stream: SocketStream, idle: float
) -> tuple[h11.Request, bytes] | None:
    """The next request, or None when the client closes or stays idle ``idle`` seconds."""
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = b""
            if request is None and not conn.trailing_data[0]:
                with anyio.move_on_after(idle), contextlib.suppress(anyio.EndOfStream):
                    data = await stream.receive()
                if not data:
                    return None  # idle keep-alive timeout, or the client closed
            else:
                try:
                    data = await stream.receive()
                except anyio.EndOfStream:
                    data = b""
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            request = event
            if conn.they_are_waiting_for_100_continue:
                await stream.send(
                    conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
                )
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return (request, bytes(body)) if request is not None else None
        else:
            return None
