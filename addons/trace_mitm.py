"""What ``addons/trace.py`` reads of mitmproxy's internals, best effort: the HTTP/2
connection mitmproxy keeps for a client and the bytes it holds there under flow control,
and the client connection's write backlog (its asyncio transport's and the kernel's).
Each answers "cannot look" (None, False) when the internals are not as expected."""

from __future__ import annotations

import fcntl
import struct
import termios
from typing import Any

from mitmproxy import connection, ctx, http
from mitmproxy.proxy.layer import NextLayer
from mitmproxy.proxy.layers.http import HttpLayer


def h2_of(client: connection.Client) -> tuple[Any, Any]:
    """mitmproxy's HTTP layer for a client connection and the HTTP/2 connection it keeps
    for it, found through mitmproxy's internals (its proxyserver's connection handler and
    the layers under it, as ``client_backlog``); (None, None) when they are not there."""
    try:
        proxyserver = ctx.master.addons.get("proxyserver")  # type: ignore[no-untyped-call]
        layer = proxyserver.connections[client.id].layer
        for _ in range(16):
            if isinstance(layer, HttpLayer):
                h2_conn = getattr(layer.connections.get(client), "h2_conn", None)
                return (layer, h2_conn) if h2_conn is not None else (None, None)
            layer = layer.layer if isinstance(layer, NextLayer) else layer.child_layer
    except Exception:
        pass
    return None, None


def stream_id(http_layer: Any, flow: http.HTTPFlow) -> int | None:
    """The client's HTTP/2 stream that carries ``flow``."""
    try:
        return next((sid for sid, s in http_layer.streams.items() if s.flow is flow), None)
    except Exception:
        return None


def held_now(h2: Any, stream: int | None) -> int | None:
    """Bytes mitmproxy holds for the client on HTTP/2 stream ``stream`` of its connection
    ``h2``, waiting for flow-control window; None when its internals cannot be looked at."""
    try:
        return sum(len(item.data) for item in h2.stream_buffers.get(stream, ()))
    except Exception:
        return None


def reset_by_client(h2: Any, stream: int | None) -> bool:
    try:
        how = h2._stream_closed_by(stream)
    except Exception:
        return False
    return how is not None and how.name == "RECV_RST_STREAM"


def client_backlog(client: connection.Client) -> tuple[bool, int | None]:
    """Whether mitmproxy holds bytes for the client, and the kernel's unsent bytes.

    Best effort through mitmproxy's internals (its proxyserver keeps the client's
    asyncio writer); (False, None) when they are not there.
    """
    try:
        proxyserver = ctx.master.addons.get("proxyserver")  # type: ignore[no-untyped-call]
        handler = proxyserver.connections[client.id]
        transport = handler.transports[client].writer.transport
        buffered = int(transport.get_write_buffer_size())
        sock = transport.get_extra_info("socket")
    except Exception:
        return False, None
    unsent: int | None = None
    if sock is not None:
        try:
            raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            unsent = int(struct.unpack("i", raw)[0])
        except (OSError, ValueError, AttributeError):  # TIOCOUTQ: Linux only
            unsent = None
    return buffered > 0, unsent
