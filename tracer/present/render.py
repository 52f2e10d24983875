"""Render an analysis result as text tables (rich) or JSON; deterministic output."""

from __future__ import annotations

import io
import json
import math
import re
import textwrap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields, is_dataclass
from itertools import batched
from json.encoder import encode_basestring as _encode_str
from typing import Any, TextIO

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from ..times import iso
from ..wording import counted
from .marks import mark_lines


def to_json(result: dict[str, Any]) -> str:
    buf = io.StringIO()
    write_json(result, buf)
    return buf.getvalue()


def write_json(result: dict[str, Any], out: TextIO) -> None:
    """The same bytes as ``json.dumps(result, indent=2, sort_keys=True)``, written row by
    row so that the rows never exist together in memory (as objects or as one string)."""
    keys = sorted(result)
    out.write("{\n")
    for i, key in enumerate(keys):
        value = result[key]
        out.write(f"  {json.dumps(key)}: ")
        if key in ("requests", "connections"):  # rows, streamed (``Rows``: not for json)
            count = len(value)
            if not count:
                out.write("[]")
            else:
                out.write("[\n")
                for j, row in enumerate(value, 1):
                    out.write(_row_json(row) + (",\n" if j < count else "\n"))
                out.write("  ]")
        else:
            text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
            out.write(text.replace("\n", "\n  "))
        out.write(",\n" if i < len(keys) - 1 else "\n")
    out.write("}\n")


def _float_json(value: float) -> str:
    return float.__repr__(value) if math.isfinite(value) else json.dumps(value)


def _nested_json(value: Any) -> str:
    if not value and type(value) in (list, dict):
        return "[]" if type(value) is list else "{}"
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    return text.replace("\n", "\n      ")


_ENCODERS: dict[type, Callable[[Any], str]] = {
    str: _encode_str,
    int: int.__repr__,
    float: _float_json,
    bool: lambda value: "true" if value else "false",
    type(None): lambda value: "null",
}
_FIELDS: dict[type, tuple[list[str], list[str]]] = {}  # names (sorted) and their prefixes


def _row_json(row: Any) -> str:
    """One table row as ``json.dumps(row, indent=2, sort_keys=True)`` indented by four,
    built field by field (the stdlib's indenting encoder is pure Python and slow)."""
    if is_dataclass(row) and not isinstance(row, type):
        known = _FIELDS.get(type(row))
        if known is None:
            names = sorted(f.name for f in fields(row))
            known = _FIELDS[type(row)] = (names, [f"      {_encode_str(n)}: " for n in names])
        names, prefixes = known
        values = [getattr(row, name) for name in names]
    else:
        names = sorted(row)
        prefixes = [f"      {_encode_str(n)}: " for n in names]
        values = [row[name] for name in names]
    get, nested = _ENCODERS.get, _nested_json
    parts = [p + get(type(v), nested)(v) for p, v in zip(prefixes, values, strict=True)]
    return "    {\n" + ",\n".join(parts) + "\n    }"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 10:
        return f"{value:.1f}s"
    return f"{value * 1000:.1f}ms" if value < 1 else f"{value:.3f}s"


def _rel(value: float | None, origin: float) -> str:
    return "-" if value is None else f"+{value - origin:.3f}s"


_rel_time = _rel


# an epoch time quoted in an evidence text (``t=1796008676.953``)
EPOCH = re.compile(r"\bt=(\d+\.\d+)")


def evidence_line(item: dict[str, Any], rel: Callable[[float], str]) -> str:
    """An evidence item (``tracer.analysis/4``) for a reader: its text, each epoch time
    quoted in it as its offset from the captures' start (``rel``; the absolute start is
    in the header, once); a text that quotes no time, about an item that has one, after
    that time's offset."""
    text = str(item["text"])
    if EPOCH.search(text):
        return EPOCH.sub(lambda m: rel(float(m.group(1))), text)
    if item.get("t") is not None:
        return f"{rel(float(item['t']))}: {text}"
    return text


def verdict_lines(result: dict[str, Any]) -> list[str]:
    """The verdict, then each finding: party, kind, why, evidence, what is ruled out."""
    origin = result["time_range"]["start"] or 0.0
    v = result.get("verdict") or {}
    lines = [
        f"VERDICT: {v.get('party', 'none')} — {v.get('kind', 'healthy')} "
        f"({v.get('confidence', '-')} confidence). {v.get('summary', '')}"
    ]

    def rel(t: float) -> str:
        return _rel_time(t, origin)

    def quoted(text: str) -> str:  # epoch times quoted in a sentence, as offsets
        return EPOCH.sub(lambda m: rel(float(m.group(1))), text)

    for r in v.get("ruled_out") or []:
        lines.append(f"  ruled out {r['party']}: {quoted(r['why'])}")
    for caveat in v.get("caveats") or []:
        lines.append(f"  caveat: {caveat['text']}")

    for f in result.get("findings") or []:
        tag = "note" if f["note"] else f"{f['party']}, {f['confidence']}"
        lines.append("")
        lines.append(
            f"{f['id']} [{tag}] {f['kind']} at {_rel_time(f['t'], origin)}: {f['summary']}"
        )
        if f["requests"]:
            lines.append(f"  requests: {', '.join(f['requests'])}")
        for item in f["evidence"]:
            lines.append(f"  - {evidence_line(item, rel)}")
        for r in f["ruled_out"]:
            lines.append(f"  ruled out {r['party']}: {quoted(r['why'])}")
        if f.get("settle"):
            lines.append(f"  to settle: {quoted(f['settle'])}")
    marks = mark_lines(result, rel, "  - ")
    return [*lines, "", *marks] if marks else lines


CONNECTION_COLUMNS = (
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
)
REQUEST_COLUMNS = (
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
)
TABLE_CHUNK = 500  # rows rendered by rich at a time
TABLE_WIDTH = 400  # a table wider than the terminal wraps there; its cells stay whole


# the tables' columns without --wide: what answers "which one, when, how did it end"
COMPACT_CONNECTION_COLUMNS = ("conn", "opened", "reqs", "closed by", "how", "in flight")
COMPACT_REQUEST_COLUMNS = (
    "request",
    "start",
    "request line",
    "status",
    "ttfb",
    "duration",
    "max gap",
    "termination",
    "stalls",
)
COMPACT_TARGET = 40  # characters of a request line's target shown without --wide


def to_text(result: dict[str, Any], *, width: int = 200) -> str:
    buf = io.StringIO()
    write_text(result, buf, width=width, wide=True)
    return buf.getvalue()


def header_line(result: dict[str, Any]) -> str | None:
    """The captures' absolute time range, once: every other time is relative to it."""
    tr = result.get("time_range") or {}
    start, end = tr.get("start"), tr.get("end")
    if start is None or end is None:
        return None
    return (
        f"captures {iso(start)} to {iso(end)} ({end - start:.3f} s); times below are "
        "seconds from the start (+s)"
    )


def _limited(
    rows: Iterable[dict[str, Any]], limit: int | None, troubled: Callable[[dict[str, Any]], bool]
) -> Iterator[dict[str, Any]]:
    """At most ``limit`` rows (None: all), the troubled ones first, in table order."""
    if limit is None:
        yield from rows
        return
    shown = 0
    for row in rows:  # first pass: the rows that went wrong
        if shown < limit and troubled(row):
            shown += 1
            yield row
    if shown < limit:
        for row in rows:
            if shown >= limit:
                break
            if not troubled(row):
                shown += 1
                yield row


def _request_troubled(r: dict[str, Any]) -> bool:
    return r["termination"] != "complete" or bool(r["stalls"]) or (r["status"] or 0) >= 400


def _connection_troubled(c: dict[str, Any]) -> bool:
    return bool(c["in_flight_at_close"]) or c["how"] == "reset" or bool(c["upstream_error"])


def clock_lines(clocks: dict[str, Any]) -> list[str]:
    """Each tap pair's clock offset with its bounds, and what the analysis did with it."""
    applied = clocks.get("applied") or {}
    out = []
    for p in clocks.get("pairs") or []:
        off = p["offset"]
        if not p["consistent"]:
            how = "the requests' bounds contradict each other: not applied"
        elif p["to"] in applied or p["from"] in applied:
            how = "applied: times shifted onto one clock"
        else:
            how = "within what the requests can tell: one clock taken"
        out.append(
            f"clocks: {p['to']} reads {off:+.3f} s against {p['from']} (between "
            f"{p['low']:+.3f} and {p['high']:+.3f} s, from {p['requests']} requests both "
            f"answered): {how}"
        )
    return out


def write_text(
    result: dict[str, Any],
    out: TextIO,
    *,
    width: int = 200,
    limit: int | None = None,
    wide: bool = False,
    brief: bool = False,
) -> None:
    """Verdict, findings, totals, then the connections and requests tables, written to
    ``out`` a chunk of rows at a time; with ``limit``, each table shows at most that many
    rows, those that went wrong first (large captures stay readable and quick). Without
    ``wide`` the tables keep their essential columns (they fit 100 columns or so), and
    prose wraps at ``width``; ``brief``: the verdict and findings only."""
    console = _console(out, width)
    header = header_line(result)
    for line in [header] if header else []:
        console.print(line if wide else _wrapped(line, width), markup=False, soft_wrap=True)
    for line in verdict_lines(result):
        console.print(line if wide else _wrapped(line, width), markup=False, soft_wrap=True)
    console.print()
    if brief:
        return
    totals = result["totals"]
    origin = result["time_range"]["start"] or 0.0
    taps = ", ".join(t["tap"] for t in result["taps"]) or "-"
    console.print(
        f"taps: {taps}   connections: {totals['connections']}   requests: {totals['requests']} "
        f"({totals['reused_requests']} on reused connections)   stalls: {totals['stalls']}"
    )
    terms = "  ".join(f"{k}={v}" for k, v in totals["terminations"].items()) or "-"
    console.print(f"terminations: {terms}")
    chain = (result.get("topology") or {}).get("chain")
    if chain:
        console.print(f"chain: {chain}   (?: a hop no tap saw)", markup=False)
    lags = result["evidence"].get("tap_lags") or []
    if lags:
        worst = max(lags, key=lambda lag: lag["max_lag"])
        console.print(
            f"WARNING: the taps' own event loops ran late {counted(len(lags), 'time')}, at worst "
            f"{worst['max_lag'] * 1000:.0f} ms (tap {worst['tap']}): timing findings there "
            "are notes"
        )
    for pair in result["evidence"].get("tap_pairs", []):
        delay = pair["median_delay"]
        seen = (
            "no request seen by both"
            if delay is None
            else (
                f"requests reach {pair['to']} {delay * 1000:+.1f} ms after {pair['from']} "
                f"(median over {pair['shared']} shared; "
                + (
                    "one clock: the hop's transit)"
                    if pair.get("one_clock")
                    else "clock offset plus the hop's transit)"
                )
            )
        )
        joined = ", ".join(f"{n} by {how}" for how, n in (pair.get("joined_by") or {}).items())
        console.print(
            f"tap order: {pair['from']} -> {pair['to']}: {seen}"
            + (f"; joined {joined}" if joined else ""),
            markup=False,
        )
    for line in clock_lines(result.get("clocks") or {}):
        console.print(line, markup=False)
    if totals["capture_records_lost"]:
        console.print(f"WARNING: the capture lost {totals['capture_records_lost']} records")
    if totals.get("late_events_ignored"):
        console.print(
            f"WARNING: {totals['late_events_ignored']} events came after their request's or "
            "connection's row was written out, and were ignored"
        )

    # with a limit, the rows shown are picked once (the tables read them twice)
    conns: Iterable[dict[str, Any]] = result["connections"]
    reqs: Iterable[dict[str, Any]] = result["requests"]
    if limit is not None:
        conns = list(_limited(conns, limit, _connection_troubled))
        reqs = list(_limited(reqs, limit, _request_troubled))

    def connection_cells() -> Iterator[list[str]]:
        for c in conns:
            if c.get("probes") and not c["requests"]:
                continue  # a connection that carried only a tap's own probes
            upstream = c["upstream_error"] or c["upstream_local"] or "-"
            yield [
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
            ]

    def request_cells() -> Iterator[list[str]]:
        for r in reqs:
            stalls = ",".join(f"{s['direction']}" for s in r["stalls"]) or "-"
            termination = r["termination"]
            if r["close"]:
                termination += f" ({r['close']}{', mid-event' if r['mid_event'] else ''})"
            yield [
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
            ]

    tables = _console(out, max(width, TABLE_WIDTH))  # a cell is never cut to the terminal
    if not wide:
        connection_cells = _columns(
            connection_cells, CONNECTION_COLUMNS, COMPACT_CONNECTION_COLUMNS
        )
        request_cells = _columns(request_cells, REQUEST_COLUMNS, COMPACT_REQUEST_COLUMNS)
    _write_table(
        tables,
        "connections",
        CONNECTION_COLUMNS if wide else COMPACT_CONNECTION_COLUMNS,
        connection_cells,
    )
    _more(console, "connections", len(result["connections"]), limit)
    _write_table(
        tables, "requests", REQUEST_COLUMNS if wide else COMPACT_REQUEST_COLUMNS, request_cells
    )
    _more(console, "requests", len(result["requests"]), limit)
    if not wide:
        console.print("(--wide shows every column: peers, bytes, x-request-id, first token ...)")


def _wrapped(line: str, width: int) -> str:
    """A line of prose wrapped at ``width``, its continuation indented under its text."""
    if len(line) <= width:
        return line
    body = line.lstrip()
    indent = len(line) - len(body) + (2 if body.startswith("- ") else 4)
    return textwrap.fill(line, width=width, subsequent_indent=" " * indent, break_on_hyphens=False)


def _columns(
    cells: Callable[[], Iterator[list[str]]], have: tuple[str, ...], keep: tuple[str, ...]
) -> Callable[[], Iterator[list[str]]]:
    """The rows of ``cells`` with only the columns ``keep`` (a long target cut short)."""
    index = [have.index(c) for c in keep]
    target = keep.index("request line") if "request line" in keep else -1

    def rows() -> Iterator[list[str]]:
        for row in cells():
            picked = [row[i] for i in index]
            if target >= 0 and len(picked[target]) > COMPACT_TARGET:
                picked[target] = picked[target][: COMPACT_TARGET - 1] + "…"
            yield picked

    return rows


def _more(console: Console, what: str, total: int, limit: int | None) -> None:
    if limit is not None and total > limit:
        console.print(
            f"... {total - limit} more {what} not shown (those that went wrong come first; "
            "--limit 0 shows all, --format json has every row)"
        )


def _console(out: TextIO, width: int) -> Console:
    return Console(file=out, width=width, color_system=None, force_terminal=False, highlight=False)


def _table(title: str | None, columns: Iterable[str]) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col in columns:
        table.add_column(col, no_wrap=True)
    return table


def _cell_width(console: Console, cell: str) -> int:
    """The width rich measures for a table cell (markup and emoji codes included)."""
    if cell.isascii() and cell.isprintable() and "[" not in cell and ":" not in cell:
        return len(cell)
    return Measurement.get(console, console.options, cell).maximum


def _write_table(
    console: Console,
    title: str,
    columns: tuple[str, ...],
    rows: Callable[[], Iterator[list[str]]],
) -> None:
    """A rich table with the bytes rich gives for all rows at once, rendered in chunks.

    Every column is ``no_wrap``, so rich sizes a column by its widest cell alone. A first
    pass measures the columns; each chunk is then rendered with an extra first row as
    wide as the widest cell of each column, so every chunk gets the whole table's widths,
    and that row (with the header, repeated) is cut from the chunk's output.
    """
    widths = [0] * len(columns)
    count = 0
    for cells in rows():
        count += 1
        for i, cell in enumerate(cells):
            w = _cell_width(console, cell)
            if w > widths[i]:
                widths[i] = w
    if count == 0:
        console.print(_table(title, columns))
        return
    widest = ["x" * w for w in widths]

    def render(table_title: str | None, chunk: Iterable[list[str]]) -> list[str]:
        buf = io.StringIO()
        table = _table(table_title, columns)
        table.add_row(*widest)
        for cells in chunk:
            table.add_row(*cells)
        _console(buf, console.width).print(table)
        return buf.getvalue().splitlines(keepends=True)

    head = render(title, [])
    console.file.write("".join(head[:-1]))  # title and header, not the widest row
    skip = len(render(None, []))  # the header and the widest row
    for chunk in batched(rows(), TABLE_CHUNK):
        console.file.write("".join(render(None, chunk)[skip:]))


def _md_cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value).replace("|", "\\|")


def to_markdown(result: dict[str, Any]) -> str:
    buf = io.StringIO()
    write_markdown(result, buf)
    return buf.getvalue()


def write_markdown(result: dict[str, Any], stream: TextIO) -> None:
    """Verdict first, then findings and the tables, as Markdown, a row at a time."""
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

    def rel(t: float) -> str:
        return _rel_time(t, origin)

    for f in result.get("findings") or []:
        tag = "note" if f["note"] else f"{f['party']}, {f['confidence']} confidence"
        out.append(f"### {f['id']} `{f['kind']}` ({tag}) at {_rel_time(f['t'], origin)}")
        out.append("")
        out.append(f["summary"])
        out.append("")
        if f["requests"]:
            out.append(f"Requests: {', '.join('`' + r + '`' for r in f['requests'])}")
            out.append("")
        out += [f"- {evidence_line(item, rel)}" for item in f["evidence"]]
        out += [f"- ruled out **{r['party']}**: {r['why']}" for r in f["ruled_out"]]
        if f.get("settle"):
            out.append(f"- to settle: {f['settle']}")
        out.append("")
    marks = mark_lines(result, rel, "- ")
    for line in marks:
        out += [line] if line.startswith("- ") else ["", f"**{line}**", ""]
    out += [""] if marks else []
    out += [
        *(
            [
                f"**Warning:** {result['totals']['late_events_ignored']} events came after "
                "their row was written out, and were ignored.",
                "",
            ]
            if result["totals"].get("late_events_ignored")
            else []
        ),
        "## Requests",
        "",
        "| request | start | idle before | method target | x-request-id | status | ttfb | "
        "first token | duration | events | [DONE] | termination |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    stream.write("\n".join(out) + "\n")
    for r in result["requests"]:
        stream.write(
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
            + " |\n"
        )
    out = [
        "",
        "## Connections",
        "",
        "| connection | peer | requests | closed by | how | in flight at close |",
        "|---|---|---|---|---|---|",
    ]
    stream.write("\n".join(out) + "\n")
    for c in result["connections"]:
        stream.write(
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
            + " |\n"
        )
