"""Bounded-memory storage for the analysis: sorted runs on disk, and a chunked log.

``SortedSpool`` is an external merge sort: items are kept in memory up to ``limit``,
then written to a temporary file as one sorted run (orjson lines); iterating merges the
runs with ``heapq.merge`` and yields the items in key order, one at a time. The sort is
stable: items with equal keys come out in the order they were added.

``ChunkLog`` keeps records (dicts) in the order they were added, in chunks of ``limit``;
full chunks go to a temporary file with the time range they cover, so ``window(lo, hi)``
reads only the chunks that overlap it (a few recently read chunks stay decoded).

The temporary files are anonymous (``tempfile.TemporaryFile``: unlinked as soon as they
are created, in ``$TMPDIR``), so nothing is left behind when the process ends, however
it ends; ``close()`` frees them earlier.
"""

from __future__ import annotations

import heapq
import os
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

import orjson

READ_BUDGET = 1 << 20  # bytes of read buffers shared by the runs of one merge
FAN_IN = 32  # runs of one level merged into one run of the next


class _File:
    """An anonymous temporary file written at its end and read back with ``pread``."""

    def __init__(self) -> None:
        self._fh: IO[bytes] | None = None
        self.size = 0

    def append(self, pieces: Iterable[bytes]) -> tuple[int, int]:
        """Write the pieces one after the other (never joined in memory): their offset
        and total length."""
        if self._fh is None:
            # lives as long as its owner: closed by close(), or when the owner is collected
            self._fh = tempfile.TemporaryFile(prefix="tracer-analysis-")  # noqa: SIM115
            weakref.finalize(self, self._fh.close)
        offset = self.size
        for piece in pieces:
            self._fh.write(piece)
            self.size += len(piece)
        self._fh.flush()
        return offset, self.size - offset

    def lines(self, offset: int, length: int, chunk: int) -> Iterator[bytes]:
        assert self._fh is not None
        fd, end, tail = self._fh.fileno(), offset + length, b""
        while offset < end:
            data = os.pread(fd, min(chunk, end - offset), offset)
            if not data:
                raise OSError(f"analysis spill file truncated at byte {offset}")
            offset += len(data)
            lines = (tail + data).split(b"\n")
            tail = lines.pop()
            yield from lines

    def truncate(self) -> None:
        """Empty the file (its runs were merged into another)."""
        if self._fh is not None:
            self._fh.truncate(0)
            self._fh.seek(0)
        self.size = 0

    def read(self, offset: int, length: int) -> bytes:
        assert self._fh is not None
        return os.pread(self._fh.fileno(), length, offset)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class SortedSpool[T]:
    """Items in key order, whatever order they were added in.

    Memory: ``limit`` items, plus the read buffers of a merge (``READ_BUDGET`` shared by
    at most ``FAN_IN`` runs per level). Runs are kept in levels, as in a log-structured
    merge: when a level holds ``FAN_IN`` runs they are merged into one run of the next
    level and their file is emptied, so a capture ten times bigger adds one level, not
    ten times the runs to merge (and the disk holds each item about once).
    """

    def __init__(
        self,
        key: Callable[[T], Any],
        encode: Callable[[T], Any],
        decode: Callable[[Any], T],
        *,
        limit: int = 4096,
    ) -> None:
        if limit < 1:
            raise ValueError(f"spill limit must be at least 1, not {limit}")
        self._key, self._encode, self._decode, self.limit = key, encode, decode, limit
        self._buffer: list[T] = []
        self._levels: list[tuple[_File, list[tuple[int, int]]]] = []  # runs: (offset, length)
        self._count = 0
        self.spills = 0  # runs written from memory

    def __len__(self) -> int:
        return self._count

    @property
    def runs(self) -> int:
        """Runs on disk now."""
        return sum(len(runs) for _, runs in self._levels)

    def add(self, item: T) -> None:
        self._buffer.append(item)
        self._count += 1
        if len(self._buffer) >= self.limit:
            self._spill()

    def _spill(self) -> None:
        self._buffer.sort(key=self._key)
        self._write(0, self._buffer)
        self._buffer = []
        self.spills += 1
        level = 0
        while len(self._levels[level][1]) >= FAN_IN:
            file, runs = self._levels[level]
            chunk = max(4096, READ_BUDGET // len(runs))
            merged = heapq.merge(*(self._run(file, o, n, chunk) for o, n in runs), key=self._key)
            self._write(level + 1, merged)
            file.truncate()
            runs.clear()
            level += 1

    def _write(self, level: int, items: Iterable[T]) -> None:
        while len(self._levels) <= level:
            self._levels.append((_File(), []))
        file, runs = self._levels[level]
        encode, dumps, newline = self._encode, orjson.dumps, orjson.OPT_APPEND_NEWLINE
        runs.append(file.append(dumps(encode(item), option=newline) for item in items))

    def _run(self, file: _File, offset: int, length: int, chunk: int) -> Iterator[T]:
        decode, loads = self._decode, orjson.loads
        for line in file.lines(offset, length, chunk):
            yield decode(loads(line))

    def __iter__(self) -> Iterator[T]:
        """Every item, in key order (a merge of the runs and what is still in memory).

        Older runs come first, so items with equal keys keep the order they were added in.
        """
        chunk = max(4096, READ_BUDGET // max(1, self.runs))
        sources: list[Iterator[T]] = [
            self._run(file, o, n, chunk) for file, runs in reversed(self._levels) for o, n in runs
        ]
        sources.append(iter(sorted(self._buffer, key=self._key)))
        if len(sources) == 1:
            return sources[0]
        return heapq.merge(*sources, key=self._key)

    def close(self) -> None:
        for file, _ in self._levels:
            file.close()
        self._levels, self._buffer, self._count = [], [], 0


class ChunkLog:
    """Records in the order added; ``window(lo, hi)`` reads only the chunks it needs.

    ``time`` names the field that ``window`` selects on. Memory: the chunk being filled
    and ``cache`` decoded chunks.
    """

    def __init__(self, *, time: str = "t", limit: int = 512, cache: int = 4) -> None:
        if limit < 1:
            raise ValueError(f"spill limit must be at least 1, not {limit}")
        self.time, self.limit, self._cache_size = time, limit, cache
        self._tail: list[dict[str, Any]] = []
        self._chunks: list[tuple[float, float, int, int]] = []  # (lo, hi, offset, length)
        self._cache: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()
        self._file = _File()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def append(self, record: dict[str, Any]) -> None:
        self._tail.append(record)
        self._count += 1
        if len(self._tail) >= self.limit:
            times = [r[self.time] for r in self._tail]
            offset, length = self._file.append([orjson.dumps(self._tail)])
            self._chunks.append((min(times), max(times), offset, length))
            self._tail = []

    def _chunk(self, index: int) -> list[dict[str, Any]]:
        cached = self._cache.get(index)
        if cached is not None:
            self._cache.move_to_end(index)
            return cached
        _, _, offset, length = self._chunks[index]
        records: list[dict[str, Any]] = orjson.loads(self._file.read(offset, length))
        self._cache[index] = records
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return records

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for index in range(len(self._chunks)):
            yield from self._chunk(index)
        yield from list(self._tail)

    def window(self, lo: float, hi: float) -> Iterator[dict[str, Any]]:
        """The records with ``lo <= record[time] <= hi``, in the order they were added."""
        name = self.time
        for index, (first, last, _, _) in enumerate(self._chunks):
            if last >= lo and first <= hi:
                yield from (r for r in self._chunk(index) if lo <= r[name] <= hi)
        yield from [r for r in self._tail if lo <= r[name] <= hi]

    def close(self) -> None:
        self._file.close()
        self._chunks, self._tail, self._count = [], [], 0
        self._cache.clear()
