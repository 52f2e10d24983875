"""The relay observes a read after the loop has run the other ready callbacks
(``Tap.observe_later``): in arrival order, each with its own time, a failing observer
costing nothing but its own read, and ``drain`` settling everything at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tracer.proxy.relay import Tap, TapConfig


def _tap() -> Tap:
    return Tap(TapConfig("127.0.0.1", 0, "127.0.0.1", 9))


def test_reads_are_observed_after_the_ready_callbacks_in_arrival_order() -> None:
    seen: list[tuple[str, bytes, float]] = []

    def observer(name: str) -> Callable[[bytes, float], None]:
        return lambda data, now: seen.append((name, data, now))

    async def main() -> list[tuple[str, bytes, float]]:
        tap = _tap()
        tap.observe_later(observer("a"), b"1", 1.0, 1)
        tap.observe_later(observer("b"), b"2", 2.0, 2)
        tap.observe_later(observer("a"), b"3", 3.0, 1)
        before = list(seen)  # the forwarding callbacks return before any observation
        await asyncio.sleep(0)  # one turn of the loop
        assert before == []
        return list(seen)

    assert asyncio.run(main()) == [("a", b"1", 1.0), ("b", b"2", 2.0), ("a", b"3", 3.0)]


def test_a_failing_observer_loses_only_its_read_and_drain_settles_at_once() -> None:
    seen: list[bytes] = []

    def broken(data: bytes, now: float) -> None:
        raise ValueError("observer bug")

    async def main() -> None:
        tap = _tap()
        tap.observe_later(broken, b"x", 1.0, 1)
        tap.observe_later(lambda data, now: seen.append(data), b"y", 2.0, 2)
        tap.drain()  # what reads an observer's state calls this first
        assert seen == [b"y"]
        await asyncio.sleep(0)  # the scheduled drain finds nothing left
        assert seen == [b"y"]

    asyncio.run(main())


def test_without_a_running_loop_a_read_is_observed_at_once() -> None:
    seen: list[bytes] = []
    _tap().observe_later(lambda data, now: seen.append(data), b"z", 1.0, 1)
    assert seen == [b"z"]
