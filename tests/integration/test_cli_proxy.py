"""`tracer proxy` as a real process: signals, kill -9, admin endpoint, JSON logs, analyze."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.net import wait_until
from tests.support.procs import tracer_proxy
from tracer.capture.files import ReadStats, read_records
from tracer.sim.engine import EngineConfig, SimEngine

pytestmark = pytest.mark.anyio


async def _stream_once(client: httpx.AsyncClient, url: str, rid: str) -> int:
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
    }
    events = 0
    async with client.stream(
        "POST",
        url + "/v1/chat/completions",
        json=body,
        headers={"x-request-id": rid, "authorization": "Bearer sk-top-secret"},
    ) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events += 1
    return events


async def test_sigterm_flushes_and_exits_fast(tmp_path: Path) -> None:
    engine = SimEngine(EngineConfig(tokens=5, ttft=0.0, itl=0.001))
    capture = tmp_path / "cap.jsonl"
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(engine.serve)
        async with tracer_proxy(
            "proxy",
            "--log-json",  # after the command, as the README shows it
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            f"http://{host}:{port}",
            "--capture",
            str(capture),
            "--tap",
            "front",
        ) as proc:
            async with httpx.AsyncClient() as client:
                for i in range(3):
                    # role, 5 content, the finish_reason chunk, [DONE]
                    assert await _stream_once(client, proc.url, f"rid-{i}") == 8
                # keep one connection open and idle while the tap stops
                start = time.monotonic()
                proc.process.send_signal(signal.SIGTERM)
                with anyio.fail_after(5):
                    code = await proc.process.wait()
                elapsed = time.monotonic() - start
        tg.cancel_scope.cancel()
    assert code == 0
    assert elapsed < 1.5, f"SIGTERM took {elapsed:.2f}s"
    stats = ReadStats()
    records = list(read_records(capture, stats))
    assert records[0]["type"] == "capture_start" and records[-1]["type"] == "capture_end"
    assert records[-1]["reason"] == "SIGTERM"
    assert [r["request_id"] for r in records if r["type"] == "request"] == [
        "rid-0",
        "rid-1",
        "rid-2",
    ]
    assert b"sk-top-secret" not in capture.read_bytes()
    # JSON log lines: every line about a connection carries its id
    logs = [json.loads(line) for line in proc.lines if line.strip()]  # every line is JSON
    assert any(line.get("event") == "stopping" for line in logs)
    assert not any(v is None for line in logs for v in line.values())  # no empty fields


async def test_kill_9_keeps_what_was_flushed(tmp_path: Path) -> None:
    engine = SimEngine(EngineConfig(tokens=3, ttft=0.0, itl=0.0))
    capture = tmp_path / "cap.jsonl"
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(engine.serve)
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            f"http://{host}:{port}",
            "--capture",
            str(capture),
        ) as proc:
            async with httpx.AsyncClient() as client:
                for i in range(5):
                    await _stream_once(client, proc.url, f"rid-{i}")

                def flushed() -> bool:
                    return capture.read_bytes().count(b'"type":"response_end"') >= 5

                await wait_until(flushed)
                proc.process.kill()
                await proc.process.wait()
        tg.cancel_scope.cancel()
    stats = ReadStats()
    records = list(read_records(capture, stats))
    assert stats.bad_lines == 0
    assert sum(1 for r in records if r["type"] == "response_end") == 5
    assert records[-1]["type"] != "capture_end"


async def test_admin_metrics_and_status(tmp_path: Path) -> None:
    engine = SimEngine(EngineConfig(tokens=200, ttft=0.0, itl=0.02))
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(engine.serve)
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            f"http://{host}:{port}",
            "--admin",
            "127.0.0.1:0",
            "--tap",
            "adm",
        ) as proc:
            async with httpx.AsyncClient() as client:

                async def long_stream() -> None:
                    with contextlib.suppress(httpx.HTTPError):  # cut when the tap stops
                        await _stream_once(client, proc.url, "long-one")

                tg.start_soon(long_stream)

                async def in_flight() -> dict[str, object]:
                    r = await client.get(f"{proc.admin}/status")
                    return dict(r.json())

                with anyio.fail_after(5):
                    while True:
                        status = await in_flight()
                        conns = status["connections"]
                        assert isinstance(conns, list)
                        if conns and conns[0]["in_flight"]:
                            break
                        await anyio.sleep(0.02)
                req = conns[0]["in_flight"][0]
                assert req["seq"] == 1 and req["age"] >= 0 and "last_byte_age" in req
                metrics = (await client.get(f"{proc.admin}/metrics")).text
        tg.cancel_scope.cancel()
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    assert families["tracer_connections_open"].samples[0].value == 1
    assert families["tracer_requests_in_flight"].samples[0].value == 1
    assert families["tracer_requests"].samples[0].labels == {"tap": "adm"}
    for name in ("tracer_responses", "tracer_stalls", "tracer_capture_records_dropped"):
        assert name in families


async def test_admin_refuses_remote_bind_without_flag(tmp_path: Path) -> None:
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
            "--admin",
            "0.0.0.0:0",
        ],
        check=False,
    )
    assert result.returncode == 2
    assert b"--admin-allow-remote" in result.stderr


async def test_analyze_is_deterministic_and_reads_a_live_capture(tmp_path: Path) -> None:
    engine = SimEngine(EngineConfig(tokens=4, ttft=0.0, itl=0.001))
    capture = tmp_path / "cap.jsonl"
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(engine.serve)
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            f"http://{host}:{port}",
            "--capture",
            str(capture),
        ) as proc:
            async with httpx.AsyncClient() as client:
                for i in range(3):
                    await _stream_once(client, proc.url, f"r{i}")
            await wait_until(lambda: capture.read_bytes().count(b'"type":"conn_close"') >= 1)
            live = await anyio.run_process(
                [sys.executable, "-m", "tracer", "analyze", str(capture), "--format", "json"]
            )
        tg.cancel_scope.cancel()
    doc = json.loads(live.stdout)
    assert doc["schema"] == "tracer.analysis/6"
    assert [r["request_id"] for r in doc["requests"]] == ["r0", "r1", "r2"]
    assert [r["seq"] for r in doc["requests"]] == [1, 2, 3]
    assert all(r["termination"] == "complete" and r["done"] for r in doc["requests"])
    outs = []
    for fmt in ("json", "json", "text", "text"):
        res = await anyio.run_process(
            [sys.executable, "-m", "tracer", "analyze", str(capture), "--format", fmt]
        )
        outs.append(res.stdout)
    assert outs[0] == outs[1] and outs[2] == outs[3]
    assert b"requests" in outs[2] and b"tap/1/2" in outs[2]


TOKEN = "test-token-0123456789abcdef"


async def test_admin_mark_is_a_hang_mark_in_the_capture(tmp_path: Path) -> None:
    capture = tmp_path / "cap.jsonl"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    async with anyio.create_task_group() as tg:
        engine = SimEngine(EngineConfig(tokens=2, ttft=0.0, itl=0.0))
        host, port = await tg.start(engine.serve)
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            f"http://{host}:{port}",
            "--admin",
            "127.0.0.1:0",
            "--capture",
            str(capture),
            "--tap",
            "front",
            "--admin-token-file",
            str(token_file),
        ) as proc:
            async with httpx.AsyncClient() as client:
                await _stream_once(client, proc.url, "before")
                mark = f"{proc.admin}/mark"
                no_token = await client.post(mark, json={"note": "stuck"})
                assert no_token.status_code == 401
                auth = {"authorization": f"Bearer {TOKEN}"}
                r = await client.post(mark, json={"note": "stuck"}, headers=auth)
                assert r.status_code == 200 and r.json()["note"] == "stuck"
                assert r.json()["by"].startswith("127.0.0.1:")
                assert (await client.get(mark)).status_code == 405
        tg.cancel_scope.cancel()
    marks = [r for r in read_records(capture) if r["type"] == "mark"]
    assert len(marks) == 1 and marks[0]["note"] == "stuck"
    result = await anyio.run_process(
        [sys.executable, "-m", "tracer", "analyze", str(capture), "--format", "json"]
    )
    doc = json.loads(result.stdout)
    assert doc["evidence"]["marks"] == [marks[0]["t"]]
    assert doc["findings"][0]["kind"] == "idle_at_hang"


async def test_a_rotated_capture_is_read_as_one_from_its_folder(tmp_path: Path) -> None:
    """``--capture-max-bytes``: segments cap.jsonl, cap.1.jsonl ...; ``tracer analyze``
    given the folder reads them in order as one capture."""
    folder = tmp_path / "caps"
    folder.mkdir()
    async with anyio.create_task_group() as tg:
        engine = SimEngine(EngineConfig(tokens=5, ttft=0.0, itl=0.0))
        host, port = await tg.start(engine.serve)
        async with tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", f"http://{host}:{port}",
            "--capture", str(folder / "cap.jsonl"), "--capture-max-bytes", "0.004",
            "--no-fingerprint",
        ) as proc:  # fmt: skip
            async with httpx.AsyncClient() as client:
                for i in range(12):
                    before = sum(p.stat().st_size for p in folder.iterdir())
                    await _stream_once(client, proc.url, f"r{i}")
                    # each exchange flushed before the next: segments roll between batches
                    await wait_until(
                        lambda before=before: (
                            sum(p.stat().st_size for p in folder.iterdir()) > before
                        ),
                        timeout=20,
                    )
        tg.cancel_scope.cancel()
    names = sorted(p.name for p in folder.iterdir())
    assert "cap.1.jsonl" in names and "cap.jsonl" in names
    result = await anyio.run_process(
        [sys.executable, "-m", "tracer", "analyze", str(folder), "--format", "json"]
    )
    doc = json.loads(result.stdout)
    assert sorted(r["request_id"] for r in doc["requests"]) == sorted(f"r{i}" for i in range(12))
    assert len(doc["captures"]) == len(names)
    from tracer.tools.replay_compare import load  # replay reads the set too

    assert len(load(folder).rows) == 12
