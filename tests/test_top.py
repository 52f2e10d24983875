"""`tracer top`: a live view of a running tap, as a real process, in a pipe and in a pty."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from rich.console import Console

from tracer.present.top import render, render_text, status_url

from .test_cli_proxy import Proc, _free_port, tracer_proxy
from .test_sim_engine import engine_running

pytestmark = pytest.mark.anyio

CHAT = {
    "model": "sim-model",
    "stream": True,
    "max_tokens": 5,
    "messages": [{"role": "user", "content": "hi"}],
}


@asynccontextmanager
async def tap_with_a_stall() -> AsyncIterator[tuple[Proc, int, str]]:
    """A tap (admin on, engine metrics polled) whose connection 1 served two requests and
    holds a third one, stalled by the engine; yields the tap, its admin port, the engine."""
    async with engine_running(ttft=0.0, itl=0.005) as engine:
        assert engine.bound is not None
        engine_url = f"http://127.0.0.1:{engine.bound[1]}"
        admin = await _free_port()
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            engine_url,
            "--admin",
            f"127.0.0.1:{admin}",
            "--engine-metrics",
            f"{engine_url}/metrics",
            "--metrics-interval",
            "0.2",
            "--stall-after",
            "0.5",
            "--tap",
            "front",
        ) as proc:
            async with httpx.AsyncClient(timeout=60) as client, anyio.create_task_group() as tg:
                for _ in range(2):
                    await client.post(proc.url + "/v1/chat/completions", json=CHAT)

                async def held() -> None:
                    headers = {"x-sim-fault": "stall:for=60", "x-request-id": "held-1"}
                    with contextlib.suppress(httpx.HTTPError):  # cut when the tap stops
                        async with client.stream(
                            "POST", proc.url + "/v1/chat/completions", json=CHAT, headers=headers
                        ) as r:
                            async for _ in r.aiter_bytes():
                                pass

                tg.start_soon(held)
                with anyio.fail_after(10):
                    while True:
                        status = (await client.get(f"http://127.0.0.1:{admin}/status")).json()
                        conns = status["connections"]
                        stalled = (
                            conns and conns[0]["in_flight"] and conns[0]["in_flight"][0]["stalled"]
                        )
                        engines = status["engines"]
                        busy = engines and engines[0]["running"] == 1
                        if stalled and busy and status["recent"]:
                            break
                        await anyio.sleep(0.05)
                yield proc, admin, engine_url
                tg.cancel_scope.cancel()


async def _top(*args: str) -> tuple[int, str, str]:
    result = await anyio.run_process(
        [sys.executable, "-m", "tracer", "top", *args], check=False, env=_env()
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return env | {"TERM": "xterm-256color"}


def _line(text: str, needle: str) -> str:
    lines = [line for line in text.splitlines() if needle in line]
    assert lines, f"no line with {needle!r} in:\n{text}"
    return lines[0]


def _seconds(cell: str) -> float:
    value = re.fullmatch(r"(?:(\d+)m)?(\d+(?:\.\d)?)s", cell)
    assert value, cell
    return int(value.group(1) or 0) * 60 + float(value.group(2))


async def test_once_shows_the_connection_the_request_in_flight_and_the_stall() -> None:
    async with tap_with_a_stall() as (_, admin, engine_url):
        code, out, err = await _top("--admin", f"127.0.0.1:{admin}", "--once")
        # stdout is a pipe here: without --once it prints one snapshot too
        piped, out2, _ = await _top("--admin", f"http://127.0.0.1:{admin}")
    assert code == 0, err
    assert piped == 0 and "requests in flight (1)" in out2
    assert "\x1b[" not in out, "plain text: no escape sequences"
    assert out.startswith("tracer top · tap front -> http://127.0.0.1:")
    assert "STALLED 1" in _line(out, "connections 1 open")

    # the request in flight: connection 1, 3rd on it, its age, time since its last byte
    row = _line(out, "held-1").split()
    assert row[:4] == ["1", "3", "POST", "/v1/chat/completions"]
    assert "STALLED" in row and "(upstream_silent)" in row
    age, last = _seconds(row[6]), _seconds(row[7])
    assert row[8] == "ago"
    assert age >= 0.5 and 0.5 <= last <= age + 0.1

    # the connection: 3 requests served on it, reused twice, busy now
    conn = next(
        line.split() for line in out.splitlines() if re.match(r"\s*1\s+127\.0\.0\.1:\d+\s", line)
    )
    assert conn[3:6] == ["3", "2x", "active"]

    # the stall among the recent findings, and the engine's own load
    assert re.search(r"ago\s+stall\s+conn 1 #3\s+upstream_silent", out), out
    engine = _line(out, f"{engine_url}/metrics").split()
    assert engine[1] == "sglang" and engine[2] == "1" and engine[3] == "0"  # running, queued


async def test_top_without_a_tap_says_so_and_exits_1() -> None:
    port = await _free_port()
    code, out, err = await _top("--admin", f"127.0.0.1:{port}", "--once")
    assert code == 1 and out == ""
    assert f"cannot read http://127.0.0.1:{port}/status" in err


async def test_bad_options_are_usage_errors() -> None:
    for args, needle in (
        (["--interval", "0"], "--interval"),
        (["--admin", "nonsense"], "HOST:PORT"),
        (["--admin", "https://x:1"], "--admin"),
    ):
        code, _, err = await _top(*args)
        assert code == 2 and needle in err, (args, err)


# ---- in a terminal --------------------------------------------------------------------


def _read_some(fd: int, timeout: float) -> bytes:
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return b""
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: the other side closed
        return b""


async def _wait_for(fd: int, seen: bytearray, needle: bytes, timeout: float = 10) -> None:
    with anyio.fail_after(timeout):
        while needle not in seen:
            seen += await anyio.to_thread.run_sync(_read_some, fd, 0.1)


@asynccontextmanager
async def top_in_a_terminal(admin: int) -> AsyncIterator[tuple[Any, int, bytearray]]:
    """``tracer top`` on a pseudo-terminal; on exit, checks the terminal was put back."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    before = termios.tcgetattr(slave)
    cmd = [sys.executable, "-m", "tracer", "top", "--admin", f"127.0.0.1:{admin}"]
    cmd += ["--interval", "0.2"]
    process = await anyio.open_process(cmd, stdin=slave, stdout=slave, stderr=slave, env=_env())
    try:
        yield process, master, bytearray()
        assert process.returncode is not None
        assert termios.tcgetattr(slave) == before, "the terminal was left in cbreak mode"
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.CancelScope(shield=True):
            await process.aclose()
        os.close(slave)
        os.close(master)


async def test_live_view_refreshes_in_place_and_quits_on_q_or_ctrl_c() -> None:
    async with tap_with_a_stall() as (_, admin, _):
        async with top_in_a_terminal(admin) as (process, master, seen):
            await _wait_for(master, seen, b"q quits")
            await _wait_for(master, seen, b"STALLED")
            # a redraw: the cursor moves up over the previous view rather than scrolling
            before = seen.count(b"q quits")
            with anyio.fail_after(10):
                while seen.count(b"q quits") < before + 2:
                    seen += await anyio.to_thread.run_sync(_read_some, master, 0.1)
            assert b"\x1b[1A" in seen or b"\x1b[2K" in seen
            os.write(master, b"q")
            with anyio.fail_after(10):
                assert await process.wait() == 0
        async with top_in_a_terminal(admin) as (process, master, seen):
            await _wait_for(master, seen, b"q quits")
            process.send_signal(signal.SIGINT)
            with anyio.fail_after(10):
                assert await process.wait() == 0
            assert b"Traceback" not in seen + await anyio.to_thread.run_sync(
                _read_some, master, 0.1
            )


async def test_live_view_exits_1_when_the_tap_goes_away() -> None:
    async with tap_with_a_stall() as (proc, admin, _):
        async with top_in_a_terminal(admin) as (process, master, seen):
            await _wait_for(master, seen, b"q quits")
            proc.process.terminate()
            await _wait_for(master, seen, f"the tap went away (http://127.0.0.1:{admin}".encode())
            with anyio.fail_after(10):
                assert await process.wait() == 1


# ---- rendering is a pure function of /status ------------------------------------------

RECORDED = json.loads(
    """{
 "tap": "front", "upstream": "http://127.0.0.1:30000", "uptime": 3725.5,
 "connections": [
  {"conn": 7, "peer": "[::1]:51234", "age": 12.5, "requests": 4, "idle": 0.0,
   "in_flight": [{"seq": 4, "method": "POST", "status": 200, "events": 12,
     "response_bytes": 5120, "stalled": "upstream_silent", "age": 9.25,
     "last_byte_age": 8.0, "request": "POST /v1/chat/completions",
     "request_id": "[rid-9]"}],
   "bytes_from_client": 4096, "bytes_from_upstream": 20480},
  {"conn": 3, "peer": "127.0.0.1:40000", "age": 65.0, "requests": 1, "idle": 30.5,
   "in_flight": [], "bytes_from_client": 900, "bytes_from_upstream": 3000},
  {"conn": 9, "peer": "127.0.0.1:40002", "age": 2.0, "requests": 1, "idle": 0.0,
   "in_flight": [{"seq": 1, "method": "POST", "status": null, "events": 0,
     "response_bytes": 0, "stalled": null, "age": 0.4, "last_byte_age": 0.4,
     "request": "POST /v1/completions", "request_id": null}],
   "bytes_from_client": 300, "bytes_from_upstream": 0}
 ],
 "stall_after": 5.0,
 "totals": {"connections": 9, "connections_open": 3, "requests": 20, "in_flight": 2,
   "stalls_active": 1, "terminations": {"complete": 17, "truncated": 1},
   "stalls": {"upstream_silent": 2}, "anomalies": 0, "upstream_connect_failures": 0},
 "engines": [{"url": "http://10.0.0.5:30000/metrics", "profile": "sglang", "ok": true,
   "age": 0.3, "error": null, "running": 53, "queued": 4, "token_usage": 0.81,
   "gen_throughput": 1900.0, "in_flight": null, "tokens_per_s": 2012.5}],
 "recent": [
  {"age": 4.0, "kind": "stall", "conn": 7, "seq": 4,
   "detail": "upstream_silent, no bytes for 5.0s"},
  {"age": 50.0, "kind": "truncated", "conn": 2, "seq": 3,
   "detail": "HTTP 200, 812 bytes after 1.2s (reset)"},
  {"age": 70.0, "kind": "mark", "conn": null, "seq": null, "detail": "[harness stuck]"}
 ]
}"""
)


def test_render_from_a_recorded_status_is_deterministic() -> None:
    text = render_text(RECORDED, width=140)
    assert render_text(json.loads(json.dumps(RECORDED)), width=140) == text
    assert text.splitlines()[0] == (
        "tracer top · tap front -> http://127.0.0.1:30000 · up 1h02m · stall after 5.0s"
    )
    assert "connections 3 open / 9 total · requests 20 · in flight 2 · STALLED 1" in text
    # brackets are text, not markup: the peer, the request id, the mark's note
    assert "[::1]:51234" in text and "[rid-9]" in text and "[harness stuck]" in text
    stalled = _line(text, "[rid-9]").split()
    assert stalled[:2] == ["7", "4"] and stalled[6:9] == ["9.2s", "8.0s", "ago"]
    assert "STALLED" in stalled
    assert _line(text, "/v1/completions").split()[-3:] == ["waiting", "for", "head"]
    engine = _line(text, "10.0.0.5").split()
    assert engine[2:6] == ["53", "4", "81%", "2012.5"]
    idle = _line(text, "127.0.0.1:40000").split()
    assert idle[3:7] == ["1", "0x", "idle", "30.5s"]
    # the busiest first: stalled before waiting; active connections before idle ones
    assert text.index("[rid-9]") < text.index("/v1/completions")
    assert text.index("[::1]:51234") < text.index("127.0.0.1:40000")
    assert re.search(r"4\.0s ago\s+stall\s+conn 7 #4", text)
    assert re.search(r"50\.0s ago\s+truncated\s+conn 2 #3", text)

    # in colour too, the same document draws the same view
    def coloured() -> str:
        out = io.StringIO()
        Console(file=out, width=140, force_terminal=True, color_system="truecolor").print(
            render(RECORDED)
        )
        return out.getvalue()

    assert coloured() == coloured() and "\x1b[" in coloured()


def test_render_caps_long_tables_and_copes_with_an_empty_tap() -> None:
    text = render_text(RECORDED, limit=1)
    assert "... and 2 more" in text  # connections: 3, one shown
    assert "... and 1 more" in text  # in flight: 2, one shown
    empty = render_text({"tap": "t", "upstream": "http://u:1", "uptime": 1, "connections": []})
    assert "requests in flight: none" in empty and "connections: none open" in empty
    assert "recent findings: none" in empty


def test_a_tap_injecting_faults_says_so_on_top() -> None:
    faults = {"faults": ["status:503@every=2"], "control": True, "injected": {"status": 3}}
    status = {"tap": "t", "upstream": "http://u:1", "uptime": 1, "connections": []}
    recent = [{"age": 2.0, "kind": "fault_plan", "detail": "replace: status:503@every=2"}]
    text = render_text({**status, "faults": faults, "recent": recent}, width=140)
    assert text.splitlines()[0].endswith("· injecting status:503@every=2")
    assert re.search(r"2\.0s ago\s+fault_plan\s+replace: status:503@every=2", text)
    assert "injecting" not in render_text({**status, "faults": {"faults": []}}, width=140)


def test_status_url() -> None:
    assert status_url("127.0.0.1:9100") == "http://127.0.0.1:9100/status"
    assert status_url("http://localhost:9100/") == "http://localhost:9100/status"
    assert status_url("[::1]:9100") == "http://[::1]:9100/status"
    with pytest.raises(ValueError):
        status_url("9100")
