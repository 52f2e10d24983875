"""The simulated engine in this process, its request bytes, and the real SGLang router
(``smg``) in front of simulated engines."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.abc import Process, SocketStream

from tests.support.net import free_port
from tracer.sim.engine import EngineConfig, SimEngine

SMG = Path(sys.executable).parent / "smg"


@asynccontextmanager
async def engine_running(**config: Any) -> AsyncIterator[SimEngine]:
    engine = SimEngine(EngineConfig(**config))
    async with anyio.create_task_group() as tg:
        await tg.start(engine.serve)
        yield engine
        tg.cancel_scope.cancel()


async def connect(engine: SimEngine) -> SocketStream:
    assert engine.bound is not None
    return await anyio.connect_tcp("127.0.0.1", engine.bound[1])


def chat_request(
    max_tokens: int = 4,
    *,
    stream: bool = True,
    usage: bool = True,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> bytes:
    body: dict[str, Any] = {"model": "sim-model", "max_tokens": max_tokens, "stream": stream}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hello, simulated engine"}]
    else:
        body["prompt"] = "hello, simulated engine"
    if usage and stream:
        body["stream_options"] = {"include_usage": True}
    raw = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (
        f"POST {path} HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n"
        f"content-length: {len(raw)}\r\n{extra}\r\n"
    )
    return head.encode() + raw


def split_response(data: bytes) -> tuple[int, dict[str, str], list[bytes], bool, bytes]:
    """Status, headers, the chunks of a chunked body, whether ``0\\r\\n\\r\\n`` came, the rest."""
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    chunks: list[bytes] = []
    while rest:
        size_line, sep, after = rest.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            return status, headers, chunks, after.startswith(b"\r\n"), after[2:]
        if len(after) < size + 2:
            break
        chunks.append(after[:size])
        rest = after[size + 2 :]
    return status, headers, chunks, False, rest


def events_of(chunks: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for chunk in chunks:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n"), chunk
        assert chunk.count(b"\n\n") == 1, "one SSE event per chunk"
        payload = chunk[6:-2]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def complete(data: bytes) -> bool:
    return b"\r\n0\r\n\r\n" in data or data.startswith(b"0\r\n\r\n")


@dataclass
class Smg:
    url: str
    metrics: str  # its Prometheus port's /metrics
    log: Path
    ready: bool  # /readiness said 200 before the deadline


async def _launch_smg(
    tmp_path: Path, args: tuple[str, ...], deadline: float
) -> tuple[Process, Smg]:
    port, prom = free_port(), free_port()  # smg must be told its ports
    log_path = tmp_path / f"smg-{port}.log"
    cmd = [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port), *args]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--log-level", "warn"]
    # a worker check that fails at start (a loaded machine) is tried again in 1 s, not 30
    cmd += ["--worker-startup-check-interval", "1"]
    with log_path.open("wb") as log_file:
        process = await anyio.open_process(cmd, stdin=None, stdout=log_file, stderr=log_file)
    url = f"http://127.0.0.1:{port}"
    ready = False
    async with httpx.AsyncClient(timeout=2) as c:
        with anyio.move_on_after(deadline):
            while process.returncode is None:
                try:
                    if (await c.get(url + "/readiness")).status_code == 200:
                        ready = True
                        break
                except httpx.HTTPError:
                    pass
                await anyio.sleep(0.1)  # (polls with a deadline)
    return process, Smg(url, f"http://127.0.0.1:{prom}/metrics", log_path, ready)


async def _stop(process: Process) -> None:
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            os.kill(process.pid, signal.SIGTERM)
            with anyio.move_on_after(5):
                await process.wait()
        if process.returncode is None:
            process.kill()
        await process.aclose()


@asynccontextmanager
async def smg_router(tmp_path: Path, *args: str, deadline: float = 20) -> AsyncIterator[Smg]:
    """``smg launch ARGS`` as a subprocess on loopback; yields once /readiness answers 200
    or the deadline passed (``ready`` says which); ends it with SIGTERM. One that exits at
    once (a port taken since :func:`free_port` chose it) is launched again, twice at most."""
    for attempt in range(3):
        process, smg = await _launch_smg(tmp_path, args, deadline)
        if smg.ready or process.returncode is None or attempt == 2:
            break
        await _stop(process)
    try:
        yield smg
    finally:
        await _stop(process)


@asynccontextmanager
async def router(tmp_path: Path, *workers: str) -> AsyncIterator[tuple[str, str]]:
    """The router, round robin over ``workers``, ready; yields (its URL, its metrics URL)."""
    args = ("--worker-urls", *workers, "--policy", "round_robin")
    async with smg_router(tmp_path, *args) as smg:
        assert smg.ready, smg.log.read_text(errors="replace")
        yield smg.url, smg.metrics
