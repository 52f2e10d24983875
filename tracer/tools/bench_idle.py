"""bench's idle check: is every engine idle before the figures are taken?

Apart from the load generator because it reads the engines' own metrics (through the
poller), not the client's requests: figures from a loaded window mislead.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx

from .. import __version__
from .. import events as ev
from ..evidence.engines import progress_delta

IDLE_CHECK_GAP = 0.5  # seconds between the two scrapes of the idle check


async def check_idle(urls: Sequence[str], timeout: float) -> list[dict[str, Any]]:
    """Is every engine idle? Two scrapes ``IDLE_CHECK_GAP`` apart, through the poller.

    Busy: running > 0 or queued > 0 (SGLang's live ``/v1/loads`` when it answers, else
    the metrics gauges), or generated tokens moved between the scrapes (SGLang's gauges
    can be 30 s old; its counters are live). Unknown: the metrics cannot be read, or
    carry no running/queued figures.
    """
    from ..evidence.poller import EnginePoller, PollerConfig

    samples: list[ev.EngineSample] = []

    def keep(event: ev.Event) -> None:
        if isinstance(event, ev.EngineSample):
            samples.append(event)

    poller = EnginePoller(
        PollerConfig(urls=list(urls), timeout=timeout),
        tap="bench",
        emit=keep,
        wall_offset=time.time() - time.monotonic(),
    )
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout),
        limits=httpx.Limits(max_keepalive_connections=0),
        trust_env=False,
        follow_redirects=False,
        headers={"User-Agent": f"tracer/{__version__}"},
    ) as client:
        for round_ in range(2):
            if round_:
                await anyio.sleep(IDLE_CHECK_GAP)
            samples.clear()
            async with anyio.create_task_group() as tg:
                for url in urls:
                    tg.start_soon(poller.scrape_metrics, client, url)
    return [_verdict(url, samples) for url in urls]


def _verdict(url: str, samples: Sequence[ev.EngineSample]) -> dict[str, Any]:
    metrics = next((s for s in samples if s.url == url and s.source == "metrics"), None)
    loads = [s for s in samples if s.source == "loads" and s.ok and s.url != url]
    check: dict[str, Any] = {"url": url, "idle": None}
    if metrics is None or not metrics.ok:
        check["why"] = f"cannot read the metrics: {metrics.error if metrics else 'no answer'}"
        return check
    check["profile"] = metrics.profile
    live = next((s for s in loads if _same_host(s.url, url)), None)
    state = live.state if live is not None else metrics.state
    check["source"] = "live /v1/loads" if live is not None else "metrics gauges"
    running, queued = state.get("running"), state.get("queued")
    check["running"], check["queued"] = running, queued
    # decode progress only: SGLang adds generation_tokens_total when a request finishes
    generated = progress_delta(metrics.deltas, metrics.profile)
    check["generated_meanwhile"] = generated
    if running is None and queued is None:
        check["why"] = f"no running/queued figures at this URL (profile {metrics.profile})"
        return check
    figures = f"running={_fmt(running)}, queued={_fmt(queued)} ({check['source']})"
    busy = bool(running) or bool(queued)
    if generated:
        figures += f"; {generated} tokens generated in {IDLE_CHECK_GAP:g} s"
        busy = True
    elif busy and live is None and generated is not None:
        figures += "; no tokens generated meanwhile: SGLang's gauges can be ~30 s old after a run"
    check["idle"] = not busy
    check["why"] = figures
    return check


def _same_host(a: str, b: str) -> bool:
    pa, pb = urlsplit(a), urlsplit(b)
    return (pa.hostname, pa.port) == (pb.hostname, pb.port)


def _fmt(value: Any) -> str:
    return "?" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
