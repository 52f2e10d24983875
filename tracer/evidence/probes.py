"""Probes on stall: does a fresh connection get an answer while a reused one hangs?

When the tap records a stall it sends a tiny request over a *fresh* connection to its
own upstream and directly to each engine it knows (the base of each ``--engine-metrics``
URL), and records the outcome and latency as ``probe`` events. This is the automatic
form of the decisive experiment of the incident the project exists for: reused
connections hung while fresh ones answered in under a second.

Probes are rate-limited (one round per ``min_interval``) and never pile onto a loaded
engine: when the poller's latest samples say running + queued is at or above
``busy_threshold``, the probes are recorded as skipped, with the figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import httpx
import structlog

from .. import events as ev
from ..protocol.probe_mark import PROBE_HEADER, probe_value

log = structlog.get_logger("tracer.evidence.probes")

ProbeKind = Literal["models", "completion", "health"]


class BusySource(Protocol):
    def busy(self, threshold: int) -> str | None: ...


@dataclass
class ProbeConfig:
    upstream_url: str  # http://host:port of the tap's upstream
    engine_urls: list[str] = field(default_factory=list)  # bases (scheme://host:port)
    kind: ProbeKind = "models"
    model: str | None = None  # for "completion" probes
    timeout: float = 5.0
    min_interval: float = 5.0
    busy_threshold: int = 32


def engine_base(metrics_url: str) -> str:
    """``http://host:port/metrics`` -> ``http://host:port``."""
    parts = urlsplit(metrics_url)
    return f"{parts.scheme}://{parts.netloc}"


class Prober:
    """A tap sink: on each stall start, schedule one (rate-limited) round of probes."""

    def __init__(
        self,
        config: ProbeConfig,
        *,
        tap: str,
        emit: Callable[[ev.Event], None],
        wall_offset: float,
        spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], bool],
        load: BusySource | None = None,
    ) -> None:
        self.config = config
        self.tap = tap
        self._emit = emit
        self._wall = wall_offset
        self._spawn = spawn
        self._load = load
        self._last_round: float | None = None
        self.rounds = 0

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.Stall) and event.phase == "start":
            self.on_stall(event.conn, event.seq)

    def on_stall(self, conn: int | None, seq: int | None) -> None:
        now = time.monotonic()
        targets = [("upstream", self.config.upstream_url)] + [
            ("engine", base) for base in self.config.engine_urls
        ]
        if self._last_round is not None and now - self._last_round < self.config.min_interval:
            return  # rate limit: the previous round's answers stand for this stall too
        self._last_round = now
        self.rounds += 1
        busy = self._load.busy(self.config.busy_threshold) if self._load is not None else None
        for target, base in targets:
            url = base.rstrip("/") + self._path()
            if busy is not None:
                self._record(url, target, "skipped", conn, seq, reason=busy)
                continue

            async def run(url: str = url, target: str = target) -> None:
                await self._probe(url, target, conn, seq)

            if not self._spawn(run):
                self._record(url, target, "skipped", conn, seq, reason="tap stopping")

    def _path(self) -> str:
        return {
            "models": "/v1/models",
            "completion": "/v1/chat/completions",
            "health": "/health",
        }[self.config.kind]

    async def _probe(self, url: str, target: str, conn: int | None, seq: int | None) -> None:
        cfg = self.config
        start = time.monotonic()
        first_byte: float | None = None
        method = "POST" if cfg.kind == "completion" else "GET"
        body = None
        if cfg.kind == "completion":
            body = {
                "model": cfg.model or "default",
                "messages": [{"role": "user", "content": "ping"}],
                "max_tokens": 1,
                "stream": False,
            }
        try:
            # a new client: a new connection, never one from a pool
            async with (
                httpx.AsyncClient(
                    timeout=cfg.timeout, headers={PROBE_HEADER: probe_value("probe", self.tap)}
                ) as client,
                client.stream(method, url, json=body) as response,
            ):
                first_byte = time.monotonic() - start
                await response.aread()
                outcome: Literal["ok", "error"] = "ok" if response.status_code < 400 else "error"
                self._record(
                    url,
                    target,
                    outcome,
                    conn,
                    seq,
                    status=response.status_code,
                    latency=time.monotonic() - start,
                    first_byte=first_byte,
                )
        except httpx.TimeoutException:
            self._record(
                url,
                target,
                "timeout",
                conn,
                seq,
                latency=time.monotonic() - start,
                first_byte=first_byte,
                reason=f"no answer within {cfg.timeout:g}s",
            )
        except httpx.HTTPError as exc:
            self._record(
                url,
                target,
                "error",
                conn,
                seq,
                latency=time.monotonic() - start,
                first_byte=first_byte,
                reason=f"{type(exc).__name__}: {exc}"[:300],
            )

    def _record(
        self,
        url: str,
        target: str,
        outcome: Literal["ok", "error", "timeout", "skipped"],
        conn: int | None,
        seq: int | None,
        *,
        status: int | None = None,
        latency: float | None = None,
        first_byte: float | None = None,
        reason: str | None = None,
    ) -> None:
        m = time.monotonic()
        self._emit(
            ev.Probe(
                t=m + self._wall,
                m=m,
                tap=self.tap,
                url=url,
                target="upstream" if target == "upstream" else "engine",
                kind=self.config.kind,
                outcome=outcome,
                trigger_conn=conn,
                trigger_seq=seq,
                status=status,
                latency=None if latency is None else round(latency, 6),
                first_byte=None if first_byte is None else round(first_byte, 6),
                reason=reason,
            )
        )
        log.info("probe", url=url, target=target, outcome=outcome, latency=latency, reason=reason)
