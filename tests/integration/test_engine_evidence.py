"""Engine evidence in the tap's capture: metrics samples, probes on stall, `tracer watch`."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketStream

from tests.support.net import wait_until
from tests.support.procs import tracer_proxy
from tests.support.tap import RawUpstream, UpConn
from tracer.capture.files import read_records

pytestmark = pytest.mark.anyio

IDLE_METRICS = (
    "# TYPE sglang:num_running_reqs gauge\n"
    'sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0"} 0\n'
    "# TYPE sglang:num_queue_reqs gauge\n"
    'sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0"} 0\n'
    "# TYPE sglang:generation_tokens_total counter\n"
    'sglang:generation_tokens_total{model_name="m"} 1234\n'
)
BUSY_METRICS = IDLE_METRICS.replace("} 0\n", "} 40\n", 1)
MODELS = b'{"object":"list","data":[{"id":"m","object":"model"}]}'


def _metrics_server(text: str) -> RawUpstream:
    """A tiny engine: /metrics with fixed text, /v1/models; anything else hangs (lost)."""

    async def serve(stream: SocketStream, conn: UpConn) -> None:
        answered = 0
        while True:
            await conn.wait_for(lambda c: c.received.count(b"\r\n\r\n") > answered or c.eof, 30)
            if conn.received.count(b"\r\n\r\n") <= answered:
                return
            request = bytes(conn.received).split(b"\r\n\r\n")[answered]
            answered += 1
            if request.startswith(b"GET /metrics"):
                body = text.encode()
            elif request.startswith(b"GET /v1/models"):
                body = MODELS
            else:
                continue  # accepted and never answered: lost in the serving stack
            await stream.send(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )

    return RawUpstream(serve)


POST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b'content-length: 17\r\n\r\n{"stream": true }'
)


@pytest.mark.parametrize("busy", [False, True])
async def test_stall_sends_probes_over_fresh_connections(busy: bool, tmp_path: Path) -> None:
    """The decisive experiment, automated: the hung request stalls, a fresh probe answers."""
    engine = _metrics_server(BUSY_METRICS if busy else IDLE_METRICS)
    capture = tmp_path / "cap.jsonl"
    async with anyio.create_task_group() as tg:
        port = await tg.start(engine.serve)
        url = f"http://127.0.0.1:{port}"
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            url,
            "--capture",
            str(capture),
            "--engine-metrics",
            f"{url}/metrics",
            "--metrics-interval",
            "0.1",
            "--stall-after",
            "0.3",
            "--probe-on-stall",
        ) as proc:
            async with await anyio.connect_tcp("127.0.0.1", proc.port) as s:
                await s.send(POST)

                def probes_recorded() -> bool:
                    return capture.read_bytes().count(b'"type":"probe"') >= 2

                await wait_until(probes_recorded, timeout=10)
        tg.cancel_scope.cancel()
    records = list(read_records(capture))
    stalls = [r for r in records if r["type"] == "stall" and r["phase"] == "start"]
    assert stalls and stalls[0]["direction"] == "upstream_silent"
    probes = [r for r in records if r["type"] == "probe"]
    assert {p["target"] for p in probes} == {"upstream", "engine"}
    assert all(p["trigger_conn"] == 1 and p["trigger_seq"] == 1 for p in probes)
    if busy:
        assert all(p["outcome"] == "skipped" and "running=40" in p["reason"] for p in probes)
    else:
        assert all(p["outcome"] == "ok" and p["status"] == 200 for p in probes)
        assert all(p["latency"] < 2 for p in probes)
    samples = [r for r in records if r["type"] == "engine" and r["ok"]]
    assert samples and samples[-1]["profile"] == "sglang"
    assert samples[-1]["state"]["running"] == (40 if busy else 0)


async def test_watch_records_engine_evidence_alone(tmp_path: Path) -> None:
    engine = _metrics_server(IDLE_METRICS)
    capture = tmp_path / "watch.jsonl"
    async with anyio.create_task_group() as tg:
        port = await tg.start(engine.serve)
        process = await anyio.open_process(
            [
                sys.executable,
                "-m",
                "tracer",
                "watch",
                "--engine-metrics",
                f"http://127.0.0.1:{port}/metrics",
                "--engine-metrics",
                "http://127.0.0.1:9/metrics",
                "--metrics-interval",
                "0.1",
                "--capture",
                str(capture),
            ],
        )
        try:
            await wait_until(  # a process's start-up takes seconds on a loaded machine
                lambda: capture.exists() and capture.read_bytes().count(b'"ok":true') >= 3,
                timeout=30,
            )
            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(5):
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
            with anyio.CancelScope(shield=True):
                await process.aclose()
        tg.cancel_scope.cancel()
    records = list(read_records(capture))
    assert records[0]["type"] == "capture_start" and records[0]["kind"] == "watch"
    assert records[-1]["type"] == "capture_end" and records[-1]["reason"] == "SIGTERM"
    ok = [r for r in records if r["type"] == "engine" and r["ok"]]
    refused = [r for r in records if r["type"] == "engine" and not r["ok"]]
    assert ok and ok[0]["state"]["running"] == 0
    assert refused and refused[0]["error"] == "refused"  # failures are evidence too
    with_deltas = [r for r in ok if r.get("deltas") is not None]
    assert with_deltas and with_deltas[0]["deltas"]["generation_tokens_total"] == 0
