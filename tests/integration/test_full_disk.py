"""A tap whose capture's disk fills mid-run (a real 512 KiB tmpfs, as the tester had it):
every request is served, the capture says how much it lost and when, ends cleanly from
the writer's reserve, and the analysis blames nobody for the records it does not have.

Needs the right to mount (root, as CI runs): skipped where ``mount -t tmpfs`` is refused.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from tests.support.engine import engine_running
from tests.support.procs import tracer_proxy
from tracer.capture.files import ReadStats, read_records

pytestmark = pytest.mark.anyio

REQUESTS = 400


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _tracer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tracer", *args], capture_output=True, text=True, timeout=120
    )


async def test_a_full_disk_is_counted_ended_and_blames_nobody(small_disk: Path) -> None:
    capture = small_disk / "front.jsonl"
    async with engine_running(ttft=0.0, itl=0.0005) as sim:
        assert sim.bound is not None
        upstream = f"http://127.0.0.1:{sim.bound[1]}"
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            upstream,
            "--capture",
            str(capture),
            "--bodies",
            "all",
            "--admin",
            "127.0.0.1:0",
        ) as tap:
            statuses: list[int] = []
            async with httpx.AsyncClient(base_url=tap.url, timeout=30) as client:

                async def one(i: int) -> None:
                    body = {
                        "model": "m",
                        "messages": [{"role": "user", "content": f"{i} {uuid.uuid4().hex * 20}"}],
                        "max_tokens": 16,
                    }
                    reply = await client.post("/v1/chat/completions", json=body)
                    statuses.append(reply.status_code)

                for start in range(0, REQUESTS, 20):
                    async with anyio.create_task_group() as tg:
                        for i in range(start, start + 20):
                            tg.start_soon(one, i)
                metrics = (await client.get(f"{tap.admin}/metrics")).text
                status = (await client.get(f"{tap.admin}/status")).json()
            tap.process.send_signal(signal.SIGINT)
            with anyio.fail_after(20):
                await tap.process.wait()
    assert statuses.count(200) == REQUESTS  # the tracer is never the reason traffic stops

    dropped_metric = [
        line for line in metrics.splitlines() if line.startswith("tracer_capture_records_dropped")
    ]
    assert dropped_metric and float(dropped_metric[0].split()[-1]) > 0
    assert status["capture"]["dropped"] > 0

    stats = ReadStats()
    records = list(read_records(capture, stats))
    assert records[-1]["type"] == "capture_end"
    assert records[-1]["dropped"] > 0
    losses = [r for r in records if r["type"] == "capture_loss"]
    assert losses and sum(r["dropped"] for r in losses) == records[-1]["dropped"]
    assert all(r["first_t"] <= r["last_t"] for r in losses)
    assert losses[-1]["resumed"] is False  # written from the reserve, the disk still full
    assert not stats.torn_tail
    assert stats.bad_lines == stats.torn_at_loss  # every cut line is a loss's, not a kill's
    assert not list(small_disk.glob(".*.reserve"))  # the reserve is given back

    info = _tracer("info", str(capture), "--format", "json")
    assert info.returncode == 0, info.stderr
    doc = json.loads(info.stdout)["captures"][0]
    assert doc["ended_cleanly"] and doc["records_lost"] == records[-1]["dropped"]
    assert doc["loss_windows"] and doc["loss_windows"][-1]["resumed"] is False

    analyzed = _tracer("analyze", str(capture), "--format", "json")
    assert analyzed.returncode == 0, analyzed.stderr
    result = json.loads(analyzed.stdout)
    assert result["totals"]["capture_records_lost"] == records[-1]["dropped"]
    assert result["verdict"]["party"] in ("none", "unknown")
    assert not [f for f in result["findings"] if f["party"] in ("engine", "proxy", "client")]
    assert {c["kind"] for c in result["verdict"].get("caveats", [])} >= {"records_lost"}
    open_at_end = [r["id"] for r in result["requests"] if r["termination"] != "complete"]
    lost = [f for f in result["findings"] if f["kind"] == "capture_lost"]
    if open_at_end:  # a request whose end was lost is the capture's, never a party's
        assert lost and set(open_at_end) <= set(lost[0]["requests"])
        assert lost[0]["evidence"][0]["figures"]["dropped"] > 0
