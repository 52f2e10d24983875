"""The relay's per-read path: the socket callbacks that forward a read, then observe it.

Compiled with the observer (``tracer/compiled.py``): a paced stream is one read per
token, and in Python these callbacks and the calls into the observer were about a
third of what the tap spent beyond forwarding (``docs/bench.md``). Compiled, a read is
forwarded and observed without a Python frame, the observer called directly.

A read is written to the other side first, then observed, in the same callback. (The
tap used to queue reads and observe them behind the loop's other ready callbacks, so
that no ready read waited for another's observation; with the observer compiled, that
wait is a few microseconds, and the queue and its scheduling cost more than they saved:
``docs/bench.md``.) A relay that changes the bytes of a side has that side's reads go
through its Python methods instead: the fault layer both sides, the request-id
injector the client's (``proxy/fault_connection.py``, ``proxy/connection.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

from ..observe.wire import ConnectionObserver

monotonic: Final = time.monotonic  # (compiled: a C global, not a module dict lookup a read)


class UpstreamPump:
    """The upstream socket's callbacks of a relay (an ``asyncio.Protocol`` by its
    methods: a compiled class cannot extend asyncio's). When ``plain``, each read is
    written to the client, then observed, here; else it goes to the relay's
    ``from_upstream`` (the fault layer's). The rest goes to the relay
    (``proxy/connection.py``)."""

    def __init__(self, relay: Any, client: Any, obs: ConnectionObserver, plain: bool) -> None:
        self.relay = relay
        self.client = client
        self.obs = obs
        self.plain = plain
        # the client transport's methods, looked up once (compiled, a call a read each)
        self.client_write: Callable[[bytes], object] = client.write
        self.client_closing: Callable[[], bool] = client.is_closing

    def connection_made(self, transport: Any) -> None:
        pass  # (the relay takes the transport from create_connection)

    def data_received(self, data: bytes) -> None:
        if not self.plain:
            self.relay.from_upstream(data)
            return
        m = monotonic()
        if not self.client_closing():
            self.client_write(data)  # forward first: observing never delays bytes
        try:
            self.obs.upstream_data(data, m)
        except Exception:
            self.relay.observer_failed()

    def eof_received(self) -> bool:
        self.relay.on_upstream_eof()
        return True

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.relay.upstream is not None:
            self.relay.on_upstream_lost(exc)

    def pause_writing(self) -> None:
        self.relay.upstream_write_paused()

    def resume_writing(self) -> None:
        self.relay.upstream_write_resumed()


class ClientPump:
    """The accepted socket's callbacks: ``accept`` (the tap's) makes the relay; once a
    plain relay's upstream is connected (``connected``), a read is written to it, then
    observed, here; anything else goes to the relay (``from_client``)."""

    def __init__(self, accept: Callable[[Any, ClientPump], Any]) -> None:
        self.accept = accept
        self.relay: Any = None
        self.obs: ConnectionObserver | None = None
        # the plain relay's upstream transport's methods, once connected (as UpstreamPump's)
        self.upstream_write: Callable[[bytes], object] | None = None
        self.upstream_closing: Callable[[], bool] | None = None

    def connected(self, upstream: Any, obs: ConnectionObserver) -> None:
        """The plain relay's upstream is there: its client reads are this pump's now."""
        self.obs = obs
        self.upstream_write = upstream.write
        self.upstream_closing = upstream.is_closing

    def connection_made(self, transport: Any) -> None:
        self.relay = self.accept(transport, self)

    def data_received(self, data: bytes) -> None:
        write, closing, obs = self.upstream_write, self.upstream_closing, self.obs
        if write is None or closing is None or obs is None:
            if self.relay is not None:
                self.relay.from_client(data)
            return
        m = monotonic()
        if not closing():
            write(data)  # forward first: observing never delays bytes
        try:
            obs.client_data(data, m)
        except Exception:
            self.relay.observer_failed()

    def eof_received(self) -> bool:
        if self.relay is not None:
            self.relay.on_client_eof()
        return True  # keep the write side open: the response may still be coming

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.relay is not None:
            self.relay.on_client_lost(exc)

    def pause_writing(self) -> None:
        if self.relay is not None:
            self.relay.client_write_paused()

    def resume_writing(self) -> None:
        if self.relay is not None:
            self.relay.client_write_resumed()
