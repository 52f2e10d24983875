"""The inline tap: a transparent relay with an observer beside it.

Structure is anyio (the tap's task group, the stall ticker, the fingerprint,
cancellation on stop); the data path is asyncio ``Protocol`` callbacks under anyio's
asyncio backend, and a connection's upstream connect a plain asyncio task with a
deadline (``Tap.start_connect``: a connection costs less without anyio's bookkeeping).
Why: a paced LLM stream is one small read per token, and a callback that observes the
bytes and writes them to the other transport costs one read and one write system call,
with no task switch and no re-registration of the socket per read (which a stream
``receive()``/``send()`` pair pays every time). That is what keeps the tap's cost per
event near nginx's.

Per downstream connection one ``Connection`` (``proxy/connection.py``) pins one upstream
connection, opened when the client's first bytes arrive. Bytes are forwarded as they
arrive, unchanged; the observer then sees the same bytes with their arrival time. Once
the upstream is connected, a plain relay's reads take the compiled callbacks of
``proxy/pump.py`` (forward, then observe, no Python frame per read). FIN is propagated
as a half-close, a reset as a reset; backpressure is propagated by pausing the reading
side while the writing side's buffer is above its high-water mark (and a client whose
buffer stays full is "not reading"). Observation errors are caught and logged; they never stop forwarding.

The tap answers by itself only where it must: 502 when the upstream cannot be reached,
400 when the client's first bytes are not HTTP/1.x at all (a TLS handshake or an HTTP/2
preface on this plain HTTP/1.1 listener), which no HTTP/1.1 upstream could take.

Fault injection (``--fault``, opt-in) uses ``FaultConnection`` (``proxy/fault_connection.py``),
a subclass picked per
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
import functools
import resource
import time
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
    Fault,
    FaultPlan,
)
from ..observe.exchange import tick_interval
from ..observe.wire import Bodies
from ..protocol.probe_mark import nonce_for
from .connection import Connection, InjectingConnection, _unsent_bytes
from .fault_connection import FaultConnection, InjectingFaultConnection
from .pump import ClientPump
from .stats import TapStats as TapStats
from .stats import count_event

log = structlog.get_logger("tracer.proxy.relay")

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
        self.bus.add("counters", functools.partial(count_event, self.stats))
        for i, sink in enumerate(sinks or []):
            self.bus.add(f"sink-{i}", sink)
        self.live: dict[int, Connection] = {}
        self.stopping = False
        self._next_id = 0
        self._wall = time.time() - time.monotonic()
        self.started_m = time.monotonic()
        self.bound: list[tuple[str, int]] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._connects: set[asyncio.Task[None]] = set()  # upstream connects (start_connect)
        self.lag_windows = 0  # event-loop lag windows closed (tap_lag records or not)

    # ---- events -------------------------------------------------------------------

    def emit(self, event: ev.Event) -> None:
        """Every event goes through here, to the bus (never raises)."""
        self.bus.publish(event)

    safe_emit = emit  # (the name the poller and probes were given)

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
            probe_nonce=nonce_for(cfg.name),
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
                self._client_protocol,
                cfg.listen_host,
                cfg.listen_port,
                backlog=1024,
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
            for task in list(self._connects):
                task.cancel()
            for relay in list(self.live.values()):
                relay.shutdown()

    def stop(self) -> None:
        """Stop accepting and close every connection now (their requests end in flight)."""
        self.stopping = True
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def start_soon(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Run ``fn`` in the tap's task group (False: the tap is not serving)."""
        if self._tg is None:
            return False
        self._tg.start_soon(fn)
        return True

    def start_connect(self, connect: Coroutine[Any, Any, None]) -> bool:
        """Run a relay's upstream connect (False, and the coroutine closed: the tap is not
        serving). A plain asyncio task, not one of the task group's: a connection costs
        about 40 µs less (anyio's task handle, cancel scope and events), and ``serve``
        cancels the ones still running when it stops, as the group did."""
        if self._tg is None:
            connect.close()
            return False
        task = asyncio.get_running_loop().create_task(connect)
        self._connects.add(task)
        task.add_done_callback(self._connects.discard)
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
        interval = tick_interval(self.config.stall_after)
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

    def _client_protocol(self) -> asyncio.BaseProtocol:
        # (a Protocol by its methods: compiled classes cannot extend asyncio's)
        return cast(asyncio.BaseProtocol, ClientPump(self.accept))

    def accept(self, transport: asyncio.Transport, pump: ClientPump) -> Connection | None:
        """A client connected (``ClientPump.connection_made``): its relay, of the kind the
        tap's options ask for, or None when it is turned away."""
        if self.stopping:
            transport.abort()
            return None
        limit = self.config.max_connections
        if limit and self.stats.connections_open >= limit:
            self.refuse(transport)
            return None
        inject = self.config.inject_request_id
        if self.fault_plan is not None:
            kind: type[Connection] = InjectingFaultConnection if inject else FaultConnection
        else:
            kind = InjectingConnection if inject else Connection
        return kind(self, transport, pump)

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


def loop_options() -> dict[str, Any]:
    """uvloop where it is installed: the relay's callbacks then cost about half as much."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}
