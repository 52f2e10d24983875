"""The engine poller: scrapes engines' and the router's metrics and health, emits samples.

Theory of operation
-------------------
The I/O edge around ``tracer/evidence/engines.py``. Every metrics URL and every health URL has
its own loop on one shared schedule (ticks ``interval`` apart from a common start; a
scrape that overruns skips the ticks it missed), so a hung engine never delays the
others. Each request is bounded by ``timeout`` as a whole (connect, headers and body).

* A metrics scrape becomes one ``EngineSample``: the normalised state, the counters'
  deltas since the previous sample of that URL (``CounterTracker``), the labelled
  series. A failure is a sample too (``ok`` false, ``error``: ``timeout after 2s``,
  ``refused``, ``HTTP 503``, ``unparseable: ...``): failures are evidence. A body
  with some bad lines among good ones gives ``ok`` true, the figures of the good lines,
  and ``error`` naming what was skipped.
* For an SGLang ``.../metrics`` URL (``loads``), ``/v1/loads`` on the same host and
  path prefix is tried (falling back to ``/get_load``); once one answers with load JSON,
  it is read after every metrics scrape and emitted as ``source="loads"`` (live values,
  fresher than SGLang's sampled gauges). Until then nothing is emitted for it; a 4xx or
  a body of another shape on both means "absent" and it is not tried again.
* Health URLs become ``HealthSample`` (``ok`` = a 2xx status).
* ``busy`` answers "is any engine loaded?" from the newest samples, so that probes
  never pile onto a loaded engine. It looks at running + queued only: a router's
  ``in_flight`` includes the very requests that hang, so it is not load.

Never the cause: every scrape opens a fresh connection (no keep-alive pool, so a stale
pooled connection can never show up as an engine failure), ignores proxy environment
variables, does not follow redirects, and reads at most ``MAX_BODY`` bytes; each scrape
says it is the tap's own (``x-tracer-probe``), so a tap that sees it does not count it
as the clients' traffic. Time stamps:
``m = time.monotonic()`` at the end of the scrape, ``t = m + wall_offset``, ``elapsed``
is the scrape's duration.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import anyio
import httpx
import structlog

from .. import __version__
from .. import events as ev
from ..protocol.probe_mark import PROBE_HEADER, probe_value
from . import engines

log = structlog.get_logger(__name__)

MAX_BODY = 16 * 1024 * 1024


@dataclass
class PollerConfig:
    urls: list[str]  # metrics URLs (engines, decode/prefill workers, the router's metrics port)
    interval: float = 1.0
    timeout: float = 2.0
    health_urls: list[str] = field(default_factory=list)
    loads: bool = True  # for an SGLang /metrics URL also read /v1/loads (or /get_load)
    keep_raw: bool = False
    profile: str | None = None  # override auto-detection


@dataclass(frozen=True, slots=True)
class _Fetched:
    status: int | None
    body: bytes
    error: str | None
    elapsed: float
    m: float


@dataclass
class _Loads:
    url: str | None = None  # the loads URL once known to answer
    absent: bool = False


def _describe(exc: BaseException) -> str:
    """A short, stable name for a network failure."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return "refused"
        if isinstance(seen, ConnectionResetError):
            return "reset"
        if isinstance(seen, socket.gaierror):
            return f"DNS: {seen.strerror or seen}"
        seen = seen.__cause__ or seen.__context__
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"protocol error: {exc}"
    if isinstance(exc, httpx.ConnectError):
        return f"connect failed: {exc}"
    if isinstance(exc, httpx.ReadError):
        return f"read failed: {exc or type(exc).__name__}"
    return f"{type(exc).__name__}: {exc}"


def loads_urls(metrics_url: str) -> list[str]:
    """``/v1/loads`` and ``/get_load`` beside an ``.../metrics`` URL (none otherwise)."""
    try:
        url = httpx.URL(metrics_url)
    except httpx.InvalidURL:
        return []
    if not url.path.endswith("/metrics"):
        return []
    prefix = url.path[: -len("metrics")]
    return [str(url.copy_with(path=prefix + p, query=None)) for p in ("v1/loads", "get_load")]


class EnginePoller:
    """Scrapes ``config.urls`` and ``config.health_urls`` every interval until cancelled."""

    def __init__(
        self,
        config: PollerConfig,
        *,
        tap: str,
        emit: Callable[[ev.Event], None],
        wall_offset: float,
    ) -> None:
        if config.interval <= 0 or config.timeout <= 0:
            raise ValueError("interval and timeout must be positive")
        if config.profile is not None and config.profile not in engines.PROFILES:
            raise ValueError(
                f"unknown engine profile {config.profile!r} (known: {', '.join(engines.PROFILES)})"
            )
        self.config = config
        self.tap = tap
        self.emit = emit
        self.wall_offset = wall_offset
        self.latest: dict[str, ev.EngineSample] = {}  # newest sample per URL
        self.latest_health: dict[str, ev.HealthSample] = {}
        self.counters = engines.CounterTracker()
        self._loads: dict[str, _Loads] = {}
        self._ok: dict[str, bool] = {}  # per URL: did its last read succeed (for the log)

    # ---- the schedule -----------------------------------------------------------------

    async def run(self) -> None:
        cfg = self.config
        if not cfg.urls and not cfg.health_urls:
            return
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.timeout),
            limits=httpx.Limits(max_keepalive_connections=0),
            trust_env=False,
            follow_redirects=False,
            # the tap's own request (``x-tracer-probe``): a tap or ``tracer sniff`` that
            # sees the scrapes (metrics on the serving port) leaves them out of its tables
            headers={
                "User-Agent": f"tracer/{__version__}",
                PROBE_HEADER: probe_value("metrics", self.tap),
            },
        ) as client:
            start = time.monotonic()
            async with anyio.create_task_group() as tg:
                for url in cfg.urls:
                    tg.start_soon(self._every_tick, start, self.scrape_metrics, client, url)
                for url in cfg.health_urls:
                    tg.start_soon(self._every_tick, start, self.poll_health, client, url)

    async def _every_tick(
        self,
        start: float,
        step: Callable[[httpx.AsyncClient, str], Awaitable[None]],
        client: httpx.AsyncClient,
        url: str,
    ) -> None:
        interval = self.config.interval
        tick = 0
        while True:
            await step(client, url)
            now = time.monotonic()
            tick = max(tick + 1, math.floor((now - start) / interval) + 1)
            await anyio.sleep(max(0.0, start + tick * interval - now))

    # ---- one request ------------------------------------------------------------------

    async def _fetch(self, client: httpx.AsyncClient, url: str) -> _Fetched:
        timeout = self.config.timeout
        started = time.monotonic()
        status: int | None = None
        body = b""
        error: str | None = None
        with anyio.move_on_after(timeout) as scope:
            try:
                async with client.stream("GET", url) as response:
                    status = response.status_code
                    buf = bytearray()
                    async for chunk in response.aiter_bytes():
                        buf += chunk
                        if len(buf) > MAX_BODY:
                            error = f"body over {MAX_BODY} bytes"
                            break
                    body = bytes(buf)
            except httpx.TimeoutException:
                error = f"timeout after {timeout:g}s"
            except Exception as exc:  # every failure is a sample, never a crash
                error = _describe(exc)
        if scope.cancelled_caught:
            error = f"timeout after {timeout:g}s"
        m = time.monotonic()
        self._say_if_changed(url, status, error)
        return _Fetched(status, body, error, round(m - started, 6), m)

    def _say_if_changed(self, url: str, status: int | None, error: str | None) -> None:
        """One log line when a URL is first read and whenever it turns bad or good again:
        a wrong --engine-metrics is seen at start, not only in ``tracer top``."""
        if error is None and status is not None and status >= 400:
            error = f"HTTP {status}"
        ok = error is None
        if self._ok.get(url) == ok:
            return
        first = url not in self._ok
        self._ok[url] = ok
        if ok:
            log.info("engine URL answers" if first else "engine URL answers again", url=url)
        else:
            log.warning("engine URL does not answer", url=url, error=error)

    def _failed(
        self,
        url: str,
        fetched: _Fetched,
        error: str,
        source: Literal["metrics", "loads"] = "metrics",
    ) -> ev.EngineSample:
        return ev.EngineSample(
            t=fetched.m + self.wall_offset,
            m=fetched.m,
            tap=self.tap,
            url=url,
            ok=False,
            elapsed=fetched.elapsed,
            status=fetched.status,
            source=source,
            error=error,
        )

    @staticmethod
    def _http_error(fetched: _Fetched) -> str | None:
        if fetched.error is not None:
            return fetched.error
        if fetched.status is None or not 200 <= fetched.status < 300:
            return f"HTTP {fetched.status}"
        return None

    def _publish(self, sample: ev.EngineSample) -> None:
        self.latest[sample.url] = sample
        self.emit(sample)

    # ---- metrics ----------------------------------------------------------------------

    async def scrape_metrics(self, client: httpx.AsyncClient, url: str) -> None:
        """One scrape of a metrics URL (and of its loads endpoint, where there is one)."""
        fetched = await self._fetch(client, url)
        sample = self._metrics_sample(url, fetched)
        self._publish(sample)
        if sample.ok and self.config.loads and sample.profile == "sglang" and loads_urls(url):
            await self._scrape_loads(client, url)

    def _metrics_sample(self, url: str, fetched: _Fetched) -> ev.EngineSample:
        failure = self._http_error(fetched)
        if failure is not None:
            return self._failed(url, fetched, failure)
        text = fetched.body.decode("utf-8", errors="replace")
        note: str | None = None
        try:
            families = engines.parse(text)
        except engines.MetricsError as exc:
            families, skipped = engines.parse_lenient(text)
            if not any(family.samples for family in families):
                return self._failed(url, fetched, f"unparseable: {exc}")
            note = f"unparseable lines skipped: {len(skipped)} (first: {skipped[0]})"
        reading = engines.normalise(
            families, profile=self.config.profile, keep_raw=self.config.keep_raw
        )
        deltas, interval, restarted = self.counters.update(url, reading.state, fetched.m)
        return ev.EngineSample(
            t=fetched.m + self.wall_offset,
            m=fetched.m,
            tap=self.tap,
            url=url,
            source="metrics",
            ok=True,
            elapsed=fetched.elapsed,
            status=fetched.status,
            error=note,
            profile=reading.profile,
            state=reading.state,
            deltas=deltas if interval is not None else None,
            interval=round(interval, 6) if interval is not None else None,
            restarted=restarted,
            freshness=reading.freshness or None,
            series=reading.series or None,
            raw=reading.raw,
        )

    # ---- SGLang /v1/loads -------------------------------------------------------------

    async def _scrape_loads(self, client: httpx.AsyncClient, metrics_url: str) -> None:
        state = self._loads.setdefault(metrics_url, _Loads())
        if state.absent:
            return
        if state.url is not None:
            fetched = await self._fetch(client, state.url)
            self._publish(self._loads_sample(state.url, fetched))
            if fetched.status in (404, 405):
                state.url = None  # gone (engine replaced?): look for it again next time
            return
        for candidate in loads_urls(metrics_url):
            fetched = await self._fetch(client, candidate)
            if fetched.error is not None or fetched.status is None or fetched.status >= 500:
                return  # not settled: try again next tick, say nothing yet
            if 200 <= fetched.status < 300:
                try:
                    reading = engines.parse_loads(fetched.body)
                except engines.MetricsError:
                    continue  # something else lives there
                state.url = candidate
                self._publish(self._loads_sample(candidate, fetched, reading))
                return
        state.absent = True

    def _loads_sample(
        self, url: str, fetched: _Fetched, reading: engines.Reading | None = None
    ) -> ev.EngineSample:
        failure = self._http_error(fetched)
        if failure is not None:
            return self._failed(url, fetched, failure, source="loads")
        if reading is None:
            try:
                reading = engines.parse_loads(fetched.body)
            except engines.MetricsError as exc:
                return self._failed(url, fetched, f"unparseable: {exc}", source="loads")
        return ev.EngineSample(
            t=fetched.m + self.wall_offset,
            m=fetched.m,
            tap=self.tap,
            url=url,
            source="loads",
            ok=True,
            elapsed=fetched.elapsed,
            status=fetched.status,
            profile=reading.profile,
            state=reading.state,
            freshness=reading.freshness or None,
            series=reading.series or None,
        )

    # ---- health -----------------------------------------------------------------------

    async def poll_health(self, client: httpx.AsyncClient, url: str) -> None:
        fetched = await self._fetch(client, url)
        ok = fetched.error is None and fetched.status is not None and 200 <= fetched.status < 300
        sample = ev.HealthSample(
            t=fetched.m + self.wall_offset,
            m=fetched.m,
            tap=self.tap,
            url=url,
            ok=ok,
            elapsed=fetched.elapsed,
            status=fetched.status,
            error=fetched.error,
        )
        self.latest_health[url] = sample
        self.emit(sample)

    # ---- load gate for probes ---------------------------------------------------------

    def busy(self, threshold: int) -> str | None:
        """Why an engine counts as loaded (running + queued >= threshold), else None.

        Only each URL's newest sample counts, and only if it is ok: a failed scrape says
        nothing about load. The most loaded engine is named.
        """
        worst: tuple[float, str] | None = None
        for url, sample in self.latest.items():
            if not sample.ok:
                continue
            running = _count(sample.state.get("running"))
            queued = _count(sample.state.get("queued"))
            if running is None and queued is None:
                continue
            total = (running or 0) + (queued or 0)
            if total < threshold or (worst is not None and total <= worst[0]):
                continue
            if queued:
                figures = f"running={_fmt(running)} + queued={_fmt(queued)} = {_fmt(total)}"
            else:
                figures = f"running={_fmt(running)}"
            worst = (total, f"engine busy: {figures} >= {threshold} at {url}")
        return worst[1] if worst is not None else None


def _count(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _fmt(value: float | None) -> str:
    if value is None:
        return "?"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
