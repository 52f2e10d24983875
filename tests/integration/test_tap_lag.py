"""The tap measures its own event-loop lag: a blocked loop leaves a `tap_lag` record."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest

from tests.support.net import wait_until
from tests.support.tap import running_tap
from tracer import events as ev

pytestmark = pytest.mark.anyio

BLOCK = 0.4  # seconds the test blocks the tap's loop


async def test_a_blocked_loop_is_recorded(tmp_path: Path) -> None:
    # stall_after 0.2: the tick runs every 0.05 s, so a 0.4 s block delays one by >= 0.35 s
    async with running_tap(9, tmp_path, stall_after=0.2) as h:
        asyncio.get_running_loop().call_soon(time.sleep, BLOCK)  # the tap's own loop
        await wait_until(lambda: any(x.max_lag >= BLOCK / 2 for x in h.of(ev.TapLag)), 10)
        lag = next(x for x in h.of(ev.TapLag) if x.max_lag >= BLOCK / 2)
    assert lag.late_ticks >= 1 and lag.ticks >= lag.late_ticks
    assert lag.threshold == 0.02 and lag.interval == 0.05
    assert lag.window_start <= lag.max_lag_at - lag.max_lag < lag.max_lag_at <= lag.m
    in_capture = [e.to_record() for e in h.events() if isinstance(e, ev.TapLag)]
    assert lag.to_record() in in_capture


async def test_at_most_one_record_a_window(tmp_path: Path) -> None:
    async with running_tap(9, tmp_path, stall_after=0.2) as h:
        loop = asyncio.get_running_loop()
        # five blocks of 0.1 s, 0.2 s apart: each makes a tick (every 0.05 s) >= 0.05 s late
        for i in range(5):
            loop.call_later(i * 0.2, time.sleep, 0.1)
        await wait_until(lambda: sum(x.late_ticks for x in h.of(ev.TapLag)) >= 5, timeout=10)
        lags = h.of(ev.TapLag)
    assert len(lags) < 5  # windows of a second: the blocks share records
    for a, b in itertools.pairwise(lags):
        assert b.m - a.m >= 1.0 - 1e-9


async def test_an_idle_tap_records_no_lag(tmp_path: Path) -> None:
    # threshold 0.1 s: a shared CI machine may delay a tick by some ms, not by a tick
    # interval (0.25 s here), which is what a lateness measured wrong would show
    async with running_tap(9, tmp_path, lag_threshold=0.1) as h:
        await wait_until(lambda: h.tap.lag_windows >= 2, timeout=10)
        assert h.of(ev.TapLag) == []
