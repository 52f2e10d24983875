"""The simulated engine's fault specs, parsed."""

from __future__ import annotations

import pytest

from tracer.sim.engine import Fault, parse_fault

# ---- faults ----------------------------------------------------------------------------


def test_fault_specs() -> None:
    assert parse_fault("stall:after=3:for=10") == Fault("stall", after=3, seconds=10.0)
    assert parse_fault("stall:3:10") == Fault("stall", after=3, seconds=10.0)
    f = parse_fault("reset:after=0@every=5,from=10")
    assert f.after == 0 and f.every == 5 and f.start == 10
    assert [n for n in range(1, 31) if f.matches(n)] == [10, 15, 20, 25, 30]
    assert [n for n in range(1, 5) if parse_fault("lost@nth=2").matches(n)] == [2]
    assert str(parse_fault("wedge:for=2")) == "wedge:after=1:for=2"
    assert str(f) == "reset:after=0@every=5,from=10"
    for bad in ("nope", "stall:after", "stall:after=-1", "stall:x=1", "lost@every=0", "500:for=x"):
        with pytest.raises(ValueError):
            parse_fault(bad)
    with pytest.raises(ValueError, match="nth=2 is a rule: write lost@nth=2"):
        parse_fault("lost:nth=2")  # the former spelling
