"""The tap's admin endpoint: ``/metrics`` (Prometheus text), ``/status`` (JSON), ``POST
/mark`` and ``/faults`` (the fault plan; changed at run time with ``--fault-control``).

A deliberately small HTTP/1.1 server on anyio + h11. Loopback only unless the operator
says otherwise: it reveals live traffic metadata.

``/status`` is the tap's own view (connections, requests in flight) plus what
``LiveState``, a tap sink, keeps of the recent past: notable events (stalls, anomalies,
failed or cut responses, connect failures, faults, probes, marks), the newest engine
samples, and the target of each request in flight. ``tracer top`` renders it. Every time
in it is an age in seconds at the moment of the request, so a recorded ``/status``
renders the same way every time.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import secrets
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import h11
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskStatus
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .. import events as ev
from ..errors import start_error
from ..evidence.engines import progress_delta
from ..faults.plan import Fault, FaultSpecError, parse_fault
from .relay import Tap

log = structlog.get_logger("tracer.proxy.admin")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _TapCollector:
    """Reads the tap's live counters at scrape time (nothing is updated per event)."""

    def __init__(self, tap: Tap) -> None:
        self.tap = tap

    def collect(self) -> Iterator[Metric]:
        tap, stats = self.tap, self.tap.stats
        labels = ["tap"]
        name = [tap.config.name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=labels)
            g.add_metric(name, value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=labels)
            c.add_metric(name, value)
            return c

        yield gauge(
            "tracer_connections_open", "Downstream connections open now.", stats.connections_open
        )
        yield counter(
            "tracer_connections", "Downstream connections accepted.", stats.connections_total
        )
        in_flight = sum(len(c.obs.in_flight_requests()) for c in tap.live.values())
        yield gauge(
            "tracer_requests_in_flight", "Requests whose response has not ended.", in_flight
        )
        yield counter("tracer_requests", "Request heads seen.", stats.requests_total)
        by_term = CounterMetricFamily(
            "tracer_responses", "Responses ended, by termination.", labels=["tap", "termination"]
        )
        for term in (
            "complete",
            "truncated",
            "client_abort",
            "in_flight",
            "unparsed",
            "tracer_response",
        ):
            by_term.add_metric([tap.config.name, term], stats.terminations.get(term, 0))
        yield by_term
        stalls = CounterMetricFamily(
            "tracer_stalls", "Stalls started, by direction.", labels=["tap", "direction"]
        )
        for direction in ("upstream_silent", "client_not_reading", "client_silent"):
            stalls.add_metric([tap.config.name, direction], stats.stalls.get(direction, 0))
        yield stalls
        yield gauge("tracer_stalls_active", "Requests stalled now.", stats.stalls_active)
        yield counter(
            "tracer_connections_refused",
            "Client connections the tap answered 503 itself (--max-connections).",
            stats.connections_refused,
        )
        yield gauge(
            "tracer_sinks_disabled",
            "Event sinks switched off because they raised (the capture, admin state, OTLP, "
            "probes); traffic is unaffected.",
            len(tap.bus.disabled),
        )
        yield counter(
            "tracer_header_timeouts",
            "Client connections closed because their request head took over --header-timeout.",
            stats.header_timeouts,
        )
        yield counter(
            "tracer_upstream_connect_failures",
            "Upstream connects that failed.",
            stats.upstream_connect_failures,
        )
        yield counter(
            "tracer_protocol_anomalies", "Bytes the observer could not parse.", stats.anomalies
        )
        if tap.fault_plan is not None:  # a tap that alters traffic on purpose says how much
            injected = CounterMetricFamily(
                "tracer_faults_injected",
                "Faults the tap injected itself (--fault), by fault.",
                labels=["tap", "fault"],
            )
            for fault, count in sorted(stats.faults.items()):
                injected.add_metric([tap.config.name, fault], count)
            yield injected
            yield gauge(
                "tracer_faults_planned", "Faults in the tap's plan now.", len(tap.fault_plan.faults)
            )
        bytes_family = CounterMetricFamily(
            "tracer_bytes", "Bytes relayed (closed connections).", labels=["tap", "from"]
        )
        bytes_family.add_metric([tap.config.name, "client"], stats.bytes_from_client)
        bytes_family.add_metric([tap.config.name, "upstream"], stats.bytes_from_upstream)
        yield bytes_family
        cap = tap.capture
        yield counter(
            "tracer_capture_records_written", "Capture records on disk.", cap.written if cap else 0
        )
        yield counter(
            "tracer_capture_records_dropped",
            "Capture records lost (disk full or slow).",
            cap.dropped if cap else 0,
        )
        yield counter(
            "tracer_capture_bytes_dropped",
            "Capture bytes lost (disk full or slow).",
            cap.dropped_bytes if cap else 0,
        )
        yield gauge(
            "tracer_capture_failing",
            "1 while the capture's last write failed (records are being lost).",
            int(cap.failing) if cap else 0,
        )
        yield gauge(
            "tracer_capture_pending_bytes",
            "Capture bytes waiting for the writer.",
            cap.pending_bytes if cap else 0,
        )


RECENT = 50  # notable events kept for /status


@dataclass(slots=True)
class _Notable:
    m: float
    kind: str
    conn: int | None
    seq: int | None
    detail: str


class LiveState:
    """A tap sink that keeps what ``/status`` shows beyond the tap's own live state.

    Bounded: ``RECENT`` notable events, one sample per engine URL and source, one entry
    per request in flight. Costs nothing on the body hot path.
    """

    def __init__(self) -> None:
        self.recent: deque[_Notable] = deque(maxlen=RECENT)
        self.samples: dict[tuple[str, str], ev.EngineSample] = {}
        self.requests: dict[tuple[int, int], tuple[str, str | None]] = {}
        self._scrape_ok: dict[str, bool] = {}

    def __call__(self, event: ev.Event) -> None:
        if type(event) is ev.BodyData:
            return
        match event:
            case ev.RequestHead():
                key = (event.conn, event.seq)
                self.requests[key] = (f"{event.method} {event.target}"[:200], event.request_id)
            case ev.ResponseEnd():
                self.requests.pop((event.conn, event.seq), None)
                self._response_end(event)
            case ev.ConnClose():
                for key in [k for k in self.requests if k[0] == event.conn]:
                    del self.requests[key]
            case ev.Stall(phase="start"):
                detail = f"{event.direction}, no bytes for {event.silent_for:.1f}s"
                self._note(event, "stall", event.conn, event.seq, detail)
            case ev.Stall(phase="end"):
                detail = f"{event.direction} ended after {event.silent_for:.1f}s"
                self._note(event, "stall_end", event.conn, event.seq, detail)
            case ev.Anomaly():
                detail = f"{event.direction} bytes at {event.offset}: {event.error}"
                self._note(event, "anomaly", event.conn, event.seq, detail)
            case ev.UpstreamConnect(phase="failed"):
                detail = f"{event.addr}: {event.error}"
                self._note(event, "connect_failed", event.conn, None, detail)
            case ev.FaultInjected():
                detail = event.spec + (f": {event.detail}" if event.detail else "")
                self._note(event, "fault", event.conn, event.seq, detail)
            case ev.Probe() if event.outcome != "skipped":
                took = f" in {event.latency:.2f}s" if event.latency is not None else ""
                detail = f"{event.target} {event.url}: {event.outcome}{took}"
                self._note(event, "probe", event.trigger_conn, event.trigger_seq, detail)
            case ev.Mark():
                self._note(event, "mark", None, None, event.note or "hang marked")
            case ev.FaultPlanChanged():
                detail = ", ".join(event.faults) or "no faults"
                self._note(event, "fault_plan", None, None, f"{event.change}: {detail}")
            case ev.EngineSample():
                self.samples[(event.url, event.source)] = event
                was = self._scrape_ok.get(event.url, True)
                self._scrape_ok[event.url] = event.ok
                if was and not event.ok:
                    self._note(event, "scrape_failed", None, None, f"{event.url}: {event.error}")
            case _:
                pass

    def _note(self, e: ev.Event, kind: str, conn: int | None, seq: int | None, d: str) -> None:
        self.recent.append(_Notable(e.m, kind, conn, seq, d))

    def _response_end(self, e: ev.ResponseEnd) -> None:
        status = f"HTTP {e.status}" if e.status is not None else "no status"
        if e.termination != "complete":
            why = ", ".join(x for x in (e.close, e.detail) if x)
            detail = f"{status}, {e.body_bytes} bytes after {e.duration:.1f}s" + (
                f" ({why})" if why else ""
            )
            self._note(e, e.termination, e.conn, e.seq, detail)
        elif e.status is not None and e.status >= 500:
            self._note(e, "http_error", e.conn, e.seq, status)
        elif e.error is not None:
            self._note(e, "stream_error", e.conn, e.seq, e.error[:200])

    def engines(self, now: float) -> list[dict[str, Any]]:
        """One row per engine: load from ``/v1/loads`` when there, rates from ``/metrics``."""
        by_engine: dict[str, dict[str, ev.EngineSample]] = {}
        for (url, source), sample in self.samples.items():
            by_engine.setdefault(_engine_base(url), {})[source] = sample
        rows = []
        for _, sources in sorted(by_engine.items()):
            metrics, loads = sources.get("metrics"), sources.get("loads")
            newest = max(sources.values(), key=lambda s: s.m)
            row: dict[str, Any] = {
                "url": (metrics or newest).url,
                "profile": newest.profile,
                "ok": newest.ok,
                "age": round(now - newest.m, 3),
                "error": newest.error,
            }
            for key in ("running", "queued", "token_usage", "gen_throughput", "in_flight"):
                values = [s.state.get(key) for s in (loads, metrics) if s is not None and s.ok]
                row[key] = next((v for v in values if v is not None), None)
            row["tokens_per_s"] = None
            if metrics is not None and metrics.ok and metrics.deltas and metrics.interval:
                generated = progress_delta(metrics.deltas, metrics.profile)
                if generated is not None:
                    row["tokens_per_s"] = round(generated / metrics.interval, 1)
            rows.append(row)
        return rows

    def recent_events(self, now: float) -> list[dict[str, Any]]:
        """Newest first."""
        return [
            {"age": round(now - n.m, 3), "kind": n.kind, "conn": n.conn, "seq": n.seq}
            | {"detail": n.detail}
            for n in reversed(self.recent)
        ]


def _engine_base(url: str) -> str:
    """The engine a sample belongs to: its URL without the metrics or loads path."""
    for suffix in ("/metrics", "/v1/loads", "/get_load"):
        if url.endswith(suffix):
            return url.removesuffix(suffix)
    return url


MAX_MARKS = 100  # marks one tap run takes (more are refused: 429)
MARK_INTERVAL = 1.0  # seconds between two marks at least
TOKEN_HEADER = "x-tracer-token"


def _host_and_port(value: str) -> tuple[str, int | None]:
    """``Host`` header -> (host, port): ``[::1]:9100``, ``127.0.0.1``, ``localhost:9``."""
    host, port = value, None
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        if rest.startswith(":") and rest[1:].isdigit():
            port = int(rest[1:])
    elif value.count(":") == 1:
        host, _, tail = value.partition(":")
        port = int(tail) if tail.isdigit() else -1
    return host.lower(), port


class AdminServer:
    """The admin endpoint. Every request must name the admin by an address (``Host``: an
    IP literal or ``localhost``, the admin's port): a web page on a name that resolves
    to 127.0.0.1 (DNS rebinding) gets nothing. What changes state (``POST /mark``,
    ``/faults``) also needs the token (``Authorization: Bearer TOKEN`` or
    ``x-tracer-token``), a JSON body and no ``Origin`` — a cross-origin page can send
    neither the token nor JSON without a preflight this server never answers."""

    def __init__(
        self,
        tap: Tap,
        host: str,
        port: int,
        *,
        token: str | None = None,
        allow_remote: bool = False,
    ) -> None:
        self.tap = tap
        self.host = host
        self.port = port
        self.token = token or secrets.token_urlsafe(24)
        self.token_given = token is not None
        self.allow_remote = allow_remote
        self.marks = 0
        self.last_mark: float | None = None
        self.peer: str | None = None  # who sent the request being routed
        self.agent: str | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_TapCollector(tap))
        self.bound: tuple[str, int] | None = None
        self.live = LiveState()
        tap.bus.add("admin", self.live)

    async def serve(
        self, *, task_status: TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        except OSError as exc:
            raise start_error(f"cannot serve --admin on {self.host}:{self.port}", exc) from None
        first = listener.listeners[0]
        self.bound = (
            str(first.extra(SocketAttribute.local_address)[0]),
            int(first.extra(SocketAttribute.local_port)),
        )
        log.info("admin listening", addr=f"{self.bound[0]}:{self.bound[1]}")
        task_status.started(self.bound)
        async with listener:
            await listener.serve(self._handle)

    async def _handle(self, stream: SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            async with stream:
                while True:
                    got = None
                    with anyio.move_on_after(30):
                        got = await _next_request(conn, stream)
                    if got is None:
                        return
                    request, payload = got
                    method, target = request.method.decode(), request.target.decode()
                    given = {
                        k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers
                    }
                    refused = self.guard(method, target, given)
                    if refused is not None:
                        status, ctype, body = refused
                    else:
                        self.peer = _peer(stream)
                        self.agent = given.get("user-agent")
                        status, ctype, body = self.route(method, target, payload)
                    headers = [("content-type", ctype), ("content-length", str(len(body)))]
                    await stream.send(
                        conn.send(h11.Response(status_code=status, headers=headers)) or b""
                    )
                    await stream.send(conn.send(h11.Data(data=body)) or b"")
                    await stream.send(conn.send(h11.EndOfMessage()) or b"")
                    if conn.our_state is not h11.DONE:
                        return
                    conn.start_next_cycle()
        except (anyio.BrokenResourceError, anyio.EndOfStream, h11.ProtocolError, OSError):
            return

    def guard(
        self, method: str, target: str, headers: dict[str, str]
    ) -> tuple[int, str, bytes] | None:
        """Why this request is refused (None: it may go on). ``headers``: lower-case names."""
        host, port = _host_and_port(headers.get("host", ""))
        bound_port = self.bound[1] if self.bound is not None else self.port
        literal = host == "localhost" or _is_ip(host)
        if not literal or (port is not None and port != bound_port):
            return _json(
                421, {"error": f"Host {headers.get('host')!r} is not this admin's address"}
            )
        if not self.allow_remote and not is_loopback(host):
            return _json(421, {"error": "this admin answers on loopback addresses only"})
        changes = method not in ("GET", "HEAD")
        if not changes:
            return None
        if "origin" in headers:
            return _json(403, {"error": "requests from a web page (Origin) are refused"})
        given = headers.get(TOKEN_HEADER) or headers.get("authorization", "").removeprefix(
            "Bearer "
        )
        if not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            return _json(401, {"error": "the admin token is needed (Authorization: Bearer …)"})
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if method != "DELETE" and ctype != "application/json":  # (a DELETE has no body)
            return _json(415, {"error": "send the body as application/json"})
        return None

    def route(self, method: str, target: str, body: bytes = b"") -> tuple[int, str, bytes]:
        path = target.split("?", 1)[0]
        if path == "/mark":
            if method != "POST":
                return 405, "text/plain", b'POST /mark (JSON body: {"note": "..."}, optional)\n'
            now = time.monotonic()
            if self.marks >= MAX_MARKS:
                return _json(429, {"error": f"this tap takes at most {MAX_MARKS} marks"})
            if self.last_mark is not None and now - self.last_mark < MARK_INTERVAL:
                return _json(429, {"error": f"one mark per {MARK_INTERVAL:g} s at most"})
            self.marks += 1
            self.last_mark = now
            return 200, "application/json", json.dumps(self.mark(body)).encode()
        if path == "/faults":
            return self.faults(method, body)
        if method != "GET":
            return 405, "text/plain", b"method not allowed\n"
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4; charset=utf-8", generate_latest(self.registry)
        if path == "/status":
            return 200, "application/json", json.dumps(self.status(), indent=1).encode()
        return 404, "text/plain", b"not found: try /metrics, /status, /faults or POST /mark\n"

    def status(self) -> dict[str, Any]:
        """The tap's own status, with request targets, totals, engines and recent events."""
        now = time.monotonic()
        tap, stats = self.tap, self.tap.stats
        status = tap.status()
        in_flight = 0
        for conn in status["connections"]:
            for req in conn["in_flight"]:
                in_flight += 1
                target, request_id = self.live.requests.get((conn["conn"], req["seq"]), ("", None))
                req["request"] = target
                req["request_id"] = request_id
        status["stall_after"] = tap.config.stall_after
        status["faults"] = self.fault_status()
        status["totals"] = {
            "connections": stats.connections_total,
            "connections_open": stats.connections_open,
            "requests": stats.requests_total,
            "in_flight": in_flight,
            "stalls_active": stats.stalls_active,
            "terminations": dict(sorted(stats.terminations.items())),
            "stalls": dict(sorted(stats.stalls.items())),
            "anomalies": stats.anomalies,
            "upstream_connect_failures": stats.upstream_connect_failures,
        }
        cap = tap.capture
        status["capture"] = (
            None
            if cap is None
            else {
                "path": str(cap.path),
                "written": cap.written,
                "dropped": cap.dropped,
                "dropped_bytes": cap.dropped_bytes,
                "pending_bytes": cap.pending_bytes,
                "failing": cap.failing,  # the last write failed: records are lost now
                "reserve_bytes": cap.reserve_bytes,
            }
        )
        status["engines"] = self.live.engines(now)
        status["recent"] = self.live.recent_events(now)
        return status

    def faults(self, method: str, body: bytes) -> tuple[int, str, bytes]:
        """``/faults``: GET the plan; with ``--fault-control``, PUT a new one (specs, one
        per line, or a JSON list), POST specs to add, DELETE them all. A body with a spec
        that does not parse changes nothing (400, saying what is wrong)."""
        tap = self.tap
        if method == "GET":
            return _json(200, self.fault_status())
        if method not in ("PUT", "POST", "DELETE"):
            return 405, "text/plain", b"GET, PUT, POST or DELETE /faults\n"
        if not tap.config.fault_control:
            return _json(403, {"error": "the faults are fixed: start the tap with --fault-control"})
        faults: list[Fault] = []
        if method != "DELETE":
            try:
                faults = parse_fault_list(body)
            except FaultSpecError as exc:
                return _json(400, {"error": str(exc)})
            if method == "POST" and not faults:
                return _json(400, {"error": "POST /faults: no fault spec in the body"})
        change: Literal["replace", "add", "clear"] = (
            "add" if method == "POST" else "replace" if faults else "clear"
        )
        event = tap.change_faults(faults, change)
        return _json(200, {**self.fault_status(), "changed": event.t})

    def fault_status(self) -> dict[str, Any]:
        tap = self.tap
        plan = tap.fault_plan
        return {
            "faults": plan.specs if plan is not None else [],
            "control": tap.config.fault_control,
            "injected": dict(sorted(tap.stats.faults.items())),
        }

    def mark(self, body: bytes) -> dict[str, Any]:
        """Record "the harness was seen hung now" in the capture (analysis: like --hang-at),
        with who sent it (the peer's address and User-Agent)."""
        now = time.monotonic()
        text = body.decode("utf-8", "replace").strip()
        try:
            doc = json.loads(text) if text else {}
        except ValueError:
            doc = text
        note = doc.get("note") if isinstance(doc, dict) else doc
        note = str(note)[:500] if note not in (None, "") else None
        by = " ".join(x for x in (self.peer, self.agent and f"({self.agent[:80]})") if x) or None
        event = ev.Mark(
            t=now + self.tap.wall_offset, m=now, tap=self.tap.config.name, note=note, by=by
        )
        self.tap.emit(event)
        log.info("hang marked", note=note, by=by)
        return {"marked": event.t, "note": note, "by": by}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _peer(stream: SocketStream) -> str | None:
    try:
        addr = stream.extra(SocketAttribute.remote_address)
    except Exception:  # not a TCP socket (a test's stream)
        return None
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)


def _json(status: int, doc: dict[str, Any]) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(doc, indent=1).encode()


def parse_fault_list(body: bytes) -> list[Fault]:
    """Fault specs from a request body: a JSON list of strings, or one spec per line
    (blank lines and ``#`` comments skipped). Raises ``FaultSpecError``."""
    text = body.decode("utf-8", "replace").strip()
    if text.startswith("["):
        try:
            specs = json.loads(text)
        except ValueError as exc:
            raise FaultSpecError(f"not a JSON list of fault specs: {exc}") from None
        if not isinstance(specs, list) or not all(isinstance(x, str) for x in specs):
            raise FaultSpecError("a JSON body must be a list of fault specs (strings)")
    else:
        specs = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [parse_fault(spec) for spec in specs if spec.strip()]


async def _next_request(conn: h11.Connection, stream: SocketStream) -> Any:
    """The next request and its body (bounded), or None when the client is gone."""
    request = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                conn.receive_data(await stream.receive())
            except anyio.EndOfStream:
                conn.receive_data(b"")
            continue
        if isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            if len(body) < 65536:
                body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return (request, bytes(body)) if request is not None else None
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None
