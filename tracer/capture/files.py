"""Capture file: a non-blocking, crash-safe writer (the reader is ``reader``).

Format: JSON Lines, first line a ``capture_start`` header carrying the format version
(see ``captures/README.md``). The writer never blocks the caller: records are encoded
on the caller's thread (cheap) and copied at once onto the end of one in-memory batch, a
``bytearray`` bounded in bytes (keeping each encoded line alive as its own object instead
costs several times the encoding: a fresh allocation per record), and a background
thread writes batches with ``os.write``. When the batch is full (disk slow)
or a write fails (disk full), records are dropped and counted, with the window of time
they came from; the count and the window are written as a ``capture_loss`` record as
soon as writing works again (``resumed``), and in ``capture_end``. The writer keeps a
reserve beside the capture (``Reserve``): at the end, if the disk is still full, it frees
it to write the last ``capture_loss`` and ``capture_end``, so that a full disk is told
apart from a kill. After ``kill -9`` everything flushed so far is on disk; the reader
skips a torn line.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import structlog

from .. import events as ev
from .bodies import BodySharing

# The reading side lives in ``reader``; its names are importable from here, as they were.
from .reader import (
    PACKETS,
    CaptureError,
    PacketOptions,
    ReadStats,
    event_from_record,
    expand_captures,
    file_kind,
    not_a_capture,
    read_events,
    read_into,
    read_records,
)

__all__ = [  # the writer, and the reader's names re-exported
    "FLUSH_INTERVAL",
    "MAX_PENDING_BYTES",
    "PACKETS",
    "RESERVE_BYTES",
    "CaptureError",
    "CaptureWriter",
    "PacketOptions",
    "ReadStats",
    "Reserve",
    "boot_id",
    "compress_segment",
    "encode_line",
    "event_from_record",
    "expand_captures",
    "file_kind",
    "not_a_capture",
    "read_events",
    "read_into",
    "read_records",
    "segment_path",
    "write_all",
]

log = structlog.get_logger("tracer.capture.files")

FLUSH_INTERVAL = 0.05
MAX_PENDING_BYTES = 32 * 1024 * 1024
RESERVE_BYTES = 64 * 1024  # room kept for the last records: far more than they take

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


class Reserve:
    """Disk space held for a capture's last records: a hidden file beside it
    (``.NAME.reserve``), allocated at start and removed at the end. When the disk filled,
    removing it first makes room for the ``capture_loss`` and ``capture_end`` records, so
    the capture says how much it lost and that its tap stopped, instead of ending like a
    killed tap's. A disk full already at start gets no reserve (``size`` 0)."""

    def __init__(self, capture: Path, size: int = RESERVE_BYTES) -> None:
        self.path = capture.with_name(f".{capture.name}.reserve")
        self.size = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            log.warning("capture reserve not made", path=str(self.path), error=str(exc))
            return
        try:
            _allocate(fd, size)
            self.size = size
        except OSError as exc:
            log.warning("capture reserve not allocated", path=str(self.path), error=str(exc))
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        finally:
            os.close(fd)

    def release(self) -> int:
        """Free the space (once); how many bytes that gave back."""
        size, self.size = self.size, 0
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        return size


def _allocate(fd: int, size: int) -> None:
    """Blocks really taken on disk (not a sparse file), where the system can say so."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.write(fd, bytes(size))
        os.fsync(fd)


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
        self._reserve = Reserve(self.path)
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
        self._loss_bytes_reported = 0
        # the wall-clock window of the records dropped since the last capture_loss
        self._loss_first_t: float | None = None
        self._loss_last_t: float | None = None
        self._batch_t0: float | None = None  # the first queued record's time
        self._end: tuple[str, str] | None = None  # finish(): capture_end's tap and reason
        self._torn = False
        self._last_error: str | None = None
        self.failing = False  # the last write failed: records are being lost now
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
                self._lost_between(_record_t(record), time.time())
                return False
            batch += line
            self._batch_records += 1
            first = self._batch_records == 1
            if first:
                self._batch_t0 = _record_t(record)
        if first:
            self._wake.set()
        return True

    def _lost_between(self, first: float | None, last: float) -> None:
        """Widen the window of the records lost since the last ``capture_loss``."""
        start = first if first is not None and first <= last else last
        if self._loss_first_t is None or start < self._loss_first_t:
            self._loss_first_t = start
        if self._loss_last_t is None or last > self._loss_last_t:
            self._loss_last_t = last

    @property
    def reserve_bytes(self) -> int:
        """Disk space still held for the last records (0 once used or never had)."""
        return self._reserve.size

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
                batch, records, t0 = self._batch, self._batch_records, self._batch_t0
                self._batch, self._batch_records = bytearray(), 0
                stopping = self._stop  # read after the swap: nothing can be queued after it
            if batch:
                self._write_batch(batch, records, t0)
            if not stopping and self._rotation_due():
                self._rotate()
            if stopping:
                self._write_end()
                return

    def _loss_record(self, *, resumed: bool) -> tuple[bytes, int, int]:
        """The ``capture_loss`` line for what was dropped since the last one (empty when
        nothing was), and the counts it reports."""
        with self._lock:
            lost = self.dropped - self._loss_reported
            lost_bytes = self.dropped_bytes - self._loss_bytes_reported
            first, last = self._loss_first_t, self._loss_last_t
        if not lost or not self._tap:
            return b"", 0, 0
        loss = ev.CaptureLoss(
            t=time.time(),
            m=time.monotonic(),
            tap=self._tap,
            dropped=lost,
            dropped_bytes=lost_bytes,
            reason=self._last_error or "writer too slow",
            first_t=first,
            last_t=last,
            resumed=resumed,
        )
        return encode_line(loss.to_record()), lost, lost_bytes

    def _reported(self, lost: int, lost_bytes: int) -> None:
        """A ``capture_loss`` line is on disk: its counts and window are told."""
        with self._lock:
            self._loss_reported += lost
            self._loss_bytes_reported += lost_bytes
            if self._loss_reported == self.dropped:
                self._loss_first_t = self._loss_last_t = None

    def _write_batch(self, batch: bytearray, records: int, t0: float | None = None) -> None:
        line, lost, lost_bytes = self._loss_record(resumed=True)
        loss_end = 0
        if line:
            # ahead of the batch, but never ahead of the capture_start header
            at = batch.find(b"\n") + 1 if self.written == 0 else 0
            batch[at:at] = line
            loss_end = at + len(line)
        torn = self._torn
        if torn:
            batch[:0] = b"\n"  # end the torn fragment so the next record parses
            loss_end += 1 if loss_end else 0
        done, error = self._write(batch)
        if error is not None:
            self._shared_unsure = True
            # Records wholly unwritten are lost; a partly written one is torn (lost too).
            # Lines that are not records: the torn fragment's end and the loss line.
            unwritten = memoryview(batch)[done:]
            not_records = (torn and done == 0) + (bool(loss_end) and done < loss_end)
            lost_lines = max(0, unwritten.tobytes().count(b"\n") - not_records)
            with self._lock:
                self.dropped += lost_lines
                self.dropped_bytes += len(unwritten)
                self._lost_between(t0, time.time())
            self.written += max(0, records - lost_lines)
            if lost and loss_end and done >= loss_end:
                self._reported(lost, lost_bytes)  # the capture_loss record itself is on disk
            return
        self._segment_bytes += len(batch)
        self.written += records
        if lost:
            self._reported(lost, lost_bytes)

    def _write(self, data: bytearray | bytes) -> tuple[int, OSError | None]:
        """Write it all, or as much as the disk takes: (bytes written, the error)."""
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as exc:
            done = len(data) - len(view)
            if done:  # what is on disk now ends mid-record or not; nothing written: as before
                self._torn = data[done - 1 : done] != b"\n"
            if not self.failing:
                log.warning("capture write failed; records dropped", error=str(exc))
            self.failing = True
            self._last_error = f"{type(exc).__name__}: {exc.strerror or exc}"
            return done, exc
        if self.failing:
            log.warning("capture writing again", dropped=self.dropped)
        self.failing = False
        self._torn = False
        self._last_error = None
        return len(data), None

    def _write_end(self) -> None:
        """The capture's last lines after ``finish()``: a ``capture_loss`` for what is
        not yet told, and ``capture_end``. If the disk is still full, the reserve is
        freed for them (a capture_loss written then says ``resumed`` false)."""
        if self._end is None:
            return
        tap, reason = self._end
        for attempt in range(2):
            failing = self.failing
            line, lost, lost_bytes = self._loss_record(resumed=not failing)
            end = ev.CaptureEnd(
                t=time.time(),
                m=time.monotonic(),
                tap=tap,
                records=self.written + 1 + (1 if line else 0),
                dropped=self.dropped,
                reason=reason,
            )
            data = (b"\n" if self._torn else b"") + line + encode_line(end.to_record())
            if attempt == 0 and failing and self._reserve.release():
                log.warning("capture reserve used for the last records", dropped=self.dropped)
            _, error = self._write(data)
            if error is None:
                self.written += 1 + (1 if line else 0)
                if line:
                    self._reported(lost, lost_bytes)
                return
            if not self._reserve.release():
                return  # the reserve is gone too: what reached the disk stays

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
        self._reserve.release()
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
        """Write ``capture_end`` (with the final counts, after the last batch: from the
        reserve if the disk is full) and close."""
        self._tap = self._tap or tap
        self._end = (tap, reason)
        self.close()


def _record_t(record: dict[str, Any]) -> float | None:
    t = record.get("t")
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None


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


def segment_path(path: Path, n: int) -> Path:
    """Segment ``n`` of a capture: ``cap.jsonl`` (0), ``cap.1.jsonl``, ``cap.2.jsonl`` ..."""
    if n == 0:
        return path
    suffix = path.suffix if path.suffix else ""
    stem = path.name[: -len(suffix)] if suffix else path.name
    return path.with_name(f"{stem}.{n}{suffix}")


def write_all(path: str | os.PathLike[str], records: list[ev.Event]) -> None:
    """Write a whole capture synchronously (for tests and generated captures)."""
    with open(path, "wb") as fh:
        for event in records:
            fh.write(encode_line(event.to_record()))
