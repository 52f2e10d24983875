"""One TCP connection as the passive tap (``passive``) follows it: undecided, followed
(with its observer and its gaps) or ignored, and what a tap writes of a connection
itself that its observer does not: ``upstream_connect``'s answer (``done``, or
``failed`` at a reset in answer to the SYN) and ``conn_close`` (who closed first and
how, bytes each way). Sans-I/O."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Literal

from .. import events as ev
from .gaps import Resync
from .tcp import Endpoint, Item, TcpConnection
from .wire import ConnectionObserver


class Follow:
    """A TCP connection: undecided, followed (with its observer) or ignored. Its own
    records go to ``emit``."""

    __slots__ = (
        "client",
        "closed_by",
        "connected",
        "emit",
        "fin_at_bytes",
        "fin_side",
        "held",
        "how",
        "in_flight_at_close",
        "num",
        "obs",
        "probe",
        "resync",
        "scheduled",
        "server",
        "skipped",
        "state",
        "syn_t",
        "synack_t",
        "synced",
        "tap",
        "tcp",
    )

    def __init__(self, tcp: TcpConnection, emit: Callable[[ev.Event], None]) -> None:
        self.tcp = tcp
        self.emit = emit
        self.state: Literal["undecided", "followed", "ignored"] = "undecided"
        self.held: list[Item] = []
        self.probe = b""  # the client's first bytes, while telling whether it is HTTP
        self.skipped: Counter[Endpoint] = Counter()  # bytes not parsed (before a request)
        self.client: Endpoint | None = None
        self.server: Endpoint | None = None
        self.tap = ""
        self.num = 0
        self.obs: ConnectionObserver | None = None
        self.resync: Resync | None = None  # its gaps (from when it is followed)
        self.synced = False  # requests are parsed: from the start, or from a request head
        self.syn_t: float | None = None
        self.synack_t: float | None = None
        self.closed_by: Literal["client", "upstream"] | None = None
        self.how: Literal["fin", "reset"] | None = None
        self.in_flight_at_close = False
        self.fin_side: ev.Direction | None = None
        self.fin_at_bytes = (0, 0)
        self.scheduled = False  # a stall check is queued
        self.connected: bool | None = None  # the server answered (None: not said yet)

    def side(self, src: Endpoint) -> ev.Direction:
        return "client" if src == self.client else "upstream"

    def connect_done(self, t: float, *, refused: bool = False) -> None:
        """The server answered the SYN (its SYN-ACK, or bytes from a connection whose
        handshake was not captured), or refused it (a reset in answer to the SYN)."""
        if self.connected is not None:
            return
        self.connected = not refused
        answered = refused or self.synack_t == t  # the answer itself was captured
        elapsed = round(t - self.syn_t, 6) if self.syn_t is not None and answered else None
        self.emit(
            ev.UpstreamConnect(
                t=t,
                m=t,
                tap=self.tap,
                conn=self.num,
                phase="failed" if refused else "done",
                addr=str(self.server),
                error="connection refused (a reset in answer to the SYN)" if refused else None,
                elapsed=elapsed,
            )
        )

    def first(self, side: ev.Direction, how: Literal["fin", "reset"]) -> None:
        """The first side to close, and how (as the inline tap records it)."""
        if self.closed_by is not None:
            return
        obs = self.obs
        assert obs is not None
        self.closed_by, self.how = side, how
        self.in_flight_at_close = obs.in_flight
        if how == "fin":
            self.fin_side = side
            self.fin_at_bytes = (obs.client_bytes, obs.upstream_bytes)

    def close(self, t: float, why: str) -> None:
        """The connection's end (``why``: ``fin``, ``reset``, else the capture's end):
        the observer's, then ``conn_close``."""
        obs = self.obs
        assert obs is not None and self.client is not None and self.server is not None
        if self.closed_by is None:
            self.in_flight_at_close = obs.in_flight
        seen_end = why in ("fin", "reset")
        obs.close(t, shutdown=not seen_end)
        client_then, upstream_then = self.fin_at_bytes
        half: ev.Direction | None = None
        if self.fin_side == "client" and obs.upstream_bytes > upstream_then:
            half = "client"
        elif self.fin_side == "upstream" and obs.client_bytes > client_then:
            half = "upstream"
        first_t = self.tcp.first_t
        opened = first_t if first_t is not None else t
        self.emit(
            ev.ConnClose(
                t=t,
                m=t,
                tap=self.tap,
                conn=self.num,
                closed_by=self.closed_by or "none",
                how=self.how or "unknown",
                half_close=half,
                in_flight=self.in_flight_at_close,
                requests=obs.seq,
                bytes_from_client=obs.client_bytes + self.skipped[self.client],
                bytes_from_upstream=obs.upstream_bytes + self.skipped[self.server],
                upstream_opened=bool(self.connected),
                duration=round(t - opened, 6),
            )
        )
