"""End to end: real faults made by real processes, attributed from the capture alone.

The simulated engine's fault switches make the engine-side faults; the tap (a real
`tracer proxy` process) records them with engine metrics; `tracer analyze` (a real
process) must name the party and the kind — and a healthy control must stay clean.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from .test_cli_proxy import tracer_proxy
from .test_sim_engine import engine_running

pytestmark = pytest.mark.anyio

BODY = {
    "model": "sim-model",
    "stream": True,
    "max_tokens": 6,
    "messages": [{"role": "user", "content": "hi"}],
}


async def analyze(capture: Path, *args: str) -> dict[str, Any]:
    result = await anyio.run_process(
        [sys.executable, "-m", "tracer", "analyze", str(capture), "--format", "json", *args]
    )
    return dict(json.loads(result.stdout))


async def _stream(client: httpx.AsyncClient, url: str, fault: str | None) -> None:
    headers = {"x-sim-fault": fault} if fault else {}
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=BODY, headers=headers
        ) as r:
            async for _ in r.aiter_bytes():
                pass
    except httpx.HTTPError:
        pass  # the fault's symptom at the client; the capture is what is judged


async def run_case(
    tmp_path: Path, fault: str | None, *, client_timeout: float = 5.0, **engine: Any
) -> dict[str, Any]:
    capture = tmp_path / "cap.jsonl"
    async with engine_running(ttft=0.0, itl=0.005, **engine) as sim:
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            sim.url,
            "--capture",
            str(capture),
            "--engine-metrics",
            f"{sim.url}/metrics",
            "--metrics-interval",
            "0.1",
            "--stall-after",
            "0.5",
        ) as proc:
            async with httpx.AsyncClient(timeout=client_timeout) as client:
                await _stream(client, proc.url, None)  # a healthy request first
                await _stream(client, proc.url, fault)
                await _stream(client, proc.url, None)  # and after
    return await analyze(capture)


async def test_healthy_control_stays_clean(tmp_path: Path) -> None:
    result = await run_case(tmp_path, None)
    assert result["verdict"]["kind"] == "healthy"
    assert [f for f in result["findings"] if not f["note"]] == []


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        ("stall:after=2:for=3", "engine_stall_mid_stream"),
        ("lost", "engine_lost_request"),
        ("error:after=2", "engine_error_event"),
        ("500", "engine_error_status"),
        ("close:after=2", "engine_truncated"),
    ],
)
async def test_engine_faults_are_the_engine(fault: str, kind: str, tmp_path: Path) -> None:
    result = await run_case(tmp_path, fault, client_timeout=2.5)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("engine", kind), result["findings"]
    finding = result["findings"][0]
    assert finding["requests"] and finding["evidence"]
    assert any(r["party"] == "client" for r in finding["ruled_out"])
