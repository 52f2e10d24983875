"""Drawing the timeline picture: a ``Timeline`` (``timeline.build``) to SVG and PNG.

Apart from the picture's content (``timeline``) so that what the picture shows can be
built and tested without rendering it; matplotlib is imported only here, inside the
functions that draw.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from ..atomic import write_atomically
from .timeline import (
    DPI,
    ERROR_EDGE,
    FAULT_PLAN_COLOUR,
    HANG_COLOUR,
    HEAT_HIGH,
    HEAT_LOW,
    HEAT_MID,
    LANE_COLOUR,
    LANE_IN,
    OTHER_COLOUR,
    STALL_COLOUR,
    TERMINATION_COLOURS,
    WIDTH_IN,
    FindingMark,
    Lane,
    Timeline,
)


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
