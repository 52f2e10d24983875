"""The bench reads the host's steal per core, and its timing checks say when the host
took the proxy's core (direct does not use it: its timings are not late by it)."""

from __future__ import annotations

from typing import Any

from bench.procs import steal_seconds
from bench.report import checks


def test_steal_is_read_per_core() -> None:
    assert steal_seconds(0) >= 0.0
    assert steal_seconds(10_000) == 0.0  # no such core: nothing stolen, nothing raised


def _paced(steal: float) -> dict[str, Any]:
    tracer = {"gap_p99": 3.0e-3, "zero_gap": 0.002, "ttfe_added_p50": 80e-6}
    tracer["steal_proxy_util"] = steal
    direct = {"gap_p99": 2.8e-3, "zero_gap": 0.0, "ttfe_added_p50": 0.0}
    return {"paced-c16": {"values": {"tracer": tracer, "direct": direct}}}


def test_a_timing_check_says_when_the_host_took_the_proxy_core() -> None:
    def timing(agg: dict[str, Any]) -> list[Any]:
        return [c for c in checks(agg) if "coalescing" in c.name or "first event" in c.name]

    stolen, quiet = timing(_paced(0.2)), timing(_paced(0.01))
    assert len(stolen) == len(quiet) == 2
    assert all("steal" in c.detail and "20%" in c.detail for c in stolen)
    assert not any("steal" in c.detail for c in quiet)
    assert [c.status for c in stolen] == [c.status for c in quiet] == ["PASS", "PASS"]
