"""From raw runs to metrics, medians over rounds, ratios, the printed table and the checks."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .loadgen import ZERO_GAP, LoadResult

EVENTS_PER_STREAM = 65  # 64 content events + data: [DONE]


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of unsorted values; None if empty."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


_PROBES = (
    "proxy",
    "upstream",
    "loadgen",
    "others",
    "foreign",
    "helpers",
    "steal_proxy",
    "steal_rig",
)


def _utils(cpu: dict[str, float], w: float) -> dict[str, Any]:
    """Each probe's CPU seconds (``run._measure``) as a share of a core over the window
    (``<probe>_util``), and the rig's (upstream + load generator)."""
    m: dict[str, Any] = {f"{name}_util": _div(cpu.get(name, 0.0), w) for name in _PROBES}
    m["rig_util"] = (m["upstream_util"] or 0.0) + (m["loadgen_util"] or 0.0)
    return m


def load_metrics(res: LoadResult) -> dict[str, Any]:
    """Metrics of one closed-loop run (plain, stream or paced)."""
    w = res.window
    cpu = res.cpu
    m: dict[str, Any] = {
        "window_s": round(w, 3),
        "errors": res.errors,
        "drain_s": round(res.drain, 3),
        "undrained": res.undrained,
        **_utils(cpu, w),
    }
    if res.mode == "plain":
        m.update(
            rps=res.completed / w,
            lat_p50=pct(res.latency, 50),
            lat_p99=pct(res.latency, 99),
            cpu_per_req=_div(cpu.get("proxy"), res.completed),
            helpers_per_req=_div(cpu.get("helpers"), res.completed),
            requests=res.completed,
        )
    else:
        streams = res.events / EVENTS_PER_STREAM
        zero = sum(1 for g in res.gaps if g < ZERO_GAP)
        m.update(
            eps=res.events / w,
            ttfb_p50=pct(res.ttfb, 50),
            streams_per_s=streams / w,
            ttfe_p50=pct(res.ttfe, 50),
            ttfe_p99=pct(res.ttfe, 99),
            gap_p50=pct(res.gaps, 50),
            gap_p99=pct(res.gaps, 99),
            zero_gap=_div(zero, len(res.gaps)),
            cpu_per_stream=_div(cpu.get("proxy"), streams),
            cpu_per_event=_div(cpu.get("proxy"), res.events),
            helpers_per_event=_div(cpu.get("helpers"), res.events),
            events=res.events,
            streams_timed=len(res.ttfe),
            bad_event_counts=res.bad_events,
        )
    return m


def wrk_metrics(res: dict[str, Any]) -> dict[str, Any]:
    w = res["window"]
    cpu = res["cpu"]
    lat = res.get("latency", {})
    requests = res.get("requests")
    m: dict[str, Any] = {
        "window_s": round(w, 3),
        "errors": res.get("errors", 0),
        "rps": res.get("rps"),
        "lat_p50": lat.get("p50"),
        "lat_p99": lat.get("p99"),
        "cpu_per_req": _div(cpu.get("proxy"), requests),
        "requests": requests,
        **_utils(cpu, w),
    }
    return m


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


# ---- formatting -----------------------------------------------------------------------


def fmt_time(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 1e-3:
        return f"{v * 1e6:.0f} µs"
    if v < 1.0:
        return f"{v * 1e3:.2f} ms"
    return f"{v:.2f} s"


def fmt_added(v: float | None) -> str:
    if v is None:
        return "-"
    sign = "+" if v >= 0 else "-"
    return sign + fmt_time(abs(v))


def fmt_rate(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 10000:
        return f"{v / 1000:.1f}k"
    return f"{v:.0f}"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f} %"


def fmt_cpu_share(v: float | None) -> str:
    """CPU-seconds per second (per connection): as µs of CPU each second."""
    return "-" if v is None else f"{v * 1e6:.2f} µs/s"


def fmt_kib(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} KiB"


def fmt_ratio(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 0.1 else f"{v:.2f}"


@dataclass(frozen=True)
class Row:
    label: str
    key: str
    fmt: Callable[[float | None], str]
    ratio: bool = True  # ratio columns for this row


PLAIN_ROWS = [
    Row("req/s", "rps", fmt_rate),
    Row("latency p50", "lat_p50", fmt_time),
    Row("latency added p50", "lat_added_p50", fmt_added, ratio=False),
    Row("latency p99", "lat_p99", fmt_time),
    Row("proxy CPU / request", "cpu_per_req", fmt_time),
]
STREAM_ROWS = [
    Row("events/s", "eps", fmt_rate),
    Row("first event p50", "ttfe_p50", fmt_time),
    Row("first event p99", "ttfe_p99", fmt_time),
    Row("gap p50", "gap_p50", fmt_time, ratio=False),
    Row("gap p99", "gap_p99", fmt_time),
    Row("zero gaps (<100 µs)", "zero_gap", fmt_pct, ratio=False),
    Row("proxy CPU / stream", "cpu_per_stream", fmt_time),
    Row("proxy CPU / event", "cpu_per_event", fmt_time),
]
PACED_ROWS = [
    Row("response head p50", "ttfb_p50", fmt_time),
    Row("first event p50", "ttfe_p50", fmt_time),
    Row("first event added p50", "ttfe_added_p50", fmt_added, ratio=False),
    Row("first event p99", "ttfe_p99", fmt_time),
    Row("gap p50", "gap_p50", fmt_time),
    Row("gap p99", "gap_p99", fmt_time),
    Row("zero gaps (<100 µs)", "zero_gap", fmt_pct, ratio=False),
    Row("events/s", "eps", fmt_rate),
    Row("proxy CPU / stream", "cpu_per_stream", fmt_time),
]
IDLE_ROWS = [
    Row("RSS / idle conn (first 1000)", "rss_per_conn_first", fmt_kib),
    Row("RSS / idle conn (next 1000)", "rss_per_conn_next", fmt_kib),
    Row("CPU / idle conn (2000 open)", "cpu_per_idle_conn", fmt_cpu_share),
    Row("new conn + 1st request p50 (50 at once)", "new_conn_p50", fmt_time),
    Row("new conn + 1st request p99 (50 at once)", "new_conn_p99", fmt_time),
]


def rows_for(scenario: str) -> list[Row]:
    mode = scenario.split("-")[0]
    return {
        "plain": PLAIN_ROWS,
        "wrk": PLAIN_ROWS,
        "stream": STREAM_ROWS,
        "paced": PACED_ROWS,
        "idle": IDLE_ROWS,
    }[mode]


RATIOS = (("tracer", "direct"), ("tracer", "mitmdump"), ("tracer", "nginx"))


def aggregate(
    runs: dict[str, dict[str, list[dict[str, Any]]]], targets: list[str]
) -> dict[str, Any]:
    """Medians over rounds per (scenario, target), and per-round paired ratios."""
    agg: dict[str, Any] = {}
    for scen, by_target in runs.items():
        # paced: time to first event added vs direct, paired by round
        # paced: time to first event added vs direct; plain: latency added; paired by round
        key = "ttfe_p50" if scen.startswith("paced") else "lat_p50"
        if scen.split("-")[0] in ("paced", "plain", "wrk") and "direct" in by_target:
            direct = {m.get("round"): m for m in by_target["direct"]}
            for rounds in by_target.values():
                for m in rounds:
                    d = direct.get(m.get("round"))
                    if d and m.get(key) is not None and d.get(key) is not None:
                        m[key.replace("_p50", "_added_p50")] = m[key] - d[key]
        values: dict[str, dict[str, Any]] = {}
        keys = {r.key for r in rows_for(scen)} | {"proxy_util", "rig_util", "errors"}
        keys |= {"upstream_util", "loadgen_util", "others_util", "foreign_util"}
        keys |= {"steal_proxy_util", "steal_rig_util"}
        keys |= {"bad_event_counts"}
        for name in targets:
            rounds = by_target.get(name, [])
            if rounds:
                values[name] = {k: median([m.get(k) for m in rounds]) for k in keys}
                values[name]["rounds"] = len(rounds)
        ratios: dict[str, dict[str, float | None]] = {}
        for a, b in RATIOS:
            rb = {m.get("round"): m for m in by_target.get(b, [])}
            pairs = [(m, rb[m.get("round")]) for m in by_target.get(a, []) if m.get("round") in rb]
            if pairs:
                ratios[f"{a}/{b}"] = {
                    k: median([_div(x.get(k), y.get(k)) for x, y in pairs]) for k in keys
                }
        agg[scen] = {"values": values, "ratios": ratios}
    return agg


def render_table(agg: dict[str, Any], targets: list[str], scenarios: list[str]) -> str:
    ratio_cols = [f"{a}/{b}" for a, b in RATIOS if a in targets and b in targets]
    header = ["scenario", "metric", *targets, *ratio_cols]
    lines: list[list[str]] = []
    for scen in scenarios:
        if scen not in agg:
            continue
        vals, ratios = agg[scen]["values"], agg[scen]["ratios"]
        for i, row in enumerate(rows_for(scen)):
            cells = [scen if i == 0 else "", row.label]
            cells += [row.fmt(vals.get(t, {}).get(row.key)) if t in vals else "-" for t in targets]
            cells += [
                fmt_ratio(ratios.get(rc, {}).get(row.key)) if row.ratio else "" for rc in ratio_cols
            ]
            lines.append(cells)
        if not scen.startswith("idle"):
            cells = ["", "CPU core0 rig / core1 proxy"]
            for t in targets:
                v = vals.get(t)
                if v is None:
                    cells.append("-")
                else:
                    proxy = "-" if t == "direct" else f"{(v['proxy_util'] or 0) * 100:.0f}%"
                    cells.append(f"{(v['rig_util'] or 0) * 100:.0f}% / {proxy}")
            cells += [""] * len(ratio_cols)
            lines.append(cells)
            errs = {t: vals[t].get("errors") for t in targets if t in vals}
            if any(errs.values()):
                cells = ["", "errors"] + [str(int(errs.get(t) or 0)) for t in targets]
                lines.append(cells + [""] * len(ratio_cols))
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]

    def fmt_line(cells: list[str]) -> str:
        out = []
        for i, c in enumerate(cells):
            out.append(c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    text = [fmt_line(header), sep]
    prev = None
    for cells in lines:
        if cells[0] and prev is not None:
            text.append("")
        text.append(fmt_line(cells))
        prev = cells
    return "\n".join(text)


# ---- checks ---------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    status: str  # PASS, MISS, n/a
    detail: str
    value: float | None = None
    threshold: float | None = None
    margin: float | None = None  # > 0: passed by this fraction of the threshold

    def line(self) -> str:
        margin = "" if self.margin is None else f" (margin {self.margin * 100:+.0f}%)"
        return f"{self.status:4}  {self.name}: {self.detail}{margin}"


def _get(agg: dict[str, Any], scen: str, kind: str, name: str, key: str) -> float | None:
    part = agg.get(scen, {}).get(kind, {}).get(name, {})
    v = part.get(key)
    return None if v is None else float(v)


def _at_least(name: str, value: float | None, threshold: float, what: str) -> Check:
    if value is None:
        return Check(name, "n/a", f"not measured ({what})")
    ok = value >= threshold
    return Check(
        name,
        "PASS" if ok else "MISS",
        f"{value:.2f}x (need ≥ {threshold:g}x)",
        value,
        threshold,
        value / threshold - 1,
    )


def _at_most(
    name: str, value: float | None, threshold: float, fmt: Callable[[float | None], str], what: str
) -> Check:
    if value is None:
        return Check(name, "n/a", f"not measured ({what})")
    ok = value <= threshold
    margin = 1 - value / threshold if threshold else None
    return Check(
        name,
        "PASS" if ok else "MISS",
        f"{fmt(value)} (need ≤ {fmt(threshold)})",
        value,
        threshold,
        margin,
    )


def _versus_nginx(name: str, agg: dict[str, Any], scen: str, key: str, times: float) -> Check:
    """The tap's figure against ``times`` nginx's, both from the same run: at most for a
    cost, at least for a rate (``eps``)."""
    tr = _get(agg, scen, "values", "tracer", key)
    ng = _get(agg, scen, "values", "nginx", key)
    what = f"{scen}, tracer and nginx"
    if ng is None or tr is None:
        return Check(name, "n/a", f"not measured ({what})")
    if key == "eps":
        c = _at_least(name, tr / ng, times, what)
    else:
        c = _at_most(name, tr, times * ng, fmt_time, what)
    c.detail += f"; {tr / ng:.2f}x nginx's {fmt_rate(ng) if key == 'eps' else fmt_time(ng)}"
    return c


def checks(agg: dict[str, Any]) -> list[Check]:
    out = [
        _at_least(
            "plain c=64 req/s ≥ 5x mitmdump (own load generator)",
            _get(agg, "plain-c64", "ratios", "tracer/mitmdump", "rps"),
            5,
            "plain-c64, tracer and mitmdump",
        ),
        _at_least(
            "plain c=64 req/s ≥ 5x mitmdump (wrk)",
            _get(agg, "wrk-c64", "ratios", "tracer/mitmdump", "rps"),
            5,
            "wrk-c64, tracer and mitmdump",
        ),
        _at_least(
            "stream c=64 events/s ≥ 3x mitmdump",
            _get(agg, "stream-c64", "ratios", "tracer/mitmdump", "eps"),
            3,
            "stream-c64, tracer and mitmdump",
        ),
    ]
    out.append(
        _versus_nginx("plain c=64 CPU per request ≤ 5x nginx", agg, "plain-c64", "cpu_per_req", 5)
    )
    out.append(_versus_nginx("stream c=64 events/s ≥ 0.7x nginx", agg, "stream-c64", "eps", 0.7))
    out.append(
        _versus_nginx(
            "paced c=16 CPU per stream ≤ 1.5x nginx", agg, "paced-c16", "cpu_per_stream", 1.5
        )
    )
    added = _get(agg, "paced-c16", "values", "tracer", "ttfe_added_p50")
    nginx_added = _get(agg, "paced-c16", "values", "nginx", "ttfe_added_p50")
    limit = max(250e-6, 2 * nginx_added) if nginx_added is not None else 250e-6
    c = _at_most(
        "paced c=16 first event added vs direct p50 ≤ max(250 µs, 2x nginx's)",
        added,
        limit,
        fmt_time,
        "paced-c16, tracer and direct",
    )
    if nginx_added is None and added is not None:
        c.detail += " (nginx not measured: 250 µs)"
    c.detail += _steal_note(agg, "paced-c16")
    out.append(c)
    first = _get(agg, "idle", "values", "tracer", "rss_per_conn_first")
    nxt = _get(agg, "idle", "values", "tracer", "rss_per_conn_next")
    worst = max((v for v in (first, nxt) if v is not None), default=None)
    c = _at_most("memory per idle connection ≤ 64 KiB", worst, 64.0, fmt_kib, "idle, tracer")
    if worst is not None:
        c.detail += " (the larger of first and next 1000)"
    out.append(c)
    # coalescing: paced gaps like direct's; few zero gaps
    gap = _get(agg, "paced-c16", "values", "tracer", "gap_p99")
    dgap = _get(agg, "paced-c16", "values", "direct", "gap_p99")
    zero = _get(agg, "paced-c16", "values", "tracer", "zero_gap")
    name = "no coalescing at paced c=16: gap p99 ≤ direct's + 0.5 ms, zero gaps ≤ 1 %"
    if gap is None or dgap is None or zero is None:
        out.append(Check(name, "n/a", "not measured (paced-c16, tracer and direct)"))
    else:
        limit = dgap + 0.5e-3
        ok = gap <= limit and zero <= 0.01
        margin = min(1 - gap / limit, 1 - zero / 0.01)
        out.append(
            Check(
                name,
                "PASS" if ok else "MISS",
                f"gap p99 {fmt_time(gap)} (direct {fmt_time(dgap)}), zero gaps {fmt_pct(zero)}"
                + _steal_note(agg, "paced-c16"),
                gap,
                limit,
                margin,
            )
        )
    return out


def _steal_note(agg: dict[str, Any], scen: str) -> str:
    """Said beside a timing check when the host took the proxy's core for a while (steal,
    the median of the tap's rounds): direct does not use that core, so its timings are
    not late by it, and the check compares the tap with a luckier run."""
    stolen = _get(agg, scen, "values", "tracer", "steal_proxy_util")
    if stolen is None or stolen <= 0.05:
        return ""
    return f"; the host took {stolen * 100:.0f}% of the proxy's core (steal): partly its delay"
