"""`tracer top`: a live view of a running tap, as a real process, in a pipe and in a pty."""

from __future__ import annotations

import contextlib
import fcntl
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

from tests.support.engine import engine_running
from tests.support.procs import Proc, tracer_proxy
from tests.support.text import line_with

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
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            engine_url,
            "--admin",
            "127.0.0.1:0",
            "--engine-metrics",
            f"{engine_url}/metrics",
            "--metrics-interval",
            "0.2",
            "--stall-after",
            "0.5",
            "--tap",
            "front",
        ) as proc:
            assert proc.admin_port is not None
            admin = proc.admin_port
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
    assert "STALLED 1" in line_with(out, "connections 1 open")

    # the request in flight: connection 1, 3rd on it, its age, time since its last byte
    row = line_with(out, "held-1").split()
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
    engine = line_with(out, f"{engine_url}/metrics").split()
    assert engine[1] == "sglang" and engine[2] == "1" and engine[3] == "0"  # running, queued


async def test_top_without_a_tap_says_so_and_exits_1(refused_port: int) -> None:
    port = refused_port
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
