"""`tracer proxy --otlp`: one span per request reaches a (fake) OTLP/HTTP collector."""

from __future__ import annotations

import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
import h11
import httpx
import pytest
from anyio.abc import SocketAttribute, SocketStream
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.support.net import wait_until
from tests.support.procs import tracer_proxy
from tests.support.tap import RawUpstream, UpConn
from tracer.sim.engine import EngineConfig, SimEngine

pytestmark = pytest.mark.anyio


# ---- a fake OTLP/HTTP collector -------------------------------------------------------


@dataclass
class Collector:
    """Decodes every ``POST /v1/traces`` body as an ``ExportTraceServiceRequest``."""

    port: int = 0
    paths: list[str] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = int(listener.extra(SocketAttribute.local_port))
        task_status.started(self.port)
        async with listener:
            await listener.serve(self._handle)

    async def _handle(self, stream: SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                request, body = None, bytearray()
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        try:
                            conn.receive_data(await stream.receive())
                        except (anyio.EndOfStream, anyio.BrokenResourceError):
                            return
                    elif isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
                assert request is not None
                self.paths.append(request.target.decode())
                self.content_types.append(dict(request.headers)[b"content-type"].decode())
                decoded = ExportTraceServiceRequest.FromString(bytes(body))
                for rs in decoded.resource_spans:
                    self.resources.append(_attrs(rs.resource.attributes))
                    for ss in rs.scope_spans:
                        self.spans.extend(ss.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                headers = [("content-type", "application/x-protobuf")]
                headers.append(("content-length", str(len(reply))))
                await stream.send(conn.send(h11.Response(status_code=200, headers=headers)) or b"")
                await stream.send(conn.send(h11.Data(data=reply)) or b"")
                await stream.send(conn.send(h11.EndOfMessage()) or b"")
                conn.start_next_cycle()


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@asynccontextmanager
async def upstream(**config: Any) -> AsyncIterator[str]:
    engine = SimEngine(EngineConfig(**config))
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(engine.serve)
        yield f"http://{host}:{port}"
        tg.cancel_scope.cancel()


async def _stream(client: httpx.AsyncClient, url: str, rid: str, **headers: str) -> int:
    body = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 4,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
    events = 0
    async with client.stream(
        "POST",
        url + "/v1/chat/completions",
        json=body,
        headers={"x-request-id": rid, **headers},
    ) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events += 1
    return events


# ---- tests ----------------------------------------------------------------------------


async def test_one_span_per_request_with_conventions_position_and_events() -> None:
    collector = Collector()
    async with anyio.create_task_group() as tg:
        await tg.start(collector.serve)
        async with upstream(ttft=0.0, itl=0.002) as engine_url:
            start_wall = time.time()
            async with tracer_proxy(
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                engine_url,
                "--tap",
                "edge",
                "--stall-after",
                "0.3",
                "--otlp",
                f"http://127.0.0.1:{collector.port}",
            ) as proc:
                async with httpx.AsyncClient() as client:  # one keep-alive connection
                    for i in range(3):
                        assert await _stream(client, proc.url, f"ka-{i}") > 4
                    # the 4th on the same connection stalls 1 s after its first token
                    await _stream(client, proc.url, "stalled", **{"x-sim-fault": "stall:for=1"})
                async with httpx.AsyncClient() as client:  # a fresh connection
                    await _stream(client, proc.url, "fresh")
                async with httpx.AsyncClient(timeout=30) as client:
                    # still in flight when the tap stops: its span must say so

                    async def held() -> None:
                        with suppress(httpx.HTTPError):
                            await _stream(
                                client, proc.url, "held", **{"x-sim-fault": "stall:for=60"}
                            )

                    tg.start_soon(held)
                    await wait_until(lambda: sum("stall started" in x for x in proc.lines) == 2, 10)
                    proc.process.send_signal(signal.SIGTERM)
                    with anyio.fail_after(10):
                        assert await proc.process.wait() == 0
            end_wall = time.time()
        tg.cancel_scope.cancel()

    assert set(collector.paths) == {"/v1/traces"}
    assert set(collector.content_types) == {"application/x-protobuf"}
    assert collector.resources[0]["service.name"] == "tracer"
    assert collector.resources[0]["tracer.tap"] == "edge"
    spans = {_attrs(s.attributes)["tracer.request_id"]: s for s in collector.spans}
    assert len(collector.spans) == 6, "one span per request, no more"
    assert set(spans) == {"ka-0", "ka-1", "ka-2", "stalled", "fresh", "held"}

    def a(rid: str) -> dict[str, Any]:
        return _attrs(spans[rid].attributes)

    first = a("ka-0")
    assert spans["ka-0"].name == "POST /v1/chat/completions"
    assert spans["ka-0"].kind == Span.SPAN_KIND_SERVER
    assert first["http.request.method"] == "POST"
    assert first["url.path"] == "/v1/chat/completions"
    assert first["http.response.status_code"] == 200
    assert first["server.address"] == "127.0.0.1"
    assert first["network.peer.address"] == "127.0.0.1"
    assert first["network.peer.port"] > 0
    assert first["gen_ai.operation.name"] == "chat"
    assert first["gen_ai.request.model"] == "sim-model"
    assert first["gen_ai.usage.output_tokens"] == 4
    assert first["gen_ai.usage.input_tokens"] > 0
    assert first["gen_ai.response.finish_reasons"] == ["length"]
    assert first["tracer.tap"] == "edge"
    assert first["tracer.termination"] == "complete"
    assert spans["ka-0"].status.code != Status.STATUS_CODE_ERROR

    # position on the keep-alive connection; a fresh connection starts at 1
    conn = first["tracer.conn"]
    for i, rid in enumerate(["ka-0", "ka-1", "ka-2", "stalled"], start=1):
        assert a(rid)["tracer.conn"] == conn and a(rid)["tracer.position"] == i
    assert a("ka-1")["tracer.idle_before"] >= 0
    assert a("fresh")["tracer.conn"] != conn and a("fresh")["tracer.position"] == 1

    # wall-clock times, ordered: start < first byte <= first token <= end
    for rid in ("ka-0", "ka-1", "ka-2", "stalled", "fresh"):
        span = spans[rid]
        events = {e.name: e.time_unix_nano for e in span.events}
        assert start_wall * 1e9 <= span.start_time_unix_nano < span.end_time_unix_nano
        assert span.end_time_unix_nano <= end_wall * 1e9
        assert span.start_time_unix_nano <= events["tracer.first_byte"]
        assert events["tracer.first_byte"] <= events["tracer.first_token"]
        assert events["tracer.first_token"] <= span.end_time_unix_nano
    assert spans["ka-0"].end_time_unix_nano <= spans["ka-1"].start_time_unix_nano

    # the stall: start and end events inside the span, about 1 s apart
    stalled = spans["stalled"]
    events = {e.name: e for e in stalled.events}
    start, end = events["tracer.stall.start"], events["tracer.stall.end"]
    assert _attrs(start.attributes)["tracer.stall.direction"] == "upstream_silent"
    # (the capture's durations are rounded to the microsecond: allow that much)
    assert events["tracer.first_token"].time_unix_nano <= start.time_unix_nano + 1000
    assert 0.5e9 < end.time_unix_nano - start.time_unix_nano < 5e9
    assert end.time_unix_nano <= stalled.end_time_unix_nano
    assert a("stalled")["tracer.termination"] == "complete"

    # still in flight at stop: an error span that says so
    held = spans["held"]
    assert a("held")["tracer.termination"] == "in_flight"
    assert a("held")["error.type"] == "in_flight"
    assert held.status.code == Status.STATUS_CODE_ERROR
    assert "tracer.stall.start" in {e.name for e in held.events}


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
# the flags bits that say the parent is known remote (opentelemetry-proto's SpanFlags)
REMOTE_KNOWN, REMOTE = 0x100, 0x200


async def _metrics(proc: Any) -> dict[str, float]:
    """The admin's /metrics as ``{'name{labels}': value}``."""
    async with httpx.AsyncClient() as client:
        r = await client.get(proc.admin + "/metrics")
    r.raise_for_status()
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _dropped(metrics: dict[str, float], reason: str, tap: str = "tap") -> float:
    return metrics[f'tracer_otlp_spans_dropped_total{{reason="{reason}",tap="{tap}"}}']


def _done_counts(lines: list[str]) -> dict[str, int]:
    """The counts in the stop line (``otlp export done exported=N dropped_REASON=N``)."""
    (line,) = [x for x in lines if "otlp export done" in x]
    return {k: int(v) for k, v in re.findall(r"\b(exported|dropped\w*)=(\d+)", line)}


async def test_traceparent_makes_the_span_a_child_of_the_clients_and_bad_ones_roots() -> None:
    collector = Collector()
    invalid = {
        "short": f"00-{TRACE_ID[:-1]}-{CLIENT_SPAN}-01",
        "zeros": f"00-{'0' * 32}-{CLIENT_SPAN}-01",
        "ff": f"ff-{TRACE_ID}-{CLIENT_SPAN}-01",
        "upper": f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01",
    }
    async with anyio.create_task_group() as tg:
        await tg.start(collector.serve)
        async with upstream(ttft=0.0, itl=0.0) as engine_url:
            async with tracer_proxy(
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                engine_url,
                "--tap",
                "tap",
                "--admin",
                "127.0.0.1:0",
                "--otlp",
                f"http://127.0.0.1:{collector.port}/",
            ) as proc:
                async with httpx.AsyncClient() as client:  # one connection for them all
                    await _stream(
                        client,
                        proc.url,
                        "child",
                        traceparent=TRACEPARENT,
                        tracestate="vendor=opaque,other=x1",
                    )
                    for rid, value in invalid.items():
                        assert await _stream(client, proc.url, rid, traceparent=value) > 4
                    assert await _stream(client, proc.url, "after") > 4  # still serving
                # exported on the processor's schedule, before any stop
                await wait_until(lambda: len(collector.spans) == 2 + len(invalid), 10)
                metrics = await _metrics(proc)
        tg.cancel_scope.cancel()
    assert metrics['tracer_otlp_traceparent_invalid_total{tap="tap"}'] == len(invalid)
    assert metrics['tracer_otlp_spans_exported_total{tap="tap"}'] == 2 + len(invalid)
    spans = {_attrs(s.attributes)["tracer.request_id"]: s for s in collector.spans}
    child = spans["child"]
    assert child.trace_id.hex() == TRACE_ID and child.parent_span_id.hex() == CLIENT_SPAN
    assert child.span_id.hex() not in (CLIENT_SPAN, "0" * 16)
    assert child.trace_state == "vendor=opaque,other=x1"  # the client's, in the span context
    assert child.flags & REMOTE_KNOWN and child.flags & REMOTE  # its parent is remote
    assert "tracer.traceparent_invalid" not in _attrs(child.attributes)
    for rid, value in invalid.items():
        span = spans[rid]
        assert span.parent_span_id == b"", f"{rid}: a root span"
        assert span.trace_id.hex() != TRACE_ID and len(span.trace_id) == 16
        assert _attrs(span.attributes)["tracer.traceparent_invalid"] == value
        assert _attrs(span.attributes)["http.response.status_code"] == 200
    assert spans["after"].parent_span_id == b""
    assert "tracer.traceparent_invalid" not in _attrs(spans["after"].attributes)
    assert not any("Traceback" in x for x in proc.lines)


async def test_two_taps_in_a_row_are_both_children_of_the_clients_span() -> None:
    """client -> front tap -> back tap -> engine: the front tap forwards traceparent as it
    came, so the back tap's span has the same parent as the front's: the client's."""
    collector = Collector()
    async with anyio.create_task_group() as tg:
        await tg.start(collector.serve)
        otlp_url = f"http://127.0.0.1:{collector.port}"
        async with upstream(ttft=0.0, itl=0.0) as engine_url:
            back_args = ["--tap", "back", "--otlp", otlp_url]
            async with tracer_proxy(
                "proxy", "--listen", "127.0.0.1:0", "--upstream", engine_url, *back_args
            ) as back:
                front_args = ["--tap", "front", "--otlp", otlp_url]
                async with tracer_proxy(
                    "proxy", "--listen", "127.0.0.1:0", "--upstream", back.url, *front_args
                ) as front:
                    async with httpx.AsyncClient() as client:
                        events = await _stream(
                            client, front.url, "chained", traceparent=TRACEPARENT
                        )
                        assert events > 4
                    await wait_until(lambda: len(collector.spans) == 2, 10)
        tg.cancel_scope.cancel()
    by_tap = {}
    for resource, span in zip(collector.resources, collector.spans, strict=True):
        by_tap[resource["tracer.tap"]] = span
    assert set(by_tap) == {"front", "back"}
    for tap, span in by_tap.items():
        assert span.trace_id.hex() == TRACE_ID, tap
        assert span.parent_span_id.hex() == CLIENT_SPAN, tap
        assert _attrs(span.attributes)["tracer.request_id"] == "chained"
    assert by_tap["front"].span_id != by_tap["back"].span_id
    # the back tap's span lies inside the front's
    front, back = by_tap["front"], by_tap["back"]
    assert front.start_time_unix_nano <= back.start_time_unix_nano
    assert back.end_time_unix_nano <= front.end_time_unix_nano


async def test_trace_headers_reach_the_upstream_byte_identical() -> None:
    """The tap with --otlp forwards the request as it came: traceparent and tracestate
    (odd case, spaces, two tracestate lines) byte for byte, nothing added."""
    body = b'{"model": "m", "messages": []}'
    reply = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

    async def answer(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: c.received.endswith(body))
        await stream.send(reply)
        await conn.wait_for(lambda c: c.eof or c.reset, timeout=30)

    raw = RawUpstream(answer)
    collector = Collector()
    async with anyio.create_task_group() as tg:
        await tg.start(collector.serve)
        await tg.start(raw.serve)
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            f"http://127.0.0.1:{raw.port}",
            "--otlp",
            f"http://127.0.0.1:{collector.port}",
        ) as proc:
            sent = (
                b"POST /v1/chat/completions HTTP/1.1\r\n"
                + f"Host: 127.0.0.1:{proc.port}\r\n".encode()
                + f"TraceParent:  {TRACEPARENT} \r\n".encode()
                + b"tracestate: vendor=opaque ,  congo=t61rcWkgMzE\r\n"
                + b"TRACESTATE: rojo=00f067aa0ba902b7\r\n"
                + b"content-type: application/json\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            async with await anyio.connect_tcp("127.0.0.1", proc.port) as client:
                await client.send(sent)
                got = b""
                with anyio.fail_after(10):
                    while not got.endswith(b"{}"):
                        got += await client.receive()
            await wait_until(lambda: len(collector.spans) == 1, 10)
        tg.cancel_scope.cancel()
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert bytes(raw.conns[0].received) == sent, "the request, byte for byte"
    (span,) = collector.spans
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == CLIENT_SPAN
    assert span.trace_state == "vendor=opaque,congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


async def test_collector_down_traffic_flows_drops_counted_failure_logged_once(
    refused_port: int,
) -> None:
    dead = refused_port  # nothing listens there
    async with upstream(ttft=0.0, itl=0.0) as engine_url:
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            engine_url,
            "--tap",
            "tap",
            "--admin",
            "127.0.0.1:0",
            "--otlp",
            f"http://127.0.0.1:{dead}",
        ) as proc:
            async with httpx.AsyncClient() as client:
                for i in range(3):
                    assert await _stream(client, proc.url, f"a{i}") > 4
                await wait_until(lambda: any("otlp export failed" in x for x in proc.lines), 10)
                for i in range(3):  # still flowing after the failure
                    assert await _stream(client, proc.url, f"b{i}") > 4
                metrics = await _metrics(proc)
            started = time.monotonic()
            proc.process.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                assert await proc.process.wait() == 0
            stopped_in = time.monotonic() - started
    assert sum("otlp export failed" in x for x in proc.lines) == 1
    assert not any("Traceback" in x for x in proc.lines)
    assert stopped_in < 5, f"stop took {stopped_in:.1f}s with the collector down"
    assert metrics['tracer_otlp_spans_exported_total{tap="tap"}'] == 0
    assert _dropped(metrics, "export_failed") >= 1  # the first batch, a0 at least
    assert _dropped(metrics, "queue_full") == 0
    # at the stop, every span is accounted for: none exported, all 6 dropped
    counts = _done_counts(proc.lines)
    assert counts["exported"] == 0 and counts["dropped"] == 6, counts
    assert counts["dropped_export_failed"] >= 1
    assert sum(v for k, v in counts.items() if k.startswith("dropped_")) == 6, counts


async def test_a_hung_collector_never_slows_traffic_and_a_full_queue_drops_counted() -> None:
    """A collector that accepts and never answers: each export hangs for its timeout.
    Requests through the tap take no longer for it; with --otlp-queue 2, the spans past
    the queue are dropped and counted as queue_full."""
    held: list[SocketStream] = []

    async def hold(stream: SocketStream) -> None:
        held.append(stream)
        with suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                await stream.receive()

    n = 10
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = int(listener.extra(SocketAttribute.local_port))
    async with listener, anyio.create_task_group() as tg:  # (both closed at the end)
        tg.start_soon(listener.serve, hold)
        async with upstream(ttft=0.0, itl=0.0) as engine_url:
            async with tracer_proxy(
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                engine_url,
                "--tap",
                "tap",
                "--admin",
                "127.0.0.1:0",
                "--otlp",
                f"http://127.0.0.1:{port}",
                "--otlp-queue",
                "2",
            ) as proc:
                took = []
                async with httpx.AsyncClient() as client:
                    assert await _stream(client, proc.url, "warm") > 4  # a span, queued
                    await wait_until(lambda: bool(held), 5)  # it is being sent: it hangs
                    started = time.monotonic()
                    for i in range(n):
                        t0 = time.monotonic()
                        assert await _stream(client, proc.url, f"r{i}") > 4
                        took.append(time.monotonic() - t0)
                    burst = time.monotonic() - started
                metrics = await _metrics(proc)
                stop_started = time.monotonic()
                proc.process.send_signal(signal.SIGTERM)
                with anyio.fail_after(15):
                    assert await proc.process.wait() == 0
                stopped_in = time.monotonic() - stop_started
        for stream in held:
            await stream.aclose()
        tg.cancel_scope.cancel()
    assert max(took) < 1.5, f"a request took {max(took):.2f}s while the collector hung"
    assert metrics['tracer_otlp_spans_exported_total{tap="tap"}'] == 0
    # while the first export hangs (3 s) the queue takes 2 more: the rest are dropped
    queue_full = _dropped(metrics, "queue_full")
    assert queue_full >= (n - 2 if burst < 2.5 else 1), (queue_full, burst)
    assert sum("otlp queue full" in x for x in proc.lines) == 1
    counts = _done_counts(proc.lines)
    assert counts["exported"] == 0 and counts["dropped"] == n + 1, counts
    assert counts["dropped_queue_full"] == queue_full
    assert stopped_in < 8, f"stop took {stopped_in:.1f}s with the collector hung"
    assert not any("Traceback" in x for x in proc.lines)


async def test_bad_otlp_url_is_a_usage_error() -> None:
    result = await anyio.run_process(
        [
            sys.executable,
            "-m",
            "tracer",
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
            "--otlp",
            "grpc://collector:4317",
        ],
        check=False,
    )
    assert result.returncode == 2
    assert b"--otlp" in result.stderr and b"http://" in result.stderr
