"""The tap's admin endpoint: ``/metrics`` (Prometheus text) and ``/status`` (JSON).

A deliberately small HTTP/1.1 server on anyio + h11. Loopback only unless the operator
says otherwise: it reveals live traffic metadata.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Iterator
from typing import Any

import anyio
import h11
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskStatus
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from . import events as ev
from .relay import Tap

log = structlog.get_logger("tracer.admin")


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
            "tracer_upstream_connect_failures",
            "Upstream connects that failed.",
            stats.upstream_connect_failures,
        )
        yield counter(
            "tracer_protocol_anomalies", "Bytes the observer could not parse.", stats.anomalies
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
        yield gauge(
            "tracer_capture_pending_bytes",
            "Capture bytes waiting for the writer.",
            cap.pending_bytes if cap else 0,
        )


class AdminServer:
    def __init__(self, tap: Tap, host: str, port: int) -> None:
        self.tap = tap
        self.host = host
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_TapCollector(tap))
        self.bound: tuple[str, int] | None = None

    async def serve(
        self, *, task_status: TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
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
                    status, ctype, body = self.route(
                        request.method.decode(), request.target.decode(), payload
                    )
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

    def route(self, method: str, target: str, body: bytes = b"") -> tuple[int, str, bytes]:
        path = target.split("?", 1)[0]
        if path == "/mark":
            if method != "POST":
                return 405, "text/plain", b"POST /mark (body: an optional note)\n"
            return 200, "application/json", json.dumps(self.mark(body)).encode()
        if method != "GET":
            return 405, "text/plain", b"method not allowed\n"
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4; charset=utf-8", generate_latest(self.registry)
        if path == "/status":
            return 200, "application/json", json.dumps(self.tap.status(), indent=1).encode()
        return 404, "text/plain", b"not found: try /metrics, /status or POST /mark\n"

    def mark(self, body: bytes) -> dict[str, Any]:
        """Record "the harness was seen hung now" in the capture (analysis: like --hang-at)."""
        now = time.monotonic()
        note = body.decode("utf-8", "replace").strip()[:500] or None
        event = ev.Mark(t=now + self.tap.wall_offset, m=now, tap=self.tap.config.name, note=note)
        self.tap.emit(event)
        log.info("hang marked", note=note)
        return {"marked": event.t, "note": note}


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
