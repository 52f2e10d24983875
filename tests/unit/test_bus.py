"""The event bus: a sink that raises is switched off alone; the sender never sees it.
(A tap whose sink raises: tests/integration/test_bus.py.)"""

from __future__ import annotations

from tracer import events as ev
from tracer.bus import EventBus


def _event(n: int) -> ev.Event:
    return ev.ConnOpen(t=float(n), m=float(n), tap="t", conn=n, peer="p", local="l")


def test_a_sink_that_raises_is_switched_off_and_the_others_go_on() -> None:
    bus = EventBus()
    got: list[int] = []
    calls = {"bad": 0}

    def bad(event: ev.Event) -> None:
        calls["bad"] += 1
        raise RuntimeError("broken sink")

    bus.add("first", lambda e: got.append(1))
    bus.add("bad", bad)
    bus.add("last", lambda e: got.append(3))
    for n in range(3):
        bus.publish(_event(n))  # never raises
    assert got == [1, 3, 1, 3, 1, 3] and calls["bad"] == 1
    assert bus.names == ["first", "last"] and "RuntimeError: broken sink" in bus.disabled["bad"]
