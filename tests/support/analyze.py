"""``tracer analyze CAPTURE... --format json``, parsed.

The command's ``main`` runs in the test's own process: a process per analysis cost the
suite about 0.8 s of CPU each (interpreter and imports) and tested nothing more, the
command line as users run it being tested by the CLI tests (``test_cli_*``,
``test_readme``), which start real ``tracer`` processes."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from tracer.cli import commands


def _argv(args: tuple[Path | str, ...]) -> list[str]:
    return ["analyze", *map(str, args), "--format", "json"]


def analyze_json(*args: Path | str) -> dict[str, Any]:
    """The captures (and options) analysed as ``tracer analyze`` does; it must exit 0."""
    return analyze_here(*args)


async def analyze_async(*args: Path | str) -> dict[str, Any]:
    """:func:`analyze_json` for async tests (the loop waits: the servers have stopped)."""
    return analyze_here(*args)


def analyze_here(*args: Path | str) -> dict[str, Any]:
    """The same command's ``main`` called in this process (no process, no socket)."""
    out = io.StringIO()
    with redirect_stdout(out):
        code = commands.main(_argv(args))
    assert code == 0, code
    return dict(json.loads(out.getvalue()))
