"""`tracer demo` refuses a scenario it does not know (a usage error, exit 2)."""

from __future__ import annotations

from pathlib import Path

from tests.support.procs import tracer_demo


def test_unknown_scenario_is_a_usage_error(tmp_path: Path) -> None:
    done = tracer_demo(tmp_path / "out", "--scenario", "nope")
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr
