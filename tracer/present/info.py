"""``tracer info CAPTURE...``: what each file holds before anyone analyses it.

For each capture: its format version and the tracer that wrote it, the tap (its kind,
where it listened, its upstream and what that upstream is), the time range, records by
type, what was lost (records the writer dropped, lines that could not be read, a torn
last line) and whether it ended cleanly (a ``capture_end``) or not (the tap was killed
or is still writing: what was in flight at the end is unknown). The segments of a rotated
capture are one entry. A file that is not a capture is named with what it is instead,
and makes the exit status 3.

  tracer info front.jsonl back.jsonl
  tracer info captures/            (a folder: every capture in it)
  tracer info front.jsonl --format json
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from ..capture.files import (
    PACKETS,
    CaptureError,
    PacketOptions,
    ReadStats,
    expand_captures,
    file_kind,
    not_a_capture,
    read_events,
    read_records,
)
from ..wording import counted

EXIT_INPUT = 3
_SEGMENT_OF = ".jsonl"


@dataclass
class CaptureInfo:
    """One capture (all the segments of a rotated one)."""

    files: list[str]
    kind: str = "tracer capture"  # or what the file is instead (pcap, zstd, text, ...)
    problem: str | None = None  # why it is not a capture this tracer can read
    stats: ReadStats = field(default_factory=ReadStats)
    types: Counter[str] = field(default_factory=Counter)
    header: dict[str, Any] = field(default_factory=dict)
    topology: dict[str, Any] | None = None
    bound: str | None = None  # where the tap's clients connected (its --listen may say :0)

    @property
    def packets(self) -> bool:
        """A packet capture (pcap, pcapng), read as the taps it holds."""
        return self.kind.startswith("pcap")

    first_t: float | None = None
    last_t: float | None = None
    end: dict[str, Any] | None = None
    dropped: int = 0  # records the writer dropped (capture_loss, capture_end)
    loss_records: int = 0  # the capture_loss records' own counts, added up
    # the writer's loss windows (first_t, last_t, resumed), as its capture_loss records say
    loss_windows: list[tuple[float | None, float | None, bool | None]] = field(default_factory=list)
    packet_losses: list[str] = field(default_factory=list)  # what a packet capture missed
    starts: set[Any] = field(default_factory=set)  # the runs' headers (segments repeat one)

    @property
    def ok(self) -> bool:
        return self.problem is None

    def to_json(self) -> dict[str, Any]:
        if not self.ok:
            return {"files": self.files, "capture": False, "kind": self.kind, "why": self.problem}
        h, s = self.header, self.stats
        return {
            "files": self.files,
            "capture": True,
            "version": s.version,
            "tracer_version": h.get("tracer_version"),
            "tap": h.get("tap"),
            "tap_kind": h.get("kind"),
            "listen": h.get("listen"),
            "bound": self.bound,
            "upstream": h.get("upstream"),
            "upstream_role": _role(h, self.topology),
            "client_facing": bool(h.get("client_facing"))
            or bool(self.topology and self.topology.get("client_facing")),
            "start": _iso(self.first_t),
            "end": _iso(self.last_t),
            "t_first": self.first_t,
            "t_last": self.last_t,
            "duration": _span(self.first_t, self.last_t),
            "records": s.records,
            "by_type": dict(sorted(self.types.items())),
            "records_lost": max(self.dropped, self.loss_records),
            "loss_windows": [
                {"first": _iso(a), "last": _iso(b), "resumed": r} for a, b, r in self.loss_windows
            ],
            "packet_losses": self.packet_losses,
            "bad_lines": s.bad_lines,
            "problems": s.problems,
            "torn_tail": s.torn_tail,
            "torn_at_loss": s.torn_at_loss,
            "ended_cleanly": self.end is not None,
            "end_reason": self.end.get("reason") if self.end else None,
            "runs": len(self.starts),
        }


def _role(header: dict[str, Any], topology: dict[str, Any] | None) -> str | None:
    if header.get("upstream_role"):
        return f"{header['upstream_role']} (declared)"
    if topology is not None:
        return f"{topology.get('upstream_role')} ({topology.get('basis')})"
    return None


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _span(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 3)


def inspect(files: list[str], packets: PacketOptions = PACKETS) -> CaptureInfo:
    """Read one capture (its segments in order) to the end, tolerating anything."""
    info = CaptureInfo(files=files)
    for name in files:
        kind = file_kind(name)
        if kind not in ("capture", "text", "pcap", "pcapng"):  # text: to count what fails
            info.kind, info.problem = kind, not_a_capture(name, kind)
            return info
        if kind in ("pcap", "pcapng"):
            info.kind = f"{kind} file, read as the tap(s) it holds"
        records = (
            (e.to_record() for e in read_events(name, info.stats, packets))
            if kind in ("pcap", "pcapng")
            else read_records(name, info.stats)
        )
        try:
            for record in records:
                _count(info, record)
        except CaptureError as exc:
            info.kind, info.problem = "not a tracer capture", str(exc)
            return info
        except OSError as exc:
            info.kind, info.problem = "unreadable", f"{name}: {exc.strerror or exc}"
            return info
    if info.stats.version is None:
        what = f"{info.stats.bad_lines} unparseable line(s)" if info.stats.bad_lines else "empty"
        info.kind = "not a tracer capture"
        info.problem = f"{files[0]}: not a tracer capture: no capture_start, {what}"
    return info


def _count(info: CaptureInfo, record: dict[str, Any]) -> None:
    kind = str(record.get("type"))
    info.types[kind] += 1
    t = _time(record.get("t"))
    if t is not None:
        info.first_t = t if info.first_t is None else min(info.first_t, t)
        info.last_t = t if info.last_t is None else max(info.last_t, t)
    if kind == "capture_start":
        info.starts.add((record.get("t"), record.get("m")))
        if not info.header:
            info.header = record
        info.end = None  # a later run (--append) must end again
    elif kind == "capture_end":
        info.end = record
        info.dropped = max(info.dropped, _int(record.get("dropped")))
    elif kind == "capture_loss" and str(record.get("reason", "")).startswith("packet capture"):
        if len(info.packet_losses) < 5:  # a packet capture's own losses, not a writer's
            info.packet_losses.append(str(record["reason"]))
    elif kind == "capture_loss":
        info.loss_records += _int(record.get("dropped"))
        first, last = _time(record.get("first_t")), _time(record.get("last_t"))
        resumed = record.get("resumed")
        info.loss_windows.append((first, last, resumed if isinstance(resumed, bool) else None))
    elif kind == "topology" and info.topology is None:
        info.topology = record
    elif kind == "conn_open" and info.bound is None and isinstance(record.get("local"), str):
        info.bound = record["local"]


def _time(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1e11
    return float(value) if ok else None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def group(paths: list[str]) -> list[list[str]]:
    """The files named, the segments of one rotated capture together."""
    out: list[list[str]] = []
    for name in expand_captures(paths) or paths:
        stem = _stem(name)
        if out and _stem(out[-1][-1]) == stem and file_kind(name) == "capture":
            out[-1].append(name)
        else:
            out.append([name])
    return out


def _stem(name: str) -> str:
    base = Path(name).name.removesuffix(".zst").removesuffix(_SEGMENT_OF)
    head, dot, n = base.rpartition(".")
    return str(Path(name).parent / (head if dot and n.isdigit() else base))


def text(info: CaptureInfo) -> str:
    names = info.files[0] + (f" (+{len(info.files) - 1} segments)" if len(info.files) > 1 else "")
    if not info.ok:
        return f"NOT A CAPTURE: {info.problem}\n"
    j = info.to_json()
    lines = [
        f"{names}: {info.kind}"
        + (
            f" v{j['version']} (written by tracer {j['tracer_version']})"
            if not info.packets
            else ""
        ),
        f"  tap       {j['tap']} ({j['tap_kind']})"
        + (f", listening on {j['listen']}" if j["listen"] else "")
        + (f" (bound {j['bound']})" if j["bound"] and j["bound"] != j["listen"] else "")
        + (f" -> {j['upstream']}" if j["upstream"] else ""),
    ]
    if j["upstream_role"] or j["client_facing"]:
        lines.append(
            f"  place     upstream: {j['upstream_role'] or 'not known'}"
            + ("; clients connect directly (client-facing)" if j["client_facing"] else "")
        )
    if j["start"]:
        lines.append(f"  time      {j['start']} for {j['duration']:.3f} s (to {j['end']})")
    shown = ", ".join(f"{n} {k}" for k, n in info.types.most_common(8))
    more = len(info.types) - 8
    lines.append(f"  records   {j['records']}: {shown}" + (f", +{more} kinds" if more > 0 else ""))
    losses = []
    if j["records_lost"]:
        losses.append(
            f"{j['records_lost']} records dropped by the tap's capture writer (its disk full "
            "or too slow)" + _windows(info.loss_windows)
        )
    for what in j["packet_losses"]:
        losses.append(what)  # the packet capture's own words: kernel drops, gaps
    if j["bad_lines"]:
        torn = j["torn_at_loss"]
        losses.append(
            f"{counted(j['bad_lines'], 'unreadable line')} ({'; '.join(j['problems'][:2])})"
            + (f"; {torn} of them cut when a write failed (a capture_loss follows)" if torn else "")
        )
    if j["torn_tail"]:
        losses.append(
            "the last line is cut mid-record: the tap was killed while writing it, or is "
            "still writing"
        )
    lines.append(f"  losses    {'; '.join(losses) if losses else 'none'}")
    if info.end is not None:
        at_loss = any(r is False for _, _, r in info.loss_windows)
        lines.append(
            f"  ended     cleanly ({j['end_reason']})"
            + (
                ": its last records written from the reserve, the disk still full"
                if at_loss
                else ""
            )
        )
    else:
        lines.append(
            "  ended     NO capture_end: the tap was killed or is still writing; what was in "
            "flight at the end is unknown"
        )
    if j["runs"] > 1:
        lines.append(f"  runs      {j['runs']} (extended with --append)")
    return "\n".join(lines) + "\n"


def _windows(windows: list[tuple[float | None, float | None, bool | None]]) -> str:
    """When the writer's records were lost, as its capture_loss records say."""
    said = [
        f"{_clock(a)} to {_clock(b)}"
        + (", writing resumed" if r else ", not resumed before the end" if r is False else "")
        for a, b, r in windows
        if a is not None and b is not None
    ]
    if not said:
        return ""
    more = f" and {len(said) - 3} more" if len(said) > 3 else ""
    return " from " + "; ".join(said[:3]) + more


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "captures",
        nargs="+",
        metavar="CAPTURE",
        help="capture files, rotated segments or folders of them",
    )
    parser.add_argument(
        "--format", choices=["text", "json"], default="text", help="text for people, json"
    )
    from .analyze import packet_arguments

    packet_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from .analyze import packet_options

    packets = packet_options(args)
    infos = [inspect(files, packets) for files in group(list(args.captures))]
    if args.format == "json":
        doc = {"schema": "tracer.info/1", "captures": [i.to_json() for i in infos]}
        sys.stdout.buffer.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        sys.stdout.write("\n".join(text(i) for i in infos))
    sys.stdout.flush()
    return 0 if all(i.ok for i in infos) else EXIT_INPUT
