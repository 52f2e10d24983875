"""The report for a person: the document (``report_document``) as Markdown.

Its own module because it decides only how the document reads: verdict first, tables cut
at ``MD_ROWS`` (the JSON keeps every row), times as offsets from the captures' start.
"""

from __future__ import annotations

from typing import Any

from ..wording import counted
from .render import EPOCH, clock_lines, evidence_line
from .report_document import _iso

MAX_PLANS_SHOWN = 20  # fault plan changes listed in the Markdown's provenance
MD_ROWS = 60  # rows of a Markdown table before the rest is left to the JSON
MD_FINDINGS = 12  # findings shown in full; the others of the same kind as one line each


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
    out += [f"- {line}" for line in clock_lines(ov.get("clocks") or {})]
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
