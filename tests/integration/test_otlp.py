"""`tracer proxy --otlp`: one span per request reaches a (fake) OTLP/HTTP collector."""

from __future__ import annotations

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


async def test_traceparent_makes_the_span_a_child_of_the_clients() -> None:
    collector = Collector()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent_id = "00f067aa0ba902b7"
    async with anyio.create_task_group() as tg:
        await tg.start(collector.serve)
        async with upstream(ttft=0.0, itl=0.0) as engine_url:
            async with tracer_proxy(
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                engine_url,
                "--otlp",
                f"http://127.0.0.1:{collector.port}/",
            ) as proc:
                async with httpx.AsyncClient() as client:
                    await _stream(
                        client, proc.url, "child", traceparent=f"00-{trace_id}-{parent_id}-01"
                    )
                # exported on the processor's schedule, before any stop
                await wait_until(lambda: len(collector.spans) == 1, 10)
        tg.cancel_scope.cancel()
    span = collector.spans[0]
    assert span.trace_id.hex() == trace_id and span.parent_span_id.hex() == parent_id


async def test_collector_down_traffic_flows_and_failure_is_logged_once(refused_port: int) -> None:
    dead = refused_port  # nothing listens there
    async with upstream(ttft=0.0, itl=0.0) as engine_url:
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            engine_url,
            "--otlp",
            f"http://127.0.0.1:{dead}",
        ) as proc:
            async with httpx.AsyncClient() as client:
                for i in range(3):
                    assert await _stream(client, proc.url, f"a{i}") > 4
                await wait_until(lambda: any("otlp export failed" in x for x in proc.lines), 10)
                for i in range(3):  # still flowing after the failure
                    assert await _stream(client, proc.url, f"b{i}") > 4
            started = time.monotonic()
            proc.process.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                assert await proc.process.wait() == 0
            stopped_in = time.monotonic() - started
    assert sum("otlp export failed" in x for x in proc.lines) == 1
    assert not any("Traceback" in x for x in proc.lines)
    assert stopped_in < 5, f"stop took {stopped_in:.1f}s with the collector down"


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
