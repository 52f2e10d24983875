"""A small HTTP/2 client over TLS for the tests (the ``h2`` state machine, anyio sockets).

httpx offers ``http/1.1`` before ``h2`` in its TLS handshake, and mitmproxy takes the
client's first choice, so an httpx client always speaks HTTP/1.1 to mitmproxy. This one
offers ``h2`` only, runs several streams on one connection at once, can reset one
(``RST_STREAM``), as a browser or a Go client would, and can stop granting one stream
flow-control window (``pause``), as a client that stops reading it.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field
from typing import Any

import anyio
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
from anyio.abc import ByteStream


@dataclass
class Stream:
    """One request's side of the exchange, as the client saw it."""

    status: int | None = None
    data: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset: bool = False


class H2Client:
    def __init__(self, sock: ByteStream, authority: str) -> None:
        self.sock = sock
        self.authority = authority
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.streams: dict[int, Stream] = {}
        self.paused: dict[int, int] = {}  # streams whose data is not acknowledged: bytes
        self.closed = False

    @classmethod
    async def connect(cls, port: int, cafile: str) -> H2Client:
        ctx = ssl.create_default_context(cafile=cafile)
        ctx.set_alpn_protocols(["h2"])
        sock = await anyio.connect_tcp(
            "127.0.0.1", port, ssl_context=ctx, tls_standard_compatible=False
        )
        assert sock.extra(anyio.streams.tls.TLSAttribute.alpn_protocol) == "h2"
        client = cls(sock, f"127.0.0.1:{port}")
        client.conn.initiate_connection()
        await client.flush()
        return client

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            await self.sock.send(data)

    async def post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> int:
        """Start a request; its stream id."""
        raw = json.dumps(body).encode()
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(
            sid,
            [
                (":method", "POST"),
                (":path", path),
                (":scheme", "https"),
                (":authority", self.authority),
                ("content-type", "application/json"),
                ("content-length", str(len(raw))),
                *headers.items(),
            ],
        )
        self.conn.send_data(sid, raw, end_stream=True)
        self.streams[sid] = Stream()
        await self.flush()
        return sid

    async def window(self, size: int) -> None:
        """Grant each stream this much to begin with (``SETTINGS_INITIAL_WINDOW_SIZE``)."""
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: size})
        await self.flush()

    def pause(self, sid: int) -> None:
        """Stop granting ``sid`` window: its data stays with the sender (flow control)."""
        self.paused.setdefault(sid, 0)

    async def resume(self, sid: int) -> None:
        """Grant ``sid`` what it has used, and go on granting as data comes."""
        unacked = self.paused.pop(sid, 0)
        if unacked:
            self.conn.acknowledge_received_data(unacked, sid)
        await self.flush()

    async def reset(self, sid: int) -> None:
        """Give up on one stream (``RST_STREAM`` CANCEL); the connection stays."""
        self.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        self.streams[sid].reset = True
        await self.flush()

    async def read_until(self, done: Any, timeout: float = 10) -> None:
        """Read and answer frames until ``done()`` holds."""
        with anyio.fail_after(timeout):
            while not done():
                data = await self.sock.receive()
                for event in self.conn.receive_data(data):
                    self._on(event)
                await self.flush()

    def _on(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            status = dict(event.headers)[b":status"]
            self.streams[event.stream_id].status = int(status)
        elif isinstance(event, h2.events.DataReceived):
            stream = self.streams[event.stream_id]
            stream.data += event.data
            if event.stream_id in self.paused:
                self.paused[event.stream_id] += event.flow_controlled_length
            else:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            self.streams[event.stream_id].ended = True
        elif isinstance(event, h2.events.StreamReset):
            self.streams[event.stream_id].reset = True
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.closed = True

    async def close(self) -> None:
        self.conn.close_connection()
        await self.flush()
        await self.sock.aclose()
