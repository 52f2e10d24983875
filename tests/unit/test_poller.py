"""The poller's choices without a server: the URLs it asks, what busy means, nothing to poll."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tracer import events as ev
from tracer.evidence.poller import EnginePoller, PollerConfig, loads_urls

pytestmark = pytest.mark.anyio


def test_loads_urls() -> None:
    assert loads_urls("http://h:30000/metrics") == [
        "http://h:30000/v1/loads",
        "http://h:30000/get_load",
    ]
    assert loads_urls("http://h/sglang/metrics?x=1") == [
        "http://h/sglang/v1/loads",
        "http://h/sglang/get_load",
    ]
    assert loads_urls("http://router:8000/engine_metrics") == []
    assert loads_urls("http://router:29000/") == []


async def test_nothing_to_poll_returns() -> None:
    poller = EnginePoller(PollerConfig(urls=[]), tap="t", emit=print, wall_offset=0.0)
    with anyio.fail_after(1):
        await poller.run()


# ---- busy, without the network -------------------------------------------------------


def test_busy_uses_each_urls_newest_ok_sample() -> None:
    poller = EnginePoller(PollerConfig(urls=[]), tap="t", emit=lambda e: None, wall_offset=0.0)

    def sample(url: str, ok: bool = True, **state: Any) -> ev.EngineSample:
        return ev.EngineSample(t=0, m=0, tap="t", url=url, ok=ok, elapsed=0.001, state=state)

    poller.latest = {
        "http://a/metrics": sample("http://a/metrics", running=40, queued=0),
        "http://b/metrics": sample("http://b/metrics", running=53, queued=None),
        "http://c/metrics": sample("http://c/metrics", ok=False),
        "http://d/metrics": sample("http://d/metrics", running=None, queued=None),
    }
    assert poller.busy(32) == "engine busy: running=53 >= 32 at http://b/metrics"
    assert poller.busy(54) is None
    poller.latest["http://b/metrics"] = sample("http://b/metrics", ok=False)
    assert poller.busy(32) == "engine busy: running=40 >= 32 at http://a/metrics"
