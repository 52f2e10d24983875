"""The multi-round harness (openai SDK) against the simulated engine, in-process and as a CLI."""

from __future__ import annotations

import re
import sys

import anyio
import pytest

from tests.support.engine import engine_running
from tracer.sim.engine import parse_fault
from tracer.sim.harness import HarnessConfig, run_harness

pytestmark = pytest.mark.anyio


async def test_rounds_complete_and_reuse_the_connection() -> None:
    async with engine_running(ttft=0.0, itl=0.001) as engine:
        report = await run_harness(
            HarnessConfig(base_url=engine.url, sessions=2, rounds=3, think=0.05, max_tokens=4)
        )
    assert [r.outcome for r in report.rounds] == ["complete"] * 6
    assert not report.failed and report.not_run == 0
    assert all(r.ttft is not None and r.chunks == 6 for r in report.rounds)  # role+4+finish
    assert engine.connections == 2  # one keep-alive connection per session
    assert engine.completions == 6


@pytest.mark.parametrize(
    ("spec", "outcome"),
    [
        ("close:after=2@nth=2", "truncated"),
        ("error:after=1@nth=2", "error"),
        ("500@nth=2", "error"),
    ],
)
async def test_a_failed_round_is_reported_and_ends_its_session(spec: str, outcome: str) -> None:
    async with engine_running(ttft=0.0, itl=0.001, faults=[parse_fault(spec)]) as engine:
        report = await run_harness(
            HarnessConfig(base_url=engine.url, sessions=1, rounds=3, think=0.0, max_tokens=4)
        )
    assert [r.outcome for r in report.rounds] == ["complete", outcome]
    assert report.failed[0].error and report.not_run == 1


async def _harness_cli(url: str, *extra: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "tracer.sim.cli", "harness", "--target", url]
    cmd += ["--sessions", "2", "--rounds", "2", "--think", "0.05", "--max-tokens", "3", *extra]
    with anyio.fail_after(15):
        result = await anyio.run_process(cmd, check=False)
    return result.returncode, result.stdout.decode()


async def test_harness_cli_prints_the_round_table() -> None:
    async with engine_running(ttft=0.0, itl=0.001) as engine:
        code, out = await _harness_cli(engine.url, "--deadline", "5")
    assert code == 0, out
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s+s\d-r\d-", line)]
    assert len(rows) == 4
    for row in rows:
        *_, outcome, ttft, total, chunks = row.split()
        assert outcome == "complete" and float(ttft) <= float(total) and chunks == "5"
    assert "4/4 rounds complete" in out


async def test_harness_cli_exits_nonzero_on_a_hung_round() -> None:
    async with engine_running(ttft=0.0, itl=0.001, faults=[parse_fault("lost@nth=3")]) as engine:
        code, out = await _harness_cli(engine.url, "--deadline", "1")
        assert engine.lost == 0  # the harness gave up and closed the connection
    assert code == 1, out
    assert re.search(r"\s+\d+\s+2\s+s\d-r2-\w+\s+hung\s+-", out), out
    assert "NOT COMPLETE" in out and "hung: no complete answer after 1s" in out
    assert "3/4 rounds complete" in out
