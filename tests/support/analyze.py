"""``tracer analyze CAPTURE... --format json``, parsed: as a process a user starts (blocking,
or awaited beside servers in the test's event loop), or in this process (unit tests)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import anyio

from tracer.cli import commands


def _argv(args: tuple[Path | str, ...]) -> list[str]:
    return ["analyze", *map(str, args), "--format", "json"]


def analyze_json(*args: Path | str, timeout: float = 60) -> dict[str, Any]:
    """The captures (and options) analysed by a ``tracer analyze`` process; it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", "tracer", *_argv(args)],
        capture_output=True,
        check=True,
        timeout=timeout,
    )
    return dict(json.loads(done.stdout))


async def analyze_async(*args: Path | str) -> dict[str, Any]:
    """:func:`analyze_json` awaited, for tests whose servers run in the same event loop."""
    done = await anyio.run_process([sys.executable, "-m", "tracer", *_argv(args)])
    return dict(json.loads(done.stdout))


def analyze_here(*args: Path | str) -> dict[str, Any]:
    """The same command's ``main`` called in this process (no process, no socket)."""
    out = io.StringIO()
    with redirect_stdout(out):
        code = commands.main(_argv(args))
    assert code == 0, code
    return dict(json.loads(out.getvalue()))
