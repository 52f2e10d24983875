"""``tracer sniff`` for real: a process capturing on lo (root or CAP_NET_RAW) while a
client talks to the simulated engine on 127.0.0.1, stopped with SIGINT, its capture read
back by ``tracer analyze --format json``; and the same start without CAP_NET_RAW."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from tests.support.analyze import analyze_async
from tests.support.engine import chat_request, engine_running
from tests.support.net import recv_until, wait_until
from tests.support.procs import count_records, drain_lines
from tracer.capture.files import read_records

pytestmark = pytest.mark.anyio


def _can_capture() -> str | None:
    """Why a packet socket cannot be opened here (None: it can)."""
    family = getattr(socket, "AF_PACKET", None)
    if family is None:
        return "live capture needs Linux (AF_PACKET)"
    try:
        socket.socket(family, socket.SOCK_RAW, 0).close()
    except PermissionError:
        return "live capture needs root or CAP_NET_RAW, which this test run has not"
    return None


CANNOT = _can_capture()


@asynccontextmanager
async def sniffing(*args: str) -> AsyncIterator[tuple[Process, list[str]]]:
    """``python -m tracer sniff ARGS`` once it says it captures; its stderr lines."""
    cmd = [sys.executable, "-m", "tracer", "sniff", *args]
    process = await anyio.open_process(cmd, stdin=None)
    assert process.stderr is not None
    reader = BufferedByteReceiveStream(process.stderr)
    lines: list[str] = []
    try:
        with anyio.fail_after(15):
            while not any(line.startswith("tracer sniff: capturing on") for line in lines):
                lines.append((await reader.receive_until(b"\n", 65536)).decode())
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain_lines, reader, lines)
            yield process, lines
            with anyio.fail_after(10):
                await process.wait()
            tg.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.CancelScope(shield=True):
            await process.aclose()


async def _stream(client: httpx.AsyncClient, url: str, rid: str) -> int:
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    }
    events = 0
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"x-request-id": rid}
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            events += line.startswith("data:")
    return events


@pytest.mark.skipif(CANNOT is not None, reason=CANNOT or "")
async def test_sniff_records_a_live_exchange_as_a_tap_would(tmp_path: Path) -> None:
    capture = tmp_path / "sniff.jsonl"
    async with engine_running(tokens=4, ttft=0.0, itl=0.001) as engine:
        assert engine.bound is not None
        port = engine.bound[1]
        url = f"http://127.0.0.1:{port}"
        # fmt: off
        args = [
            "--iface", "lo", "--port", str(port), "--capture", str(capture), "--tap", "live",
            "--engine-metrics", f"{url}/metrics", "--metrics-interval", "0.2",
            "--stall-after", "0.5", "--probe-on-stall", "--probe-interval", "60",
        ]
        # fmt: on
        async with sniffing(*args) as (process, lines):
            async with httpx.AsyncClient() as client:  # two requests on one connection
                assert await _stream(client, url, "rid-1") == 7  # role, 4 tokens, finish, [DONE]
                assert await _stream(client, url, "rid-2") == 7
            # a third, on a connection of its own, whose stream stops after two tokens
            request = chat_request(
                headers={"x-request-id": "rid-hung", "x-sim-fault": "stall:after=2:for=60"}
            )
            async with await anyio.connect_tcp("127.0.0.1", port) as hung:
                await hung.send(request)
                await recv_until(hung, lambda b: b.count(b"data:") >= 2)
                # the tap sees it stall and probes the server and the engine over fresh
                # connections; the poller's samples come in; then it is stopped
                await wait_until(lambda: count_records(capture, "stall") >= 1, timeout=20)
                await wait_until(lambda: count_records(capture, "probe") >= 2, timeout=20)
                await wait_until(lambda: count_records(capture, "engine") >= 2, timeout=20)
                process.send_signal(signal.SIGINT)
                with anyio.fail_after(10):
                    code = await process.wait()
    assert code == 0, lines
    assert "Traceback" not in "".join(lines)
    assert any(line.startswith("tracer sniff: stopped (SIGINT)") for line in lines), lines

    records = list(read_records(capture))
    assert records[0]["type"] == "capture_start" and records[-1]["type"] == "capture_end"
    head, end = records[0], records[-1]
    assert (head["kind"], head["tap"], head["listen"]) == ("sniff", "live", f"*:{port}")
    assert head["options"]["iface"] == "lo" and head["options"]["passive"] is True
    assert head["options"]["filter"] == "kernel (BPF)"
    assert head["t"] == head["m"]  # one clock: the packets' (wall) times
    assert (end["reason"], end["dropped"]) == ("SIGINT", 0)
    assert all(r["t"] == r["m"] for r in records)  # the poller's and probes' records too
    (probe,) = [r for r in records if r["type"] == "probe" and r["target"] == "upstream"]
    assert probe["url"] == f"{url}/v1/models" and probe["outcome"] == "ok"

    doc = await analyze_async(capture)
    # the clients' requests (the poller's scrapes and the probe are the tracer's own)
    rows = {r["request_id"]: r for r in doc["requests"]}
    assert sorted(rows) == ["rid-1", "rid-2", "rid-hung"], doc["requests"]
    done, reused, stalled = rows["rid-1"], rows["rid-2"], rows["rid-hung"]
    assert reused["conn"] == done["conn"] != stalled["conn"]
    assert [(r["seq"], r["reused"]) for r in (done, reused, stalled)] == [
        (1, False),
        (2, True),
        (1, False),
    ]
    for row in (done, reused):
        assert (row["status"], row["termination"], row["done"], row["events"]) == (
            200,
            "complete",
            True,
            7,
        )
        assert row["method"] == "POST" and row["target"] == "/v1/chat/completions"
    assert (stalled["status"], stalled["termination"], stalled["detail"]) == (
        200,
        "in_flight",
        "tap stopped",
    )
    assert stalled["stalls"] and stalled["stalls"][0]["direction"] == "upstream_silent"
    conns = {c["conn"]: c for c in doc["connections"]}
    first, second = conns[done["conn"]], conns[stalled["conn"]]
    assert (first["requests"], first["probes"], first["closed_by"], first["how"]) == (
        2,
        0,
        "client",
        "fin",
    )
    assert (second["requests"], second["closed_by"], second["in_flight_at_close"]) == (
        1,
        "none",
        True,
    )
    assert first["upstream"] == second["upstream"] == f"127.0.0.1:{port}"
    # the tracer's own connections (the poller's scrapes, the probe) are seen, and
    # counted as its own: none of their requests is in the tables
    own = [c for c in doc["connections"] if c["conn"] not in (first["conn"], second["conn"])]
    # (a scrape the stop cut before its request was on the wire has no request at all)
    assert own and all(c["probes"] == c["requests"] <= 1 for c in own)
    assert sum(c["requests"] for c in own) >= 2
    assert doc["totals"]["tap_own_requests"] == sum(c["requests"] for c in own)


@pytest.mark.skipif(CANNOT is not None, reason=CANNOT or "")
async def test_two_taps_by_port_in_one_capture(tmp_path: Path) -> None:
    """``--tap-by-port``: two servers' connections as two taps, each with its header,
    numbering and end (back's with the role declared for it); stopped by SIGTERM."""
    capture = tmp_path / "both.jsonl"
    async with (
        engine_running(tokens=2, ttft=0.0, itl=0.001) as front,
        engine_running(tokens=3, ttft=0.0, itl=0.001) as back,
    ):
        assert front.bound is not None and back.bound is not None
        ports = {"front": front.bound[1], "back": back.bound[1]}
        by_port = f"{ports['front']}=front,{ports['back']}=back:engine"
        args = ["--iface", "lo", "--tap-by-port", by_port, "--capture", str(capture)]
        async with sniffing(*args) as (process, lines):
            async with httpx.AsyncClient() as client:
                for tap, port in ports.items():
                    await _stream(client, f"http://127.0.0.1:{port}", f"to-{tap}")
            await wait_until(lambda: count_records(capture, "conn_close") >= 2, timeout=20)
            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                code = await process.wait()
    assert code == 0, lines
    records = list(read_records(capture))
    heads = [(r["tap"], r["listen"]) for r in records if r["type"] == "capture_start"]
    assert heads == [("front", f"*:{ports['front']}"), ("back", f"*:{ports['back']}")]
    roles = {r["tap"]: r.get("upstream_role") for r in records if r["type"] == "capture_start"}
    assert roles == {"front": None, "back": "engine"}
    topo = [(r["tap"], r["upstream_role"], r["basis"]) for r in records if r["type"] == "topology"]
    assert topo == [("back", "engine", "declared")]
    ends = [(r["tap"], r["reason"]) for r in records if r["type"] == "capture_end"]
    assert ends == [("front", "SIGTERM"), ("back", "SIGTERM")]
    doc = await analyze_async(capture)
    rows = [(r["tap"], r["conn"], r["seq"], r["request_id"]) for r in doc["requests"]]
    assert sorted(rows) == [("back", 1, 1, "to-back"), ("front", 1, 1, "to-front")]
    assert {r["termination"] for r in doc["requests"]} == {"complete"}
    declared = {t["tap"]: (t["topology"] or {}).get("upstream_role") for t in doc["taps"]}
    assert declared == {"front": None, "back": "engine"}


@pytest.mark.skipif(
    CANNOT is not None or shutil.which("setpriv") is None,
    reason=CANNOT or "setpriv (util-linux) is not installed",
)
def test_sniff_without_cap_net_raw_says_so_in_one_line(tmp_path: Path) -> None:
    """As root with CAP_NET_RAW taken out of the bounding set: what a user without it sees."""
    capture = tmp_path / "f.jsonl"
    cmd = ["setpriv", "--bounding-set=-net_raw", "--inh-caps=-net_raw", sys.executable]
    cmd += ["-m", "tracer", "sniff", "--iface", "lo", "--port", "8000", "--capture", str(capture)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        "tracer: cannot capture on lo: needs root or CAP_NET_RAW (operation not permitted)\n"
    )
    assert not capture.exists()
