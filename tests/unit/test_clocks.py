"""Taps whose wall clocks disagree: the offset is bounded from the requests both answered
(the one behind sees each request later and its end earlier), printed with its bounds,
and applied, so that the analysis reads as if the clocks agreed."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_findings import ROUTER, Cap, analyze
from tracer import events as ev
from tracer.analysis.findings.clocks import Clocks, PairClock, clocks_to_apply
from tracer.analysis.summary import Summary

SKEW = 3.25  # the tap behind's clock is this far ahead


def _chain(skew: float) -> tuple[Cap, Cap]:
    """Ten requests through a hop: 2 ms to reach the tap behind, 3 ms back; the third
    from last hangs between the taps (the front tap saw it, the one behind never did)."""
    front = Cap("front")
    back = Cap("back", upstream=ROUTER, t0=1000.0 + skew)
    for i in range(10):
        start = 1.0 + i * 0.5
        front.exchange(i + 1, 1, start, rid=f"r{i}", duration=0.105)
        back.exchange(i + 1, 1, start + 0.002, rid=f"r{i}", duration=0.100)
    front.exchange(11, 1, 7.0, rid="lost", end=None)
    front.stall(11, 1, 7.0, None)
    return front, back


def _twice(*caps: Cap) -> dict[str, Any]:
    """As ``tracer analyze`` does: a second pass with the offsets the first measured."""
    first = analyze(*caps)
    clocks = clocks_to_apply(first)
    if clocks is None:
        return first
    summary = Summary(clocks=clocks)
    for cap in caps:
        for e in cap.events:
            summary.feed(e)
    return summary.result()


@pytest.mark.parametrize("skew", [SKEW, -SKEW])
def test_the_offset_is_bracketed_and_applied(skew: float) -> None:
    result = _twice(*_chain(skew))
    [pair] = result["clocks"]["pairs"]
    assert (pair["from"], pair["to"], pair["requests"]) == ("front", "back", 10)
    assert pair["low"] <= skew <= pair["high"] and pair["high"] - pair["low"] < 0.01
    assert result["clocks"]["applied"] == {"back": pytest.approx(skew, abs=0.005)}
    [residual] = result["clocks"]["residual"]
    assert residual["low"] <= 0 <= residual["high"] and not residual["skewed"]


@pytest.mark.parametrize("skew", [SKEW, -SKEW])
def test_the_verdict_with_skewed_clocks_is_the_unskewed_runs(skew: float) -> None:
    """A clock behind puts the tap behind in front by time: without the offset, the
    lost request would read as the engine's silence at the front (upstream_silent)."""
    skewed, same = _twice(*_chain(skew)), _twice(*_chain(0.0))
    assert same["verdict"]["kind"] == "proxy_swallowed_request"
    assert same["clocks"]["applied"] == {}
    for key in ("party", "kind", "confidence"):
        assert skewed["verdict"][key] == same["verdict"][key]
    assert [(f["kind"], f["requests"]) for f in skewed["findings"]] == [
        (f["kind"], f["requests"]) for f in same["findings"]
    ]
    back = {r["id"]: r for r in skewed["requests"]}["back/1/1"]
    assert back["start"] == pytest.approx(1001.002, abs=0.005)  # on the front tap's clock


def test_bounds_under_either_order_and_when_they_contradict() -> None:
    clock = PairClock()
    clock.add(10.0, 11.0, 13.002, 13.997)  # b behind a, 3 s ahead
    est = clock.estimate("a", "b")
    assert est is not None and (est["from"], est["to"]) == ("a", "b")
    assert est["low"] == pytest.approx(2.997) and est["high"] == pytest.approx(3.002)
    clock = PairClock()
    clock.add(13.002, 13.997, 10.0, 11.0)  # now a is behind b
    est = clock.estimate("a", "b")
    assert est is not None and (est["from"], est["to"]) == ("b", "a")
    assert est["low"] == pytest.approx(2.997) and est["high"] == pytest.approx(3.002)
    clock.add(10.0, 14.0, 20.0, 20.5)  # a request that cannot be: the bounds cross
    est = clock.estimate("a", "b")
    assert est is not None and not est["consistent"] and not est["skewed"]
    assert Clocks().to_json([]) == {"pairs": [], "applied": {}, "residual": []}


def test_a_clock_that_stepped_mid_capture_is_said_and_not_applied() -> None:
    """The tap behind's clock steps 3 s forward halfway: no one offset fits both halves;
    nothing is applied, a caveat says so and the verdict is at most medium."""
    front, back = _chain(0.0)
    seen = 0
    for e in back.events:
        if isinstance(e, ev.RequestHead):
            seen += 1
        if seen > 5:
            e.t += 3.0
    result = _twice(front, back)
    [pair] = result["clocks"]["pairs"]
    assert not pair["consistent"] and result["clocks"]["applied"] == {}
    [caveat] = [c for c in result["verdict"]["caveats"] if c["kind"] == "clocks_disagree"]
    assert caveat["taps"] == ["front", "back"] and caveat["low"] > caveat["high"]
    assert result["verdict"]["confidence"] != "high"


def test_taps_put_on_one_clock_are_still_said_to_have_two() -> None:
    """After the offset is applied, the pair's one_clock still says what the headers say:
    two clocks (the join's slack and every rule that trusts one clock stay off)."""
    front, back = _chain(SKEW)
    for cap, wall in ((front, 0.0), (back, SKEW)):
        start = cap.events[0]
        assert isinstance(start, ev.CaptureStart)
        start.boot_id = "boot-a"  # one machine's boot, its wall clock stepped in between
        start.m = start.t - wall
    result = _twice(front, back)
    assert result["clocks"]["applied"]
    [pair] = result["evidence"]["tap_pairs"]
    assert pair["one_clock"] is False
