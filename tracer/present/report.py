"""tracer report: the Markdown to attach to an incident, its timeline picture, and JSON.

The reader is an engineer who was not there. The report gives the verdict first (party,
kind, why), what was ruled out and by which evidence, the timeline picture (SVG and
PNG beside the Markdown: one lane per connection, requests coloured by termination,
stalls, hang marks, the engine's load beneath), the requests that hung, failed or were
truncated, connection reuse, the engine's own figures around each finding, the exact
`tracer replay` commands that reproduce it (same connections, and fresh ones), and the
provenance needed to check it later (capture hashes, taps, time range, versions).
--json writes the same content for machines (schema tracer.report/2, documented in
captures/REPORT.md). The analysis is that of `tracer analyze` (Summary, findings.find):
the report decides nothing new.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .. import __version__
from ..analysis.findings import Context, Evidence
from ..analysis.summary import Summary
from ..atomic import write_atomically
from ..capture.files import CaptureError, expand_captures, read_into
from ..evidence.engines import progress_delta
from ..times import parse_time
from ..wording import counted
from .render import EPOCH, evidence_line

if TYPE_CHECKING:
    from .timeline import Timeline

SCHEMA = "tracer.report/2"
MAX_PLANS_SHOWN = 20  # fault plan changes listed in the Markdown's provenance
AROUND = 1.5  # seconds of engine samples taken on either side of a finding's window
MD_ROWS = 60  # rows of a Markdown table before the rest is left to the JSON
MD_FINDINGS = 12  # findings shown in full; the others of the same kind as one line each
ENGINE_PROFILES = {"sglang", "vllm", "llamacpp"}
ROUTER_PROFILES = {"smg", "sgl_router"}


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare this command's options."""
    parser.epilog = (
        "example: tracer report front.jsonl back.jsonl -o incident.md --json incident.json\n"
        "writes incident.md, incident-timeline.svg and incident-timeline.png (and the JSON)"
    )
    parser.add_argument("captures", nargs="+", metavar="CAPTURE")
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE.md",
        help="the Markdown report; the picture is written beside it as "
        "<name>-timeline.svg and <name>-timeline.png",
    )
    parser.add_argument(
        "--json", metavar="FILE.json", help="also write the report as JSON (tracer.report/2)"
    )
    parser.add_argument(
        "--hang-at",
        action="append",
        default=[],
        metavar="TIME",
        help="the harness was seen hung at about this time (repeatable): "
        "ISO 8601, epoch seconds, or +SECONDS from the capture's start",
    )
    parser.add_argument(
        "--client-facing",
        action="append",
        default=[],
        metavar="TAP",
        help="this tap's clients are the harness itself (no proxy in front)",
    )
    parser.add_argument(
        "--max-lanes",
        type=int,
        default=40,
        metavar="N",
        help="above N connections, each lane of the picture holds a group of connections "
        "(about N lanes in all; default 40)",
    )


def run(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if output.suffix.lower() != ".md":
        raise ValueError(f"-o {args.output}: the report is Markdown, give a .md file name")
    for option, name in (("-o", args.output), ("--json", args.json)):
        if name and not Path(name).parent.is_dir():
            raise ValueError(f"{option} {name}: directory {Path(name).parent} does not exist")
    if args.max_lanes < 1:
        raise ValueError(f"--max-lanes {args.max_lanes}: must be at least 1")
    summary, captures = load(args.captures)
    with summary:  # its rows may spill to temporary files: removed at the end
        return _write(args, summary, captures)


def _write(args: argparse.Namespace, summary: Summary, captures: list[dict[str, Any]]) -> int:
    output = Path(args.output)
    marks = [parse_time(v, summary.first_t, summary.last_t) for v in args.hang_at]
    svg = output.with_name(f"{output.stem}-timeline.svg")
    png = output.with_name(f"{output.stem}-timeline.png")
    doc, timeline = build(
        summary,
        captures,
        hang_at=marks,
        client_facing=list(args.client_facing),
        picture=(svg.name, png.name),
        max_lanes=args.max_lanes,
        command=_command(args),
    )
    from .timeline import draw

    draw(timeline, svg, png)
    write_atomically(output, to_markdown(doc).encode())
    written = [str(output), str(svg), str(png)]
    if args.json:
        write_atomically(Path(args.json), to_json(doc).encode())
        written.append(args.json)
    v = doc["verdict"]
    print(
        f"tracer report: verdict {v['party']} — {v['kind']}; wrote {', '.join(written)}",
        file=sys.stderr,
    )
    return 0


def _command(args: argparse.Namespace) -> str:
    parts = ["tracer", "report", *args.captures, "-o", args.output]
    if args.json:
        parts += ["--json", args.json]
    for value in args.hang_at:
        parts += ["--hang-at", value]
    for tap in args.client_facing:
        parts += ["--client-facing", tap]
    if args.max_lanes != 40:
        parts += ["--max-lanes", str(args.max_lanes)]
    return shlex.join(parts)


def load(paths: list[str]) -> tuple[Summary, list[dict[str, Any]]]:
    """Feed every capture to one Summary; per capture: its hash and what reading it found."""
    summary = Summary()
    try:
        captures = [_feed(summary, path) for path in expand_captures(paths)]
    except BaseException:
        summary.close()
        raise
    return summary, captures


def _feed(summary: Summary, path: str) -> dict[str, Any]:
    """One capture into the summary; what reading it found, and its hash."""
    try:
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        size = Path(path).stat().st_size
    except OSError as exc:
        raise CaptureError(f"cannot read {path}: {exc.strerror or exc}") from exc
    stats = read_into(path, summary.feed)
    if stats.records == 0:
        raise CaptureError(f"{path}: empty, not a tracer capture")
    return {
        **stats.describe(path),
        "name": Path(path).name,
        "sha256": digest,
        "bytes": size,
        "taps": [h.get("tap") for h in stats.headers],
        "headers": stats.headers,
    }


def build(
    summary: Summary,
    captures: list[dict[str, Any]],
    *,
    hang_at: list[float],
    client_facing: list[str],
    picture: tuple[str, str],
    max_lanes: int = 40,
    command: str | None = None,
) -> tuple[dict[str, Any], Timeline]:
    """The report document (what the Markdown and the JSON both say) and its timeline."""
    from .timeline import build as build_timeline

    public = [{k: v for k, v in c.items() if k != "headers"} for c in captures]
    result = summary.result(captures=public, hang_at=hang_at, client_facing=client_facing)
    order = tap_order(summary, result)
    origin = result["time_range"]["start"] or 0.0
    end = result["time_range"]["end"] or origin
    timeline = build_timeline(result, summary.engine, order, max_lanes=max_lanes)
    findings = result["findings"]
    by_id = {f["id"]: f for f in findings}
    verdict = dict(result["verdict"])
    top = by_id.get(verdict.get("finding") or "")
    verdict["evidence"] = top["evidence"] if top else []
    verdict["requests"] = top["requests"] if top else []
    verdict["t"] = top["t"] if top else None
    verdict.setdefault("ruled_out", [])
    named = {q for f in findings for q in f["requests"]}
    rows = {r["id"]: r for r in result["requests"] if r["id"] in named}
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "tracer_version": __version__,
        "verdict": verdict,
        "overview": {
            "taps": order,
            "time_range": _range(origin, end),
            "totals": result["totals"],
            "engine_urls": result["evidence"]["engine_urls"],
            "marks": result["evidence"]["marks"],
            "topology": result.get("topology") or {},
            "tap_lags": result["evidence"].get("tap_lags", []),
        },
        "findings": findings,
        "problem_requests": _by_tap(problem_requests(result, findings), order),
        "connections": _by_tap(connection_reuse(result), order),
        "engine_around_findings": [
            engine_around(f, summary.engine, _window(f, rows, end)) for f in findings
        ],
        "reproduce": reproduce(captures, order, result),
        "timeline": {"svg": picture[0], "png": picture[1], **timeline.summary()},
        "provenance": {
            "captures": public,
            "taps": result["taps"],
            "time_range": _range(origin, end),
            "tracer_version": __version__,
            "capture_tracer_versions": sorted(
                {str(t["tracer_version"]) for t in result["taps"] if t.get("tracer_version")}
            ),
            "hang_at": hang_at,
            "fault_plans": result["evidence"].get("fault_plans", []),
            "client_facing": client_facing,
            "command": command,
        },
    }
    return doc, timeline


def tap_order(summary: Summary, result: dict[str, Any]) -> list[str]:
    """Taps from the client side to the engine side, as the attribution orders them."""
    evidence = Evidence(
        taps=summary.taps,
        connections=summary.connections.values(),
        requests=summary.requests.values(),
        engine=summary.engine,
        probes=summary.probes,
        health=summary.health,
        faults=summary.faults,
        marks=result["evidence"]["marks"],
    )
    order = Context(evidence).order
    rest = sorted(t for t in summary.taps if t not in order)
    return [*order, *rest]


def _by_tap(rows: list[dict[str, Any]], order: list[str]) -> list[dict[str, Any]]:
    """Rows of the client-side tap first (the sort is stable: within a tap, as given)."""
    rank = {t: i for i, t in enumerate(order)}
    return sorted(rows, key=lambda row: rank.get(row["tap"], len(rank)))


def _range(start: float, end: float) -> dict[str, Any]:
    return {
        "start": start,
        "end": end,
        "seconds": round(end - start, 6),
        "start_iso": _iso(start),
        "end_iso": _iso(end),
    }


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def problem_requests(
    result: dict[str, Any], findings: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Requests that hung, failed or were truncated, or that a finding names."""
    named: dict[str, list[str]] = {}
    for f in findings:
        for q in f["requests"]:
            named.setdefault(q, []).append(f["id"])
    out = []
    for r in result["requests"]:
        failed = (r["status"] or 0) >= 400 or bool(r["error"])
        if (
            r["termination"] == "complete"
            and not failed
            and not r["stalls"]
            and r["id"] not in named
        ):
            continue
        out.append(
            {
                "id": r["id"],
                "tap": r["tap"],
                "connection": f"{r['tap']}/{r['conn']}",
                "seq": r["seq"],
                "reused": r["reused"],
                "idle_before": r["idle_before"],
                "start": r["start"],
                "end": r["end"],
                "method": r["method"],
                "target": r["target"],
                "request_id": r["request_id"],
                "status": r["status"],
                "ttfb": r["ttfb"],
                "first_token": r["first_token"],
                "duration": r["duration"],
                "max_gap": r["max_gap"],
                "events": r["events"],
                "done": r["done"],
                "termination": r["termination"],
                "close": r["close"],
                "detail": r["detail"],
                "error": r["error"],
                "stalls": r["stalls"],
                "injected": r["injected"],
                "findings": named.get(r["id"], []),
            }
        )
    return out


def _reuse_figures() -> dict[str, Any]:
    return {"count": 0, "idles": 0, "max_idle": None, "outcomes": {}, "first_bad": None}


def connection_reuse(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per connection: how many requests it carried, the idle gaps, how they ended."""
    per: dict[str, dict[str, Any]] = {}
    for r in result["requests"]:  # one pass, a few figures per connection
        agg = per.setdefault(f"{r['tap']}/{r['conn']}", _reuse_figures())
        agg["count"] += 1
        agg["outcomes"][r["termination"]] = agg["outcomes"].get(r["termination"], 0) + 1
        if r["reused"]:
            agg["idles"] += 1
            agg["max_idle"] = max(agg["max_idle"] or 0.0, r["idle_before"])
        if r["termination"] != "complete":
            first = agg["first_bad"]
            agg["first_bad"] = r["seq"] if first is None else min(first, r["seq"])
    out = []
    for c in result["connections"]:
        agg = per.get(c["id"]) or _reuse_figures()
        out.append(
            {
                "id": c["id"],
                "tap": c["tap"],
                "peer": c["peer"],
                "opened": c["opened"],
                "closed": c["closed"],
                "requests": max(c["requests"], agg["count"]),
                "reused_requests": agg["idles"],
                "max_idle_before_reuse": agg["max_idle"],
                "outcomes": dict(sorted(agg["outcomes"].items())),
                "first_not_complete": agg["first_bad"],
                "closed_by": c["closed_by"],
                "how": c["how"],
                "in_flight_at_close": c["in_flight_at_close"],
            }
        )
    return out


def _window(f: dict[str, Any], rows: dict[str, dict[str, Any]], end: float) -> tuple[float, float]:
    """The span a finding is about: from its time to the end of its requests."""
    reqs = [rows[q] for q in f["requests"] if q in rows]
    t = f["t"]
    if not reqs:
        at = t if t is not None else end
        return at - 5.0, at  # a hang mark: the moments before it (as the analysis looks)
    start = t if t is not None else min(r["start"] for r in reqs)
    stop = max((r["end"] if r["end"] is not None else end) for r in reqs)
    return start, max(start, stop)


def _host(url: str) -> str:
    return urlsplit(url).netloc or url


def engine_around(
    f: dict[str, Any], samples: list[dict[str, Any]], window: tuple[float, float]
) -> dict[str, Any]:
    """Each engine's (and router's) own figures before a finding's window and during it.

    The rules are those of the attribution (``findings.Context.engine_view``): running and
    queued from the samples inside the phase (live ``/v1/loads`` ones where the engine has
    them), tokens from the counter deltas whose interval lies inside the phase.
    """
    start, stop = window
    phases = {"before": (start - AROUND, start), "during": (start, stop)}
    live = {_host(s["url"]) for s in samples if s["ok"] and s.get("source") == "loads"}
    engines: list[dict[str, Any]] = []
    routers: list[dict[str, Any]] = []
    for phase, (low, high) in phases.items():
        inside = sorted(
            (s for s in samples if low <= s["t"] <= high), key=lambda s: (s["t"], s["url"])
        )
        engines += _engine_rows(phase, low, high, inside, live)
        routers += _router_rows(phase, inside)
    return {
        "finding": f["id"],
        "kind": f["kind"],
        "window": {"start": start, "end": stop, "before": AROUND},
        "engines": engines,
        "routers": routers,
    }


def _engine_rows(
    phase: str, low: float, high: float, samples: list[dict[str, Any]], live: set[str]
) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for s in samples:
        host, profile, state = _host(s["url"]), s.get("profile"), s.get("state") or {}
        if profile in ROUTER_PROFILES or (s["ok"] and profile not in ENGINE_PROFILES):
            continue
        e = rows.setdefault(
            host,
            {
                "engine": host,
                "phase": phase,
                "start": low,
                "end": high,
                "profile": profile,
                "source": "loads" if host in live else "metrics",
                "samples": 0,
                "failed_scrapes": 0,
                "running": None,
                "queued_max": None,
                "generation_tokens": None,
                "token_rate": None,
                "_seconds": 0.0,
            },
        )
        if not s["ok"]:
            e["failed_scrapes"] += 1
            continue
        e["samples"] += 1
        e["profile"] = e["profile"] or profile
        if (s.get("source") == "loads") == (host in live):
            if state.get("running") is not None:
                value = int(state["running"])
                old = e["running"] or [value, value]
                e["running"] = [min(old[0], value), max(old[1], value)]
            if state.get("queued") is not None:
                e["queued_max"] = max(e["queued_max"] or 0, int(state["queued"]))
        deltas, interval = s.get("deltas") or {}, s.get("interval") or 0.0
        tokens = progress_delta(deltas, profile)
        if interval > 0 and tokens is not None and s["t"] - interval >= low - 1e-9:
            e["generation_tokens"] = (e["generation_tokens"] or 0) + tokens
            e["_seconds"] += interval
    for e in rows.values():
        seconds = e.pop("_seconds")
        if seconds > 0:
            e["token_rate"] = round(e["generation_tokens"] / seconds, 3)
    return [rows[k] for k in sorted(rows)]


def _router_rows(phase: str, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for s in samples:
        if s.get("profile") not in ROUTER_PROFILES:
            continue
        host, state = _host(s["url"]), s.get("state") or {}
        r = rows.setdefault(
            host, {"router": host, "phase": phase, "samples": 0, "in_flight_max": None}
        )
        r["samples"] += 1
        if s["ok"] and state.get("in_flight") is not None:
            r["in_flight_max"] = max(r["in_flight_max"] or 0, int(state["in_flight"]))
    return [rows[k] for k in sorted(rows)]


def reproduce(
    captures: list[dict[str, Any]], order: list[str], result: dict[str, Any]
) -> list[dict[str, Any]]:
    """``tracer replay`` against each capture's upstream: same connections, then fresh ones."""
    seen_taps = {r["tap"] for r in result["requests"] if r["method"]}
    rank = {t: i for i, t in enumerate(order)}
    out = []
    for c in captures:
        several = len({h.get("tap") for h in c["headers"]}) > 1
        for header in c["headers"]:
            tap, upstream = header.get("tap"), header.get("upstream")
            if not upstream or tap not in seen_taps:
                continue
            base = ["tracer", "replay", c["path"], "--target", str(upstream)]
            if several:  # a file holding several taps' records: replay this tap's
                base += ["--tap", str(tap)]
            out.append(
                {
                    "tap": tap,
                    "capture": c["path"],
                    "target": upstream,
                    "same_connections": shlex.join(base),
                    "fresh_connections": shlex.join([*base, "--connections", "fresh"]),
                }
            )
            seen_taps.discard(tap)
    return sorted(out, key=lambda x: (rank.get(x["tap"], len(rank)), x["tap"]))


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ---- Markdown -----------------------------------------------------------------------------


class _Clock:
    """Times for a reader: seconds from the captures' start, epoch quotes annotated."""

    def __init__(self, origin: float) -> None:
        self.origin = origin

    def rel(self, t: float | None) -> str:
        return "-" if t is None else f"{t - self.origin:+.3f} s"

    def quote(self, text: str) -> str:
        """``t=1796008676.953`` -> ``+1.629 s`` (the absolute start is in the overview)."""
        return EPOCH.sub(lambda m: self.rel(float(m.group(1))), text)

    def evidence(self, item: dict[str, Any]) -> str:
        """An evidence item: its text with its times (``render.evidence_line``)."""
        return evidence_line(item, self.rel)


def _dur(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.1f} ms"
    return f"{value:.3f} s" if value < 100 else f"{value:.0f} s"


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value).replace("|", "\\|")


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_cell(x) for x in row) + " |" for row in rows]
    return out


def to_markdown(doc: dict[str, Any]) -> str:
    """The report for a person: verdict first, evidence quoted with its times."""
    ov = doc["overview"]
    clock = _Clock(ov["time_range"]["start"])
    v = doc["verdict"]
    totals = ov["totals"]
    out = [f"# Incident report: {v['party']} — {v['kind']}", ""]
    at = f" at {clock.rel(v['t'])}" if v.get("t") is not None else ""
    finding = f", finding {v['finding']}{at}" if v.get("finding") else ""
    out += [
        f"**Verdict: {v['party']} — `{v['kind']}`** ({v['confidence']} confidence{finding}). "
        f"{v['summary']}",
        "",
    ]
    if v.get("caveats"):
        out += ["**Caveats** (what the captures may be missing):", ""]
        out += [f"- {c['text']}" for c in v["caveats"]]
        out += [""]
    tr = ov["time_range"]
    terms = ", ".join(f"{k} {n}" for k, n in totals["terminations"].items()) or "none"
    out += [
        f"Captured from {tr['start_iso']} to {tr['end_iso']} ({tr['seconds']:.1f} s) by "
        f"tap(s) {', '.join(ov['taps']) or '-'}"
        f"{' (client side first)' if len(ov['taps']) > 1 else ''}: "
        f"{totals['connections']} connections, {totals['requests']} requests "
        f"({totals['reused_requests']} on reused keep-alive connections), "
        f"{totals['stalls']} stall(s); terminations: {terms}. Times below are seconds from "
        f"the start ({tr['start_iso']}); quoted evidence keeps the epoch time `t=` with "
        "the offset beside it.",
        "",
    ]
    if totals["capture_records_lost"]:
        out += [f"**Warning:** the captures lost {totals['capture_records_lost']} records.", ""]
    out += _chain_md(ov)
    out += ["## Ruled out, and by which evidence", ""]
    if v["ruled_out"]:
        out += [f"- **{r['party']}** ruled out: {clock.quote(r['why'])}" for r in v["ruled_out"]]
    elif v["finding"] is None:
        out.append("- no fault was found, so there is nothing to rule out")
    else:
        out.append("- the verdict's evidence rules out no party")
    if v["evidence"]:
        out += ["", f"Evidence ({v['finding']}):", ""]
        out += [f"- {clock.evidence(item)}" for item in v["evidence"]]
    out += [""]
    out += _timeline_md(doc)
    out += _findings_md(doc, clock)
    out += _problems_md(doc, clock)
    out += _connections_md(doc, clock)
    out += _engine_md(doc, clock)
    out += _reproduce_md(doc)
    out += _provenance_md(doc)
    return "\n".join(out).rstrip("\n") + "\n"


def _timeline_md(doc: dict[str, Any]) -> list[str]:
    tl = doc["timeline"]
    if tl["heat"]:
        lanes = (
            f"{tl['lanes']} lanes of up to {tl['connections_per_lane']} connection(s) each "
            "(a band's shade is how many of its requests were in flight; requests that did "
            "not complete cleanly are drawn one by one on top)"
        )
    else:
        lanes = f"one lane per connection ({tl['lanes']})"
    return [
        "## Timeline",
        "",
        f"![timeline]({tl['svg']})",
        "",
        f"[PNG]({tl['png']}) · {lanes}; each request a bar coloured by termination, stalls "
        f"hatched ({tl['stalls']}), hang marks dashed ({tl['hang_marks']}), findings as "
        "labelled triangles; beneath, on the same time axis, the engines' running and "
        "queued requests and generation tokens/s.",
        "",
    ]


def _findings_md(doc: dict[str, Any], clock: _Clock) -> list[str]:
    findings = doc["findings"]
    out = ["## Findings", ""]
    if not findings:
        return [*out, "None: the captures show no anomaly.", ""]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for f in findings:
        groups.setdefault((f["party"], f["kind"], f["summary"]), []).append(f)
    shown = 0
    for (party, kind, _), group in groups.items():
        f = group[0]
        tag = "note, not a fault" if f["note"] else f"{party}, {f['confidence']} confidence"
        ids = ", ".join(g["id"] for g in group)
        if len(group) > 4:
            ids = f"{group[0]['id']} … {group[-1]['id']} ({len(group)} findings)"
        out += [f"### {ids}: `{kind}` ({tag})", "", f["summary"], ""]
        if shown >= MD_FINDINGS:
            out += [
                f"{counted(len(group), 'finding')} of this kind; the JSON has their evidence.",
                "",
            ]
            continue
        shown += 1
        if len(group) > 1:
            out += [f"{f['id']} at {clock.rel(f['t'])} (the others below):", ""]
        else:
            out += [f"At {clock.rel(f['t'])}.", ""]
        if f["requests"]:
            out += [f"- requests: {', '.join('`' + q + '`' for q in f['requests'])}"]
        out += [f"- {clock.evidence(item)}" for item in f["evidence"]]
        out += [f"- ruled out **{r['party']}**: {clock.quote(r['why'])}" for r in f["ruled_out"]]
        if f.get("settle"):
            out.append(f"- to settle: {f['settle']}")
        out.append("")
        for g in group[1:MD_ROWS]:
            reqs = ", ".join("`" + q + "`" for q in g["requests"]) or "-"
            out.append(f"- {g['id']} at {clock.rel(g['t'])}: {reqs}")
        if len(group) > MD_ROWS:
            out.append(f"- … and {len(group) - MD_ROWS} more (in the JSON)")
        if len(group) > 1:
            out.append("")
    return out


def _problems_md(doc: dict[str, Any], clock: _Clock) -> list[str]:
    rows = doc["problem_requests"]
    out = ["## Requests that hung, failed or were truncated", ""]
    if not rows:
        return [*out, "None: every request completed without error or stall.", ""]
    table = []
    for r in rows[:MD_ROWS]:
        termination = r["termination"] + (f" (upstream {r['close']})" if r["close"] else "")
        stalls = "; ".join(
            f"{s['direction']} {clock.rel(s['start'])}"
            + (f" for {_dur(s['duration'])}" if s["duration"] is not None else ", never ended")
            for s in r["stalls"]
        )
        table.append(
            [
                f"`{r['id']}`",
                r["connection"],
                f"{r['seq']} ({'reused' if r['reused'] else 'fresh'})",
                _dur(r["idle_before"]) if r["reused"] else "fresh",
                clock.rel(r["start"]),
                f"{r['method']} {r['target']}",
                r["request_id"],
                r["status"],
                _dur(r["ttfb"]),
                _dur(r["first_token"]),
                _dur(r["duration"]),
                termination,
                stalls or None,
                ", ".join(r["findings"]) or None,
            ]
        )
    out += _table(
        [
            "request",
            "connection",
            "position",
            "idle before",
            "start",
            "request line",
            "x-request-id",
            "status",
            "ttfb",
            "first token",
            "duration",
            "termination",
            "stalls",
            "findings",
        ],
        table,
    )
    if len(rows) > MD_ROWS:
        out.append(f"\n… and {len(rows) - MD_ROWS} more (in the JSON).")
    return [*out, ""]


def _connections_md(doc: dict[str, Any], clock: _Clock) -> list[str]:
    conns = doc["connections"]
    out = ["## Connection reuse", ""]
    if not conns:
        return [*out, "No connections.", ""]
    troubled = [c for c in conns if c["first_not_complete"] is not None]
    shown = conns if len(conns) <= MD_ROWS else troubled[:MD_ROWS]
    rows = [
        [
            c["id"],
            clock.rel(c["opened"]),
            c["requests"],
            c["reused_requests"],
            _dur(c["max_idle_before_reuse"]),
            ", ".join(f"{k} {n}" for k, n in c["outcomes"].items()) or None,
            c["first_not_complete"],
            c["closed_by"] or "open",
            c["how"],
        ]
        for c in shown
    ]
    out += _table(
        [
            "connection",
            "opened",
            "requests",
            "reuses",
            "longest idle before reuse",
            "outcomes",
            "first not complete (position)",
            "closed by",
            "how",
        ],
        rows,
    )
    if len(shown) < len(conns):
        quiet = [c for c in conns if c["first_not_complete"] is None]
        reqs = [c["requests"] for c in quiet] or [0]
        out.append(
            f"\nShown: {len(shown)} of the {counted(len(troubled), 'connection')} with a request that "
            f"did not complete. The {len(quiet)} others carried {min(reqs)}-{max(reqs)} "
            "requests each, all complete (the JSON lists every connection)."
        )
    return [*out, ""]


def _engine_md(doc: dict[str, Any], clock: _Clock) -> list[str]:
    out = ["## Engine state around each finding", ""]
    items = doc["engine_around_findings"]
    if not items:
        return [*out, "No findings.", ""]
    rows = []
    for item in items[:MD_ROWS]:
        if not item["engines"] and not item["routers"]:
            w = item["window"]
            when = f"{clock.rel(w['start'] - w['before'])} to {clock.rel(w['end'])}"
            rows.append([item["finding"], item["kind"], "no engine samples", when, *["-"] * 6])
        for e in item["engines"]:
            running = e["running"]
            rows.append(
                [
                    item["finding"],
                    item["kind"],
                    f"{e['engine']} ({e['profile'] or '?'}, {e['source']})",
                    f"{e['phase']}: {clock.rel(e['start'])} to {clock.rel(e['end'])}",
                    e["samples"],
                    "-" if running is None else f"{running[0]}-{running[1]}",
                    e["queued_max"],
                    e["generation_tokens"],
                    e["token_rate"],
                    e["failed_scrapes"],
                ]
            )
        for r in item["routers"]:
            rows.append(
                [
                    item["finding"],
                    item["kind"],
                    f"{r['router']} (router)",
                    r["phase"],
                    r["samples"],
                    f"in flight ≤ {r['in_flight_max']}",
                    *["-"] * 4,
                ]
            )
    out += [
        f"Each engine's own metrics in the {items[0]['window']['before']:g} s before the "
        "finding's window and during it: running/queued from the live `/v1/loads` where the "
        "capture has it (else the metrics gauges, which SGLang refreshes only every 40 "
        "decode steps), generation tokens from the counter deltas that fall inside.",
        "",
    ]
    out += _table(
        [
            "finding",
            "kind",
            "engine",
            "phase",
            "samples",
            "running (min-max)",
            "queued (max)",
            "generation tokens",
            "tokens/s",
            "failed scrapes",
        ],
        rows,
    )
    if len(items) > MD_ROWS:
        out.append(f"\n… and {len(items) - MD_ROWS} more findings (in the JSON).")
    return [*out, ""]


def _reproduce_md(doc: dict[str, Any]) -> list[str]:
    out = ["## How to reproduce", ""]
    items = doc["reproduce"]
    if not items:
        return [
            *out,
            "No capture names an upstream to replay against (engine-only captures).",
            "",
        ]
    out += [
        "Replay the captured requests against the same upstream the tap forwarded to: first "
        "with the same connection reuse and timing, then over fresh connections. If the "
        "first hangs again at the same position and the second completes, the fault follows "
        "keep-alive reuse on the path, not the engine.",
        "",
    ]
    for item in items:
        out += [
            f"Tap `{item['tap']}` (capture `{item['capture']}`, upstream {item['target']}):",
            "",
            "```sh",
            item["same_connections"],
            item["fresh_connections"],
            "```",
            "",
        ]
    return out


def _chain_md(ov: dict[str, Any]) -> list[str]:
    """The chain of hops the analysis believes in, and what each link rests on."""
    topo = ov.get("topology") or {}
    if not topo.get("chain"):
        return []
    out = [f"Chain: `{topo['chain']}` (`?`: a hop no tap saw).", ""]
    out += [f"- {why}" for why in topo.get("why", [])]
    lags = ov.get("tap_lags") or []
    if lags:
        worst = max(lags, key=lambda lag: lag["max_lag"])
        out += [
            f"- the taps' own event loops ran late {counted(len(lags), 'time')}, at worst "
            f"{worst['max_lag'] * 1000:.0f} ms (tap {worst['tap']}): timing findings there "
            "are notes"
        ]
    return [*out, ""]


def _provenance_md(doc: dict[str, Any]) -> list[str]:
    p = doc["provenance"]
    out = ["## Provenance", ""]
    out += _table(
        [
            "capture",
            "taps",
            "sha256",
            "bytes",
            "records",
            "bad lines",
            "torn tail",
            "bodies lost",
            "format",
        ],
        [
            [
                f"`{c['path']}`",
                ", ".join(str(t) for t in c["taps"]),
                f"`{c['sha256']}`",
                c["bytes"],
                c["records"],
                c["bad_lines"],
                "yes" if c["torn_tail"] else "no",
                c["bodies_unresolved"],
                c["version"],
            ]
            for c in p["captures"]
        ],
    )
    out += [""]
    out += _table(
        ["tap", "kind", "listen", "upstream", "tracer", "started", "ended", "records dropped"],
        [
            [
                t["tap"],
                t["kind"],
                t["listen"],
                t["upstream"],
                t["tracer_version"],
                _iso(t["started"]) if t["started"] is not None else None,
                _iso(t["ended"]) if t["ended"] is not None else "no capture_end",
                t["dropped"],
            ]
            for t in p["taps"]
        ],
    )
    tr = p["time_range"]
    out += [
        "",
        f"- time range: {tr['start_iso']} to {tr['end_iso']} "
        f"(epoch {tr['start']:.3f} to {tr['end']:.3f}, {tr['seconds']:.3f} s)",
        f"- report made by tracer {p['tracer_version']}; schema `{doc['schema']}`",
    ]
    if p["hang_at"]:
        out.append("- hang marks given: " + ", ".join(f"{t:.3f}" for t in p["hang_at"]))
    for plan in p["fault_plans"][:MAX_PLANS_SHOWN]:
        faults = ", ".join(f"`{f}`" for f in plan["faults"]) or "none"
        out.append(
            f"- faults changed at tap {plan['tap']}, {_iso(plan['t'])} ({plan['change']}): "
            f"{faults} from then on"
        )
    if len(p["fault_plans"]) > MAX_PLANS_SHOWN:
        out.append(f"- ... and {len(p['fault_plans']) - MAX_PLANS_SHOWN} more fault plan changes")
    if p["client_facing"]:
        out.append("- client-facing taps: " + ", ".join(p["client_facing"]))
    if p["command"]:
        out.append(f"- made with: `{p['command']}`")
    return [*out, ""]
