"""``tracer analyze`` as a process on a capture bigger than its memory bounds: it spills
and gives what the rows in memory give, and stops quietly when its reader goes away."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.captures import IN_MEMORY, capture, fed
from tracer import events as ev
from tracer.capture.files import write_all
from tracer.present import render


def test_cli_analyze_spills_and_matches_the_in_memory_result(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    write_all(path, list(capture(3_000)))  # more rows than the default spill threshold
    done = subprocess.run(
        [sys.executable, "-m", "tracer", "analyze", str(path), "--format", "json"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    expected = io.StringIO()
    summary = fed(3_000, **IN_MEMORY)
    result: dict[str, Any] = summary.result(
        captures=[{"path": path.name, "records": summary.events, "bad_lines": 0,
                   "torn_tail": False, "bodies_unresolved": 0,
                   "version": ev.CAPTURE_VERSION}],
        raw_rows=True,
    )  # fmt: skip
    render.write_json(result, expected)
    assert done.stdout.decode() == expected.getvalue()


def test_cli_analyze_stops_quietly_when_its_reader_goes_away(tmp_path: Path) -> None:
    """`tracer analyze … | head`: a closed pipe ends it with 141 (SIGPIPE), no traceback."""
    path = tmp_path / "big.jsonl"
    write_all(path, list(capture(3_000)))  # far more JSON than a pipe holds
    with subprocess.Popen(
        [sys.executable, "-m", "tracer", "analyze", str(path), "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.read(100).startswith(b"{")
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 141 and b"Traceback" not in err
