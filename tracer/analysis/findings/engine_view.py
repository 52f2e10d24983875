"""What the serving stack's own metrics said during a window: ``EngineView``, and the
engine samples it is read from.

The rules of engine evidence (live, sampled and finish-time figures; idle, wedged,
loaded) live here, in one place, because every analyzer that blames or clears the
engine quotes the same view.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...evidence import engines
from ...wording import counted
from ..rows import RequestRow
from ..spill import ChunkLog
from .model import EvidenceItem
from .quotes import ts

ENGINE_PROFILES = {"sglang", "vllm", "llamacpp"}
ROUTER_PROFILES = {"smg", "sgl_router"}
# A progress figure must stay flat this long, and FLAT_CADENCES times as long as the
# engine takes between writes of it (SGLang: every 40 decode steps), to mean "no progress".
MIN_FLAT = 1.5
FLAT_CADENCES = 2.0
LOST_MARGIN = 0.2  # seconds after reaching the tap before a request must be counted
UNCOUNTED_CHECKS = 64  # hang windows checked against the engines' counts (a pass each)
SAMPLED_CADENCE = 5.0  # seconds assumed between writes of a sampled figure never seen move


@dataclass
class EngineView:
    """What the serving stack's own metrics said during a time window.

    ``progress`` counts tokens from a figure that moves while streams decode (SGLang's
    ``realtime_tokens_total{mode="decode"}``, vLLM's token counter: ``engines.
    progress_delta``) over ``progress_span`` seconds of samples inside the window;
    ``finished`` is the finish-time token counter's increase (SGLang's tokenizer adds a
    request's tokens only when it ends), quoted but never read as "no tokens".
    ``cadence``: how often the progress figure is written on this engine (sampled
    figures), so that a flat stretch shorter than it proves nothing.
    """

    samples: int = 0
    urls: int = 0
    failures: int = 0
    running_max: int | None = None
    queued_max: int | None = None
    progress: float | None = None
    progress_span: float = 0.0
    finished: float | None = None
    cadence: float = 0.0
    router_in_flight: int | None = None
    start: float = 0.0
    end: float = 0.0

    @property
    def known(self) -> bool:
        return self.samples > 0

    @property
    def flat_long_enough(self) -> bool:
        """The progress figure stayed flat over enough of the window to mean it."""
        return self.progress == 0 and self.progress_span >= max(
            MIN_FLAT, FLAT_CADENCES * self.cadence
        )

    @property
    def idle(self) -> bool:
        return (
            self.known
            and self.running_max == 0
            and (self.queued_max or 0) == 0
            and not self.progress
            and not self.finished
        )

    @property
    def wedged(self) -> bool:
        """Running work and no progress, from a figure that would have moved: positive
        evidence of a stall (a finish-time counter alone can never say this)."""
        return self.known and (self.running_max or 0) >= 1 and self.flat_long_enough

    @property
    def loaded(self) -> bool:
        """Requests running or queued and no sign of a wedge: load (a queue, a full batch)."""
        return (
            self.known
            and ((self.running_max or 0) + (self.queued_max or 0)) >= 1
            and not self.wedged
        )

    @property
    def generating(self) -> bool:
        """Requests running while the live progress figure moved: the engine was decoding
        in the window (what a non-streamed request waits on, silent until it is done)."""
        return self.known and (self.running_max or 0) >= 1 and bool(self.progress)

    @property
    def producing(self) -> bool:
        """Tokens were produced in the window (progress, or requests finishing)."""
        return bool(self.progress) or bool(self.finished)

    def quote(self) -> str:
        progress = (
            "no progress figure"
            if self.progress is None
            else f"decode progress +{self.progress:g} tokens over {self.progress_span:.1f} s"
        )
        finished = "" if self.finished is None else f", finished-request tokens +{self.finished:g}"
        text = (
            f"engine metrics {ts(self.start)} to {ts(self.end)}: running≤{self.running_max}, "
            f"queued≤{self.queued_max}, {progress}{finished} "
            f"({self.samples} samples from {counted(self.urls, 'URL')})"
        )
        if self.router_in_flight is not None:
            text += f"; router in flight≤{self.router_in_flight}"
        if self.failures:
            text += f"; {self.failures} failed scrapes"
        return text

    def item(self) -> EvidenceItem:
        """``quote()`` as an evidence item, with its figures."""
        figures: dict[str, Any] = {
            "running_max": self.running_max,
            "queued_max": self.queued_max,
            "progress": self.progress,
            "progress_span": self.progress_span,
            "finished": self.finished,
            "samples": self.samples,
            "urls": self.urls,
        }
        if self.router_in_flight is not None:
            figures["router_in_flight"] = self.router_in_flight
        if self.failures:
            figures["failed_scrapes"] = self.failures
        return EvidenceItem(text=self.quote(), t=self.start, figures=figures)


class EngineFigures:
    """The engine samples of the captures, asked about windows (``view``, ``uncounted``).

    ``engine`` is a list or a ``ChunkLog`` (read back by time window); ``requests`` the
    request rows, iterated again for ``uncounted`` (at most ``UNCOUNTED_CHECKS`` times).
    """

    def __init__(self, engine: Iterable[dict[str, Any]], requests: Iterable[RequestRow]) -> None:
        self.engine = engine
        self.requests = requests
        self._cadences: dict[str, float] | None = None  # see _cadence
        self._uncounted_checks = 0  # see uncounted

    def _engine_between(self, lo: float, hi: float) -> Iterable[dict[str, Any]]:
        if isinstance(self.engine, ChunkLog):
            return self.engine.window(lo, hi)
        return (s for s in self.engine if lo <= s["t"] <= hi)

    def view(self, start: float, end: float) -> EngineView:
        """The engines' own figures over a window.

        running/queued come from SGLang's live ``/v1/loads`` samples when the capture has
        them (its gauges can be 30 s old), else from the metrics gauges; progress comes
        from the deltas of a figure that moves while streams decode (``engines.
        progress_delta``) whose interval lies inside the window; finish-time token
        counters are kept apart (``EngineView.finished``).
        """
        view = EngineView(start=start, end=end)
        urls: set[str] = set()
        spans: dict[str, float] = defaultdict(float)
        owner: dict[str, Any] = {}  # the tap whose samples of a URL count its deltas
        gauges: list[tuple[float, dict[str, Any]]] = []
        live: list[tuple[float, dict[str, Any]]] = []
        for s in self._engine_between(start - 1.5, end + 1.5):
            if not s["ok"]:
                view.failures += 1
                continue
            state = s.get("state") or {}
            profile = s.get("profile")
            if profile in ROUTER_PROFILES:
                in_flight = state.get("in_flight")
                if in_flight is not None:
                    view.router_in_flight = max(view.router_in_flight or 0, int(in_flight))
                continue
            if profile not in ENGINE_PROFILES:
                continue
            view.samples += 1
            urls.add(s["url"])
            (live if s.get("source") == "loads" else gauges).append((s["t"], state))
            deltas = s.get("deltas") or {}
            interval = s.get("interval") or 0.0
            if not deltas or s["t"] - interval < start or s["t"] > end:
                continue  # the delta covers (t - interval, t]: only those inside count
            if owner.setdefault(s["url"], s.get("tap")) != s.get("tap"):
                continue  # the same engine polled by another tap too: counted once
            progress = engines.progress_delta(deltas, profile)
            if progress is not None:
                view.progress = (view.progress or 0.0) + progress
                spans[s["url"]] += interval
                view.cadence = max(view.cadence, self._cadence(s["url"]))
            finished = deltas.get("generation_tokens_total")
            if finished is not None and (
                engines.figure_timing(profile, "generation_tokens_total") == "finish"
            ):
                view.finished = (view.finished or 0.0) + float(finished)
        chosen = live or gauges
        inside = [(t, st) for t, st in chosen if start <= t <= end]
        for _, state in inside or chosen:  # samples around it only when none fell inside
            running, queued = state.get("running"), state.get("queued")
            if running is not None:
                view.running_max = max(view.running_max or 0, int(running))
            if queued is not None:
                view.queued_max = max(view.queued_max or 0, int(queued))
        view.urls = len(urls)
        view.progress_span = max(spans.values(), default=0.0)
        return view

    def _cadence(self, url: str) -> float:
        """Seconds between writes of this engine's progress figure: the scrape interval
        for a live figure; for a sampled one (SGLang writes it every 40 decode steps) the
        median gap between the increases seen while it ran requests, or
        ``SAMPLED_CADENCE`` when it was never seen to move twice."""
        if self._cadences is None:
            self._cadences = self._find_cadences()
        return self._cadences.get(url, SAMPLED_CADENCE)

    def _find_cadences(self) -> dict[str, float]:
        rises: dict[str, list[float]] = defaultdict(list)
        intervals: dict[str, list[float]] = defaultdict(list)
        timing: dict[str, str | None] = {}
        for s in self.engine:
            if not s["ok"] or s.get("profile") not in ENGINE_PROFILES:
                continue
            url, deltas = s["url"], s.get("deltas")
            progress = engines.progress_delta(deltas, s.get("profile"))
            if progress is None:
                continue
            if url not in timing:
                key = engines.PROGRESS_KEY if engines.PROGRESS_KEY in (deltas or {}) else ""
                timing[url] = engines.figure_timing(s.get("profile"), key) if key else "live"
            if s.get("interval") and len(intervals[url]) < 1024:
                intervals[url].append(float(s["interval"]))
            if progress > 0 and len(rises[url]) < 4096:
                rises[url].append(float(s["t"]))
        out: dict[str, float] = {}
        for url, kind in timing.items():
            if kind == "live":
                out[url] = statistics.median(intervals[url]) if intervals[url] else 1.0
                continue
            gaps = [b - a for a, b in itertools.pairwise(rises[url])]
            out[url] = statistics.median(gaps) if len(gaps) >= 2 else SAMPLED_CADENCE
        return out

    def uncounted(self, r: RequestRow, start: float, end: float) -> tuple[int, int] | None:
        """(requests in flight at the tap, the engines' running + queued) at a moment of
        the window when the engines counted fewer, if they did at half the moments or more: some
        request the tap handed to the serving stack is neither running nor queued there.
        Read from live figures only (``/v1/loads``, or gauges whose timing is live): a
        sampled gauge written before a request came cannot count it. Each engine's
        latest figure is summed (other clients only add to it); a request counts as in
        flight from ``LOST_MARGIN`` after it reached the tap. None otherwise, or past
        ``UNCOUNTED_CHECKS`` windows (each costs a pass over the rows)."""
        if end - start < MIN_FLAT or self._uncounted_checks >= UNCOUNTED_CHECKS:
            return None
        points: list[tuple[float, str, int]] = []
        for s in self._engine_between(start, end):
            state = s.get("state") or {}
            profile = s.get("profile")
            if not s["ok"] or profile not in ENGINE_PROFILES or state.get("running") is None:
                continue
            live = s.get("source") == "loads" or engines.figure_timing(profile, "running") == "live"
            if live:
                points.append(
                    (s["t"], s["url"], int(state["running"]) + int(state.get("queued") or 0))
                )
        if len(points) < 2:
            return None
        self._uncounted_checks += 1
        spans = [
            (o.start, math.inf if o.end is None else o.end)
            for o in self.requests
            if o.tap == r.tap and o.method and o.start <= end and (o.end is None or o.end >= start)
        ]
        latest: dict[str, int] = {}
        short: list[tuple[int, int]] = []
        for t, url, count in sorted(points):
            latest[url] = count
            counted = sum(latest.values())
            in_flight = sum(1 for a, b in spans if a <= t - LOST_MARGIN and b >= t)
            if in_flight > counted:
                short.append((in_flight, counted))
        if len(short) < 2 or len(short) * 2 < len(points):
            return None
        return max(short)
