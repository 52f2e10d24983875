"""The timeline picture of an incident: connections, requests, stalls, hangs, engine load.

Theory of operation
-------------------
``build(result, engine_samples, tap_order)`` turns an analysis result (``Summary.result``)
and the capture's engine samples into a ``Timeline``: plain data, no drawing, so what
the picture will show can be tested without rendering it. ``draw(timeline, svg, png)``
(``timeline_draw``) renders it with matplotlib (Agg, no display) into an SVG and a PNG.

Layout, top to bottom, on one time axis (seconds from the captures' start):

* **lanes**: one per connection, taps from the client side to the engine side, then by
  connection number. Each request is a bar from its head to its end (or to the end of
  the capture when it never ended), coloured by termination; a bar with an HTTP error
  status or an SSE error event has a dark outline. Stalls are hatched over the bar;
  every finding has a labelled triangle on its request; a hang mark (``--hang-at`` or a
  ``mark`` record) is a dashed vertical line across the whole picture; a change of the
  faults a tap injects (``fault_plan``) a dotted one, labelled with the plan from then on
  where there is room (a change to no faults is the line alone).
* **aggregated lanes**, when there are more connections than ``max_lanes`` (40): each
  lane is a group of consecutive connections of one tap (as many per group as it takes
  to stay within ``max_lanes`` lanes per tap set), drawn as a heat band of how many of
  the group's requests were in flight at each moment; requests that did not complete
  cleanly (and their stalls) are still drawn one by one on top, so faults stay visible
  among hundreds of healthy connections. Lanes of single connections are drawn the same
  way when the captures hold more than ``MAX_BARS`` (4000) requests.
* **engine**: the serving stack's own figures beneath, on the same axis: running and
  queued requests summed over engines (live ``/v1/loads`` values where the capture has
  them, else the metrics gauges), the router's in-flight count where a router was
  scraped, and the generation token rate (counter deltas per second) on the right axis.

Every drawn element has a ``gid`` (the SVG ``id``) so the picture can be checked
structurally: ``lane-<tap>/<conn>`` (or ``lane-<tap>/<first>-<last>``),
``req-<tap>/<conn>/<seq>``, ``stall-<request>-<n>``, ``hang-<n>``, ``finding-<id>``,
``heat-<lane>``, ``engine-running``, ``engine-queued``, ``engine-router``,
``engine-tokens``. The output is deterministic: the same captures give the same bytes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from ..evidence.engines import progress_delta

MAX_LANES = 40
MAX_BARS = 4000  # above this many requests, lanes are heat bands (a bar each is too slow)
LANE_COLOUR = "#e6ebf2"  # lane background; tests find lanes in the PNG by this colour
HANG_COLOUR = "#b2182b"
FAULT_PLAN_COLOUR = "#2166ac"  # the tap's faults changed (--fault-control)
STALL_COLOUR = "#b2182b"
ERROR_EDGE = "#222222"
TERMINATION_COLOURS = {
    "complete": "#5aa469",
    "truncated": "#e69f00",
    "client_abort": "#cc79a7",
    "in_flight": "#d55e00",
    "timeout": "#8c6d1f",
    "unparsed": "#999999",
    "tracer_response": "#0072b2",
}
OTHER_COLOUR = "#777777"
HEAT_LOW, HEAT_HIGH = (0.80, 0.85, 0.93), (0.35, 0.47, 0.68)  # light to mid slate blue
HEAT_MID = "#8fa3c4"
ENGINE_PROFILES = {"sglang", "vllm", "llamacpp"}
ROUTER_PROFILES = {"smg", "sgl_router"}
DPI = 100
WIDTH_IN = 13.0
LANE_IN = 0.32  # height of one lane, inches


@dataclass(slots=True)
class Lane:
    key: str  # "front/3", or "front/1-25" for a group
    tap: str
    conns: list[int]

    @property
    def grouped(self) -> bool:
        return len(self.conns) > 1


@dataclass(slots=True)
class Bar:
    request: str
    lane: int
    seq: int
    start: float  # seconds from the origin
    end: float
    termination: str
    error: bool  # HTTP status >= 400 or an SSE error event
    ended: bool  # False: no end in the capture (drawn to the capture's end)
    stalled: bool

    @property
    def problem(self) -> bool:
        return self.termination != "complete" or self.error or self.stalled


@dataclass(slots=True)
class StallMark:
    gid: str
    lane: int
    start: float
    end: float
    direction: str


@dataclass(slots=True)
class FindingMark:
    id: str
    kind: str
    lane: int | None  # None: the finding concerns no request (drawn on the hang line)
    t: float
    note: bool


@dataclass(slots=True)
class EngineSeries:
    """Sums over engines at each sample time (each engine's last known value)."""

    t: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    queued: list[float] = field(default_factory=list)
    router: list[float] = field(default_factory=list)  # router in flight (nan: unknown)
    rate: list[float] = field(default_factory=list)  # generation tokens/s (nan: unknown)
    engines: list[str] = field(default_factory=list)  # host:port of each engine
    routers: list[str] = field(default_factory=list)

    @property
    def known(self) -> bool:
        return bool(self.t)


@dataclass
class Timeline:
    origin: float  # wall clock of x = 0
    span: float  # seconds shown
    title: str
    max_lanes: int
    group_size: int  # connections per lane (1: one lane per connection)
    lanes: list[Lane]
    bars: list[Bar]
    stalls: list[StallMark]
    findings: list[FindingMark]
    hangs: list[float]
    engine: EngineSeries
    terminations: list[str]
    fault_plans: list[tuple[float, list[str]]] = field(default_factory=list)  # (x, the plan)

    @property
    def layout(self) -> Literal["lanes", "grouped"]:
        return "grouped" if self.group_size > 1 else "lanes"

    def summary(self) -> dict[str, Any]:
        """What the picture shows, for the report's JSON."""
        return {
            "layout": self.layout,
            "lanes": len(self.lanes),
            "connections_per_lane": self.group_size,
            "max_lanes": self.max_lanes,
            "heat": self.heat,
            "bars": len(self.drawn_bars()),
            "stalls": len(self.stalls),
            "hang_marks": len(self.hangs),
            "fault_plan_changes": len(self.fault_plans),
            "finding_marks": len(self.findings),
            "engines": self.engine.engines,
            "routers": self.engine.routers,
            "origin": self.origin,
            "span": self.span,
        }

    @property
    def heat(self) -> bool:
        """Lanes drawn as heat bands: grouped, or too many requests for a bar each."""
        return self.layout == "grouped" or len(self.bars) > MAX_BARS

    def drawn_bars(self) -> list[Bar]:
        """A bar per request; with heat bands only the problem requests."""
        if not self.heat:
            return self.bars
        return [b for b in self.bars if b.problem]


def build(
    result: dict[str, Any],
    engine_samples: list[dict[str, Any]],
    tap_order: list[str],
    *,
    max_lanes: int = MAX_LANES,
) -> Timeline:
    """The picture's content from an analysis result (rows as dicts) and engine samples."""
    if max_lanes < 1:
        raise ValueError(f"max_lanes must be at least 1, not {max_lanes}")
    start = result["time_range"]["start"]
    end = result["time_range"]["end"]
    origin = float(start) if start is not None else 0.0
    span = max(float(end) - origin, 1e-3) if end is not None else 1.0
    rank = {tap: i for i, tap in enumerate(tap_order)}
    conns = sorted(
        {
            (c["tap"], c["conn"])
            for c in result["connections"]
            if not (c.get("probes") and not c["requests"])  # only a tap's own probes
        }
        | {(r["tap"], r["conn"]) for r in result["requests"]},
        key=lambda k: (rank.get(k[0], len(rank)), k[0], k[1]),
    )
    group_size = max(1, math.ceil(len(conns) / max_lanes))
    lanes: list[Lane] = []
    lane_of: dict[tuple[str, int], int] = {}
    by_tap: dict[str, list[int]] = defaultdict(list)
    for tap, conn in conns:
        by_tap[tap].append(conn)
    for tap in sorted(by_tap, key=lambda t: (rank.get(t, len(rank)), t)):
        numbers = by_tap[tap]
        for i in range(0, len(numbers), group_size):
            chunk = numbers[i : i + group_size]
            key = f"{tap}/{chunk[0]}" if len(chunk) == 1 else f"{tap}/{chunk[0]}-{chunk[-1]}"
            for n in chunk:
                lane_of[(tap, n)] = len(lanes)
            lanes.append(Lane(key=key, tap=tap, conns=chunk))

    bars: list[Bar] = []
    stalls: list[StallMark] = []
    lane_of_request: dict[str, int] = {}
    for r in result["requests"]:
        lane = lane_of[(r["tap"], r["conn"])]
        lane_of_request[r["id"]] = lane
        r_end = r.get("end")
        bar_end = (float(r_end) if r_end is not None else origin + span) - origin
        error = (r.get("status") or 0) >= 400 or bool(r.get("error"))
        bars.append(
            Bar(
                request=r["id"],
                lane=lane,
                seq=r["seq"],
                start=r["start"] - origin,
                end=max(bar_end, r["start"] - origin),
                termination=r["termination"],
                error=error,
                ended=r_end is not None,
                stalled=bool(r["stalls"]),
            )
        )
        for n, s in enumerate(r["stalls"], 1):
            s_end = s["end"] if s["end"] is not None else (r_end if r_end is not None else None)
            stalls.append(
                StallMark(
                    gid=f"stall-{r['id']}-{n}",
                    lane=lane,
                    start=s["start"] - origin,
                    end=(float(s_end) if s_end is not None else origin + span) - origin,
                    direction=s["direction"],
                )
            )
    findings = [
        FindingMark(
            id=f["id"],
            kind=f["kind"],
            lane=next((lane_of_request[q] for q in f["requests"] if q in lane_of_request), None),
            t=(f["t"] if f["t"] is not None else origin) - origin,
            note=bool(f["note"]),
        )
        for f in result.get("findings") or []
    ]
    hangs = [m - origin for m in (result.get("evidence") or {}).get("marks") or []]
    fault_plans = [
        (p["t"] - origin, p["faults"])
        for p in (result.get("evidence") or {}).get("fault_plans") or []
    ]
    verdict = result.get("verdict") or {}
    title = f"verdict: {verdict.get('party', 'none')} — {verdict.get('kind', 'healthy')}"
    present = {b.termination for b in bars}
    terminations = [t for t in TERMINATION_COLOURS if t in present or t == "complete"]
    terminations += sorted(present - set(TERMINATION_COLOURS))
    return Timeline(
        origin=origin,
        span=span,
        title=title,
        max_lanes=max_lanes,
        group_size=group_size,
        lanes=lanes,
        bars=bars,
        stalls=stalls,
        findings=findings,
        hangs=hangs,
        engine=engine_series(engine_samples, origin),
        terminations=terminations,
        fault_plans=fault_plans,
    )


def _host(url: str) -> str:
    return urlsplit(url).netloc or url


def engine_series(samples: list[dict[str, Any]], origin: float) -> EngineSeries:
    """Running, queued, router in flight and token rate, summed over engines over time.

    Each engine (host:port) contributes its last known value at every sample time.
    running/queued come from its live ``/v1/loads`` samples when the capture has any
    (SGLang's gauges can be 30 s old), else from its metrics gauges; the token rate from
    its generation-token counter deltas. Samples of the same engine by several taps are
    not added up: the last one stands for the engine.
    """
    ok = sorted((s for s in samples if s.get("ok")), key=lambda s: (s["t"], s["url"]))
    live = {_host(s["url"]) for s in ok if s.get("source") == "loads"}
    running: dict[str, float] = {}
    queued: dict[str, float] = {}
    rate: dict[str, float] = {}
    router: dict[str, float] = {}
    series = EngineSeries()
    for s in ok:
        host, state, profile = _host(s["url"]), s.get("state") or {}, s.get("profile")
        if profile in ROUTER_PROFILES:
            if state.get("in_flight") is not None:
                router[host] = float(state["in_flight"])
        elif profile in ENGINE_PROFILES:
            if (s.get("source") == "loads") == (host in live):
                if state.get("running") is not None:
                    running[host] = float(state["running"])
                if state.get("queued") is not None:
                    queued[host] = float(state["queued"])
            deltas = s.get("deltas") or {}
            interval = s.get("interval") or 0.0
            progress = progress_delta(deltas, profile)
            if interval > 0 and progress is not None:
                rate[host] = progress / interval
        else:
            continue
        series.t.append(s["t"] - origin)
        series.running.append(sum(running.values()))
        series.queued.append(sum(queued.values()))
        series.router.append(sum(router.values()) if router else math.nan)
        series.rate.append(sum(rate.values()) if rate else math.nan)
    series.engines = sorted(set(running) | set(queued) | set(rate))
    series.routers = sorted(router)
    return series
