"""Bad input that needs the network or a process: a port in use, a target that refuses,
a real process's stderr. An exit code that says what kind of failure, one line on
stderr, never a traceback, and nothing left behind by a start that failed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.captures import slow_reader_capture
from tests.support.cli import run

USAGE, RUNTIME, INPUT = 2, 1, 3


def test_a_port_in_use_is_one_line_and_the_capture_is_not_left_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], busy_port: int
) -> None:
    capture = tmp_path / "c.jsonl"
    code, err = run(
        ["proxy", "--listen", f"127.0.0.1:{busy_port}", "--upstream", "http://127.0.0.1:9",
         "--capture", str(capture), "--no-fingerprint"],
        capsys,
    )  # fmt: skip
    assert code == RUNTIME and f"cannot listen on 127.0.0.1:{busy_port}" in err
    assert "address already in use" in err and not capture.exists()
    code, err = run(
        ["proxy", "--listen", "127.0.0.1:0", "--upstream", "http://127.0.0.1:9",
         "--admin", f"127.0.0.1:{busy_port}", "--capture", str(capture)],
        capsys,
    )  # fmt: skip
    assert code == RUNTIME and "--admin" in err and not capture.exists()
    code, err = run(["sim", "engine", "--listen", f"127.0.0.1:{busy_port}"], capsys)
    assert code == RUNTIME and f"sim engine cannot listen on 127.0.0.1:{busy_port}" in err


def test_replay_against_a_target_that_refuses_fails_fast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], refused_port: int
) -> None:
    original = tmp_path / "orig.jsonl"
    slow_reader_capture(original)
    out = tmp_path / "again.jsonl"
    code, err = run(
        ["replay", str(original), "--target", f"http://127.0.0.1:{refused_port}",
         "--capture", str(out)],
        capsys,
    )  # fmt: skip
    assert code == RUNTIME and "cannot be reached" in err and "refused" in err
    assert not out.exists()


def test_no_traceback_from_a_real_process() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tracer", "proxy", "--listen", "127.0.0.1:0",
         "--upstream", "http://127.0.0.1:9", "--stall-after", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == USAGE and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[0].startswith("tracer proxy: error: argument --stall-after")
