"""``tracer analyze``: the verdict, the findings and the connection and request tables.

examples:
  tracer analyze front.jsonl back.jsonl                  who is at fault, and why
  tracer analyze front.jsonl --brief                     the verdict and findings only
  tracer analyze front.jsonl --hang-at +42               the harness hung about 42 s in
  tracer analyze front.jsonl --since +40 --until +60     the rows of those 20 seconds
  tracer analyze front.jsonl back.jsonl --id req-7       one request, at every tap
  tracer analyze captures/ --format json | jq .verdict   for machines (tracer.analysis/4)

The filters (--since, --until, --tap, --conn, --id) choose the rows and findings shown;
the verdict and the totals are over everything the captures hold (over rotated captures,
--since/--until read only the segments that hold the window: docs/fleet.md).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..analysis.findings.clocks import Clocks, clocks_to_apply
from ..analysis.summary import Summary
from ..arguments import non_negative_int
from ..capture.files import PacketOptions, expand_captures, read_into
from ..capture.reader import capture_headers
from ..capture.segments import plan_window
from ..protocol.probe_mark import KnownTaps
from ..times import parse_time
from ..wording import counted
from .render import write_json, write_markdown, write_text

PIPED_WIDTH = 120  # text output that is not to a terminal wraps here


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "captures",
        nargs="+",
        metavar="CAPTURE",
        help="capture files of one incident (one per tap; a rotated capture's segments or "
        "its folder; pcap and pcapng files from tcpdump too)",
    )
    parser.add_argument(
        "--format",
        choices=["text", "json", "md"],
        default="text",
        help="text for people, json for machines (schema tracer.analysis.summary), md for a document",
    )
    parser.add_argument(
        "--brief", action="store_true", help="the verdict and the findings only (text)"
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        help="every column of the tables, lines not wrapped (default: the essential "
        "columns, wrapped to the terminal or to 120 when piped)",
    )
    parser.add_argument(
        "--limit",
        type=non_negative_int,
        default=50,
        metavar="N",
        help="rows shown per table in text output, those that went wrong first (0: all; "
        "default: %(default)s)",
    )
    incident_arguments(parser)
    parser.add_argument(
        "--engine-requests",
        action="append",
        default=[],
        metavar="FILE",
        help="the engines' own per-request records (repeatable): SGLang's "
        "--export-metrics-to-file JSONL (a file, or its folder), or vLLM's spans as OTLP JSON "
        "(the OpenTelemetry Collector's file exporter); joined to the requests by "
        "x-request-id or traceparent (docs/evidence.md)",
    )
    packet_arguments(parser)
    rows = parser.add_argument_group("filters (the rows and findings shown)")
    rows.add_argument("--since", metavar="TIME", help="from this time (as --hang-at)")
    rows.add_argument("--until", metavar="TIME", help="to this time (as --hang-at)")
    rows.add_argument(
        "--tap", action="append", default=[], metavar="NAME", help="this tap's (repeatable)"
    )
    rows.add_argument(
        "--conn",
        action="append",
        default=[],
        metavar="ID",
        help="this connection, as the tables name it: TAP/N (repeatable)",
    )
    rows.add_argument(
        "--id",
        action="append",
        default=[],
        metavar="REQUEST",
        help="this request: its x-request-id, or TAP/CONN/SEQ (repeatable)",
    )


def incident_arguments(parser: argparse.ArgumentParser) -> None:
    """What the user knows of the incident, for ``analyze`` and ``report`` alike."""
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


def packet_arguments(parser: argparse.ArgumentParser) -> None:
    """How a pcap or pcapng file (tcpdump) is read as taps."""
    group = parser.add_argument_group("packet captures (pcap, pcapng from tcpdump)")
    group.add_argument(
        "--port",
        action="append",
        type=int,
        default=[],
        metavar="PORT",
        help="follow the connections to this server port (repeatable; default: every "
        "stream whose first bytes are an HTTP request)",
    )
    group.add_argument(
        "--tap-by-port",
        metavar="PORT=TAP[:ROLE],...",
        help="one tap per server port, e.g. 8000=front,30000=back (a capture taken on the "
        "router's host, both sides of it, is then read as two taps); :ROLE says what the "
        "server at that port is (engine, router or proxy), e.g. 30000=back:engine",
    )
    group.add_argument(
        "--upstream-role",
        choices=["engine", "router", "proxy"],
        default=None,
        help="what the server of the one tap (--port, or every HTTP stream) is: an engine, "
        "the router or a proxy (a capture cannot ask it; declared as `tracer proxy "
        "--upstream-role` declares it; with --tap-by-port: PORT=TAP:ROLE)",
    )


def packet_options(args: argparse.Namespace) -> PacketOptions:
    taps: dict[int, str] = {}
    roles: dict[str, str] = {}
    role = getattr(args, "upstream_role", None)
    if getattr(args, "tap_by_port", None):
        from ..observe.passive import parse_tap_by_port

        spec = parse_tap_by_port(args.tap_by_port)  # ValueError: a usage error
        taps, roles = spec.taps, dict(spec.roles)
        if role is not None:
            raise ValueError(
                f"--upstream-role {role}: it is for one tap; with --tap-by-port give the "
                "role after the tap's name, e.g. 30000=back:engine"
            )
    for port in getattr(args, "port", []):
        if not 0 < port < 65536:
            raise ValueError(f"--port {port}: not a port number")
    return PacketOptions(
        ports=tuple(getattr(args, "port", [])),
        taps=tuple(taps.items()),
        upstream_role=role,
        roles=tuple(roles.items()),
    )


def run(args: argparse.Namespace) -> int:
    packets = packet_options(args)
    engine_requests = _engine_requests(getattr(args, "engine_requests", []))
    files = expand_captures(args.captures)
    known = KnownTaps.of(capture_headers(files))  # whose x-tracer-probe to believe
    # a window over rotated captures reads only the segments it needs (capture/segments.py)
    window = plan_window(files, args.since, args.until) if args.since or args.until else None
    window = window if window is not None and window.skips else None

    # taps whose wall clocks disagree: a pass that measures the offsets, then one that
    # applies them (``analysis/findings/clocks.py``); one pass where they agree
    clocks: Clocks | None = None
    while True:
        with Summary(known_taps=known, clocks=clocks) as summary:  # (spilled rows: freed)
            if window is not None:
                captures = window.read(summary.feed, read_into)
            else:
                captures = [
                    read_into(path, summary.feed, packets).describe(Path(path).name)
                    for path in files
                ]
            first, last = summary.first_t, summary.last_t
            if window is not None:
                first, last = window.origin, window.end  # the captures', not what was read
            marks = [parse_time(v, first, last) for v in args.hang_at]
            since = parse_time(args.since, first, last, option="--since") if args.since else None
            until = parse_time(args.until, first, last, option="--until") if args.until else None
            # rows are written one at a time: big captures stay affordable
            result = summary.result(
                captures=captures,
                hang_at=marks,
                client_facing=args.client_facing,
                raw_rows=args.format == "json",
                engine_requests=engine_requests,
            )
            if clocks is None and (clocks := clocks_to_apply(result)) is not None:
                continue  # again, on one clock
            _show(args, result, RowFilter(since, until, args.tap, args.conn, args.id), window)
        return 0


def _show(args: argparse.Namespace, result: dict[str, Any], keep: RowFilter, window: Any) -> None:
    """The analysis as asked: filtered, in its format (while its rows can be read)."""
    if keep.active:
        keep.apply(result)
    if window is not None:
        result["filter"]["segments"] = segments = window.to_json()
        if segments.get("requests_cut"):
            _cut_caveat(result["verdict"], int(segments["requests_cut"]))
    if args.format == "json":
        write_json(result, sys.stdout)
    elif args.format == "md":
        write_markdown(result, sys.stdout)
    else:
        if keep.active:
            print(keep.describe(result), file=sys.stdout)
        tty = sys.stdout.isatty()
        width = shutil.get_terminal_size().columns if tty else PIPED_WIDTH
        write_text(
            result,
            sys.stdout,
            width=400 if args.wide else width,
            limit=args.limit or None,
            wide=args.wide,
            brief=args.brief,
        )


def _cut_caveat(verdict: dict[str, Any], cut: int) -> None:
    """Requests open at the window's start whose heads were in segments not read: any of
    them may be what hung, so an all-clear over them is low."""
    verdict.setdefault("caveats", []).append(
        {
            "kind": "window_cut",
            "count": cut,
            "text": f"{counted(cut, 'request')} open at the window's start began in a segment "
            "not read: not analysed (start the window earlier by the longest request)",
        }
    )
    if verdict["party"] == "none":
        verdict["confidence"] = "low"


def _engine_requests(paths: list[str]) -> list[Any]:
    """The records of ``--engine-requests`` (read before the captures: a file that is
    neither format stops the run at once, exit 3); bad lines are said on stderr."""
    if not paths:
        return []
    from ..evidence.engine_requests import read_engine_requests

    records: list[Any] = []
    for path in paths:
        got = read_engine_requests(path)
        records += got.records
        if got.bad_lines:
            print(
                f"tracer: {path}: {counted(got.bad_lines, 'line')} not read ({got.first_bad})",
                file=sys.stderr,
            )
    return records


class _Attrs(dict[str, Any]):
    """A row object (JSON output keeps rows as they are made) read like a dict."""

    def __init__(self, row: Any) -> None:
        super().__init__()
        self.row = row

    def __missing__(self, key: str) -> Any:
        return getattr(self.row, key)


def _fields(row: Any) -> dict[str, Any]:
    return row if isinstance(row, dict) else _Attrs(row)


class RowFilter:
    """Which rows and findings are shown: those within the time window, of the taps,
    connections and requests named (every condition given must hold)."""

    def __init__(
        self,
        since: float | None,
        until: float | None,
        taps: list[str],
        conns: list[str],
        ids: list[str],
    ) -> None:
        self.since, self.until = since, until
        self.taps, self.conns, self.ids = set(taps), set(conns), set(ids)
        self.active = any(x is not None for x in (since, until)) or bool(taps or conns or ids)

    def request(self, row: Any) -> bool:
        r = _fields(row)
        end = r["start"] + (r["duration"] or 0.0)
        return (
            (self.since is None or end >= self.since or r["duration"] is None)
            and (self.until is None or r["start"] <= self.until)
            and (not self.taps or r["tap"] in self.taps)
            and (not self.conns or r["id"].rsplit("/", 1)[0] in self.conns)
            and (not self.ids or r["request_id"] in self.ids or r["id"] in self.ids)
        )

    def connection(self, row: Any, with_requests: set[str]) -> bool:
        c = _fields(row)
        if self.ids:
            return c["id"] in with_requests
        closed = c["closed"]
        return (
            (self.since is None or closed is None or closed >= self.since)
            and (self.until is None or c["opened"] <= self.until)
            and (not self.taps or c["tap"] in self.taps)
            and (not self.conns or c["id"] in self.conns)
        )

    def apply(self, result: dict[str, Any]) -> None:
        requests = [r for r in result["requests"] if self.request(r)]
        kept = {_fields(r)["id"] for r in requests}
        conns_of = {i.rsplit("/", 1)[0] for i in kept}
        connections = [c for c in result["connections"] if self.connection(c, conns_of)]
        kept_conns = {_fields(c)["id"] for c in connections}
        result["requests"], result["connections"] = requests, connections
        result["filter"] = self.to_json()
        result["findings"] = [f for f in result["findings"] if self._finding(f, kept, kept_conns)]

    def _finding(self, f: dict[str, Any], requests: set[str], conns: set[str]) -> bool:
        if f["requests"] or f["connections"]:
            return bool(requests & set(f["requests"]) or conns & set(f["connections"]))
        inside: Callable[[float], bool] = lambda t: (  # noqa: E731
            (self.since is None or t >= self.since) and (self.until is None or t <= self.until)
        )
        return not (self.taps or self.conns or self.ids) and (f["t"] is None or inside(f["t"]))

    def to_json(self) -> dict[str, Any]:
        return {
            "since": self.since,
            "until": self.until,
            "taps": sorted(self.taps),
            "conns": sorted(self.conns),
            "ids": sorted(self.ids),
        }

    def describe(self, result: dict[str, Any]) -> str:
        origin = (result.get("time_range") or {}).get("start") or 0.0
        parts = []
        if self.since is not None:
            parts.append(f"since +{self.since - origin:.3f} s")
        if self.until is not None:
            parts.append(f"until +{self.until - origin:.3f} s")
        for name, values in (("tap", self.taps), ("conn", self.conns), ("id", self.ids)):
            if values:
                parts.append(f"{name} {', '.join(sorted(values))}")
        over = "everything"
        segments = result.get("filter", {}).get("segments")
        if segments:  # a window over rotated captures: only its segments were read
            read = segments["read"] + segments["followed"]
            over = (
                f"the {read} of {counted(read + segments['skipped'], 'segment')} that hold the "
                "window"
            )
            if segments["requests_cut"]:
                over += (
                    f"; {counted(segments['requests_cut'], 'request')} open at its start "
                    "began in a segment not read: not shown"
                )
        return (
            f"filter: {'; '.join(parts)}: {counted(len(result['requests']), 'request')}, "
            f"{counted(len(result['connections']), 'connection')}, "
            f"{counted(len(result['findings']), 'finding')} shown (the verdict and totals are "
            f"over {over})"
        )
