"""The README's quick start, run for real as a newcomer runs it: its ``tracer proxy`` line
in front of a simulated engine (standing in for the router), the openai SDK pointed at the
README's ``base_url``, SIGTERM, then its ``tracer report``/``analyze``/``info`` lines.
The commands are read from the fenced blocks of the README's ``## Quick start`` section;
only addresses are substituted (the tap's port, ``ROUTER:PORT``, ``ENGINE:PORT``), and
relative files land in ``tmp_path`` (the commands run there)."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import openai
import pytest
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from tests.support.docs import (
    README,
    argv,
    command_lines,
    fenced_blocks,
    section,
    substitute,
)
from tracer.capture.files import read_records
from tracer.sim.engine import EngineConfig, SimEngine

TAP_ADDRESS = "127.0.0.1:8080"  # where the quick start's tap listens; a free port here


ROUNDS = 3


def tracer_command() -> list[str]:
    """``tracer`` as installed beside this interpreter (pyproject's [project.scripts])."""
    script = Path(sys.executable).with_name("tracer")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tracer"]


# ---- the quick start, run ----------------------------------------------------------------


@asynccontextmanager
async def started(command: list[str], cwd: Path) -> AsyncIterator[tuple[Process, int, list[str]]]:
    """A ``tracer proxy`` process, once it says where it listens; killed if still running."""
    process = await anyio.open_process(
        command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    assert process.stderr is not None
    reader = BufferedByteReceiveStream(process.stderr)
    lines: list[str] = []
    try:
        with anyio.fail_after(15):
            while True:
                try:
                    line = (await reader.receive_until(b"\n", 1 << 20)).decode()
                except (anyio.EndOfStream, anyio.IncompleteRead):
                    pytest.fail("tracer proxy exited before listening:\n" + "".join(lines))
                lines.append(line + "\n")
                found = re.match(r"tracer proxy: listening on 127\.0\.0\.1:(\d+)", line)
                if found:
                    break
        async with anyio.create_task_group() as tg:

            async def drain() -> None:  # its log must never fill the pipe
                try:
                    while True:
                        lines.append((await reader.receive_until(b"\n", 1 << 20)).decode() + "\n")
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
                    return

            tg.start_soon(drain)
            yield process, int(found.group(1)), lines
            tg.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.CancelScope(shield=True):
            await process.aclose()


async def chat_rounds(base_url: str) -> int:
    """A few streaming rounds through one client, as an agent harness sends them."""
    completed = 0
    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="sk-readme-test", max_retries=0, timeout=10
    ) as client:
        for n in range(ROUNDS):
            stream = await client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": f"round {n + 1}"}],
                max_tokens=4,
                stream=True,
            )
            finish = None
            async for chunk in stream:
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
            completed += finish is not None
    return completed


@pytest.mark.anyio
async def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    quick = section(README.read_text(), "Quick start")
    commands = [argv(line) for block in fenced_blocks(quick) for line in command_lines(block)]
    proxy = next(c for c in commands if c[1] == "proxy")
    after = [c for c in commands if c[1] != "proxy"]
    base_url = re.search(r'base_url="([^"]+)"', quick)
    assert base_url and TAP_ADDRESS in base_url.group(1), "the client goes to the tap"
    assert TAP_ADDRESS in proxy

    engine = SimEngine(EngineConfig(tokens=4, ttft=0.0, itl=0.001))
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(engine.serve)
        router = f"{host}:{port}"  # the simulated engine stands in for the router
        subs = {TAP_ADDRESS: "127.0.0.1:0", "ROUTER:PORT": router, "ENGINE:PORT": router}
        run = tracer_command() + substitute(proxy, subs)[1:]
        assert not re.search(r"[A-Z]+:PORT", " ".join(run)), run
        async with started(run, tmp_path) as (process, tap_port, log):
            url = base_url.group(1).replace(TAP_ADDRESS, f"127.0.0.1:{tap_port}")
            assert await chat_rounds(url) == ROUNDS
            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                code = await process.wait()
        tg.cancel_scope.cancel()
    assert code == 0, "".join(log)

    outputs: dict[str, str] = {}
    for words in after:
        done = await anyio.run_process(
            tracer_command() + substitute(words, subs)[1:], cwd=tmp_path, check=False
        )
        out, err = done.stdout.decode(), done.stderr.decode()
        assert done.returncode == 0, f"{shlex.join(words)}: exit {done.returncode}\n{err}"
        outputs[words[1]] = out

    capture = tmp_path / "front.jsonl"
    records = list(read_records(capture))
    types = [r["type"] for r in records]
    assert types.count("request") == ROUNDS and types.count("response_end") == ROUNDS
    assert "engine" in types, "--engine-metrics recorded the engine's figures"
    assert types[-1] == "capture_end"

    report = tmp_path / "incident.md"
    assert report.exists() and (tmp_path / "incident-timeline.svg").exists()
    verdict = re.search(r"^\*\*Verdict: (\w+) — `(\w+)`\*\*", report.read_text(), re.M)
    assert verdict, report.read_text()[:500]
    brief = re.search(r"^VERDICT: (\w+) — (\w+)", outputs["analyze"], re.M)
    assert brief and brief.groups() == verdict.groups(), outputs["analyze"]
    assert "cleanly" in outputs["info"] and "request" in outputs["info"], outputs["info"]
