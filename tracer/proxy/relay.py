"""The inline tap: a transparent relay with an observer beside it.

Structure is anyio (the tap's task group, the stall ticker, upstream connects with a
deadline, cancellation on stop); the data path is asyncio ``Protocol`` callbacks under
anyio's asyncio backend. Why: a paced LLM stream is one small read per token, and a
callback that observes the bytes and writes them to the other transport costs one read
and one write system call, with no task switch and no re-registration of the socket
per read (which a stream ``receive()``/``send()`` pair pays every time). That is what
keeps the tap's cost per event near nginx's.

Per downstream connection one ``_Relay`` pins one upstream connection, opened when the
client's first bytes arrive. Bytes are forwarded as they arrive, unchanged; the observer
sees the same bytes with their arrival time. FIN is propagated as a half-close, a reset
as a reset; backpressure is propagated by pausing the reading side while the writing
side's buffer is above its high-water mark (and a client whose buffer stays full is
"not reading"). Observation errors are caught and logged; they never stop forwarding.

The tap answers by itself only where it must: 502 when the upstream cannot be reached,
400 when the client's first bytes are not HTTP/1.x at all (a TLS handshake or an HTTP/2
preface on this plain HTTP/1.1 listener), which no HTTP/1.1 upstream could take.

Fault injection (``--fault``, opt-in) uses ``_FaultRelay``, a subclass picked per
connection only when faults are configured, so the plain relay's data path has no check
at all. It runs every byte through ``faults.ConnectionFaults`` (sans-I/O) and carries
out the actions it returns. The observer then sees what the client sees: the client's
bytes as they came, and the bytes actually written to the client, when they were
written; each injection is a ``fault`` record.

Beside the traffic, two records about the tap itself: ``topology`` (what the upstream
is: declared, or from a fingerprint taken in the background over a connection of the
tap's own, ``tracer/evidence/topology.py``) and ``tap_lag`` (the stall ticker measures how late it
wakes: the tap's own event loop lagging is the tap's own delay, not the upstream's).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import math
import resource
import socket
import struct
import termios
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import anyio
import structlog
from anyio.abc import TaskStatus

from .. import __version__
from .. import events as ev
from ..bus import EventBus
from ..capture.bodies import BodyBudget
from ..capture.files import CaptureWriter, boot_id
from ..errors import start_error
from ..evidence import topology
from ..faults.plan import (
    Action,
    ArmIdle,
    ConnectionFaults,
    Cut,
    Deliver,
    Fault,
    FaultPlan,
    Forward,
    Freeze,
    Hold,
    Injected,
)
from ..observe.wire import Bodies, ConnectionObserver, not_http
from .inject import RequestIdInjector

log = structlog.get_logger("tracer.proxy.relay")

READ_SIZE = 65536
# errors that are the tap's own limits, not its upstream's: reported as such (503)
OWN_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# descriptors kept back from the client budget: capture, admin, probes, logs, the loop
_SPARE_DESCRIPTORS = 64


def descriptor_budget() -> int:
    """The default ``--max-connections``: raise the soft descriptor limit to the hard one
    (as Go's runtime does), then allow as many clients as have a descriptor for themselves
    and one for their upstream, less a reserve. Past it the tap answers its own 503
    instead of running out of descriptors, where a client could only get an EOF."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    wanted = min(wanted, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, (soft - _SPARE_DESCRIPTORS) // 2)


LAG_WINDOW = 1.0  # seconds: at most one tap_lag record per window


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
    # a request head unfinished this long closes the connection (slowloris; None: never)
    header_timeout: float | None = 60.0
    bodies: Bodies = "requests"
    max_header_bytes: int = 64 * 1024
    max_body_keep: int = 16 * 1024 * 1024
    body_memory: int = 64 * 1024 * 1024  # --body-memory: every body held, together
    max_connections: int = 0  # --max-connections: past it the tap answers 503 itself (0: none)
    redact_json_fields: frozenset[str] = frozenset()  # --redact-json-field (lower case)
    faults: list[Fault] = field(default_factory=list)  # --fault: opt-in, altering traffic
    fault_control: bool = False  # --fault-control: the faults change at run time (admin)
    inject_request_id: bool = False  # --inject-request-id: opt-in, altering traffic
    # topology (tracer/evidence/topology.py): declared role wins; else a fingerprint at start
    upstream_role: Literal["engine", "router", "proxy"] | None = None  # --upstream-role
    client_facing: bool = False  # --client-facing: the harness connects here directly
    fingerprint: bool = False  # fingerprint the upstream at start (the CLI turns it on)
    fingerprint_timeout: float = topology.TIMEOUT
    serving_urls: list[str] = field(default_factory=list)  # --engine-metrics, --health
    lag_threshold: float = 0.02  # a tick later than this is event-loop lag (tap_lag)

    @property
    def upstream_url(self) -> str:
        return f"http://{self.upstream_host}:{self.upstream_port}"


@dataclass
class TapStats:
    connections_total: int = 0
    connections_open: int = 0
    connections_refused: int = 0  # over --max-connections: answered 503 by the tap
    header_timeouts: int = 0  # connections closed: their request head took too long
    requests_total: int = 0
    upstream_connect_failures: int = 0
    anomalies: int = 0
    bytes_from_client: int = 0
    bytes_from_upstream: int = 0
    terminations: Counter[str] = field(default_factory=Counter)
    stalls: Counter[str] = field(default_factory=Counter)
    stalls_active: int = 0
    faults: Counter[str] = field(default_factory=Counter)


class Tap:
    """One named observation point: listener, relays, observers, capture, stats."""

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
        self.body_budget = BodyBudget(config.body_memory)
        self._refused_logged = -1.0
        self.fault_plan = (
            FaultPlan(config.faults) if config.faults or config.fault_control else None
        )
        # every event goes through the bus: capture first, then counters and log lines,
        # then the sinks added later (admin, probes, OTLP); a failing sink is switched off
        self.bus = EventBus()
        if capture is not None:
            self.bus.add("capture", capture.write)
        self.bus.add("counters", self._count)
        for i, sink in enumerate(sinks or []):
            self.bus.add(f"sink-{i}", sink)
        self.live: dict[int, _Relay] = {}
        self.stopping = False
        self._next_id = 0
        self._wall = time.time() - time.monotonic()
        self.started_m = time.monotonic()
        self.bound: list[tuple[str, int]] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self.lag_windows = 0  # event-loop lag windows closed (tap_lag records or not)

    # ---- events -------------------------------------------------------------------

    def emit(self, event: ev.Event) -> None:
        """Every event goes through here, to the bus (never raises)."""
        self.bus.publish(event)

    safe_emit = emit  # (the name the poller and probes were given)

    def _count(self, event: ev.Event) -> None:
        """The counters of /metrics and /status, and a log line for what deserves one."""
        if type(event) is ev.BodyData:  # the hot path: nothing to count or log
            return
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
            case ev.FaultInjected():
                stats.faults[event.fault] += 1
                log.warning(
                    "fault injected",
                    conn=event.conn,
                    seq=event.seq,
                    fault=event.spec,
                    detail=event.detail,
                )
            case ev.UpstreamConnect(phase="failed"):
                stats.upstream_connect_failures += 1
                log.warning("upstream connect failed", conn=event.conn, error=event.error)
            case _:
                pass

    def change_faults(
        self, faults: Sequence[Fault], change: Literal["replace", "add", "clear"]
    ) -> ev.FaultPlanChanged:
        """Change the fault plan at run time (``--fault-control``), recorded in the capture.
        Raises ``RuntimeError`` when the tap was not started for it: its connections then
        relay without following requests, and a plan could not reach them."""
        plan = self.fault_plan
        if plan is None or not self.config.fault_control:
            raise RuntimeError("the faults are fixed: start the tap with --fault-control")
        if change == "add":
            plan.add(faults)
        else:
            plan.replace(faults)
        now = time.monotonic()
        event = ev.FaultPlanChanged(
            t=now + self._wall, m=now, tap=self.config.name, faults=plan.specs, change=change
        )
        self.emit(event)
        log.warning("fault plan changed", change=change, faults=plan.specs)
        return event

    @property
    def wall_offset(self) -> float:
        """Add to a monotonic time to get wall-clock time (fixed at start)."""
        return self._wall

    def header(self, **extra: Any) -> ev.CaptureStart:
        now = time.monotonic()
        cfg = self.config
        if cfg.faults:
            extra["faults"] = [f.spec for f in cfg.faults]
        if cfg.fault_control:
            extra["fault_control"] = True  # the faults may change: fault_plan records
        if cfg.inject_request_id:
            extra["inject_request_id"] = True  # this tap altered requests (opt-in)
        if cfg.fingerprint and cfg.upstream_role is None:
            extra["fingerprint"] = True  # a topology record follows once it is taken
        return ev.CaptureStart(
            t=now + self._wall,
            m=now,
            tap=cfg.name,
            tracer_version=__version__,
            kind="proxy",
            listen=f"{cfg.listen_host}:{cfg.listen_port}",
            upstream=cfg.upstream_url,
            boot_id=boot_id(),
            options={
                "stall_after": cfg.stall_after,
                "bodies": cfg.bodies,
                "idle_timeout": cfg.idle_timeout,
                "header_timeout": cfg.header_timeout,
                "connect_timeout": cfg.connect_timeout,
                **extra,
            },
            upstream_role=cfg.upstream_role,
            client_facing=True if cfg.client_facing else None,
        )

    # ---- serving ------------------------------------------------------------------

    async def serve(
        self, *, task_status: TaskStatus[list[tuple[str, int]]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and relay until cancelled or ``stop()``; ``tg.start`` gets the bound addresses."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        try:
            server = await loop.create_server(
                lambda: _ClientSide(self), cfg.listen_host, cfg.listen_port, backlog=1024
            )
        except OSError as exc:
            raise start_error(
                f"cannot listen on {cfg.listen_host}:{cfg.listen_port}", exc
            ) from None
        self.bound = [
            (str(sock.getsockname()[0]), int(sock.getsockname()[1])) for sock in server.sockets
        ]
        log.info(
            "tap listening",
            tap=cfg.name,
            listen=self.bound,
            upstream=cfg.upstream_url,
            max_connections=cfg.max_connections or None,
        )
        try:
            with structlog.contextvars.bound_contextvars(tap=cfg.name):
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    tg.start_soon(self._ticker)
                    if cfg.upstream_role is not None or cfg.fingerprint:
                        tg.start_soon(self._topology)
                    task_status.started(self.bound)
                    await anyio.sleep_forever()
        finally:
            self._tg = None
            server.close()
            self.stopping = True
            for relay in list(self.live.values()):
                relay.shutdown()

    def stop(self) -> None:
        """Stop accepting and close every connection now (their requests end in flight)."""
        self.stopping = True
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def start_soon(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        if self._tg is None:
            return False
        self._tg.start_soon(fn)
        return True

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def _topology(self) -> None:
        """Record what the upstream is: declared at once, else after the fingerprint (its
        own connection, in the background; it never touches forwarding)."""
        cfg = self.config
        start = time.monotonic()
        elapsed: float | None = None
        try:
            if cfg.upstream_role is not None:
                verdict = topology.declared(cfg.upstream_role)
            else:
                verdict = await topology.probe(
                    cfg.upstream_host,
                    cfg.upstream_port,
                    tap=cfg.name,
                    urls=cfg.serving_urls,
                    timeout=cfg.fingerprint_timeout,
                )
                elapsed = round(time.monotonic() - start, 6)
        except Exception as exc:  # never into the tap
            log.exception("upstream fingerprint failed")
            verdict = topology.Verdict(
                "unknown", "unknown", [f"fingerprint failed: {topology.describe_error(exc)}"]
            )
        now = time.monotonic()
        self.safe_emit(
            ev.Topology(
                t=now + self._wall,
                m=now,
                tap=cfg.name,
                upstream=cfg.upstream_url,
                upstream_role=verdict.role,
                basis=verdict.basis,
                evidence=list(verdict.evidence),
                client_facing=cfg.client_facing,
                server=verdict.server,
                elapsed=elapsed,
            )
        )
        refused = [e for e in verdict.evidence if "connect failed" in e]
        if refused:  # the fingerprint was the start-up check of the upstream
            log.warning(
                "upstream does not accept connections now; clients get 502 until it does",
                upstream=cfg.upstream_url,
                error=refused[0],
            )
        log.info(
            "upstream topology",
            role=verdict.role,
            basis=verdict.basis,
            server=(verdict.server or {}).get("kind"),
            evidence=verdict.evidence,
        )

    async def _ticker(self) -> None:
        interval = max(0.05, min(0.25, self.config.stall_after / 4))
        stall_after = self.config.stall_after
        idle_timeout = self.config.idle_timeout
        # event-loop lag: how late each tick wakes (a subtraction and a compare a tick)
        threshold = self.config.lag_threshold
        window_start = time.monotonic()
        window_end = window_start + LAG_WINDOW
        ticks = late_ticks = 0
        worst = worst_at = 0.0
        due = window_start + interval
        try:
            while True:
                await anyio.sleep(interval)
                now = time.monotonic()
                late = now - due
                ticks += 1
                if late > threshold:
                    late_ticks += 1
                    if late > worst:
                        worst, worst_at = late, now
                if now >= window_end:
                    if late_ticks:
                        self._lag(window_start, now, worst, worst_at, late_ticks, ticks, interval)
                    self.lag_windows += 1
                    window_start, window_end = now, now + LAG_WINDOW
                    ticks = late_ticks = 0
                    worst = 0.0
                self._tick(now, stall_after, idle_timeout)
                due = time.monotonic() + interval
        finally:
            if late_ticks:  # stopping: the window so far
                self._lag(
                    window_start, time.monotonic(), worst, worst_at, late_ticks, ticks, interval
                )

    def _lag(
        self,
        start: float,
        end: float,
        worst: float,
        worst_at: float,
        late_ticks: int,
        ticks: int,
        interval: float,
    ) -> None:
        event = ev.TapLag(
            t=end + self._wall,
            m=end,
            tap=self.config.name,
            window_start=start,
            window=round(end - start, 6),
            max_lag=round(worst, 6),
            max_lag_at=worst_at,
            late_ticks=late_ticks,
            ticks=ticks,
            threshold=self.config.lag_threshold,
            interval=interval,
        )
        self.safe_emit(event)
        log.warning("the tap's event loop ran late", max_lag=event.max_lag, late_ticks=late_ticks)

    def _tick(self, now: float, stall_after: float, idle_timeout: float | None) -> None:
        """The stall, idle and header-timeout checks of every live connection, once a tick."""
        header_timeout = self.config.header_timeout
        for relay in list(self.live.values()):
            obs = relay.obs
            obs.flush(now)
            silent = now - obs.last_activity_m
            if obs.in_flight and silent >= stall_after:
                try:
                    obs.tick(
                        now,
                        stall_after=stall_after,
                        client_blocked=relay.client_paused_since is not None,
                        unsent=_unsent_bytes(relay.client),
                    )
                except Exception:  # observation must never stop the tap
                    log.exception("observer tick failed", conn=relay.id)
            elif idle_timeout is not None and not obs.in_flight and silent >= idle_timeout:
                relay.close_by_tracer("idle timeout")
            started = obs.head_started_m
            if started is not None and header_timeout and now - started >= header_timeout:
                self.stats.header_timeouts += 1
                relay.close_by_tracer("request head not finished within --header-timeout")

    # ---- guarded observation ------------------------------------------------------

    # ---- live status --------------------------------------------------------------

    def refuse(self, transport: asyncio.Transport) -> None:
        """A client over ``--max-connections``: the tap's own 503, and a log line (at most
        one a second, with the count refused since)."""
        self.stats.connections_refused += 1
        limit = self.config.max_connections
        body = f"tracer: this tap is at --max-connections ({limit}); try again later\n".encode()
        transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\nx-tracer: %s"
            b"\r\n\r\n%s" % (len(body), self.config.name.encode(), body)
        )
        transport.close()
        now = time.monotonic()
        if now - self._refused_logged >= 1.0:
            self._refused_logged = now
            log.warning(
                "connection refused: --max-connections reached",
                limit=limit,
                refused=self.stats.connections_refused,
            )

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        conns = []
        for relay in self.live.values():
            obs = relay.obs
            requests = []
            for req in obs.in_flight_requests():
                started = req.pop("started_m")
                req["age"] = round(now - started, 3)
                req["last_byte_age"] = round(now - obs.last_activity_m, 3)
                requests.append(req)
            conns.append(
                {
                    "conn": relay.id,
                    "peer": relay.peer,
                    "age": round(now - relay.opened_m, 3),
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
            "body_memory": {
                "held": self.body_budget.held,
                "limit": self.body_budget.limit,
                "bodies_over": self.body_budget.exceeded,
            },
        }


class _Relay:
    """One client connection and its pinned upstream connection, driven by callbacks."""

    def __init__(self, tap: Tap, client: asyncio.Transport) -> None:
        self.tap = tap
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
            wall_offset=tap._wall,
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
        _nodelay(client)
        tap.stats.connections_total += 1
        tap.stats.connections_open += 1
        tap.live[self.id] = self
        tap.emit(
            ev.ConnOpen(
                t=self.opened_m + tap._wall,
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
            self._observe(self.obs.client_data, data, now)
            return
        if self.finished or self.closed_by == "tracer":
            return
        self._observe(self.obs.client_data, data, now)
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
            if not self.tap.start_soon(self._connect):
                self.close_by_tracer("tap stopping")

    def from_upstream(self, data: bytes) -> None:
        now = time.monotonic()
        if not self.client.is_closing():
            self.client.write(data)  # forward first: observing never delays bytes
        self._observe(self.obs.upstream_data, data, now)

    async def _connect(self) -> None:
        tap, cfg = self.tap, self.tap.config
        addr = f"{cfg.upstream_host}:{cfg.upstream_port}"
        start = time.monotonic()
        tap.emit(
            ev.UpstreamConnect(
                t=start + tap._wall, m=start, tap=cfg.name, conn=self.id, phase="start", addr=addr
            )
        )
        loop = asyncio.get_running_loop()
        try:
            with anyio.fail_after(cfg.connect_timeout):
                transport, _ = await loop.create_connection(
                    lambda: _UpstreamSide(self), cfg.upstream_host, cfg.upstream_port
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
                    t=done + tap._wall,
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
        _nodelay(transport)
        self.upstream = transport
        self.upstream_lost = False
        self.upstream_opened = True
        tap.emit(
            ev.UpstreamConnect(
                t=done + tap._wall,
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
                t=now + tap._wall,
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

    def _observe(self, fn: Callable[[bytes, float], None], data: bytes, now: float) -> None:
        try:
            fn(data, now)
        except Exception:
            log.exception("observer failed; forwarding unchanged", conn=self.id)

    def _observe_eof(self, fn: Callable[..., None], now: float, *, reset: bool) -> None:
        try:
            fn(now, reset=reset)
        except Exception:
            log.exception("observer failed at EOF", conn=self.id)


class _InjectingRelay(_Relay):
    """A relay that adds ``x-request-id`` to requests without one (``--inject-request-id``).

    The observer sees the rewritten bytes — what the upstream got — so every tap behind
    this one records the same id and the multi-tap join is exact.
    """

    def __init__(self, tap: Tap, client: asyncio.Transport) -> None:
        super().__init__(tap, client)
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
                t=now + tap._wall,
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


class _FaultRelay(_Relay):
    """A relay with faults (``--fault``): every byte goes through ``ConnectionFaults``.

    Actions toward the client pass through one ordered queue, so that a ``Hold`` holds
    everything behind it (bytes, records, the end of the upstream connection) until its
    timer releases it. While the queue holds more than ``QUEUE_LIMIT`` bytes, the
    upstream is not read. The observer is fed what the client sees: bytes written to the
    client when they are written, and the tap's own close of the client connection.
    """

    QUEUE_LIMIT = 1 << 20

    def __init__(self, tap: Tap, client: asyncio.Transport) -> None:
        super().__init__(tap, client)
        assert tap.fault_plan is not None
        self.faults = ConnectionFaults(tap.fault_plan)
        self._queue: deque[Deliver | Hold | Cut | Injected | ArmIdle | Callable[[], None]] = deque()
        self._queued = 0  # bytes waiting in the queue
        self._holding = False
        self._hold: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._frozen = False  # half-open: neither side is read or written any more
        self._up_paused = False  # the upstream is not read: the queue is full

    # ---- bytes --------------------------------------------------------------------

    def from_client(self, data: bytes) -> None:
        if self._frozen:
            self.client.pause_reading()
            return
        if self.finished:
            return
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        # observed first (unlike the plain relay): the request's record precedes its fault's
        self._observe(self.obs.client_data, data, time.monotonic())
        self._act(self.faults.client_data(data))

    def from_upstream(self, data: bytes) -> None:
        if self._frozen:
            if self.upstream is not None:
                self.upstream.pause_reading()
            return
        self._act(self.faults.upstream_data(data))

    def _act(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Forward):
                upstream = self.upstream
                if upstream is not None:
                    if not upstream.is_closing():
                        upstream.write(action.data)
                elif not (self.finished or self.closed_by == "tracer"):
                    self._hold_for_upstream(action.data)
            elif isinstance(action, Freeze):
                self._freeze()
            elif isinstance(action, Injected) and action.now:
                self._record(action)
            else:
                if isinstance(action, Deliver):
                    self._queued += len(action.data)
                self._queue.append(action)
        if self._queue:
            self._drain()

    def _drain(self) -> None:
        queue = self._queue
        while queue and not self._holding:
            item = queue.popleft()
            if isinstance(item, Deliver):
                self._queued -= len(item.data)
                if not self.client.is_closing():
                    self.client.write(item.data)
                self._observe(self.obs.upstream_data, item.data, time.monotonic())
            elif isinstance(item, Hold):
                if item.merge and any(isinstance(i, Hold) and i.merge for i in queue):
                    continue  # what queued behind it goes out with this bunch
                self._holding = True
                if not math.isinf(item.seconds):
                    loop = asyncio.get_running_loop()
                    self._hold = loop.call_later(item.seconds, self._release)
            elif isinstance(item, Injected):
                self._record(item)
            elif isinstance(item, Cut):
                self._cut(item.how)
            elif isinstance(item, ArmIdle):
                if self._idle is not None:
                    self._idle.cancel()
                loop = asyncio.get_running_loop()
                self._idle = loop.call_later(item.fault.seconds, self._idle_close, item)
            else:
                item()  # the upstream's end, deferred behind a hold
        upstream = self.upstream
        if upstream is None or upstream.is_closing():
            return
        if self._queued > self.QUEUE_LIMIT and not self._up_paused:
            self._up_paused = True
            upstream.pause_reading()
        elif self._up_paused and self._queued <= self.QUEUE_LIMIT:
            self._up_paused = False
            if self.client_paused_since is None and not self._frozen:
                upstream.resume_reading()

    def _release(self) -> None:
        self._hold = None
        self._holding = False
        if not self.finished:
            self._drain()

    # ---- what the faults do ---------------------------------------------------------

    def _record(self, item: Injected) -> None:
        now = time.monotonic()
        tap = self.tap
        tap.safe_emit(
            ev.FaultInjected(
                t=now + tap._wall,
                m=now,
                tap=tap.config.name,
                conn=self.id,
                seq=item.seq,
                fault=item.fault.name,
                spec=item.fault.spec,
                detail=item.detail,
            )
        )

    def _cut(self, how: Literal["fin", "reset"]) -> None:
        """Close the client connection mid-response; the observer records the cut."""
        self._first("tracer", "tracer")
        self._observe_eof(self.obs.upstream_eof, time.monotonic(), reset=how == "reset")
        if how == "reset":
            _abort(self.client)
        elif not self.client.is_closing():
            self.client.close()
        if self.upstream is not None and not self.upstream.is_closing():
            self.upstream.close()
        self._queue.clear()

    def _freeze(self) -> None:
        self._frozen = True
        self._stop_timers()
        self._queue.clear()
        self.client.pause_reading()
        if self.upstream is not None and not self.upstream.is_closing():
            self.upstream.pause_reading()

    def _idle_close(self, item: ArmIdle) -> None:
        self._idle = None
        if self.finished or self.closed_by is not None or self.obs.in_flight or self.faults.busy:
            return
        detail = f"connection closed after {item.fault.seconds:g}s idle"
        self._record(Injected(item.fault, item.seq, detail))
        self.close_by_tracer("fault close-idle-after")

    def _stop_timers(self) -> None:
        for timer in (self._hold, self._idle):
            if timer is not None:
                timer.cancel()
        self._hold = self._idle = None
        self._holding = False

    # ---- ends -------------------------------------------------------------------------

    def on_upstream_eof(self) -> None:
        if self._frozen:
            return
        self._act(self.faults.upstream_eof())
        if self.faults.silent and not self.client_eof:
            # a dropped request: the client connection stays open and silent
            self.upstream_eof = True
            if self.upstream is not None:
                self.upstream.close()
            return
        if self._queue or self._holding:
            self._queue.append(super().on_upstream_eof)
            return
        super().on_upstream_eof()

    def on_upstream_lost(self, exc: Exception | None) -> None:
        if self._frozen or (self.faults.silent and not self.client_eof):
            self.upstream_lost = True
            self._maybe_finish()
            return
        if self._queue or self._holding:
            self._queue.append(functools.partial(super().on_upstream_lost, exc))
            return
        super().on_upstream_lost(exc)

    def on_client_lost(self, exc: Exception | None) -> None:
        self._stop_timers()
        deferred = [item for item in self._queue if callable(item)]
        self._queue.clear()
        super().on_client_lost(exc)
        for end in deferred:  # the upstream's end, held behind a hold that is moot now
            end()

    def finish(self, *, shutdown: bool = False) -> None:
        self._stop_timers()
        super().finish(shutdown=shutdown)

    # ---- backpressure -----------------------------------------------------------------

    def client_write_resumed(self) -> None:
        self.client_paused_since = None
        upstream = self.upstream
        if upstream is not None and not (upstream.is_closing() or self._frozen or self._up_paused):
            upstream.resume_reading()

    def upstream_write_resumed(self) -> None:
        if not self._frozen:
            super().upstream_write_resumed()


class _InjectingFaultRelay(_InjectingRelay, _FaultRelay):
    """Both: ``x-request-id`` added first, so the faults and the observer see the request
    the upstream gets (and a request the tap answers itself is recorded with its id)."""


class _ClientSide(asyncio.Protocol):
    """Callbacks of the accepted (downstream) socket."""

    def __init__(self, tap: Tap) -> None:
        self.tap = tap
        self.relay: _Relay | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if self.tap.stopping:
            transport.abort()
            return
        limit = self.tap.config.max_connections
        if limit and self.tap.stats.connections_open >= limit:
            self.tap.refuse(transport)
            return
        inject = self.tap.config.inject_request_id
        if self.tap.fault_plan is not None:
            kind: type[_Relay] = _InjectingFaultRelay if inject else _FaultRelay
        else:
            kind = _InjectingRelay if inject else _Relay
        self.relay = kind(self.tap, transport)

    def data_received(self, data: bytes) -> None:
        if self.relay is not None:
            self.relay.from_client(data)

    def eof_received(self) -> bool:
        if self.relay is not None:
            self.relay.on_client_eof()
        return True  # keep the write side open: the response may still be coming

    def connection_lost(self, exc: Exception | None) -> None:
        if self.relay is not None:
            self.relay.on_client_lost(exc)

    def pause_writing(self) -> None:
        if self.relay is not None:
            self.relay.client_write_paused()

    def resume_writing(self) -> None:
        if self.relay is not None:
            self.relay.client_write_resumed()


class _UpstreamSide(asyncio.Protocol):
    """Callbacks of the upstream socket of one relay."""

    def __init__(self, relay: _Relay) -> None:
        self.relay = relay

    def data_received(self, data: bytes) -> None:
        self.relay.from_upstream(data)

    def eof_received(self) -> bool:
        self.relay.on_upstream_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.relay.upstream is not None:
            self.relay.on_upstream_lost(exc)

    def pause_writing(self) -> None:
        self.relay.upstream_write_paused()

    def resume_writing(self) -> None:
        self.relay.upstream_write_resumed()


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


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


def loop_options() -> dict[str, Any]:
    """uvloop where it is installed: the relay's callbacks then cost about half as much."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}
