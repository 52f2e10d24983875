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

from collections.abc import Callable
from time import monotonic
from typing import Any

from ..observe.wire import ConnectionObserver


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

    def connection_made(self, transport: Any) -> None:
        pass  # (the relay takes the transport from create_connection)

    def data_received(self, data: bytes) -> None:
        if not self.plain:
            self.relay.from_upstream(data)
            return
        m = monotonic()
        client = self.client
        if not client.is_closing():
            client.write(data)  # forward first: observing never delays bytes
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
        self.upstream: Any = None  # the plain relay's upstream transport, once connected
        self.obs: ConnectionObserver | None = None

    def connected(self, upstream: Any, obs: ConnectionObserver) -> None:
        """The plain relay's upstream is there: its client reads are this pump's now."""
        self.upstream = upstream
        self.obs = obs

    def connection_made(self, transport: Any) -> None:
        self.relay = self.accept(transport, self)

    def data_received(self, data: bytes) -> None:
        upstream = self.upstream
        obs = self.obs
        if upstream is None or obs is None:
            if self.relay is not None:
                self.relay.from_client(data)
            return
        m = monotonic()
        if not upstream.is_closing():
            upstream.write(data)  # forward first: observing never delays bytes
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
