"""One client connection and its pinned upstream connection: ``Connection`` forwards
first and observes after, on asyncio ``Protocol`` callbacks (see ``proxy/relay.py`` for
why); ``InjectingConnection`` adds ``x-request-id`` where a head is unambiguous. The tap
(``relay.Tap``) accepts and picks the kind per connection; what a connection needs of it
is ``ConnectionTap``, so that no connection module imports the relay (which imports them)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import socket
import struct
import termios
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Literal, Protocol

import structlog

from .. import events as ev
from ..evidence import topology
from ..observe.wire import Bodies, ConnectionObserver, not_http
from .inject import RequestIdInjector
from .pump import ClientPump, UpstreamPump

if TYPE_CHECKING:
    from ..capture.bodies import BodyBudget
    from ..faults.plan import FaultPlan
    from .stats import TapStats

log = structlog.get_logger("tracer.proxy.relay")

READ_SIZE = 65536
# errors that are the tap's own limits, not its upstream's: reported as such (503)
OWN_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class TapSettings(Protocol):
    """What a connection reads of its tap's configuration (``relay.TapConfig``)."""

    @property
    def name(self) -> str: ...
    @property
    def upstream_host(self) -> str: ...
    @property
    def upstream_port(self) -> int: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def bodies(self) -> Bodies: ...
    @property
    def max_header_bytes(self) -> int: ...
    @property
    def max_body_keep(self) -> int: ...
    @property
    def redact_json_fields(self) -> frozenset[str]: ...


class ConnectionTap(Protocol):
    """What a connection needs of its tap (``relay.Tap``): its settings, counters and
    records, the live connections, and the upstream connect run for it."""

    @property
    def config(self) -> TapSettings: ...
    @property
    def stats(self) -> TapStats: ...
    @property
    def body_budget(self) -> BodyBudget: ...
    @property
    def live(self) -> dict[int, Connection]: ...
    @property
    def fault_plan(self) -> FaultPlan | None: ...  # (a ``FaultConnection``'s)
    @property
    def wall_offset(self) -> float: ...
    def next_id(self) -> int: ...
    def emit(self, event: ev.Event) -> None: ...
    def safe_emit(self, event: ev.Event) -> None: ...
    def start_connect(self, connect: Coroutine[Any, Any, None]) -> bool: ...


class Connection:
    """One client connection and its pinned upstream connection, driven by callbacks.

    Its reads, once the upstream is connected, are forwarded and observed by the
    compiled callbacks of ``proxy/pump.py``; this class does the rest (connecting, the
    ends, backpressure). A subclass that changes the bytes of a side says so: its reads
    then go through its ``from_client`` or ``from_upstream``."""

    plain_client = True  # the pumps forward the client's reads unchanged
    plain_upstream = True  # and the upstream's

    def __init__(
        self, tap: ConnectionTap, client: asyncio.Transport, pump: ClientPump | None = None
    ) -> None:
        self.tap = tap
        self.pump = pump
        self.id = tap.next_id()
        self.client = client
        self.upstream: asyncio.Transport | None = None
        self.opened_m = time.monotonic()
        self.peer = _addr(client.get_extra_info("peername"))
        self.local = _addr(client.get_extra_info("sockname"))
        cfg = tap.config
        self.obs = ConnectionObserver(
            tap=cfg.name,
            conn=self.id,
            emit=tap.safe_emit,
            wall_offset=tap.wall_offset,
            opened_m=self.opened_m,
            bodies=cfg.bodies,
            max_header_bytes=cfg.max_header_bytes,
            max_body_keep=cfg.max_body_keep,
            budget=tap.body_budget,
            redact_fields=cfg.redact_json_fields,
        )
        self.connecting = False
        self.held: list[bytes] = []  # client bytes read while the upstream connects
        self.client_eof = self.upstream_eof = False
        self.client_lost = False
        self.upstream_lost = True  # until an upstream connection exists
        self.client_paused_since: float | None = None  # writes to the client backed up
        self.finished = False
        # who closed first, and how
        self.closed_by: Literal["client", "upstream", "tracer", "none"] | None = None
        self.how: Literal["fin", "reset", "tracer"] | None = None
        self.in_flight_at_close = False
        self.fin_side: ev.Direction | None = None
        self.fin_at_bytes = (0, 0)
        self.upstream_opened = False
        tap.stats.connections_total += 1
        tap.stats.connections_open += 1
        tap.live[self.id] = self
        tap.emit(
            ev.ConnOpen(
                t=self.opened_m + tap.wall_offset,
                m=self.opened_m,
                tap=cfg.name,
                conn=self.id,
                peer=self.peer,
                local=self.local,
            )
        )

    # ---- bytes --------------------------------------------------------------------

    def from_client(self, data: bytes) -> None:
        now = time.monotonic()
        if self.upstream is not None:
            if not self.upstream.is_closing():
                self.upstream.write(data)  # forward first: observing never delays bytes
            self._observe_client(data, now)
            return
        if self.finished or self.closed_by == "tracer":
            return
        self._observe_client(data, now)
        self._hold_for_upstream(data)

    def _hold_for_upstream(self, data: bytes) -> None:
        """Client bytes before the upstream connection exists: hold them and connect."""
        what = None if self.connecting or self.held else not_http(data)
        if what is not None:
            self._answer(400, "Bad Request", f"tracer: {what} on a plain HTTP/1.1 listener\n")
            return
        self.held.append(data)
        if not self.connecting:
            self.connecting = True
            self.client.pause_reading()  # hold at most one read until the upstream is there
            if not self.tap.start_connect(self._connect()):
                self.close_by_tracer("tap stopping")

    def _upstream_protocol(self) -> Any:
        """The upstream socket's callbacks (compiled)."""
        return UpstreamPump(self, self.client, self.obs, self.plain_upstream)

    async def _connect(self) -> None:
        tap, cfg = self.tap, self.tap.config
        addr = f"{cfg.upstream_host}:{cfg.upstream_port}"
        start = time.monotonic()
        tap.emit(
            ev.UpstreamConnect(
                t=start + tap.wall_offset,
                m=start,
                tap=cfg.name,
                conn=self.id,
                phase="start",
                addr=addr,
            )
        )
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(cfg.connect_timeout):
                transport, _ = await loop.create_connection(
                    self._upstream_protocol, cfg.upstream_host, cfg.upstream_port
                )
        except (OSError, TimeoutError) as exc:
            done = time.monotonic()
            error = (
                f"connect timed out after {cfg.connect_timeout:g}s"
                if isinstance(exc, TimeoutError)
                else topology.describe_error(exc)
            )
            tap.emit(
                ev.UpstreamConnect(
                    t=done + tap.wall_offset,
                    m=done,
                    tap=cfg.name,
                    conn=self.id,
                    phase="failed",
                    addr=addr,
                    error=error,
                    elapsed=round(done - start, 6),
                )
            )
            if not self.finished and not self.client_lost:
                if isinstance(exc, OSError) and exc.errno in OWN_LIMITS:
                    # the tap's own limit (descriptors, memory), never the upstream's fault
                    log.error("the tap is out of resources", conn=self.id, error=error)
                    self._answer(
                        503,
                        "Service Unavailable",
                        f"tracer: the tap itself is out of resources ({error}); "
                        f"upstream {addr} was not tried\n",
                    )
                else:
                    self._answer(
                        502, "Bad Gateway", f"tracer: upstream {addr} unreachable: {error}\n"
                    )
            return
        done = time.monotonic()
        # (uvloop's transport is not an asyncio.Transport subclass: no isinstance checks)
        if self.finished or self.client_lost:  # the client went away meanwhile
            transport.abort()
            return
        self.upstream = transport
        self.upstream_lost = False
        self.upstream_opened = True
        tap.emit(
            ev.UpstreamConnect(
                t=done + tap.wall_offset,
                m=done,
                tap=cfg.name,
                conn=self.id,
                phase="done",
                addr=addr,
                local=_addr(transport.get_extra_info("sockname")),
                elapsed=round(done - start, 6),
            )
        )
        held, self.held = self.held, []
        for data in held:
            transport.write(data)
        if self.plain_client and self.pump is not None:  # the client's reads: the pump's from now
            self.pump.connected(transport, self.obs)
        if self.client_eof:
            transport.write_eof()
        else:
            self.client.resume_reading()

    # ---- ends -------------------------------------------------------------------------

    def on_client_eof(self) -> None:
        now = time.monotonic()
        self.client_eof = True
        self._first("client", "fin")
        self._observe_eof(self.obs.client_eof, now, reset=False)
        if self.upstream is not None and not self.upstream.is_closing():
            if self.upstream.can_write_eof():
                self.upstream.write_eof()
        elif self.upstream is None and not self.connecting:
            self.client.close()  # nothing was sent: nothing to wait for
        self._maybe_close()

    def on_upstream_eof(self) -> None:
        now = time.monotonic()
        self.upstream_eof = True
        self._first("upstream", "fin")
        self._observe_eof(self.obs.upstream_eof, now, reset=False)
        if not self.client.is_closing() and self.client.can_write_eof():
            self.client.write_eof()
        self._maybe_close()

    def on_client_lost(self, exc: Exception | None) -> None:
        self.client_lost = True
        if exc is not None and not self.client_eof and self.closed_by != "tracer":
            self._first("client", "reset")
            self._observe_eof(self.obs.client_eof, time.monotonic(), reset=True)
            if self.upstream is not None:
                _abort(self.upstream)  # propagate the reset
        elif self.upstream is not None and not self.upstream.is_closing():
            self.upstream.close()
        self._maybe_finish()

    def on_upstream_lost(self, exc: Exception | None) -> None:
        self.upstream_lost = True
        if exc is not None and not self.upstream_eof and self.closed_by != "tracer":
            self._first("upstream", "reset")
            self._observe_eof(self.obs.upstream_eof, time.monotonic(), reset=True)
            _abort(self.client)  # propagate the reset
        elif not self.client.is_closing():
            self.client.close()
        self._maybe_finish()

    def _maybe_close(self) -> None:
        """Both sides sent FIN: close both (their buffers are flushed first)."""
        if self.client_eof and (self.upstream_eof or self.upstream is None):
            if not self.client.is_closing():
                self.client.close()
            if self.upstream is not None and not self.upstream.is_closing():
                self.upstream.close()

    def _maybe_finish(self) -> None:
        if self.client_lost and self.upstream_lost:
            self.finish()

    def close_by_tracer(self, reason: str) -> None:
        """Idle timeout or a refused start: close both sides, the tap is the closer."""
        self._first("tracer", "tracer")
        self.client.close()
        if self.upstream is not None:
            self.upstream.close()
        log.info("tap closed the connection", conn=self.id, reason=reason)

    def shutdown(self) -> None:
        """The tap is stopping: close both sides and settle the records now."""
        self._first("tracer", "tracer")
        if not self.client.is_closing():
            self.client.close()
        if self.upstream is not None and not self.upstream.is_closing():
            self.upstream.close()
        self.finish(shutdown=True)

    def _answer(self, status: int, reason: str, body: str) -> None:
        """Write the tap's own response (502/400), record it, and close."""
        payload = body.encode()
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n"
            f"x-tracer: {self.tap.config.name}\r\n\r\n"
        ).encode()
        self._first("tracer", "tracer")
        try:
            detail = body.strip().removeprefix("tracer: ")
            self.obs.tracer_response(time.monotonic(), status, reason, detail)
        except Exception:
            log.exception("observer failed recording the tap's own response", conn=self.id)
        self.connecting = False
        self.held = []
        if not self.client.is_closing():
            self.client.write(head + payload)
            self.client.close()

    def _first(
        self, side: Literal["client", "upstream", "tracer"], how: Literal["fin", "reset", "tracer"]
    ) -> None:
        if self.closed_by is not None:
            return
        self.closed_by, self.how = side, how
        self.in_flight_at_close = self.obs.in_flight
        if how == "fin" and side != "tracer":
            self.fin_side = side
            self.fin_at_bytes = (self.obs.client_bytes, self.obs.upstream_bytes)

    def _half_close(self) -> ev.Direction | None:
        """The side that sent FIN first, if the other side still sent bytes after it."""
        client_then, upstream_then = self.fin_at_bytes
        if self.fin_side == "client" and self.obs.upstream_bytes > upstream_then:
            return "client"
        if self.fin_side == "upstream" and self.obs.client_bytes > client_then:
            return "upstream"
        return None

    def finish(self, *, shutdown: bool = False) -> None:
        if self.finished:
            return
        self.finished = True
        tap, obs = self.tap, self.obs
        now = time.monotonic()
        if self.closed_by is None:
            self.closed_by, self.how = "tracer", "tracer"
            self.in_flight_at_close = obs.in_flight
        try:
            obs.close(now, shutdown=shutdown or self.closed_by == "tracer")
        except Exception:
            log.exception("observer close failed", conn=self.id)
        tap.live.pop(self.id, None)
        tap.stats.connections_open -= 1
        tap.stats.bytes_from_client += obs.client_bytes
        tap.stats.bytes_from_upstream += obs.upstream_bytes
        tap.emit(
            ev.ConnClose(
                t=now + tap.wall_offset,
                m=now,
                tap=tap.config.name,
                conn=self.id,
                closed_by=self.closed_by,
                how=self.how or "tracer",
                half_close=self._half_close(),
                in_flight=self.in_flight_at_close,
                requests=obs.seq,
                bytes_from_client=obs.client_bytes,
                bytes_from_upstream=obs.upstream_bytes,
                upstream_opened=self.upstream_opened,
                duration=round(now - self.opened_m, 6),
            )
        )

    # ---- backpressure -----------------------------------------------------------------

    def client_write_paused(self) -> None:
        self.client_paused_since = time.monotonic()
        if self.upstream is not None and not self.upstream.is_closing():
            self.upstream.pause_reading()

    def client_write_resumed(self) -> None:
        self.client_paused_since = None
        if self.upstream is not None and not self.upstream.is_closing():
            self.upstream.resume_reading()

    def upstream_write_paused(self) -> None:
        if not self.client.is_closing():
            self.client.pause_reading()

    def upstream_write_resumed(self) -> None:
        if not self.client.is_closing():
            self.client.resume_reading()

    # ---- guarded observation ------------------------------------------------------

    def _observe_client(self, data: bytes, now: float) -> None:
        """Observe client bytes (already forwarded, or held for the upstream)."""
        try:
            self.obs.client_data(data, now)
        except Exception:
            self.observer_failed()

    def observer_failed(self) -> None:
        """An observer raised (called inside its ``except``): logged; forwarding goes on."""
        log.exception("observer failed; forwarding unchanged", conn=self.id)

    def _observe_eof(self, fn: Callable[..., None], now: float, *, reset: bool) -> None:
        try:
            fn(now, reset=reset)
        except Exception:
            log.exception("observer failed at EOF", conn=self.id)


class InjectingConnection(Connection):
    """A relay that adds ``x-request-id`` to requests without one (``--inject-request-id``).

    The observer sees the rewritten bytes — what the upstream got — so every tap behind
    this one records the same id and the multi-tap join is exact.
    """

    plain_client = False  # its client reads are rewritten (``from_client``)

    def __init__(
        self, tap: ConnectionTap, client: asyncio.Transport, pump: ClientPump | None = None
    ) -> None:
        super().__init__(tap, client, pump)
        self.injector = RequestIdInjector(f"tracer-{tap.config.name}-{self.id}")
        self.client_bytes = 0

    def from_client(self, data: bytes) -> None:
        passing = self.injector.passed_through is not None
        try:
            out = self.injector.feed(data)
        except Exception:  # the rewriter must never stop traffic
            log.exception("request-id injection failed; passing through", conn=self.id)
            out = self.injector.flush() + data
            self.injector.give_up("the rewriter failed")
        if not passing and self.injector.passed_through is not None:
            self._passing_through(self.injector.passed_through)
        self.client_bytes += len(data)
        if out:
            super().from_client(out)

    def _passing_through(self, why: str) -> None:
        """The connection's bytes go on untouched from here: an anomaly says why."""
        now = time.monotonic()
        tap = self.tap
        tap.safe_emit(
            ev.Anomaly(
                t=now + tap.wall_offset,
                m=now,
                tap=tap.config.name,
                conn=self.id,
                direction="client",
                error=f"--inject-request-id: passed through untouched: {why}",
                offset=self.client_bytes,
            )
        )
        log.info("request-id injection off for this connection", conn=self.id, reason=why)

    def on_client_eof(self) -> None:
        held = self.injector.flush()
        if held:
            super().from_client(held)
        super().on_client_eof()


def _unsent_bytes(transport: asyncio.Transport | None) -> int | None:
    """Bytes queued toward the peer: in the transport's buffer plus the kernel's (SIOCOUTQ)."""
    if transport is None or transport.is_closing():
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.fileno() < 0:
        return None
    try:
        buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return None
    return int(struct.unpack("i", buf)[0]) + transport.get_write_buffer_size()


def _abort(transport: asyncio.Transport) -> None:
    """Close with a reset (SO_LINGER 0), as the peer did on the other side."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.fileno() >= 0:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _addr(value: Any) -> str:
    if isinstance(value, tuple) and len(value) >= 2:
        host = str(value[0])
        return f"[{host}]:{value[1]}" if ":" in host else f"{host}:{value[1]}"
    return str(value)
