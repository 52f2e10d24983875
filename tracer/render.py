"""Render an analysis result as text tables (rich) or JSON; deterministic output."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, is_dataclass
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table


def to_json(result: dict[str, Any]) -> str:
    buf = io.StringIO()
    write_json(result, buf)
    return buf.getvalue()


def write_json(result: dict[str, Any], out: TextIO) -> None:
    """The same bytes as ``json.dumps(result, indent=2, sort_keys=True)``, written row by
    row so that the rows never exist twice in memory (as objects and as one string)."""
    keys = sorted(result)
    out.write("{\n")
    for i, key in enumerate(keys):
        value = result[key]
        out.write(f"  {json.dumps(key)}: ")
        if key in ("requests", "connections") and value:
            out.write("[\n")
            for j, row in enumerate(value):
                item = asdict(row) if is_dataclass(row) and not isinstance(row, type) else row
                text = json.dumps(item, indent=2, sort_keys=True, ensure_ascii=False)
                out.write("    " + text.replace("\n", "\n    "))
                out.write(",\n" if j < len(value) - 1 else "\n")
            out.write("  ]")
        else:
            text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
            out.write(text.replace("\n", "\n  "))
        out.write(",\n" if i < len(keys) - 1 else "\n")
    out.write("}\n")


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 10:
        return f"{value:.1f}s"
    return f"{value * 1000:.1f}ms" if value < 1 else f"{value:.3f}s"


def _rel(value: float | None, origin: float) -> str:
    return "-" if value is None else f"+{value - origin:.3f}s"


def _rel_time(t: float | None, origin: float) -> str:
    return "-" if t is None else f"+{t - origin:.3f}s"


def verdict_lines(result: dict[str, Any]) -> list[str]:
    """The verdict, then each finding: party, kind, why, evidence, what is ruled out."""
    origin = result["time_range"]["start"] or 0.0
    v = result.get("verdict") or {}
    lines = [
        f"VERDICT: {v.get('party', 'none')} — {v.get('kind', 'healthy')} "
        f"({v.get('confidence', '-')} confidence). {v.get('summary', '')}"
    ]
    for r in v.get("ruled_out") or []:
        lines.append(f"  ruled out {r['party']}: {r['why']}")
    for f in result.get("findings") or []:
        tag = "note" if f["note"] else f"{f['party']}, {f['confidence']}"
        lines.append("")
        lines.append(
            f"{f['id']} [{tag}] {f['kind']} at {_rel_time(f['t'], origin)}: {f['summary']}"
        )
        if f["requests"]:
            lines.append(f"  requests: {', '.join(f['requests'])}")
        for item in f["evidence"]:
            lines.append(f"  - {item}")
        for r in f["ruled_out"]:
            lines.append(f"  ruled out {r['party']}: {r['why']}")
        if f.get("settle"):
            lines.append(f"  to settle: {f['settle']}")
    return lines


def to_text(result: dict[str, Any], *, width: int = 200) -> str:
    buf = io.StringIO()
    console = Console(
        file=buf, width=width, color_system=None, force_terminal=False, highlight=False
    )
    for line in verdict_lines(result):
        console.print(line, markup=False, soft_wrap=True)
    console.print()
    totals = result["totals"]
    origin = result["time_range"]["start"] or 0.0
    taps = ", ".join(t["tap"] for t in result["taps"]) or "-"
    console.print(
        f"taps: {taps}   connections: {totals['connections']}   requests: {totals['requests']} "
        f"({totals['reused_requests']} on reused connections)   stalls: {totals['stalls']}"
    )
    terms = "  ".join(f"{k}={v}" for k, v in totals["terminations"].items()) or "-"
    console.print(f"terminations: {terms}")
    if totals["capture_records_lost"]:
        console.print(f"WARNING: the capture lost {totals['capture_records_lost']} records")

    conns = Table(title="connections", title_justify="left", show_edge=False, pad_edge=False)
    for col in (
        "conn",
        "peer",
        "opened",
        "reqs",
        "closed by",
        "how",
        "half-close",
        "in flight",
        "bytes c->u",
        "bytes u->c",
        "upstream",
    ):
        conns.add_column(col, no_wrap=True)
    for c in result["connections"]:
        upstream = c["upstream_error"] or c["upstream_local"] or "-"
        conns.add_row(
            c["id"],
            c["peer"],
            _rel(c["opened"], origin),
            str(c["requests"]),
            c["closed_by"] or "open",
            c["how"] or "-",
            c["half_close"] or "-",
            "-"
            if c["in_flight_at_close"] is None
            else ("yes" if c["in_flight_at_close"] else "no"),
            str(c["bytes_from_client"] if c["bytes_from_client"] is not None else "-"),
            str(c["bytes_from_upstream"] if c["bytes_from_upstream"] is not None else "-"),
            upstream,
        )
    console.print(conns)

    reqs = Table(title="requests", title_justify="left", show_edge=False, pad_edge=False)
    for col in (
        "request",
        "start",
        "idle before",
        "request line",
        "x-request-id",
        "status",
        "ttfb",
        "first token",
        "duration",
        "max gap",
        "events",
        "[DONE]",
        "finish",
        "termination",
        "stalls",
    ):
        reqs.add_column(col, no_wrap=True)
    for r in result["requests"]:
        stalls = ",".join(f"{s['direction']}" for s in r["stalls"]) or "-"
        termination = r["termination"]
        if r["close"]:
            termination += f" ({r['close']}{', mid-event' if r['mid_event'] else ''})"
        reqs.add_row(
            r["id"],
            _rel(r["start"], origin),
            _ms(r["idle_before"]) if r["reused"] else "fresh",
            f"{r['method']} {r['target']}",
            r["request_id"] or "-",
            str(r["status"] or "-"),
            _ms(r["ttfb"]),
            _ms(r["first_token"]),
            _ms(r["duration"]),
            _ms(r["max_gap"]),
            str(r["events"]) if r["sse"] else "-",
            ("yes" if r["done"] else "no") if r["sse"] else "-",
            r["finish_reason"] or "-",
            termination,
            stalls,
        )
    console.print(reqs)
    return buf.getvalue()


def _md_cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value).replace("|", "\\|")


def to_markdown(result: dict[str, Any]) -> str:
    """Verdict first, then findings and the tables, as Markdown."""
    origin = result["time_range"]["start"] or 0.0
    v = result.get("verdict") or {}
    out = [
        "# tracer analysis",
        "",
        f"**Verdict: {v.get('party', 'none')} — {v.get('kind', 'healthy')}** "
        f"({v.get('confidence', '-')} confidence). {v.get('summary', '')}",
        "",
    ]
    for r in v.get("ruled_out") or []:
        out.append(f"- ruled out **{r['party']}**: {r['why']}")
    if result.get("findings"):
        out += ["", "## Findings", ""]
    for f in result.get("findings") or []:
        tag = "note" if f["note"] else f"{f['party']}, {f['confidence']} confidence"
        out.append(f"### {f['id']} `{f['kind']}` ({tag}) at {_rel_time(f['t'], origin)}")
        out.append("")
        out.append(f["summary"])
        out.append("")
        if f["requests"]:
            out.append(f"Requests: {', '.join('`' + r + '`' for r in f['requests'])}")
            out.append("")
        out += [f"- {item}" for item in f["evidence"]]
        out += [f"- ruled out **{r['party']}**: {r['why']}" for r in f["ruled_out"]]
        if f.get("settle"):
            out.append(f"- to settle: {f['settle']}")
        out.append("")
    out += [
        "## Requests",
        "",
        "| request | start | idle before | method target | x-request-id | status | ttfb | "
        "first token | duration | events | [DONE] | termination |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["requests"]:
        out.append(
            "| "
            + " | ".join(
                _md_cell(x)
                for x in (
                    r["id"],
                    _rel_time(r["start"], origin),
                    f"{r['idle_before']:.3f}s" if r["reused"] else "fresh",
                    f"{r['method']} {r['target']}",
                    r["request_id"],
                    r["status"],
                    _ms(r["ttfb"]),
                    _ms(r["first_token"]),
                    _ms(r["duration"]),
                    r["events"] if r["sse"] else None,
                    ("yes" if r["done"] else "no") if r["sse"] else None,
                    r["termination"],
                )
            )
            + " |"
        )
    out += [
        "",
        "## Connections",
        "",
        "| connection | peer | requests | closed by | how | in flight at close |",
        "|---|---|---|---|---|---|",
    ]
    for c in result["connections"]:
        out.append(
            "| "
            + " | ".join(
                _md_cell(x)
                for x in (
                    c["id"],
                    c["peer"],
                    c["requests"],
                    c["closed_by"] or "open",
                    c["how"],
                    c["in_flight_at_close"],
                )
            )
            + " |"
        )
    return "\n".join(out) + "\n"
