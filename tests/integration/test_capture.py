"""A damaged capture (records lost, a bad line, no end) read by ``tracer analyze`` as a
process: caveats beside the verdict, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.captures import open_event, start_event
from tracer import events as ev


def test_losses_a_missing_end_and_bad_lines_are_the_verdicts_caveats(tmp_path: Path) -> None:
    """A capture with records lost, a line that cannot be read and no capture_end (its
    tap killed): the analysis says so beside its verdict, and never gives a high-confidence
    all-clear over it."""
    import subprocess
    import sys

    path = tmp_path / "killed.jsonl"
    loss = ev.CaptureLoss(t=3.0, m=3.0, tap="t", dropped=40, dropped_bytes=9000, reason="ENOSPC")
    body = [start_event().to_record(), open_event(1).to_record(), loss.to_record()]
    path.write_text("".join(json.dumps(r) + "\n" for r in body) + "{torn\n")
    done = subprocess.run(
        [sys.executable, "-m", "tracer", "analyze", str(path), "--format", "json"],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    verdict = json.loads(done.stdout)["verdict"]
    assert verdict["kind"] == "healthy" and verdict["confidence"] == "low"
    caveats = {c["kind"]: c for c in verdict["caveats"]}
    assert caveats["records_lost"]["count"] == 40
    assert (
        caveats["bad_lines"]["count"] == 1 and caveats["bad_lines"]["first"] == "line 4: not JSON"
    )
    assert caveats["no_capture_end"]["tap"] == "t"
    text = subprocess.run(
        [sys.executable, "-m", "tracer", "analyze", str(path)], capture_output=True, timeout=60
    )
    assert b"caveat: " in text.stdout and b"Traceback" not in text.stderr
