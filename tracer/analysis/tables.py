"""A ``Summary``'s two tables (requests, connections): rows in table order, memory bounded.

A row stays in memory while it is open and for ``recent`` finished rows after it (late
events still land on it), then goes to a ``SortedSpool`` and its key to a bounded list
of finished keys. Apart from the fold (``summary``) because it is storage: the same for
both tables, whatever the rows say.
"""

from __future__ import annotations

import heapq
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

from .rows import ConnectionRow, RequestRow
from .spill import SortedSpool

RequestKey = tuple[str, int, int]
ConnKey = tuple[str, int]


def request_order(r: RequestRow) -> tuple[str, int, int]:
    """The requests table's order."""
    return (r.tap, r.conn, r.seq)


def connection_order(c: ConnectionRow) -> tuple[str, float, int]:
    """The connections table's order."""
    return (c.tap, c.opened, c.conn)


_REQUEST_VALUES = operator.attrgetter(*(f.name for f in fields(RequestRow)))
_CONNECTION_VALUES = operator.attrgetter(*(f.name for f in fields(ConnectionRow)))


def _request_from(values: list[Any]) -> RequestRow:
    return RequestRow(*values)


def _connection_from(values: list[Any]) -> ConnectionRow:
    return ConnectionRow(*values)


class Rows[T]:
    """A table's rows in table order, read again at every iteration; ``len()`` counts them.

    What ``Summary.result()`` gives as ``requests`` and ``connections``: iterate it (as
    often as needed), never index it.
    """

    def __init__(self, source: Callable[[], Iterator[T]], count: int) -> None:
        self._source, self._count = source, count

    def __iter__(self) -> Iterator[T]:
        return self._source()

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __eq__(self, other: object) -> bool:
        """Equal to rows or a list with the same items in the same order (streamed)."""
        if not isinstance(other, Rows | list):
            return NotImplemented
        if len(self) != len(other):
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<Rows: {self._count}>"


class Table[K, T]:
    """One table of a ``Summary``: the rows still in memory and those written out.

    Read-only and mapping-like (``values()``, ``items()``, ``len()``, ``get(key)``); the
    rows come in table order.
    """

    def __init__(
        self,
        key: Callable[[T], K],
        order: Callable[[T], Any],
        encode: Callable[[T], Any],
        decode: Callable[[list[Any]], T],
        *,
        spill: int,
        recent: int,
        remember: int,
    ) -> None:
        self._key, self._order = key, order
        self.open: dict[K, T] = {}
        self.recent: OrderedDict[K, T] = OrderedDict()  # finished, still updatable
        self.finished: OrderedDict[K, None] = OrderedDict()  # keys of rows written out
        self.store: SortedSpool[T] = SortedSpool(order, encode, decode, limit=spill)
        self._recent_limit, self._remember = recent, remember

    def lookup(self, key: K) -> tuple[T | None, bool]:
        """The row if it is in memory; else whether the key is one of a row written out."""
        row = self.open.get(key)
        if row is None:
            row = self.recent.get(key)
        return row, row is None and key in self.finished

    def start(self, key: K, row: T) -> None:
        """A new row; it replaces one with the same key that is still in memory."""
        self.open.pop(key, None)
        self.recent.pop(key, None)
        self.finished.pop(key, None)
        self.open[key] = row

    def finish(self, key: K) -> T | None:
        """The row is complete; it stays updatable until ``recent`` more have finished.

        Returns a row written out to make room, if one was.
        """
        row = self.open.pop(key, None)
        if row is None:
            return None
        self.recent[key] = row
        if len(self.recent) <= self._recent_limit:
            return None
        old_key, old = self.recent.popitem(last=False)
        self.store.add(old)
        self.finished[old_key] = None
        if len(self.finished) > self._remember:
            self.finished.popitem(last=False)
        return old

    def live(self) -> list[T]:
        return [*self.open.values(), *self.recent.values()]

    def __len__(self) -> int:
        return len(self.store) + len(self.open) + len(self.recent)

    def __iter__(self) -> Iterator[K]:
        return (self._key(row) for row in self.values())

    def values(self) -> Rows[T]:
        def rows() -> Iterator[T]:
            live = sorted(self.live(), key=self._order)
            if not len(self.store):
                return iter(live)
            return heapq.merge(self.store, live, key=self._order)

        return Rows(rows, len(self))

    def items(self) -> Rows[tuple[K, T]]:
        return Rows(lambda: ((self._key(r), r) for r in self.values()), len(self))

    def get(self, key: K) -> T | None:
        """The row with this key (a scan of the rows written out when it is not in memory)."""
        row, _ = self.lookup(key)
        if row is None:
            row = next((r for r in self.store if self._key(r) == key), None)
        return row

    def close(self) -> None:
        self.store.close()
