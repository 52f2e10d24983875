"""The simulated engine writes its own per-request records in both formats (SGLang's
request metrics JSONL, vLLM's spans as OTLP JSON) behind a real tap, and ``tracer analyze
--engine-requests`` joins them to the tap's rows: by x-request-id, and by the client's
traceparent where it sent no request id."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.engine import engine_running
from tests.support.tap import running_tap
from tracer import events as ev
from tracer.evidence.engine_requests import read_engine_requests

pytestmark = pytest.mark.anyio

BODY = {
    "model": "sim-model",
    "stream": True,
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "hi"}],
}


async def test_the_sim_engine_writes_both_formats_and_analyze_joins_them(tmp_path: Path) -> None:
    sglang, spans = tmp_path / "sglang.jsonl", tmp_path / "spans.json"
    trace = secrets.token_hex(16)
    async with (
        engine_running(
            ttft=0.0, itl=0.002, export_request_metrics=str(sglang), export_spans=str(spans)
        ) as engine,
        running_tap(engine.bound[1], tmp_path, name="front") as front,
    ):
        async with httpx.AsyncClient(base_url=front.url, timeout=10) as client:
            for i in range(3):
                r = await client.post(
                    "/v1/chat/completions", json=BODY, headers={"x-request-id": f"r{i}"}
                )
                assert r.status_code == 200
            parent = {"traceparent": f"00-{trace}-{secrets.token_hex(8)}-01"}
            r = await client.post("/v1/chat/completions", json=BODY, headers=parent)
            assert r.status_code == 200
        await front.wait_for(ev.ResponseEnd, count=4)
    capture = front.capture

    sg = read_engine_requests(sglang)
    assert (sg.format, sg.bad_lines) == ("sglang", 0)
    assert [r.request_id for r in sg.records][:3] == ["r0", "r1", "r2"]
    assert all(r.finish == "length" and r.output_tokens == 4 for r in sg.records)
    assert all(r.queued is not None and r.ttft is not None for r in sg.records)
    vl = read_engine_requests(spans)
    assert (vl.format, vl.bad_lines) == ("vllm", 0)
    assert [r.request_id for r in vl.records][:3] == ["chatcmpl-r0", "chatcmpl-r1", "chatcmpl-r2"]
    assert vl.records[3].trace_id == trace  # the client's trace, as vLLM keeps it

    for records in (sglang, spans):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tracer",
                "analyze",
                str(capture),
                "--format",
                "json",
                "--engine-requests",
                str(records),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        joined = doc["evidence"]["engine_requests"]
        # SGLang's records carry no trace: the request with only a traceparent is not joined
        assert joined == {"records": 4, "joined": 4 if records == spans else 3}
        assert doc["verdict"]["kind"] == "healthy"

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hello": 1}\n')
    out = subprocess.run(
        [sys.executable, "-m", "tracer", "analyze", str(capture), "--engine-requests", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 3 and out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in out.stderr
