"""The mitmproxy addon (addons/trace.py) with its capture process, a real process fed
through a pipe: it writes what the engine in-process writes, falls behind, dies or is
kept off mitmproxy's cores. Hook by hook: tests/unit; mitmdump: tests/e2e."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.support.addon import (
    BIG_EVENT,
    SSE_CHUNKS,
    a_flow,
    addon_ctx,
    records,
    sse_response,
    start,
    streaming_sse,
    trace,
)
from tests.support.net import wait_until
from tests.support.procs import REPO
from tracer.capture.files import read_records
from tracer.observe import flow_pipe

with warnings.catch_warnings():  # mitmproxy.master imports ldap3, which warns on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from mitmproxy.test import taddons


def _scripted(addon: Any) -> None:
    """One connection: an SSE exchange, a silent one that stalls, then the client goes."""
    flow, stream, _ = streaming_sse(addon)
    for chunk in SSE_CHUNKS:
        stream(chunk)
    stream(b"")
    addon.response(flow)
    slow = a_flow(client=flow.client_conn)
    start(addon, slow)
    slow.response = sse_response()
    addon.responseheaders(slow)
    slow.response.stream(SSE_CHUNKS[0])
    addon.tick(time.monotonic() + 1.0)
    addon.client_disconnected(flow.client_conn)


def _untimed_records(path: Path) -> list[Any]:
    """The records but their times, at any depth (and the header, which names the mode)."""

    def untimed(value: Any) -> Any:
        if isinstance(value, float):
            return "time"
        if isinstance(value, list):
            return [untimed(v) for v in value]
        if isinstance(value, dict):
            return {k: untimed(v) for k, v in value.items()}
        return value

    return [untimed(r) for r in read_records(path) if r["type"] != "capture_start"]


def test_the_capture_process_writes_what_the_engine_in_process_writes(tmp_path: Path) -> None:
    with addon_ctx(tmp_path, tracer_stall_after="0.5") as (addon, inline):
        assert addon.engine is not None and addon.process is None
        _scripted(addon)
    with addon_ctx(tmp_path, tracer_stall_after="0.5", tracer_sidecar=True) as (addon, apart):
        assert addon.engine is None and addon.process is not None
        _scripted(addon)
    assert addon.process is None  # done() waited for it
    assert _untimed_records(apart) == _untimed_records(inline)
    kinds = [r["type"] for r in _untimed_records(apart)]
    assert kinds.count("body") == 2 and kinds.count("stall") == 2 and kinds[-1] == "capture_end"
    assert next(read_records(apart))["options"]["capture_process"] is True


def test_a_capture_file_changed_while_mitmproxy_runs(tmp_path: Path) -> None:
    """``tracer_capture`` set anew (mitmproxy's ``set`` command): the first capture ends
    with what was open settled, its process finishing beside the loop; the next capture
    gets what comes after."""
    addon = trace.TraceAddon()
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tracer_capture=str(first))
        one = a_flow()
        start(addon, one)
        tctx.configure(addon, tracer_capture=str(second))
        assert len(addon._closing) == 1
        two = a_flow()
        start(addon, two)
        addon.done()
        assert not addon._closing
    kinds = [r["type"] for r in records(first)]
    assert kinds == [
        "capture_start",
        "conn_open",
        "request",
        "request_end",
        "response_end",
        "conn_close",
        "capture_end",
    ]
    assert records(first, "capture_end")[0]["reason"] == "capture file changed"
    assert records(first, "response_end")[0]["termination"] == "in_flight"
    assert [r["type"] for r in records(second)] == kinds  # the second request only
    assert records(second, "capture_end")[0]["reason"] == "mitmproxy stopped"


def test_a_capture_process_that_falls_behind_costs_facts_not_traffic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipe is never waited for: with the capture process stopped, the pieces still go
    on at once, the backlog stays under its bound, and what did not fit is counted in a
    ``capture_loss`` record once the process reads again."""
    monkeypatch.setattr(flow_pipe, "MAX_BACKLOG", 256 << 10)
    event = BIG_EVENT
    with addon_ctx(tmp_path, tracer_sidecar=True) as (addon, path):
        process = addon.process
        flow, stream, _ = streaming_sse(addon)
        os.kill(process.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(40):  # 2.6 MB: more than the pipe (at most 1 MiB) and the bound
                assert stream(event) == event
            assert process.lost_facts > 0 and len(process.backlog) <= flow_pipe.MAX_BACKLOG
        finally:
            os.kill(process.proc.pid, signal.SIGCONT)
        stream(SSE_CHUNKS[4])
        stream(b"")
        addon.response(flow)
    (loss,) = records(path, "capture_loss")
    assert loss["dropped"] > 0 and "fell behind" in loss["reason"]
    end = records(path, "response_end")[0]
    assert end["termination"] == "complete" and end["done"] is True
    assert records(path)[-1]["type"] == "capture_end"


@pytest.mark.anyio
async def test_a_full_pipe_is_written_when_the_loop_says_it_drained(tmp_path: Path) -> None:
    """In mitmproxy's loop: with the capture process stopped the pipe fills, the rest
    waits in the backlog, and the loop's writer callback writes it once the process reads
    again. Nothing is lost under the bound."""
    event = BIG_EVENT
    with addon_ctx(tmp_path, tracer_sidecar=True) as (addon, path):
        process = addon.process
        flow, stream, _ = streaming_sse(addon)
        os.kill(process.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(48):  # 3.1 MB: three times the pipe
                assert stream(event) == event
                await anyio.lowlevel.checkpoint()  # the ship of a big piece
            assert process.backlog and process._waiting and not process.lost_facts
        finally:
            os.kill(process.proc.pid, signal.SIGCONT)
        await wait_until(lambda: not process.backlog, 10, interval=0.001)
        assert not process._waiting
        stream(SSE_CHUNKS[4])
        stream(b"")
        addon.response(flow)
    assert not records(path, "capture_loss")
    end = records(path, "response_end")[0]
    assert end["events"] == 49 and end["done"] is True and end["termination"] == "complete"


def test_a_fact_that_cannot_be_sent_is_counted_and_the_rest_go(tmp_path: Path) -> None:
    """A value ``marshal`` refuses (not one mitmproxy gives today) costs that fact only."""
    with addon_ctx(tmp_path, tracer_sidecar=True) as (addon, path):
        flow = a_flow()
        flow.client_conn.peername = ("127.0.0.1", object())  # type: ignore[assignment]
        addon.client_connected(flow.client_conn)
        addon.requestheaders(flow)
        addon.request(flow)
        assert addon.process.lost_facts == 0  # reported with the next batch
        addon.record_fault_plan(["drop-request"], "replace")
    (loss,) = records(path, "capture_loss")
    assert loss["dropped"] == 1
    assert [r["type"] for r in records(path)][1:] == [
        "capture_loss",
        "conn_open",  # made up from the request's fact: its connection's was the one lost
        "request",
        "request_end",
        "fault_plan",
        "response_end",
        "conn_close",
        "capture_end",
    ]


def test_a_capture_process_that_dies_stops_tracing_not_traffic(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with addon_ctx(tmp_path, tracer_sidecar=True) as (addon, path):
        process = addon.process
        flow, stream, _ = streaming_sse(addon)
        process.proc.kill()
        process.proc.wait(5)
        for chunk in SSE_CHUNKS:
            assert stream(chunk) == chunk
        stream(b"")
        addon.response(flow)
        assert process.gone
    assert "the capture process is gone" in caplog.text
    assert "capture_end" not in [r["type"] for r in records(path)]  # it was killed


PINNED_PARENT = """\
import os, sys, time
os.sched_setaffinity(0, {{{core}}})
from tracer.observe.facts import Close
from tracer.observe.flow_pipe import CaptureProcess
from tracer.observe.flows import Settings
header = dict(t=time.time(), m=time.monotonic(), tracer_version="0", kind="mitmproxy",
              listen="-", upstream=None, boot_id=None, options={{}})
process = CaptureProcess({path!r}, Settings(), header)
print(process.proc.pid, flush=True)
sys.stdin.readline()
process.close([Close(time.monotonic(), "test over")], wait=True)
"""


def _allowed_cores(pid: int) -> set[int]:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
    cores: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def test_the_capture_process_keeps_off_the_cores_mitmproxy_is_pinned_to(tmp_path: Path) -> None:
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip("one core: nowhere else to go")
    core = min(cores)
    capture = tmp_path / "pinned.jsonl"
    script = PINNED_PARENT.format(core=core, path=str(capture))
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO
    )
    try:
        assert parent.stdout is not None and parent.stdin is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while core in _allowed_cores(child):
            assert time.monotonic() < deadline, _allowed_cores(child)
            time.sleep(0.01)
        assert _allowed_cores(child) and core not in _allowed_cores(child)
        parent.stdin.write(b"\n")
        parent.stdin.close()
        assert parent.wait(20) == 0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)
        for pipe in (parent.stdin, parent.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
    assert [r["type"] for r in records(capture)] == ["capture_start", "capture_end"]
