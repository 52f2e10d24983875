"""`tracer demo`, as `make demo` runs it: real processes, the verdict, the files it leaves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tracer.tools.demo import smg_path

DEMO_TIMEOUT = 150  # under a minute on an idle 2-core machine; CI machines are loaded


def demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tracer", "demo", "--out", str(tmp_path / "out"), *args],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT,
        check=False,
    )


@pytest.mark.timeout(DEMO_TIMEOUT + 10)
@pytest.mark.skipif(smg_path() is None, reason="smg (sglang-router) is not installed")
def test_the_incident_demo(tmp_path: Path) -> None:
    done = demo(tmp_path)
    out = tmp_path / "out"
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    assert "router smg" in text
    assert "VERDICT: proxy — proxy_hung_on_reuse (high confidence)" in text
    assert "ruled out client" in text and "ruled out engine" in text
    assert "verdict as expected" in text
    # the differential replay: the same connections hang again, fresh ones complete
    same = next(line for line in text.splitlines() if "replay, same connections" in line)
    fresh = next(line for line in text.splitlines() if "replay, fresh connections" in line)
    assert ": reproduced" in same, same
    assert "not reproduced" in fresh and "6 complete" in fresh, fresh
    for name in ("front.jsonl", "back.jsonl", "replay-same.jsonl", "replay-fresh.jsonl"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "incident.md").read_text()
    assert "proxy_hung_on_reuse" in report
    assert "tracer replay" in report
    assert (out / "incident-timeline.svg").exists()
    doc = json.loads((out / "incident.json").read_text())
    assert doc["verdict"]["party"] == "proxy"


@pytest.mark.timeout(DEMO_TIMEOUT + 10)
def test_a_healthy_scenario_stays_clean_and_a_client_fault_is_the_client(tmp_path: Path) -> None:
    done = demo(tmp_path, "--scenario", "client-not-reading")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "VERDICT: client — client_not_reading" in done.stdout
    assert (tmp_path / "out" / "client-not-reading" / "tap.jsonl").exists()
    done = demo(tmp_path, "--scenario", "healthy")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "VERDICT: none — healthy" in done.stdout


def test_unknown_scenario_is_a_usage_error(tmp_path: Path) -> None:
    done = demo(tmp_path, "--scenario", "nope")
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr


def test_the_scenarios_listed_by_the_cli_are_the_demo_s() -> None:
    from tracer.cli.demo import DEMOS
    from tracer.tools.demo import SCENARIOS

    assert list(DEMOS) == list(SCENARIOS)
