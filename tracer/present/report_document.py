"""The report's document: what the Markdown and the JSON both say (``tracer.report/2``).

Apart from the command so that the document can be built and tested without writing
files, and apart from the Markdown so that the JSON never depends on how people read it.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..analysis.findings import Context, Evidence
from ..analysis.findings.clocks import Clocks, clocks_to_apply
from ..analysis.summary import Summary
from ..capture.files import PACKETS, CaptureError, PacketOptions, expand_captures, read_into
from ..capture.reader import capture_headers
from ..protocol.probe_mark import KnownTaps
from .clock_pass import one_clock
from .report_engine import engine_around

if TYPE_CHECKING:
    from .timeline import Timeline


SCHEMA = "tracer.report/2"


def load(
    paths: list[str], packets: PacketOptions = PACKETS
) -> tuple[Summary, list[dict[str, Any]]]:
    """Feed every capture to one Summary; per capture: its hash and what reading it found
    (``packets``: how a pcap is read as taps)."""
    files = expand_captures(paths)
    headers = capture_headers(files)
    known = KnownTaps.of(headers)
    clocks: Clocks | None = None
    while True:
        summary = Summary(known_taps=known, clocks=clocks)
        try:
            captures = [_feed(summary, path, packets) for path in files]
            # taps whose clocks disagree: once measured, read again on one clock
            if clocks is None and not one_clock(files, headers):
                clocks = clocks_to_apply(summary.result(captures=captures))
                if clocks is not None:
                    summary.close()
                    continue
        except BaseException:
            summary.close()
            raise
        break
    return summary, captures


def _feed(summary: Summary, path: str, packets: PacketOptions) -> dict[str, Any]:
    """One capture into the summary; what reading it found, and its hash."""
    try:
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        size = Path(path).stat().st_size
    except OSError as exc:
        raise CaptureError(f"cannot read {path}: {exc.strerror or exc}") from exc
    stats = read_into(path, summary.feed, packets)
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
            "clocks": result.get("clocks") or {},
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
