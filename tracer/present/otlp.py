"""OpenTelemetry export of the tap's requests: one span per request, over OTLP/HTTP.

Theory of operation
-------------------
``OtlpSink`` is a tap sink: it sees every event the tap records, opens a span at a
request's head and ends it at the response's end (``response_end``, which the tap always
emits, ``in_flight`` included when it stops). Times are the events' own monotonic times
plus the tap's wall offset, so a span measures what the tap saw, not when it was sent.

Names follow OpenTelemetry's semantic conventions where they have one: HTTP server
spans (``http.request.method``, ``url.path``, ``http.response.status_code``,
``server.address``, ``client.address``, ``network.peer.*``, ``error.type``) and GenAI
(``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.*``,
``gen_ai.response.finish_reasons``); tracer's own figures go under ``tracer.*``
(``tracer.conn``, ``tracer.position``, ``tracer.termination``, ``tracer.idle_before``
...). Span events mark the first byte, the first token, and each stall's start and end.

In the user's trace: a request that carries a valid W3C ``traceparent`` gets a span in
the client's trace, a child of the client's span (``tracestate`` goes into the span's
context as the SDK parses it). The tap never adds or rewrites either header: the engine
behind sees the client's own and its span is the client's child too, a sibling of the
tap's (two taps in a row: both children of the client's span). A ``traceparent`` that
is not valid (the grammar, version ``ff``, an all-zero id, uppercase hex, sent twice)
makes a root span with ``tracer.traceparent_invalid`` holding what was sent, counted.
Every request is exported, whatever its parent's sampled flag (docs/otel.md).

Never the cause: the data path only builds a span and appends it to a bounded queue
(``MAX_QUEUE`` spans, ``--otlp-queue``); a ``BatchSpanProcessor`` thread sends batches.
A span that finds the queue full is dropped and counted (``queue_full``); a batch the
collector does not take is dropped and counted (``export_failed``), and for
``RETRY_AFTER`` seconds after that batches are dropped untried (``retry_wait``) instead
of piling up retries. Each kind of loss is logged once; the counts are on the admin's
``/metrics`` (``tracer_otlp_spans_dropped_total{reason}``) and in the stop line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests
import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .. import __version__
from .. import events as ev
from ..capture.bodies import request_fields

log = structlog.get_logger("tracer.present.otlp")

TRACES_PATH = "/v1/traces"
EXPORT_TIMEOUT = 3.0  # seconds for one export, retries included
SCHEDULE_DELAY_MS = 500  # how often finished spans are sent
RETRY_AFTER = 5.0  # seconds of dropping after a failed export before trying again
MAX_QUEUE = 2048  # finished spans waiting for the exporter; past it a span is dropped
MAX_BATCH = 512  # spans in one export request
MAX_NOTED = 256  # characters of an invalid traceparent/tracestate kept in the span
DROP_REASONS = ("queue_full", "export_failed", "retry_wait", "shutdown")

_KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)
_OPERATIONS = (  # path suffix -> gen_ai.operation.name
    ("/chat/completions", "chat"),
    ("/completions", "text_completion"),
    ("/embeddings", "embeddings"),
    ("/responses", "chat"),
    ("/generate", "text_completion"),
)


def traces_url(endpoint: str) -> str:
    """``http://host:4318`` -> ``http://host:4318/v1/traces``; a URL with a path is kept."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"--otlp {endpoint!r}: expected an http:// or https:// URL such as "
            "http://127.0.0.1:4318 (OTLP/HTTP, protobuf)"
        )
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as exc:
        raise ValueError(f"--otlp {endpoint!r}: {exc}") from None
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + TRACES_PATH
    return endpoint


class _GuardedExporter(SpanExporter):
    """The OTLP exporter, made harmless: a failure is logged once and then batches are
    dropped for ``RETRY_AFTER`` seconds (no pile-up of retries), a recovery is logged.

    Called by the batch processor's thread only (or ``force_flush`` under its lock), so
    its counters have one writer at a time: ``taken`` (spans handed over, whatever came
    of them), ``exported``, ``failed`` (in a batch the collector did not take) and
    ``skipped`` (dropped untried while waiting after a failure)."""

    def __init__(self, inner: SpanExporter, endpoint: str) -> None:
        self.inner = inner
        self.endpoint = endpoint
        self.taken = 0
        self.exported = 0
        self.failed = 0
        self.skipped = 0
        self.failures = 0  # batches
        self._down_until = 0.0
        self._warned = False

    @property
    def dropped(self) -> int:
        return self.failed + self.skipped

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.taken += len(spans)
        now = time.monotonic()
        if now < self._down_until:
            self.skipped += len(spans)
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter bug must not kill the export thread
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
            if self._down_until:
                log.info("otlp export recovered", endpoint=self.endpoint, dropped=self.dropped)
                self._down_until = 0.0
            return result
        self.failures += 1
        self.failed += len(spans)
        self._down_until = time.monotonic() + RETRY_AFTER
        if not self._warned:
            self._warned = True
            log.warning(
                "otlp export failed; spans are dropped while the collector is unreachable "
                "(traffic is not affected; logged once)",
                endpoint=self.endpoint,
            )
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _BoundedProcessor(SpanProcessor):
    """A ``BatchSpanProcessor`` whose queue bound is ours, so a span it would drop
    silently (the SDK's deque pushes the oldest out) is refused here and counted.

    Spans in the queue are ``accepted - exporter.taken``: each counter has one writer
    (the data path, the export thread), so no lock is taken on the data path. A span
    being handed to the exporter still counts as queued: the bound errs on the safe
    side and the SDK's own deque never overflows."""

    def __init__(self, exporter: _GuardedExporter, max_queue: int) -> None:
        self.exporter = exporter
        self.max_queue = max_queue
        self.accepted = 0
        self.queue_full = 0
        self._warned = False
        self.batch = BatchSpanProcessor(
            exporter,
            max_queue_size=max_queue,
            schedule_delay_millis=SCHEDULE_DELAY_MS,
            max_export_batch_size=min(MAX_BATCH, max_queue),
        )

    @property
    def queued(self) -> int:
        return max(0, self.accepted - self.exporter.taken)

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self.accepted - self.exporter.taken >= self.max_queue:
            self.queue_full += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "otlp queue full; spans are dropped until the exporter catches up "
                    "(traffic is not affected; logged once)",
                    max_queue=self.max_queue,
                    endpoint=self.exporter.endpoint,
                )
            return
        self.accepted += 1
        self.batch.on_end(span)

    def shutdown(self) -> None:
        self.batch.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.batch.force_flush(timeout_millis)


class OtlpMetrics:
    """The sink's counters for the admin's ``/metrics`` (a Prometheus collector)."""

    def __init__(self, sink: OtlpSink) -> None:
        self.sink = sink

    def collect(self) -> Iterator[Metric]:
        sink = self.sink
        tap = [sink.tap]
        exported = CounterMetricFamily(
            "tracer_otlp_spans_exported",
            "Spans the OTLP collector took (--otlp).",
            labels=["tap"],
        )
        exported.add_metric(tap, sink.exporter.exported)
        yield exported
        dropped = CounterMetricFamily(
            "tracer_otlp_spans_dropped",
            "Spans lost on the way to the OTLP collector, by reason: queue_full (the "
            "bounded queue was full), export_failed (in a batch the collector did not "
            "take), retry_wait (dropped untried in the wait after a failure), shutdown "
            "(still queued when the tap stopped).",
            labels=["tap", "reason"],
        )
        for reason, count in sink.drops().items():
            dropped.add_metric([sink.tap, reason], count)
        yield dropped
        queued = GaugeMetricFamily(
            "tracer_otlp_spans_queued", "Spans waiting for the OTLP exporter.", labels=["tap"]
        )
        queued.add_metric(tap, sink.processor.queued)
        yield queued
        invalid = CounterMetricFamily(
            "tracer_otlp_traceparent_invalid",
            "Requests whose traceparent was not valid W3C Trace Context (their span is a "
            "root span; tracer.traceparent_invalid holds the value).",
            labels=["tap"],
        )
        invalid.add_metric(tap, sink.traceparent_invalid)
        yield invalid


@dataclass(slots=True)
class _Conn:
    peer: str
    local: str
    upstream: str | None = None


@dataclass(slots=True)
class _Open:
    span: trace.Span
    start_m: float
    status: int | None = None
    first_byte_ns: int | None = None


class OtlpSink:
    """A tap sink: one span per request, sent to an OTLP/HTTP collector."""

    def __init__(
        self,
        endpoint: str,
        *,
        tap: str,
        wall_offset: float,
        max_queue: int = MAX_QUEUE,
        exporter: SpanExporter | None = None,
    ) -> None:
        """``exporter``: tests only (an in-memory one); else OTLP/HTTP to ``endpoint``."""
        if max_queue < 1:
            raise ValueError(f"--otlp-queue {max_queue}: give 1 or more spans")
        self.endpoint = traces_url(endpoint)
        self.tap = tap
        self.wall_offset = wall_offset
        self._wall_ns = round(wall_offset * 1e9)
        for name in (
            "opentelemetry.exporter",
            "opentelemetry.sdk._shared_internal",
            "opentelemetry.trace.propagation",  # a bad header: noted in the span instead
            "opentelemetry.trace.span",  # (TraceState.from_header's warnings)
        ):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # we log failures ourselves
        if exporter is None:
            session = requests.Session()
            session.trust_env = False  # like the poller: no proxy variables, no netrc
            exporter = OTLPSpanExporter(
                endpoint=self.endpoint, timeout=EXPORT_TIMEOUT, session=session
            )
        self.exporter = _GuardedExporter(exporter, self.endpoint)
        self.processor = _BoundedProcessor(self.exporter, max_queue)
        resource = Resource.create(
            {"service.name": "tracer", "service.version": __version__, "tracer.tap": tap}
        )
        self.provider = TracerProvider(sampler=ALWAYS_ON, resource=resource, shutdown_on_exit=False)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("tracer", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.conns: dict[int, _Conn] = {}
        self.open: dict[tuple[int, int], _Open] = {}
        self.traceparent_invalid = 0
        self.lost_at_stop = 0
        self._failed = False
        self._closed = False

    def metrics(self) -> OtlpMetrics:
        """A Prometheus collector of this sink's counters (for ``--admin``'s registry)."""
        return OtlpMetrics(self)

    def drops(self) -> dict[str, int]:
        """Spans dropped so far, by reason (``DROP_REASONS``)."""
        return {
            "queue_full": self.processor.queue_full,
            "export_failed": self.exporter.failed,
            "retry_wait": self.exporter.skipped,
            "shutdown": self.lost_at_stop,
        }

    def _ns(self, m: float) -> int:
        """Wall-clock ns of a monotonic time; the offset is added in integers, so the
        order of two monotonic times is kept exactly (floats near 1.7e9 s would not)."""
        return self._wall_ns + round(m * 1e9)

    def __call__(self, event: ev.Event) -> None:
        """Called with every event the tap records; never raises into the tap."""
        if type(event) is ev.BodyData or self._closed:
            return  # the hot path: nothing a span needs
        try:
            self._on(event)
        except Exception:
            if not self._failed:
                self._failed = True
                log.exception("otlp span building failed (logged once; traffic unaffected)")

    def _on(self, event: ev.Event) -> None:
        match event:
            case ev.ConnOpen():
                self.conns[event.conn] = _Conn(peer=event.peer, local=event.local)
            case ev.UpstreamConnect(phase="done"):
                conn = self.conns.get(event.conn)
                if conn is not None:
                    conn.upstream = event.addr
            case ev.RequestHead():
                self._start(event)
            case ev.RequestEnd():
                self._request_end(event)
            case ev.ResponseHead():
                self._response_head(event)
            case ev.Stall():
                self._stall(event)
            case ev.FaultInjected() | ev.Anomaly():
                self._note(event)
            case ev.ResponseEnd():
                self._end(event)
            case ev.ConnClose():
                self.conns.pop(event.conn, None)
            case _:
                pass

    def _start(self, head: ev.RequestHead) -> None:
        path, _, query = head.target.partition("?")
        method = head.method if head.method in _KNOWN_METHODS else "_OTHER"
        headers = {name.lower(): value for name, value in head.headers}
        attrs: dict[str, Any] = {
            "http.request.method": method,
            "url.path": path,
            "url.scheme": "http",
            "network.protocol.name": "http",
            "network.protocol.version": head.version,
            "tracer.tap": self.tap,
            "tracer.conn": head.conn,
            "tracer.position": head.seq,
            "tracer.idle_before": head.idle_before,
            "tracer.reused": head.seq > 1,
        }
        if method == "_OTHER":
            attrs["http.request.method_original"] = head.method
        if query:
            attrs["url.query"] = query
        if head.request_id:
            attrs["tracer.request_id"] = head.request_id
        if head.pipelined:
            attrs["tracer.pipelined"] = True
        if "user-agent" in headers:
            attrs["user_agent.original"] = headers["user-agent"]
        host = headers.get("host")
        conn = self.conns.get(head.conn)
        if host:
            attrs.update(_host_port("server", host))
        elif conn is not None:
            attrs.update(_host_port("server", conn.local))
        if conn is not None:
            peer = _host_port("network.peer", conn.peer)
            attrs.update(peer)
            if "network.peer.address" in peer:
                attrs["client.address"] = peer["network.peer.address"]
            attrs.update(_host_port("network.local", conn.local))
        for suffix, operation in _OPERATIONS:
            if path.endswith(suffix):
                attrs["gen_ai.operation.name"] = operation
                break
        parent = self._parent(head.headers, attrs)
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,  # an empty context: a root span, whatever is current
            kind=SpanKind.SERVER,
            attributes=attrs,
            start_time=self._ns(head.m),
        )
        self.open[(head.conn, head.seq)] = _Open(span=span, start_m=head.m)

    def _parent(self, headers: list[list[str]], attrs: dict[str, Any]) -> Context:
        """The client's span as the parent, from ``traceparent`` (and ``tracestate``, its
        header lines combined as HTTP combines them); an empty context (a root span) when
        there is none or it is not valid, which is noted in ``attrs`` and counted."""
        parents = [value for name, value in headers if name.lower() == "traceparent"]
        if not parents:
            return Context()
        states = [value for name, value in headers if name.lower() == "tracestate"]
        carrier = (
            {"traceparent": parents, "tracestate": states} if states else {"traceparent": parents}
        )
        # sent twice is not valid (W3C: "multiple traceparent headers" restart the trace)
        context = self.propagator.extract(carrier, Context()) if len(parents) == 1 else Context()
        span_context = trace.get_current_span(context).get_span_context()
        if not span_context.is_valid:
            self.traceparent_invalid += 1
            attrs["tracer.traceparent_invalid"] = ", ".join(parents)[:MAX_NOTED]
            return Context()
        if not span_context.trace_state and any(s.strip(" \t,") for s in states):
            # not the grammar, over 32 members or 512 characters: the SDK drops it all
            attrs["tracer.tracestate_invalid"] = ",".join(states)[:MAX_NOTED]
        return context

    def _request_end(self, end: ev.RequestEnd) -> None:
        req = self.open.get((end.conn, end.seq))
        if req is None:
            return
        attrs: dict[str, Any] = {"http.request.body.size": end.body_bytes}
        fields = request_fields(end)  # live: a kept body's fields are not in the event
        if "model" in fields:
            attrs["gen_ai.request.model"] = fields["model"]
        if "max_tokens" in fields:
            attrs["gen_ai.request.max_tokens"] = fields["max_tokens"]
        if "stream" in fields:
            attrs["tracer.stream"] = fields["stream"]
        if not end.complete:
            attrs["tracer.request_complete"] = False
        req.span.set_attributes(attrs)

    def _response_head(self, head: ev.ResponseHead) -> None:
        req = self.open.get((head.conn, head.seq))
        if req is None:
            return
        req.status = head.status
        req.first_byte_ns = self._ns(head.m)
        req.span.set_attribute("http.response.status_code", head.status)
        req.span.add_event(
            "tracer.first_byte", {"tracer.ttfb": head.ttfb}, timestamp=req.first_byte_ns
        )
        conn = self.conns.get(head.conn)
        if conn is not None and conn.upstream:
            req.span.set_attribute("tracer.upstream", conn.upstream)

    def _stall(self, stall: ev.Stall) -> None:
        req = self.open.get((stall.conn, stall.seq))
        if req is None:
            return
        attrs: dict[str, Any] = {"tracer.stall.direction": stall.direction}
        if stall.phase == "start":
            if stall.unsent_bytes is not None:
                attrs["tracer.stall.unsent_bytes"] = stall.unsent_bytes
            # the silence began at the last byte, before the record was made
            req.span.add_event(
                "tracer.stall.start", attrs, timestamp=self._ns(stall.m - stall.silent_for)
            )
            req.span.set_attribute("tracer.stalled", True)
        else:
            attrs["tracer.stall.duration"] = stall.silent_for
            req.span.add_event("tracer.stall.end", attrs, timestamp=self._ns(stall.m))

    def _note(self, event: ev.FaultInjected | ev.Anomaly) -> None:
        if event.seq is None:
            return
        req = self.open.get((event.conn, event.seq))
        if req is None:
            return
        if isinstance(event, ev.FaultInjected):
            attrs = {"tracer.fault": event.spec, "tracer.fault.detail": event.detail or ""}
            req.span.set_attribute("tracer.fault", event.spec)
            req.span.add_event("tracer.fault", attrs, timestamp=self._ns(event.m))
        else:
            attrs = {"tracer.anomaly.direction": event.direction, "tracer.anomaly": event.error}
            req.span.add_event("tracer.anomaly", attrs, timestamp=self._ns(event.m))

    def _end(self, end: ev.ResponseEnd) -> None:
        req = self.open.pop((end.conn, end.seq), None)
        if req is None:
            return
        span = req.span
        end_ns = self._ns(end.m)
        if end.first_token is not None:
            # first_token is rounded to the µs: keep it between the first byte and the end
            at = max(self._ns(req.start_m + end.first_token), req.first_byte_ns or 0)
            span.add_event("tracer.first_token", timestamp=min(at, end_ns))
        attrs: dict[str, Any] = {
            "tracer.termination": end.termination,
            "tracer.duration": end.duration,
            "http.response.body.size": end.body_bytes,
        }
        status = end.status if end.status is not None else req.status
        if status is not None:
            attrs["http.response.status_code"] = status
        optional: dict[str, Any] = {
            "tracer.ttfb": end.ttfb,
            "tracer.first_token": end.first_token,
            "tracer.max_gap": end.max_gap,
            "tracer.close": end.close,
            "tracer.detail": end.detail,
            "tracer.protocol.sse.error": end.error,
        }
        attrs.update({k: v for k, v in optional.items() if v is not None})
        if end.events:
            attrs["tracer.protocol.sse.events"] = end.events
            attrs["tracer.protocol.sse.done"] = end.done
        if end.mid_event:
            attrs["tracer.protocol.sse.mid_event"] = True
        if end.finish_reason is not None:
            attrs["gen_ai.response.finish_reasons"] = [end.finish_reason]
        usage = end.usage or {}
        for ours, theirs in (
            ("gen_ai.usage.input_tokens", "prompt_tokens"),
            ("gen_ai.usage.output_tokens", "completion_tokens"),
        ):
            if isinstance(usage.get(theirs), int):
                attrs[ours] = usage[theirs]
        error = _error_type(end.termination, status, end.error)
        if error is not None:
            attrs["error.type"] = error
            span.set_status(Status(StatusCode.ERROR, _describe(end, status)))
        span.set_attributes(attrs)
        span.end(end_time=end_ns)

    def close(self) -> None:
        """End spans still open (``in_flight``), send what is pending; once, at stop."""
        if self._closed:
            return
        self._closed = True
        now = time.monotonic()
        for req in self.open.values():
            req.span.set_attributes({"tracer.termination": "in_flight", "error.type": "in_flight"})
            req.span.set_status(Status(StatusCode.ERROR, "still in flight when the tap stopped"))
            req.span.end(end_time=self._ns(now))
        self.open.clear()
        self.provider.shutdown()  # sends what is queued; the exporter's timeout bounds it
        self.lost_at_stop = self.processor.queued  # what the stop gave up on
        drops = self.drops()
        log.info(
            "otlp export done",
            endpoint=self.endpoint,
            exported=self.exporter.exported,
            dropped=sum(drops.values()),
            **{f"dropped_{reason}": count for reason, count in drops.items() if count},
        )


def _host_port(prefix: str, value: str) -> dict[str, Any]:
    """``host:port`` / ``[v6]:port`` / ``host`` to ``PREFIX.address`` and ``PREFIX.port``."""
    host, port = value, ""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest.removeprefix(":")
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    out: dict[str, Any] = {f"{prefix}.address": host} if host else {}
    if port.isdigit():
        out[f"{prefix}.port"] = int(port)
    return out


def _error_type(termination: str, status: int | None, sse_error: str | None) -> str | None:
    """``error.type`` for a failed request, None for a good one (HTTP server rules: 5xx)."""
    if termination != "complete":
        return termination
    if status is not None and status >= 500:
        return str(status)
    if sse_error is not None:
        return "stream_error"
    return None


def _describe(end: ev.ResponseEnd, status: int | None) -> str:
    if end.termination == "in_flight":
        return "still in flight when the tap stopped"
    if end.termination != "complete":
        return f"response {end.termination}" + (f": {end.detail}" if end.detail else "")
    if end.error is not None:
        return f"stream error: {end.error}"
    return f"HTTP {status}"
