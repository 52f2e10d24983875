"""Reading captures back: a tolerant reader that validates every record, tells a capture
from what is not one (pcap, gzip, text, binary), expands rotated segments and folders,
and reads pcap and pcapng files as the taps they hold (``observe/pcap.py``, imported
only when one is read: it needs dpkt, and the packet layer sits above this one)."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .. import events as ev
from .bodies import BodyResolver, derive_request_end


@dataclass
class ReadStats:
    records: int = 0
    bad_lines: int = 0
    unknown_types: int = 0
    version: int | None = None
    torn_tail: bool = False
    # bad lines right before a capture_loss: records cut when a write failed (the disk
    # full), which the writer ended when it could write again — not a kill
    torn_at_loss: int = 0
    bodies_unresolved: int = 0  # kept bodies lost with the record their prefix was in
    headers: list[dict[str, Any]] = field(default_factory=list)
    lines: int = 0  # lines read so far (the line number of the last one)
    invalid_records: int = 0  # records of a known type with wrong-typed fields: skipped
    problems: list[str] = field(default_factory=list)  # the first few, with their lines

    def invalid(self, why: str) -> None:
        self.invalid_records += 1
        self.bad_lines += 1
        self.records -= 1  # counted as read, skipped as bad
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(why)

    def describe(self, path: str) -> dict[str, Any]:
        """What reading a capture found, as the analysis lists it per capture."""
        return {
            "path": path,
            "records": self.records,
            "bad_lines": self.bad_lines,
            **({"problems": self.problems} if self.problems else {}),
            "torn_tail": self.torn_tail,
            **({"torn_at_loss": self.torn_at_loss} if self.torn_at_loss else {}),
            "bodies_unresolved": self.bodies_unresolved,
            "version": self.version,
        }


_SEGMENT = re.compile(r"^(?P<stem>.*?)(?:\.(?P<n>[0-9]+))?(?P<suffix>\.jsonl)?(?:\.zst)?$")
MAX_PROBLEMS = 5  # bad lines quoted per capture (all are counted)


def _open_capture_file(path: str | os.PathLike[str]) -> Any:
    """A capture file for reading by lines: plain, or a ``.zst`` segment."""
    if str(path).endswith(".zst"):
        import zstandard

        source = open(path, "rb")  # noqa: SIM115  (closed with the reader: closefd)
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(source, closefd=True))
    return open(path, "rb")


def expand_captures(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The captures named: a directory stands for the ``*.jsonl`` files in it; the
    segments of one rotated capture are put in their order (``cap.jsonl``,
    ``cap.1.jsonl``, ``cap.2.jsonl`` ... ``cap.10.jsonl``), whatever the shell's glob order."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted([*p.glob("*.jsonl"), *p.glob("*.jsonl.zst")]) if p.is_dir() else [p]

    order = {f: i for i, f in enumerate(files)}
    groups: dict[tuple[str, str], list[Path]] = {}
    for f in files:
        k = segment_key(f)
        groups.setdefault(k[:2], []).append(f)
    out: list[str] = []
    for members in sorted(groups.values(), key=lambda m: min(order[f] for f in m)):
        out += [str(f) for f in sorted(members, key=lambda f: segment_key(f)[2])]
    return out


def segment_key(f: Path) -> tuple[str, str, int]:
    """(folder, capture name, segment number): the segments of one capture share the first
    two, and sort by the third."""
    m = _SEGMENT.match(f.name)
    assert m is not None  # the pattern matches any name
    return (str(f.parent), m["stem"] + (m["suffix"] or ""), int(m["n"] or 0))


class CaptureError(Exception):
    """The file is not a capture this version can read."""


_MAGIC = {
    b"\xd4\xc3\xb2\xa1": "pcap",
    b"\xa1\xb2\xc3\xd4": "pcap",
    b"\x4d\x3c\xb2\xa1": "pcap",
    b"\xa1\xb2\x3c\x4d": "pcap",
    b"\x0a\x0d\x0d\x0a": "pcapng",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"\x1f\x8b": "gzip",
    b"PK\x03\x04": "zip",
}


def file_kind(path: str | os.PathLike[str]) -> str:
    """What a file named as a capture is, from its first bytes: ``capture`` (JSON lines,
    or a ``.zst`` segment), ``pcap``, ``pcapng``, ``missing``, ``directory``, ``empty``,
    or a few words on what else (``binary data``, ``text``, ``gzip`` ...)."""
    p = Path(path)
    try:
        if p.is_dir():
            return "directory"
        with open(p, "rb") as fh:
            head = fh.read(512)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if not head:
        return "empty"
    for magic, kind in _MAGIC.items():
        if head.startswith(magic):
            if kind == "zstd" and p.name.endswith(".zst"):
                return "capture"
            return kind if kind.startswith("pcap") else f"{kind}-compressed data"
    if head.lstrip()[:1] == b"{":
        return "capture"
    if b"\0" in head:
        return "binary data"
    try:
        head.decode()
    except UnicodeDecodeError:
        return "binary data"
    return "text"


def not_a_capture(path: str | os.PathLike[str], kind: str) -> str:
    """The one line that says what a file is instead of a capture."""
    if kind == "missing":
        return f"{path}: no such file"
    if kind == "directory":
        return f"{path}: a folder with no *.jsonl capture in it"
    return f"{path}: not a tracer capture: {kind}"


def read_records(
    path: str | os.PathLike[str], stats: ReadStats | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the records of a capture, skipping (and counting) lines that do not parse.

    Works on a file that is still being written: it reads up to the current end, and a
    last line without its newline is a torn tail, not an error.
    """
    stats = stats if stats is not None else ReadStats()
    with _open_capture_file(path) as fh:
        try:
            yield from _read_lines(fh, stats, str(path))
        except Exception as exc:  # a .zst segment that does not decompress: not a capture
            import zstandard

            if not isinstance(exc, zstandard.ZstdError):
                raise
            raise CaptureError(f"{path}: not a readable zstd segment ({exc})") from None


def _read_lines(fh: Any, stats: ReadStats, name: str) -> Iterator[dict[str, Any]]:
    first = True
    after_bad = False  # the line before was not JSON (torn, if a capture_loss follows)
    for raw in fh:
        stats.lines += 1
        if not raw.endswith(b"\n"):
            stats.torn_tail = True
            try:
                record = orjson.loads(raw)
            except ValueError:
                return
        else:
            try:
                record = orjson.loads(raw)
            except ValueError:
                stats.bad_lines += 1
                after_bad = True
                if len(stats.problems) < MAX_PROBLEMS:
                    stats.problems.append(f"line {stats.lines}: not JSON")
                continue
        if after_bad and isinstance(record, dict) and record.get("type") == "capture_loss":
            stats.torn_at_loss += 1
        after_bad = False
        if not isinstance(record, dict):
            stats.bad_lines += 1
            if len(stats.problems) < MAX_PROBLEMS:
                stats.problems.append(f"line {stats.lines}: not a JSON object")
            continue
        if first:
            first = False
            if record.get("type") != ev.CaptureStart.TYPE:
                raise CaptureError(f"{name}: not a tracer capture (no capture_start header)")
        if record.get("type") == ev.CaptureStart.TYPE:
            version = record.get("version")
            if not isinstance(version, int) or version > ev.CAPTURE_VERSION:
                raise CaptureError(
                    f"{name}: capture format version {version!r}; this tracer reads up to "
                    f"{ev.CAPTURE_VERSION}"
                )
            stats.version = version
            stats.headers.append(record)
        stats.records += 1
        yield record


def capture_headers(paths: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """The ``capture_start`` record of each tracer capture named (its first line; packet
    captures and what is not a capture have none): read before an analysis, which needs
    to know every tap in it before its first request (whose probes to believe)."""
    out: list[dict[str, Any]] = []
    for path in expand_captures(paths):
        if file_kind(path) != "capture":
            continue
        try:
            with _open_capture_file(path) as fh:
                first = orjson.loads(fh.readline(1 << 20))
        except (OSError, ValueError):
            continue  # the analysis itself says what is wrong with it
        if isinstance(first, dict) and first.get("type") == ev.CaptureStart.TYPE:
            out.append(first)
    return out


def event_from_record(
    record: dict[str, Any], bodies: BodyResolver | None = None
) -> ev.Event | None:
    """A record as a reader sees it (``ev.from_record``): a kept request body put back
    together from its shared prefix (version 3, with the capture's ``bodies``), and the
    hash and OpenAI fields a version 2 tap leaves to the reader filled in from it."""
    kind = record.get("type")
    if kind == "request_end":
        if bodies is not None:
            bodies.resolve(record)
        derive_request_end(record)
    elif kind == "capture_start" and bodies is not None:
        bodies.reset()
    return ev.from_record(record)


@dataclass(frozen=True)
class PacketOptions:
    """How a packet capture (pcap, pcapng) is read as taps: the server ports whose
    connections to follow (none: every stream whose first bytes are a request), or one tap
    per server port (``--tap-by-port 8000=front,30000=back``); and what the server behind
    them is, where declared (``upstream_role`` for the one tap, ``--upstream-role``;
    ``roles`` per tap name, ``--tap-by-port 30000=back:engine``)."""

    ports: tuple[int, ...] = ()
    taps: tuple[tuple[int, str], ...] = ()
    upstream_role: str | None = None
    roles: tuple[tuple[str, str], ...] = ()


PACKETS = PacketOptions()


def read_events(
    path: str | os.PathLike[str],
    stats: ReadStats | None = None,
    packets: PacketOptions = PACKETS,
) -> Iterator[ev.Event]:
    """The events of a capture: a tracer capture's records, or what a tap would have
    written for a packet capture's HTTP/1.1 connections (``observe/pcap.py``)."""
    stats = stats if stats is not None else ReadStats()
    if file_kind(path) in ("pcap", "pcapng"):
        yield from _packet_events(path, stats, packets)
        return
    bodies = BodyResolver()
    for record in read_records(path, stats):
        try:
            event = event_from_record(record, bodies)
        except (ev.InvalidRecord, TypeError, ValueError, KeyError, AttributeError) as exc:
            stats.invalid(f"line {stats.lines}: {exc}")  # a record with wrong-typed fields
            continue
        stats.bodies_unresolved = bodies.unresolved
        if event is None:
            stats.unknown_types += 1
            continue
        yield event


def _packet_events(
    path: str | os.PathLike[str], stats: ReadStats, packets: PacketOptions
) -> Iterator[ev.Event]:
    """A packet capture's events, counted in ``stats`` as a capture's records are."""
    from ..observe.pcap import PcapError, PcapStats, events_from_pcap, events_from_pcap_by_port

    seen = PcapStats()
    connections = 0
    try:
        if packets.taps:
            events = events_from_pcap_by_port(
                path, dict(packets.taps), roles=dict(packets.roles), stats=seen
            )
        else:
            events = events_from_pcap(
                path,
                ports=packets.ports or None,
                upstream_role=packets.upstream_role,
                stats=seen,
            )
        for event in events:
            stats.records += 1
            if isinstance(event, ev.CaptureStart):
                stats.version = ev.CAPTURE_VERSION
                stats.headers.append(event.to_record())
            elif isinstance(event, ev.ConnOpen):
                connections += 1
            yield event
    except PcapError as exc:
        raise CaptureError(str(exc) if str(path) in str(exc) else f"{path}: {exc}") from None
    stats.torn_tail = bool(seen.torn_tail)
    if not connections:  # nothing to analyse is not an all-clear
        where = f" to port {', '.join(map(str, packets.ports))}" if packets.ports else ""
        raise CaptureError(
            f"{path}: a {seen.format or 'packet'} capture with no HTTP/1.1 connection{where} "
            f"in it ({seen.frames} packets); --port names the server's port"
        )


def read_into(
    path: str | os.PathLike[str],
    feed: Callable[[ev.Event], None],
    packets: PacketOptions = PACKETS,
) -> ReadStats:
    """Every event of a capture (or a packet capture) to ``feed`` (an analysis); a file
    that cannot be read is a ``CaptureError`` naming it."""
    stats = ReadStats()
    kind = file_kind(path)
    if kind not in ("capture", "text", "pcap", "pcapng"):  # text: to count what fails
        raise CaptureError(not_a_capture(path, kind))
    try:
        for event in read_events(path, stats, packets):
            feed(event)
    except OSError as exc:
        raise CaptureError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if stats.version is None:  # nothing to analyse is not an all-clear
        what = f"{stats.bad_lines} unparseable line(s)" if stats.bad_lines else "empty"
        raise CaptureError(f"{path}: not a tracer capture: no capture_start, {what}")
    return stats
