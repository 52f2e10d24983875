"""Capture file: a non-blocking, crash-safe writer and a tolerant reader.

Format: JSON Lines, first line a ``capture_start`` header carrying the format version
(see ``captures/README.md``). The writer never blocks the caller: records are encoded
on the caller's thread (cheap) and copied at once onto the end of one in-memory batch, a
``bytearray`` bounded in bytes (keeping each encoded line alive as its own object instead
costs several times the encoding: a fresh allocation per record), and a background
thread writes batches with ``os.write``. When the batch is full (disk slow)
or a write fails (disk full), records are dropped and counted; the count is written as
a ``capture_loss`` record as soon as writing works again, and in ``capture_end``. After
``kill -9`` everything flushed so far is on disk; the reader skips a torn line.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog

from .. import events as ev
from .bodies import BodyResolver, BodySharing, derive_request_end

log = structlog.get_logger("tracer.capture.files")

FLUSH_INTERVAL = 0.05
MAX_PENDING_BYTES = 32 * 1024 * 1024

_OPTS = orjson.OPT_APPEND_NEWLINE


@functools.cache
def boot_id() -> str | None:
    """This machine's boot, for ``capture_start.boot_id``: taps that started in the same
    boot read one wall clock (containers share their host's), so the analysis can join
    their requests by time to the millisecond instead of within a cross-host clock
    tolerance. None where the kernel does not say (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def encode_line(record: dict[str, Any]) -> bytes:
    """One record as one JSON line (UTF-8, compact, newline-terminated)."""
    return orjson.dumps(record, option=_OPTS)


class CaptureWriter:
    """Appends records to a file from any thread without ever blocking on disk."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        flush_interval: float = FLUSH_INTERVAL,
        append: str | None = None,
        max_bytes: int | None = None,
        max_age: float | None = None,
        compress: bool = False,
    ) -> None:
        """A new file only (mode 0600, never through a symlink): an existing path raises
        ``FileExistsError``, so two runs never mix. ``append``: the name of the tap whose
        capture this may extend — an existing file must be that tap's capture."""
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        if append is None:
            flags |= os.O_EXCL
        else:
            _check_append(self.path, append)
        self._fd = os.open(self.path, flags, 0o600)
        self._start_size = os.fstat(self._fd).st_size  # discard() cuts an --append back to it
        if append is not None:
            with contextlib.suppress(OSError):
                os.fchmod(self._fd, 0o600)
        # rotation (--capture-max-bytes, --capture-max-age): numbered segments, each
        # beginning with the capture's header, so that each reads alone and all in order
        self._max_bytes, self._max_age = max_bytes, max_age
        self.segment = 0
        self.segments = [self.path]
        self._segment_bytes = 0
        self._segment_start = time.monotonic()
        self._header_line: bytes | None = None
        self._compress = compress  # closed segments to NAME.zst, in a thread of their own
        self._compressors: list[threading.Thread] = []
        self._max_pending = max_pending_bytes
        self._interval = flush_interval
        self._lock = threading.Lock()
        self._batch = bytearray()
        self._batch_records = 0
        self._wake = threading.Event()
        self._closing = threading.Event()  # ends the wait for a batch to build up
        self._stop = False
        self.written = 0
        self.dropped = 0
        self.dropped_bytes = 0
        self._loss_reported = 0
        self._torn = False
        self._last_error: str | None = None
        self._tap = ""
        self._sharing = BodySharing()
        self._share_lock = threading.Lock()
        self._shared_unsure = False  # a write failed: remembered bodies may not be on disk
        self._thread = threading.Thread(target=self._run, name="capture-writer", daemon=True)
        self._thread.start()

    # ---- producer side ------------------------------------------------------------

    def write(self, event: ev.Event, *, force: bool = False) -> bool:
        """Queue one event's record (False: dropped). A kept request body that repeats most
        of one queued before is written as a reference and the rest (``BodySharing``)."""
        self._tap = event.tap
        record = event.to_record()
        if type(event) is not ev.RequestEnd or event.body is None:
            return self.write_record(record, force=force)
        with self._share_lock:  # bodies are named as bases in the order they are queued
            if self._shared_unsure:
                self._shared_unsure = False
                self._sharing.forget()
            kept = self._sharing.share(record)
            queued = self.write_record(record, force=force)
            if queued and kept is not None:
                self._sharing.remember(kept)
        return queued

    def write_record(self, record: dict[str, Any], *, force: bool = False) -> bool:
        """Queue one record; drop and count it when the bound is reached (unless forced)."""
        try:
            line = encode_line(record)
        except TypeError:
            line = encode_line({"type": "unencodable", "of": str(record.get("type"))})
        size = len(line)
        if self._header_line is None and record.get("type") == "capture_start":
            self._header_line = line  # written again at the top of every segment
        with self._lock:
            batch = self._batch
            if (len(batch) + size > self._max_pending and not force) or self._stop:
                self.dropped += 1
                self.dropped_bytes += size
                return False
            batch += line
            self._batch_records += 1
            first = self._batch_records == 1
        if first:
            self._wake.set()
        return True

    @property
    def pending_bytes(self) -> int:
        return len(self._batch)

    # ---- writer thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if not self._stop:
                self._closing.wait(self._interval)  # a batch builds up: fewer, larger writes
            self._wake.clear()
            with self._lock:
                batch, records = self._batch, self._batch_records
                self._batch, self._batch_records = bytearray(), 0
                stopping = self._stop  # read after the swap: nothing can be queued after it
            if batch:
                self._write_batch(batch, records)
            if not stopping and self._rotation_due():
                self._rotate()
            if stopping:
                return

    def _write_batch(self, batch: bytearray, records: int) -> None:
        lost = self.dropped - self._loss_reported
        if lost and self._tap:
            now_m = time.monotonic()
            loss = ev.CaptureLoss(
                t=time.time(),
                m=now_m,
                tap=self._tap,
                dropped=lost,
                dropped_bytes=self.dropped_bytes,
                reason=self._last_error or "writer too slow",
            )
            # ahead of the batch, but never ahead of the capture_start header
            at = batch.find(b"\n") + 1 if self.written == 0 else 0
            batch[at:at] = encode_line(loss.to_record())
            loss_end = at + len(encode_line(loss.to_record()))
        else:
            loss_end = 0
        if self._torn:
            batch[:0] = b"\n"  # end the torn fragment so the next record parses
            loss_end += 1 if loss_end else 0
        view = memoryview(batch)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as exc:
            self._shared_unsure = True
            done = len(batch) - len(view)
            if done:  # what is on disk now ends mid-record or not; nothing written: as before
                self._torn = batch[done - 1 : done] != b"\n"
            # Records wholly unwritten are lost; a partly written one is torn.
            lost_lines = view.tobytes().count(b"\n")
            with self._lock:
                self.dropped += lost_lines
                self.dropped_bytes += len(view)
            if lost and loss_end and done >= loss_end:
                self._loss_reported += lost  # the capture_loss record itself is on disk
            if self._last_error is None:
                log.warning("capture write failed; records dropped", error=str(exc))
            self._last_error = f"{type(exc).__name__}: {exc.strerror or exc}"
            return
        self._torn = False
        self._last_error = None
        self._segment_bytes += len(batch)
        self.written += records
        if lost:
            self._loss_reported += lost

    def _rotation_due(self) -> bool:
        if self._max_bytes is None and self._max_age is None:
            return False
        if self._segment_bytes == 0:
            return False
        if self._max_bytes is not None and self._segment_bytes >= self._max_bytes:
            return True
        age = time.monotonic() - self._segment_start
        return self._max_age is not None and age >= self._max_age

    def _rotate(self) -> None:
        """Close this segment, open the next (``cap.jsonl`` -> ``cap.1.jsonl`` ...), its
        first line the capture's header; on failure the current one goes on. Under the
        body-sharing lock: what was queued meanwhile goes to this segment first, and the
        next segment's bodies name none of this one's (each segment reads alone)."""
        with self._share_lock:
            with self._lock:
                batch, records = self._batch, self._batch_records
                self._batch, self._batch_records = bytearray(), 0
            if batch:
                self._write_batch(batch, records)
            self._open_next()
            self._sharing.forget()

    def _open_next(self) -> None:
        nxt = segment_path(self.path, self.segment + 1)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(nxt, flags, 0o600)
        except OSError as exc:
            log.warning("capture segment not opened; the current one goes on", error=str(exc))
            self._segment_start = time.monotonic()
            return
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = fd
        if self._compress:
            self._compress_later(self.segment)
        self.segment += 1
        self.segments.append(nxt)
        self._segment_bytes = 0
        self._segment_start = time.monotonic()
        self._torn = False  # a torn line stays in the segment it was cut in
        if self._header_line is not None:
            with self._lock:  # first in the new segment
                self._batch[:0] = self._header_line
                self._batch_records += 1
            self._wake.set()

    def _compress_later(self, n: int) -> None:
        """Segment ``n`` (closed) to ``NAME.zst`` in the background; the plain file is
        removed once the compressed one is whole on disk (a failure keeps the plain one)."""
        plain = self.segments[n]

        def run() -> None:
            try:
                packed = compress_segment(plain)
            except OSError as exc:
                log.warning("capture segment not compressed", segment=str(plain), error=str(exc))
                return
            self.segments[n] = packed

        thread = threading.Thread(target=run, name="capture-compress", daemon=True)
        self._compressors.append(thread)
        thread.start()

    def close(self, *, timeout: float = 2.0) -> None:
        """Flush what is pending and close; never waits longer than ``timeout`` (for the
        writer, then for the segments being compressed)."""
        with self._lock:
            self._stop = True
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        for thread in self._compressors:
            thread.join(timeout)

    def discard(self) -> None:
        """Undo this run's capture (its start failed): close, then remove the file it
        made, or cut an ``--append``-ed one back to where it was."""
        with self._lock:
            self._batch.clear()
            self._batch_records = 0
        self.close()
        with contextlib.suppress(OSError):
            if self._start_size:
                os.truncate(self.path, self._start_size)
            else:
                self.path.unlink()

    def finish(self, tap: str, reason: str) -> None:
        """Write ``capture_end`` (with the counts) and close."""
        now = time.monotonic()
        self.write(
            ev.CaptureEnd(
                t=time.time(),
                m=now,
                tap=tap,
                records=self.written + self._batch_records + 1,
                dropped=self.dropped,
                reason=reason,
            ),
            force=True,
        )
        self.close()


def _check_append(path: Path, tap: str) -> None:
    """``--append`` extends this tap's own capture only (or makes a new file)."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(1 << 20)
    except FileNotFoundError:
        return
    if not first:
        return  # an empty file: nothing to mix with
    try:
        header = orjson.loads(first)
    except orjson.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("type") != "capture_start":
        raise FileExistsError(f"{path} exists and is not a tracer capture: not appending to it")
    if header.get("tap") != tap:
        raise FileExistsError(
            f"{path} is tap {header.get('tap')!r}'s capture, not tap {tap!r}'s: not appending"
        )


@dataclass
class ReadStats:
    records: int = 0
    bad_lines: int = 0
    unknown_types: int = 0
    version: int | None = None
    torn_tail: bool = False
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
            "bodies_unresolved": self.bodies_unresolved,
            "version": self.version,
        }


MAX_PROBLEMS = 5  # bad lines quoted per capture (all are counted)
_SEGMENT = re.compile(r"^(?P<stem>.*?)(?:\.(?P<n>[0-9]+))?(?P<suffix>\.jsonl)?(?:\.zst)?$")


def compress_segment(plain: Path) -> Path:
    """``cap.1.jsonl`` -> ``cap.1.jsonl.zst`` (written whole, then the plain file removed)."""
    import zstandard

    packed = plain.with_name(plain.name + ".zst")
    tmp = plain.with_name(f".{plain.name}.zst.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with open(plain, "rb") as src, os.fdopen(fd, "wb") as dst:
            zstandard.ZstdCompressor(level=3).copy_stream(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, packed)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    os.unlink(plain)
    return packed


def _open_capture_file(path: str | os.PathLike[str]) -> Any:
    """A capture file for reading by lines: plain, or a ``.zst`` segment."""
    if str(path).endswith(".zst"):
        import zstandard

        source = open(path, "rb")  # noqa: SIM115  (closed with the reader: closefd)
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(source, closefd=True))
    return open(path, "rb")


def segment_path(path: Path, n: int) -> Path:
    """Segment ``n`` of a capture: ``cap.jsonl`` (0), ``cap.1.jsonl``, ``cap.2.jsonl`` ..."""
    if n == 0:
        return path
    suffix = path.suffix if path.suffix else ""
    stem = path.name[: -len(suffix)] if suffix else path.name
    return path.with_name(f"{stem}.{n}{suffix}")


def expand_captures(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The captures named: a directory stands for the ``*.jsonl`` files in it; the
    segments of one rotated capture are put in their order (``cap.jsonl``,
    ``cap.1.jsonl``, ``cap.2.jsonl`` ... ``cap.10.jsonl``), whatever the shell's glob order."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted([*p.glob("*.jsonl"), *p.glob("*.jsonl.zst")]) if p.is_dir() else [p]

    def key(f: Path) -> tuple[str, str, int]:
        m = _SEGMENT.match(f.name)
        assert m is not None  # the pattern matches any name
        return (str(f.parent), m["stem"] + (m["suffix"] or ""), int(m["n"] or 0))

    order = {f: i for i, f in enumerate(files)}
    groups: dict[tuple[str, str], list[Path]] = {}
    for f in files:
        k = key(f)
        groups.setdefault(k[:2], []).append(f)
    out: list[str] = []
    for members in sorted(groups.values(), key=lambda m: min(order[f] for f in m)):
        out += [str(f) for f in sorted(members, key=lambda f: key(f)[2])]
    return out


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
        yield from _read_lines(fh, stats, str(path))


def _read_lines(fh: Any, stats: ReadStats, name: str) -> Iterator[dict[str, Any]]:
    first = True
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
                if len(stats.problems) < MAX_PROBLEMS:
                    stats.problems.append(f"line {stats.lines}: not JSON")
                continue
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


def write_all(path: str | os.PathLike[str], records: list[ev.Event]) -> None:
    """Write a whole capture synchronously (for tests and generated captures)."""
    with open(path, "wb") as fh:
        for event in records:
            fh.write(encode_line(event.to_record()))
