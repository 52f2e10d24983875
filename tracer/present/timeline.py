"""The timeline picture of an incident: connections, requests, stalls, hangs, engine load.

Theory of operation
-------------------
``build(result, engine_samples, tap_order)`` turns an analysis result (``Summary.result``)
and the capture's engine samples into a ``Timeline``: plain data, no drawing, so what
the picture will show can be tested without rendering it. ``draw(timeline, svg, png)``
renders it with matplotlib (Agg, no display) into an SVG and a PNG.

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

import io
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from ..atomic import write_atomically
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


# ---- drawing ------------------------------------------------------------------------------


def draw(tl: Timeline, svg: Path, png: Path) -> None:
    """Render the timeline into an SVG and a PNG (deterministic bytes)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lanes_in = max(1.2, LANE_IN * max(len(tl.lanes), 1) + 0.5)
    engine_in = 2.2
    height = lanes_in + engine_in + 1.6
    with matplotlib.rc_context(
        {
            "svg.hashsalt": "tracer-timeline",
            "svg.fonttype": "none",
            "font.family": "DejaVu Sans",
            "font.size": 9,
            "path.simplify": True,
            "image.composite_image": False,  # one <image> per heat band, with its id
        }
    ):
        fig = Figure(figsize=(WIDTH_IN, height), dpi=DPI)
        FigureCanvasAgg(fig)
        grid = fig.add_gridspec(
            2,
            1,
            height_ratios=[lanes_in, engine_in],
            hspace=0.12,
            left=0.1,
            right=0.93,
            top=1 - 0.95 / height,
            bottom=0.55 / height,
        )
        ax = fig.add_subplot(grid[0])
        eng = fig.add_subplot(grid[1], sharex=ax)
        _draw_lanes(ax, tl)
        _draw_engine(eng, tl)
        for n, at in enumerate(tl.hangs, 1):
            ax.axvline(at, color=HANG_COLOUR, linestyle="--", linewidth=1.4, gid=f"hang-{n}")
            _line_label(ax, at, 1.0, "hang", HANG_COLOUR, fontsize=8, fontweight="bold")
            eng.axvline(at, color=HANG_COLOUR, linestyle="--", linewidth=1.4)
        labelled = -math.inf
        for n, (at, plan) in enumerate(tl.fault_plans, 1):
            ax.axvline(at, color=FAULT_PLAN_COLOUR, linestyle=":", linewidth=1.2, gid=f"faults-{n}")
            if not plan or at - labelled < tl.span * 0.02:
                continue  # a line alone: the end of a fault, or no room for its text
            labelled = at
            text = "faults: " + ", ".join(plan)
            _line_label(ax, at, 0.0, text[:60], FAULT_PLAN_COLOUR, fontsize=7, rotation=90)
        margin = tl.span * 0.01
        ax.set_xlim(-margin, tl.span + margin)
        _legend(fig, tl)
        fig.suptitle(
            f"tracer timeline — {tl.title}", x=0.1, y=1 - 0.12 / height, ha="left", fontsize=11
        )
        for path, kind, extra in (
            (svg, "svg", {"metadata": {"Date": None}}),
            (png, "png", {"dpi": DPI, "metadata": {"Software": None}}),
        ):
            buf = io.BytesIO()
            fig.savefig(buf, format=kind, **extra)
            write_atomically(Path(path), buf.getvalue())


def _draw_lanes(ax: Any, tl: Timeline) -> None:
    from matplotlib.patches import Rectangle

    n = len(tl.lanes)
    ax.set_ylim(n - 0.5 if n else 0.5, -0.5)
    ax.set_yticks(range(n))
    ax.set_yticklabels([_lane_label(lane) for lane in tl.lanes], fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelbottom=False, direction="in")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    if not n:
        ax.text(0.5, 0.5, "no connections in these captures", transform=ax.transAxes, ha="center")
        return
    low, high = -tl.span, tl.span * 2  # wider than any view: the lanes span the whole axis
    for i, lane in enumerate(tl.lanes):
        ax.add_patch(
            Rectangle(
                (low, i - 0.42),
                high - low,
                0.84,
                facecolor=LANE_COLOUR,
                edgecolor="none",
                gid=f"lane-{lane.key}",
                zorder=0,
            )
        )
    for i in range(1, n):
        if tl.lanes[i].tap != tl.lanes[i - 1].tap:
            ax.axhline(i - 0.5, color="#555555", linewidth=0.8)
    if tl.heat:
        _draw_heat(ax, tl)
    tiny = tl.span * 0.002  # a bar is never thinner than this, so short requests show
    label = not tl.heat and len(tl.bars) <= 300
    for b in tl.drawn_bars():
        colour = TERMINATION_COLOURS.get(b.termination, OTHER_COLOUR)
        ax.add_patch(
            Rectangle(
                (b.start, b.lane - 0.3),
                max(b.end - b.start, tiny),
                0.6,
                facecolor=colour,
                edgecolor=ERROR_EDGE if b.error else _darker(colour),
                linewidth=1.6 if b.error else 0.5,
                gid=f"req-{b.request}",
                zorder=2,
            )
        )
        if label and b.end - b.start >= tl.span * 0.03:
            ax.text(
                b.start + tl.span * 0.004,
                b.lane,
                f"#{b.seq}",
                va="center",
                ha="left",
                fontsize=7,
                color="white",
                zorder=4,
            )
    for s in tl.stalls:
        ax.add_patch(
            Rectangle(
                (s.start, s.lane - 0.3),
                max(s.end - s.start, tiny),
                0.6,
                facecolor="none",
                edgecolor=STALL_COLOUR,
                hatch="////",
                linewidth=1.0,
                gid=s.gid,
                zorder=3,
            )
        )
    labelled = _labelled(tl)
    for f in tl.findings:
        if f.lane is None:
            continue
        colour = "#555555" if f.note else "#111111"
        ax.plot(
            [f.t],
            [f.lane - 0.36],
            marker="v",
            markersize=6,
            color=colour,
            zorder=5,
            gid=f"finding-{f.id}",
        )
        if f.id in labelled:
            ax.text(
                f.t,
                f.lane - 0.44,
                labelled[f.id],
                ha="center",
                va="bottom",
                fontsize=7,
                fontweight="bold",
                color=colour,
                zorder=5,
            )
    if tl.layout == "grouped":
        ax.set_ylabel(f"connections, {tl.group_size} per lane", fontsize=8)


def _draw_heat(ax: Any, tl: Timeline) -> None:
    """Requests in flight per lane over time (the mean over each of 600 time bins, so
    that short requests and gaps are neither lost nor aliased), one image row per lane."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    bins = 600
    width = tl.span / bins
    counts = np.zeros((len(tl.lanes), bins))
    for b in tl.bars:
        u0 = min(max(b.start / width, 0.0), float(bins))
        u1 = min(max(b.end / width, u0 + 1e-3), float(bins))  # an instant still shows
        idx = np.arange(min(int(u0), bins - 1), min(math.ceil(u1), bins))
        counts[b.lane, idx] += np.minimum(u1, idx + 1) - np.maximum(u0, idx)
    peak = float(counts.max()) or 1.0
    blues = ListedColormap(  # quieter than the termination colours
        [
            tuple(lo + (hi - lo) * x for lo, hi in zip(HEAT_LOW, HEAT_HIGH, strict=True))
            for x in np.linspace(0, 1, 64)
        ]
    )
    for i in range(len(tl.lanes)):
        row = np.ma.masked_equal(counts[i : i + 1], 0)
        ax.imshow(
            row,
            extent=(0, tl.span, i + 0.42, i - 0.42),
            aspect="auto",
            cmap=blues,
            vmin=0,
            vmax=peak,
            interpolation="nearest",
            zorder=1,
            gid=f"heat-{tl.lanes[i].key}",
        )
    ax.set_ylim(len(tl.lanes) - 0.5, -0.5)
    ax.text(
        1.0,
        -0.5,
        f"band shade: requests in flight per lane, mean over {_span(width)} (darkest = {peak:.2g})",
        transform=ax.get_yaxis_transform(),
        ha="right",
        va="bottom",
        fontsize=7,
        color="#333333",
    )


def _labelled(tl: Timeline) -> dict[str, str]:
    """Finding labels that do not overlap: the first of each cluster on a lane, with a
    count of the others ("F3 +2")."""
    near = tl.span * 0.04
    out: dict[str, str] = {}
    marks = sorted((f for f in tl.findings if f.lane is not None), key=lambda f: (f.lane, f.t))
    head: FindingMark | None = None
    extra = 0
    for f in [*marks, None]:
        if f is not None and head is not None and f.lane == head.lane and f.t - head.t < near:
            extra += 1
            continue
        if head is not None:
            out[head.id] = head.id + (f" +{extra}" if extra else "")
        head, extra = f, 0
    return out


def _span(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _lane_label(lane: Lane) -> str:
    if lane.grouped:
        return f"{lane.key} ({len(lane.conns)})"
    return lane.key


def _darker(colour: str) -> str:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"#{int(r * 0.7):02x}{int(g * 0.7):02x}{int(b * 0.7):02x}"


def _draw_engine(ax: Any, tl: Timeline) -> None:
    e = tl.engine
    ax.set_xlabel(f"seconds since {_iso(tl.origin)}")
    for side in ("top",):
        ax.spines[side].set_visible(False)
    if not e.known:
        ax.set_yticks([])
        ax.text(
            0.5,
            0.5,
            "no engine metrics in these captures (run the tap with --engine-metrics URL)",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="#555555",
        )
        return
    t = [*e.t, tl.span]
    ax.step(
        t,
        [*e.queued, e.queued[-1]],
        where="post",
        color="#e69f00",
        linewidth=1.4,
        label="queued",
        gid="engine-queued",
    )
    ax.step(
        t,
        [*e.running, e.running[-1]],
        where="post",
        color="#0072b2",
        linewidth=1.6,
        label="running",
        gid="engine-running",
    )
    if e.routers:
        ax.step(
            t,
            [*e.router, e.router[-1]],
            where="post",
            color="#555555",
            linestyle=":",
            linewidth=1.4,
            label="router in flight",
            gid="engine-router",
        )
    top = max([*e.running, *e.queued, *[x for x in e.router if not math.isnan(x)], 1.0])
    upper = top * 1.25 + 0.5
    ax.set_ylim(-upper * 0.03, upper)  # a zero line stays visible above the axis
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("requests", fontsize=8)
    rate_ax = ax.twinx()
    rates = [0.0 if math.isnan(x) else x for x in e.rate]
    rate_ax.fill_between(
        t,
        [*rates, rates[-1]],
        step="post",
        color="#009e73",
        alpha=0.22,
        linewidth=0,
        label="generation tokens/s",
        gid="engine-tokens",
    )
    rate_top = max([*rates, 1.0]) * 1.25
    rate_ax.set_ylim(-rate_top * 0.03, rate_top)
    rate_ax.set_ylabel("tokens/s", fontsize=8, color="#00734f")
    rate_ax.spines["top"].set_visible(False)
    ax.set_zorder(rate_ax.get_zorder() + 1)  # the lines above the token-rate fill
    ax.patch.set_visible(False)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = rate_ax.get_legend_handles_labels()
    order = ["running", "queued", "router in flight", "generation tokens/s"]
    pairs = sorted(zip(handles + h2, labels + l2, strict=True), key=lambda p: order.index(p[1]))
    ax.legend(
        [h for h, _ in pairs],
        [label for _, label in pairs],
        loc="upper right",
        fontsize=7,
        ncol=4,
        frameon=False,
    )
    engines = ", ".join(e.engines[:4]) + (
        f", … {len(e.engines) - 4} more" if len(e.engines) > 4 else ""
    )
    ax.set_title(f"engine ({len(e.engines)}: {engines})", loc="left", fontsize=8, color="#333333")


def _line_label(ax: Any, at: float, y: float, text: str, colour: str, **style: Any) -> None:
    """Text beside a vertical line at ``at``, ``y`` up the axes (0: bottom, 1: top)."""
    ax.annotate(
        text,
        (at, y),
        xycoords=("data", "axes fraction"),
        xytext=(2, 2),
        textcoords="offset points",
        color=colour,
        **style,
    )


def _legend(fig: Any, tl: Timeline) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [
        Patch(facecolor=TERMINATION_COLOURS.get(t, OTHER_COLOUR), label=t.replace("_", " "))
        for t in tl.terminations
    ]
    if tl.heat:
        handles.append(Patch(facecolor=HEAT_MID, label="in flight (band shade)"))
    handles.append(
        Patch(facecolor="white", edgecolor=ERROR_EDGE, linewidth=1.6, label="error status/event")
    )
    handles.append(Patch(facecolor="white", edgecolor=STALL_COLOUR, hatch="////", label="stall"))
    handles.append(Line2D([0], [0], color=HANG_COLOUR, linestyle="--", label="hang mark"))
    if tl.fault_plans:
        handles.append(
            Line2D([0], [0], color=FAULT_PLAN_COLOUR, linestyle=":", label="faults changed")
        )
    handles.append(Line2D([0], [0], color="#111111", marker="v", linestyle="none", label="finding"))
    fig.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(0.1, 1 - 0.42 / fig.get_figheight()),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
        handlelength=1.6,
        columnspacing=1.2,
    )


def _iso(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
