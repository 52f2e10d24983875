"""The inline tap: a transparent anyio relay with an observer beside it.

Per downstream connection one task group with two pumps (client -> upstream,
upstream -> client). Bytes are forwarded as they arrive, unchanged; the observer sees
the same bytes with their arrival time and turns them into events. The upstream
connection is opened when the client's first bytes arrive and closed when either side
closes: FIN is propagated as a half-close, a reset as a reset. Observation errors are
caught and recorded; they can never stop forwarding.

The tap answers by itself only where it must: 502 when the upstream cannot be reached,
400 when the client's first bytes are not HTTP/1.x at all (a TLS handshake or an HTTP/2
preface on this plain HTTP/1.1 listener), which no HTTP/1.1 upstream could take.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import struct
import termios
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

from . import __version__
from . import events as ev
from .capture import CaptureWriter
from .sniff import Bodies, ConnectionObserver

log = structlog.get_logger("tracer.relay")

READ_SIZE = 65536
_TLS_HANDSHAKE = b"\x16\x03"
_H2_PREFACE = b"PRI * HTTP/2.0"


@dataclass
class TapConfig:
    listen_host: str
    listen_port: int
    upstream_host: str
    upstream_port: int
    name: str = "tap"
    stall_after: float = 5.0
    connect_timeout: float = 10.0
    idle_timeout: float | None = None  # close idle keep-alive connections; None: never
    bodies: Bodies = "requests"
    max_header_bytes: int = 64 * 1024
    max_body_keep: int = 16 * 1024 * 1024

    @property
    def upstream_url(self) -> str:
        return f"http://{self.upstream_host}:{self.upstream_port}"


def parse_upstream(url: str) -> tuple[str, int]:
    """``http://host:port`` (path ignored) to host and port; https is refused clearly."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http":
        raise ValueError(f"upstream must be an http:// URL (got {parts.scheme}://)")
    if not parts.hostname:
        raise ValueError(f"upstream URL has no host: {url!r}")
    return parts.hostname, parts.port or 80


def parse_hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return (host.strip("[]") or "127.0.0.1"), int(port)


@dataclass
class TapStats:
    connections_total: int = 0
    connections_open: int = 0
    requests_total: int = 0
    upstream_connect_failures: int = 0
    anomalies: int = 0
    bytes_from_client: int = 0
    bytes_from_upstream: int = 0
    terminations: Counter[str] = field(default_factory=Counter)
    stalls: Counter[str] = field(default_factory=Counter)
    stalls_active: int = 0


class _Conn:
    """What the tap knows about one live connection (for ticks and /status)."""

    __slots__ = (
        "client",
        "client_fin_m",
        "down_send_since",
        "id",
        "obs",
        "opened_m",
        "peer",
        "scope",
        "upstream",
        "upstream_fin_m",
    )

    def __init__(self, cid: int, obs: ConnectionObserver, opened_m: float, peer: str) -> None:
        self.id = cid
        self.obs = obs
        self.opened_m = opened_m
        self.peer = peer
        self.client: SocketStream | None = None
        self.upstream: SocketStream | None = None
        self.down_send_since: float | None = None
        self.client_fin_m: float | None = None
        self.upstream_fin_m: float | None = None
        self.scope: anyio.CancelScope | None = None


class Tap:
    """One named observation point: listener, relay, observers, capture, stats."""

    def __init__(
        self,
        config: TapConfig,
        *,
        capture: CaptureWriter | None = None,
        sinks: list[Callable[[ev.Event], None]] | None = None,
    ) -> None:
        self.config = config
        self.capture = capture
        self.stats = TapStats()
        self.sinks = list(sinks or [])
        self.live: dict[int, _Conn] = {}
        self.stopping = False
        self._next_id = 0
        self._wall = time.time() - time.monotonic()
        self.started_m = time.monotonic()
        self.bound: list[tuple[str, int]] = []
        self._tg: anyio.abc.TaskGroup | None = None

    # ---- events -------------------------------------------------------------------

    def emit(self, event: ev.Event) -> None:
        """Every event goes through here: capture, live counters, log lines, sinks."""
        if self.capture is not None:
            self.capture.write(event)
        stats = self.stats
        match event:
            case ev.RequestHead():
                stats.requests_total += 1
            case ev.ResponseEnd(termination=term):
                stats.terminations[term] += 1
                if term != "complete":
                    log.warning(
                        "response ended " + term,
                        conn=event.conn,
                        seq=event.seq,
                        status=event.status,
                        bytes=event.body_bytes,
                        close=event.close,
                        mid_event=event.mid_event,
                        detail=event.detail,
                    )
                elif event.events and not event.done:
                    log.info("stream complete without [DONE]", conn=event.conn, seq=event.seq)
            case ev.Stall(phase="start", direction=direction):
                stats.stalls[direction] += 1
                stats.stalls_active += 1
                log.warning(
                    "stall started",
                    conn=event.conn,
                    seq=event.seq,
                    direction=direction,
                    silent_for=event.silent_for,
                    unsent_bytes=event.unsent_bytes,
                )
            case ev.Stall(phase="end"):
                stats.stalls_active -= 1
                log.info(
                    "stall ended",
                    conn=event.conn,
                    seq=event.seq,
                    direction=event.direction,
                    lasted=event.silent_for,
                )
            case ev.Anomaly():
                stats.anomalies += 1
                log.warning(
                    "protocol anomaly; forwarding unchanged",
                    conn=event.conn,
                    direction=event.direction,
                    error=event.error,
                    offset=event.offset,
                )
            case ev.UpstreamConnect(phase="failed"):
                stats.upstream_connect_failures += 1
                log.warning("upstream connect failed", conn=event.conn, error=event.error)
            case _:
                pass
        for sink in self.sinks:
            sink(event)

    def header(self) -> ev.CaptureStart:
        now = time.monotonic()
        cfg = self.config
        return ev.CaptureStart(
            t=now + self._wall,
            m=now,
            tap=cfg.name,
            tracer_version=__version__,
            kind="proxy",
            listen=f"{cfg.listen_host}:{cfg.listen_port}",
            upstream=cfg.upstream_url,
            options={
                "stall_after": cfg.stall_after,
                "bodies": cfg.bodies,
                "idle_timeout": cfg.idle_timeout,
                "connect_timeout": cfg.connect_timeout,
            },
        )

    # ---- serving ------------------------------------------------------------------

    async def serve(
        self, *, task_status: TaskStatus[list[tuple[str, int]]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and relay until cancelled or ``stop()``; ``tg.start`` gets the bound addresses."""
        cfg = self.config
        listener = await anyio.create_tcp_listener(
            local_host=cfg.listen_host, local_port=cfg.listen_port, reuse_port=False
        )
        self.bound = [
            (
                str(lst.extra(SocketAttribute.local_address)[0]),
                int(lst.extra(SocketAttribute.local_port)),
            )
            for lst in listener.listeners
        ]
        log.info("tap listening", tap=cfg.name, listen=self.bound, upstream=cfg.upstream_url)
        try:
            with structlog.contextvars.bound_contextvars(tap=cfg.name):
                await self._serve_listener(listener, task_status)
        finally:
            self._tg = None

    async def _serve_listener(
        self, listener: Any, task_status: TaskStatus[list[tuple[str, int]]]
    ) -> None:
        async with listener, anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._ticker)
            task_status.started(self.bound)
            await listener.serve(self._handle, task_group=tg)

    def stop(self) -> None:
        """Stop accepting and close every connection now (their requests end in flight)."""
        self.stopping = True
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    async def _ticker(self) -> None:
        interval = max(0.05, min(0.25, self.config.stall_after / 4))
        stall_after = self.config.stall_after
        idle_timeout = self.config.idle_timeout
        while True:
            await anyio.sleep(interval)
            now = time.monotonic()
            for conn in list(self.live.values()):
                obs = conn.obs
                silent = now - obs.last_activity_m
                if obs.in_flight and silent >= stall_after:
                    blocked = conn.down_send_since is not None
                    unsent = _unsent_bytes(conn.client)
                    try:
                        obs.tick(
                            now, stall_after=stall_after, client_blocked=blocked, unsent=unsent
                        )
                    except Exception:  # observation must never stop the tap
                        log.exception("observer tick failed", conn=conn.id)
                elif (
                    idle_timeout is not None
                    and not obs.in_flight
                    and silent >= idle_timeout
                    and conn.scope is not None
                ):
                    conn.scope.cancel()

    async def _handle(self, client: SocketStream) -> None:
        self._next_id += 1
        cid = self._next_id
        with structlog.contextvars.bound_contextvars(conn=cid):
            try:
                await self._relay(cid, client)
            except Exception:  # one connection's bug must never take the tap down
                log.exception("connection handler failed")

    async def _relay(self, cid: int, client: SocketStream) -> None:
        cfg = self.config
        opened_m = time.monotonic()
        _nodelay(client)
        peer = _addr(client.extra(SocketAttribute.remote_address, None))
        local = _addr(client.extra(SocketAttribute.local_address, None))
        self.stats.connections_total += 1
        self.stats.connections_open += 1
        self.emit(
            ev.ConnOpen(
                t=opened_m + self._wall, m=opened_m, tap=cfg.name, conn=cid, peer=peer, local=local
            )
        )
        obs = ConnectionObserver(
            tap=cfg.name,
            conn=cid,
            emit=self._safe_emit,
            wall_offset=self._wall,
            opened_m=opened_m,
            bodies=cfg.bodies,
            max_header_bytes=cfg.max_header_bytes,
            max_body_keep=cfg.max_body_keep,
        )
        conn = _Conn(cid, obs, opened_m, peer)
        conn.client = client
        self.live[cid] = conn
        outcome = _Outcome()
        try:
            with anyio.CancelScope() as scope:
                conn.scope = scope
                await self._run_connection(conn, client, outcome)
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish(conn, outcome)

    async def _run_connection(self, conn: _Conn, client: SocketStream, outcome: _Outcome) -> None:
        cfg = self.config
        obs = conn.obs
        try:
            first = await client.receive(READ_SIZE)
        except anyio.EndOfStream:
            outcome.first("client", "fin")
            return
        except (anyio.BrokenResourceError, OSError):
            outcome.first("client", "reset")
            return
        now = time.monotonic()
        if first.startswith(_TLS_HANDSHAKE) or first.startswith(_H2_PREFACE):
            self._observe(obs.client_data, first, now)
            what = "TLS handshake" if first.startswith(_TLS_HANDSHAKE) else "HTTP/2 preface"
            await self._answer(
                conn, client, 400, "Bad Request", f"tracer: {what} on a plain HTTP/1.1 listener\n"
            )
            outcome.first("tracer", "tracer")
            return
        self._observe(obs.client_data, first, now)
        addr = f"{cfg.upstream_host}:{cfg.upstream_port}"
        start = time.monotonic()
        self.emit(
            ev.UpstreamConnect(
                t=start + self._wall, m=start, tap=cfg.name, conn=conn.id, phase="start", addr=addr
            )
        )
        try:
            with anyio.fail_after(cfg.connect_timeout):
                upstream = await anyio.connect_tcp(cfg.upstream_host, cfg.upstream_port)
        except (OSError, TimeoutError) as exc:
            done = time.monotonic()
            error = (
                _describe(exc)
                if not isinstance(exc, TimeoutError)
                else f"connect timed out after {cfg.connect_timeout:g}s"
            )
            self.emit(
                ev.UpstreamConnect(
                    t=done + self._wall,
                    m=done,
                    tap=cfg.name,
                    conn=conn.id,
                    phase="failed",
                    addr=addr,
                    error=error,
                    elapsed=round(done - start, 6),
                )
            )
            await self._answer(
                conn, client, 502, "Bad Gateway", f"tracer: upstream {addr} unreachable: {error}\n"
            )
            outcome.first("tracer", "tracer")
            return
        done = time.monotonic()
        _nodelay(upstream)
        conn.upstream = upstream
        self.emit(
            ev.UpstreamConnect(
                t=done + self._wall,
                m=done,
                tap=cfg.name,
                conn=conn.id,
                phase="done",
                addr=addr,
                local=_addr(upstream.extra(SocketAttribute.local_address, None)),
                elapsed=round(done - start, 6),
            )
        )
        outcome.upstream_opened = True
        try:
            await upstream.send(first)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            outcome.first("upstream", "reset")
            self._observe_eof(obs.upstream_eof, time.monotonic(), reset=True)
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._pump_up, conn, client, upstream, outcome, tg.cancel_scope)
            tg.start_soon(self._pump_down, conn, client, upstream, outcome, tg.cancel_scope)

    async def _pump_up(
        self,
        conn: _Conn,
        client: SocketStream,
        upstream: SocketStream,
        outcome: _Outcome,
        scope: anyio.CancelScope,
    ) -> None:
        obs = conn.obs
        receive, send = client.receive, upstream.send
        while True:
            try:
                data = await receive(READ_SIZE)
            except anyio.EndOfStream:
                now = time.monotonic()
                conn.client_fin_m = now
                outcome.first("client", "fin", obs)
                self._observe_eof(obs.client_eof, now, reset=False)
                with contextlib.suppress(
                    anyio.BrokenResourceError, anyio.ClosedResourceError, OSError
                ):
                    await upstream.send_eof()
                return
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                outcome.first("client", "reset", obs)
                self._observe_eof(obs.client_eof, time.monotonic(), reset=True)
                outcome.reset_upstream = True
                scope.cancel()
                return
            self._observe(obs.client_data, data, time.monotonic())
            try:
                await send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                outcome.first("upstream", "reset", obs)
                self._observe_eof(obs.upstream_eof, time.monotonic(), reset=True)
                outcome.reset_client = True
                scope.cancel()
                return

    async def _pump_down(
        self,
        conn: _Conn,
        client: SocketStream,
        upstream: SocketStream,
        outcome: _Outcome,
        scope: anyio.CancelScope,
    ) -> None:
        obs = conn.obs
        receive, send = upstream.receive, client.send
        while True:
            try:
                data = await receive(READ_SIZE)
            except anyio.EndOfStream:
                now = time.monotonic()
                conn.upstream_fin_m = now
                outcome.first("upstream", "fin", obs)
                self._observe_eof(obs.upstream_eof, now, reset=False)
                with contextlib.suppress(
                    anyio.BrokenResourceError, anyio.ClosedResourceError, OSError
                ):
                    await client.send_eof()
                return
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                outcome.first("upstream", "reset", obs)
                self._observe_eof(obs.upstream_eof, time.monotonic(), reset=True)
                outcome.reset_client = True
                scope.cancel()
                return
            self._observe(obs.upstream_data, data, time.monotonic())
            conn.down_send_since = time.monotonic()
            try:
                await send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                outcome.first("client", "reset", obs)
                self._observe_eof(obs.client_eof, time.monotonic(), reset=True)
                outcome.reset_upstream = True
                scope.cancel()
                return
            finally:
                conn.down_send_since = None

    async def _answer(
        self, conn: _Conn, client: SocketStream, status: int, reason: str, body: str
    ) -> None:
        """Write the tap's own response (502/400), record it, and close."""
        payload = body.encode()
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\nx-tracer: {self.config.name}\r\n\r\n"
        ).encode()
        try:
            conn.obs.tracer_response(time.monotonic(), status, reason)
        except Exception:
            log.exception("observer failed recording the tap's own response")
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await client.send(head + payload)

    async def _finish(self, conn: _Conn, outcome: _Outcome) -> None:
        obs = conn.obs
        now = time.monotonic()
        shutdown = self.stopping and outcome.closed_by is None
        if outcome.closed_by is None:
            outcome.closed_by, outcome.how = "tracer", "tracer"
            outcome.in_flight = obs.in_flight
        in_flight = outcome.in_flight
        try:
            obs.close(now, shutdown=shutdown or outcome.closed_by == "tracer")
        except Exception:
            log.exception("observer close failed")
        for stream, reset in (
            (conn.client, outcome.reset_client),
            (conn.upstream, outcome.reset_upstream),
        ):
            if stream is not None:
                await _close(stream, reset=reset)
        self.live.pop(conn.id, None)
        self.stats.connections_open -= 1
        self.stats.bytes_from_client += obs.client_bytes
        self.stats.bytes_from_upstream += obs.upstream_bytes
        self.emit(
            ev.ConnClose(
                t=now + self._wall,
                m=now,
                tap=self.config.name,
                conn=conn.id,
                closed_by=outcome.closed_by,
                how=outcome.how,
                half_close=outcome.half_close(obs),
                in_flight=in_flight,
                requests=obs.seq,
                bytes_from_client=obs.client_bytes,
                bytes_from_upstream=obs.upstream_bytes,
                upstream_opened=outcome.upstream_opened,
                duration=round(now - conn.opened_m, 6),
            )
        )

    # ---- guarded observation ------------------------------------------------------

    def _safe_emit(self, event: ev.Event) -> None:
        try:
            self.emit(event)
        except Exception:
            log.exception("emitting an event failed", type=event.TYPE)

    @staticmethod
    def _observe(fn: Callable[[bytes, float], None], data: bytes, now: float) -> None:
        try:
            fn(data, now)
        except Exception:
            log.exception("observer failed; forwarding unchanged")

    @staticmethod
    def _observe_eof(fn: Callable[..., None], now: float, *, reset: bool) -> None:
        try:
            fn(now, reset=reset)
        except Exception:
            log.exception("observer failed at EOF")

    # ---- live status --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        conns = []
        for conn in self.live.values():
            obs = conn.obs
            requests = []
            for req in obs.in_flight_requests():
                started = req.pop("started_m")
                req["age"] = round(now - started, 3)
                req["last_byte_age"] = round(now - obs.last_activity_m, 3)
                requests.append(req)
            conns.append(
                {
                    "conn": conn.id,
                    "peer": conn.peer,
                    "age": round(now - conn.opened_m, 3),
                    "requests": obs.seq,
                    "idle": round(now - obs.last_activity_m, 3) if not obs.in_flight else 0.0,
                    "in_flight": requests,
                    "bytes_from_client": obs.client_bytes,
                    "bytes_from_upstream": obs.upstream_bytes,
                }
            )
        return {
            "tap": self.config.name,
            "upstream": self.config.upstream_url,
            "uptime": round(now - self.started_m, 3),
            "connections": conns,
        }


class _Outcome:
    """Who closed first and how; which side must be reset when the other was."""

    __slots__ = (
        "closed_by",
        "fin_at_bytes",
        "fin_side",
        "how",
        "in_flight",
        "reset_client",
        "reset_upstream",
        "upstream_opened",
    )

    def __init__(self) -> None:
        self.closed_by: Any = None
        self.how: Any = None
        self.reset_client = False
        self.reset_upstream = False
        self.upstream_opened = False
        self.fin_side: ev.Direction | None = None
        self.fin_at_bytes: tuple[int, int] | None = None
        self.in_flight = False  # a request was in flight when the first side closed

    def first(self, side: str, how: str, obs: ConnectionObserver | None = None) -> None:
        if self.closed_by is None:
            self.closed_by, self.how = side, how
            self.in_flight = obs is not None and obs.in_flight
            if how == "fin" and obs is not None and side in ("client", "upstream"):
                self.fin_side = "client" if side == "client" else "upstream"
                self.fin_at_bytes = (obs.client_bytes, obs.upstream_bytes)

    def half_close(self, obs: ConnectionObserver) -> ev.Direction | None:
        """The side that sent FIN first, if the other side still sent bytes after it."""
        if self.fin_side is None or self.fin_at_bytes is None:
            return None
        client_then, upstream_then = self.fin_at_bytes
        if self.fin_side == "client" and obs.upstream_bytes > upstream_then:
            return "client"
        if self.fin_side == "upstream" and obs.client_bytes > client_then:
            return "upstream"
        return None


def _nodelay(stream: SocketStream) -> None:
    sock = stream.extra(SocketAttribute.raw_socket, None)
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _unsent_bytes(stream: SocketStream | None) -> int | None:
    """Bytes queued in the kernel toward the peer and not yet acknowledged (SIOCOUTQ)."""
    if stream is None:
        return None
    sock = stream.extra(SocketAttribute.raw_socket, None)
    if sock is None or sock.fileno() < 0:
        return None
    try:
        buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return None
    return int(struct.unpack("i", buf)[0])


async def _close(stream: SocketStream, *, reset: bool) -> None:
    if reset:
        sock = stream.extra(SocketAttribute.raw_socket, None)
        if sock is not None and sock.fileno() >= 0:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError, anyio.BrokenResourceError):
        await stream.aclose()


def _addr(value: Any) -> str:
    if isinstance(value, tuple) and len(value) >= 2:
        host = str(value[0])
        return f"[{host}]:{value[1]}" if ":" in host else f"{host}:{value[1]}"
    return str(value)


def _describe(exc: BaseException) -> str:
    """A plain reason: 'Connection refused (ECONNREFUSED)' rather than asyncio's wording."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            name = errno.errorcode.get(seen.errno, str(seen.errno))
            return f"{os.strerror(seen.errno)} ({name})"
        seen = seen.__cause__
    return str(exc) or type(exc).__name__
