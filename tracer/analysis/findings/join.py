"""The cross-tap join: the same request as each tap saw it, and what the pairs of taps
say about each other (which is in front, which relays which, one clock or not).

Apart from ``Context`` because it is a machine of its own: an external sort of small
records, per-pair statistics in O(1) memory, and the groups the analyzers ask about.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..rows import RequestRow
from ..spill import SortedSpool
from .clocks import PairClock, shared_clock
from .first_events import FIRST_EVENT_HELD, FIRST_EVENT_PROMPT, Holds

JOIN_SLACK = 1.0  # seconds: clock offset between taps tolerated when joining by time
# ... between taps that read one wall clock (the same boot, the same wall offset): only
# the few ms between a tap reading bytes and writing down when
SHARED_CLOCK_SLACK = 0.005
# On one clock, a fingerprint seen 2..this many times at a tap is joined by time (the same
# body sent again: a retry); seen more often (a load test's one prompt) it is joined by
# occurrence, as without a shared clock. At most this many such fingerprints are kept.
TIME_JOINED_REPEATS = 16
TIME_JOINED_PRINTS = 10_000
SPILL_ITEMS = 16384  # join records (a few small fields each) in memory before a run spills


class _PairOrder:
    """The sign of the median of ``t(b) - t(a)`` over shared requests, in O(1) memory.

    Equal to ``statistics.median(diffs) > 0``: with more positive than other differences
    the median is positive, with fewer it is not, and with as many it is the mean of the
    largest non-positive and the smallest positive one.
    """

    SAMPLE = 1024  # differences kept for the median's value (the first ones: deterministic)

    def __init__(self) -> None:
        self.positive = 0
        self.other = 0
        self.min_positive = math.inf
        self.max_other = -math.inf
        self.sample: list[float] = []

    def add(self, d: float) -> None:
        if len(self.sample) < self.SAMPLE:
            self.sample.append(d)
        if d > 0:
            self.positive += 1
            self.min_positive = min(self.min_positive, d)
        else:
            self.other += 1
            self.max_other = max(self.max_other, d)

    def median(self) -> float | None:
        """The median difference over the first ``SAMPLE`` shared requests."""
        return statistics.median(self.sample) if self.sample else None

    def later(self) -> bool | None:
        """Whether b sees requests after a (None: no shared request)."""
        n = self.positive + self.other
        if n == 0:
            return None
        if self.positive * 2 > n + (n % 2 == 0):  # both middle values positive
            return True
        if n % 2 == 0 and self.positive * 2 == n:
            return (self.max_other + self.min_positive) / 2 > 0
        return False


class _Seen(NamedTuple):
    """A request as one tap saw it, in a join record (``Context._scan``): ``item`` is the
    record less its key, ``(tap, start, position, relevant at the front, coalesced, end
    (-1: open), first event wait, events, row id)``."""

    start: float
    pos: int
    rel: bool
    coal: bool
    end: float  # inf: still open
    wait: float  # first_event_wait
    events: int
    rid: str

    @classmethod
    def of(cls, item: tuple[Any, ...]) -> tuple[str, _Seen]:
        tap, start, pos, rel, coal, end, wait, events, rid = item
        return tap, cls(start, pos, rel, coal, end if end >= 0 else math.inf, wait, events, rid)


def join_method(key: str) -> str:
    """What joined a group, from its key: the client's trace id, its ``x-request-id``,
    the content in order of occurrence, or the content told apart by time (one clock)."""
    if key.startswith("tr:"):
        return "trace_id"
    if key.startswith("id:"):
        return "request_id"
    return "content" if "#" in key else "content_time"


@dataclass
class _Group:
    """The requests that share one join key, as seen at each tap (the first per tap)."""

    first: tuple[str, float, int]  # (tap, start, position): where the key appears first
    members: dict[str, _Seen]


def pair_key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


def addr_key(addr: str) -> str:
    """An address as both ends write it: an IPv4 peer of a dual-stack socket is
    ``[::ffff:10.0.0.1]:port`` on one side and ``10.0.0.1:port`` on the other."""
    return addr.replace("[::ffff:", "").replace("]:", ":") if "::ffff:" in addr else addr


def _print_keys(
    by_print: Iterable[tuple[Any, ...]], retries: bool
) -> Iterator[tuple[str, int, tuple[Any, ...]]]:
    """(join key, its occurrence number at the tap, the item for ``_group_key`` without
    its key) for each request joined by fingerprint: the fingerprint, with the SDK's retry
    count when ``retries``. ``by_print`` is sorted by tap, fingerprint, start."""
    run: tuple[Any, Any] | None = None
    seen: dict[str, int] = {}
    for tap, fingerprint, start, retry, *rest in by_print:
        if run != (tap, fingerprint):
            run, seen = (tap, fingerprint), {}
        key = f"fp:{fingerprint} {retry}" if retries else f"fp:{fingerprint}"
        n = seen[key] = seen.get(key, 0) + 1
        yield key, n, (tap, start, *rest)


def _repeated_prints(keys: Iterable[tuple[str, int, tuple[Any, ...]]]) -> set[str]:
    """The keys some tap saw 2..``TIME_JOINED_REPEATS`` times and none more often (the
    first ``TIME_JOINED_PRINTS`` of them): the ones ``_join`` groups by time."""
    most: dict[str, int] = {}
    for key, n, _ in keys:
        if n > 1 and (key in most or len(most) < TIME_JOINED_PRINTS):
            most[key] = max(n, most.get(key, 0))
    return {key for key, count in most.items() if count <= TIME_JOINED_REPEATS}


# the groups of requests the analyzers ask about: those whose front copy went wrong, each
# request as every tap saw it; by request id, the groups of bunched requests and those
# that went wrong behind a front copy that was answered well
_Joined = tuple[
    list[dict[str, RequestRow]], dict[str, dict[str, RequestRow]], dict[str, dict[str, RequestRow]]
]


def _identity(item: tuple[Any, ...]) -> tuple[Any, ...]:
    return item


def tuple_spool() -> SortedSpool[tuple[Any, ...]]:
    return SortedSpool(_identity, _identity, tuple, limit=SPILL_ITEMS)


class Join:
    """The requests of several taps grouped by join key (``_join``), and the tap order.

    ``add`` each request as the rows are read, then ``run`` once; ``order`` is the taps
    from the client side. ``rows_at`` reads rows back by position (``Context.rows_at``).
    """

    def __init__(
        self,
        taps: dict[str, dict[str, Any]],
        rows_at: Callable[[Iterable[int]], dict[int, RequestRow]],
    ) -> None:
        self.taps = taps
        self.rows_at = rows_at
        self.order: list[str] = []
        self.by_trace: SortedSpool[tuple[Any, ...]] = tuple_spool()
        self.by_id: SortedSpool[tuple[Any, ...]] = tuple_spool()
        self.by_print: SortedSpool[tuple[Any, ...]] = tuple_spool()
        # every request joined with others: (position, row id, the others' ids, method)
        self.copies: SortedSpool[tuple[Any, ...]] = tuple_spool()
        # per pair of taps (in name order): the bounds on their clocks' offset (``clocks``)
        self.clocks: dict[tuple[str, str], PairClock] = defaultdict(PairClock)
        # per pair of taps (in name order): how many requests each method joined
        self.methods: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._groups: list[_Group] = []
        self._pairs: dict[tuple[str, str], _PairOrder] = defaultdict(_PairOrder)
        self._retry_taps: set[str] = set()  # taps that saw the openai SDK's retry counts
        self._inside: dict[tuple[str, str], int] = defaultdict(int)  # see _close_group
        self._next: dict[str, list[str]] | None = None  # see next_taps
        self._slack = JOIN_SLACK  # the join's (SHARED_CLOCK_SLACK on one clock)
        self._joined: _Joined | None = None
        # (tap where first events came late, tap where they came at once) -> the holds
        self.first_held: dict[tuple[str, str], Holds] = defaultdict(Holds)

    def add(self, r: RequestRow, pos: int, rel: bool, coal: bool, wait: float) -> None:
        """A request to join (``rel``: relevant at the front; ``coal``: bunched or buffered).
        By the client's trace id first (``_join`` keeps it where it is one request's at
        every tap), else by ``x-request-id``, else by content."""
        end_at = r.end if r.end is not None else -1.0  # (-1: still open)
        if r.retry_count is not None:
            self._retry_taps.add(r.tap)
        seen = (r.tap, r.start, pos, rel, coal, end_at, wait, r.events, r.id)
        fingerprint, retry = "", -1
        if r.request_bytes:  # a request without a body has no content to join by
            content = r.content_sha256 or r.body_sha256
            fingerprint = f"{r.method} {r.target} {content}"
            retry = -1 if r.retry_count is None else r.retry_count
        if r.trace_id:
            self.by_trace.add((f"tr:{r.trace_id}", *seen, r.request_id or "", fingerprint, retry))
        else:
            self._add_fallback(seen, r.request_id or "", fingerprint, retry)

    def _add_fallback(
        self, seen: tuple[Any, ...], request_id: str, fingerprint: str, retry: int
    ) -> None:
        if request_id:
            self.by_id.add((f"id:{request_id}", *seen))
        elif fingerprint:
            tap, start, *rest = seen
            self.by_print.add((tap, fingerprint, start, retry, *rest))

    def _by_trace(self, keyed: SortedSpool[tuple[Any, ...]], taps: int) -> None:
        """Trace ids that are one request's at each tap join their requests; a trace id
        that a tap saw more than once (a client that sends one per session, a retry)
        joins nothing, and its requests go by request id or content. Streamed: a trace
        id seen more often than there are taps is known to repeat at once."""
        group: list[tuple[Any, ...]] = []
        repeated: str | None = None  # the key being sent the other way as it comes

        def flush() -> None:
            seen = [g[1] for g in group]
            # the same trace id on different bodies is no one request (a hop that mixed
            # up headers): what would contradict the join, so it goes the other way
            bodies = {g[11] for g in group if g[11]}
            if len(set(seen)) == len(seen) > 1 and len(bodies) <= 1:
                for g in group:
                    keyed.add(g[:10])
            else:
                for g in group:
                    self._add_fallback(g[1:10], *g[10:])
            group.clear()

        for item in self.by_trace:
            if item[0] == repeated:
                self._add_fallback(item[1:10], *item[10:])
                continue
            if group and item[0] != group[0][0]:
                flush()
            group.append(item)
            if len(group) > taps:
                repeated = item[0]
                for g in group:
                    self._add_fallback(g[1:10], *g[10:])
                group.clear()
        if group:
            flush()

    def run(self, counts: dict[str, int]) -> None:
        """Group what was added (``counts``: the requests per tap)."""
        self._join(self.by_id, self.by_print, counts)

    def close(self) -> None:
        self.by_trace.close()
        self.by_id.close()
        self.by_print.close()  # (``copies`` is the analysis's to close, once it is written)

    def ordered(self, counts: dict[str, int]) -> list[str]:
        """Set and return ``order``: the taps from the client side to the engine side."""
        self.order = self._tap_order(counts)
        return self.order

    def _join(
        self,
        by_id: SortedSpool[tuple[Any, ...]],
        by_print: SortedSpool[Any],
        counts: dict[str, int],
    ) -> None:
        """Group the requests by join key; keep the statistics and the groups that matter.

        A key is ``x-request-id`` when the client sent one; otherwise a fingerprint
        (method, target, body hash, the openai SDK's retry count) and, unless the taps
        share a clock, its occurrence number at that tap, in time order.
        A key one tap saw again later (a retry with the same id, a replay, the same body
        sent again) is several requests: each joins the earliest group of its key that has
        no request from its tap yet and whose first request was still open (or ended less
        than the clock slack before) when it started — a request cannot reach a tap after
        its client saw it end. On one clock that slack is ``SHARED_CLOCK_SLACK``, and it
        is what tells a dropped request from the same body sent again at once: counted
        per tap, the next tap's copy of the second would be taken for the first.
        """
        shared = self.one_clock(*counts)
        slack = self._slack = SHARED_CLOCK_SLACK if shared else JOIN_SLACK
        # a hop that drops the SDK's retry count (the SGLang router does) leaves it out
        retries = self._retry_taps >= counts.keys()
        keyed: SortedSpool[tuple[Any, ...]] = tuple_spool()
        try:
            self._by_trace(keyed, len(counts))  # (first: what it leaves goes their way)
            for item in by_id:
                keyed.add(item)
            by_time = _repeated_prints(_print_keys(by_print, retries)) if shared else set()
            for key, n, item in _print_keys(by_print, retries):
                keyed.add((key if key in by_time else f"{key}#{n}", *item))
            group_key: str | None = None
            items: list[tuple[Any, ...]] = []
            for item in keyed:
                if item[0] != group_key:
                    self._group_key(items, slack)
                    group_key, items = item[0], []
                items.append(item)
            self._group_key(items, slack)
        finally:
            keyed.close()
        self._groups.sort(key=lambda g: g.first)

    def _group_key(self, items: list[tuple[Any, ...]], slack: float) -> None:
        """The requests of one key (a handful) into groups (see ``_join``).

        Seen once per tap, they are one request whatever the clocks say (taps on
        different machines may be seconds apart); only a key a tap saw again is split
        by time.
        """
        if not items:
            return
        method = join_method(items[0][0])
        taps = [item[1] for item in items]
        if len(set(taps)) == len(taps):
            _, tap, start, pos, *_ = items[0]
            members = dict(_Seen.of(item[1:]) for item in items)
            self._close_group(_Group(first=(tap, start, pos), members=members), method)
            return
        groups: list[_Group] = []
        for item in sorted(items, key=lambda i: i[2]):
            tap, seen = _Seen.of(item[1:])
            # the earliest group without this tap whose first request was still open (or
            # had ended less than the slack before) when this one began
            for group in groups:
                if (
                    tap not in group.members
                    and seen.start <= group.members[group.first[0]].end + slack
                ):
                    break
            else:
                group = _Group(first=(tap, seen.start, seen.pos), members={})
                groups.append(group)
            group.members[tap] = seen
        for group in groups:
            self._close_group(group, method)

    def _close_group(self, group: _Group | None, method: str) -> None:
        if group is None:
            return
        taps = sorted(group.members)
        members = group.members
        for i, a in enumerate(taps):
            for b in taps[i + 1 :]:
                ma, mb = members[a], members[b]
                self._pairs[(a, b)].add(mb.start - ma.start)
                self.methods[(a, b)][method] += 1
                if not (ma.rel or mb.rel) and ma.end < math.inf and mb.end < math.inf:
                    self.clocks[(a, b)].add(ma.start, ma.end, mb.start, mb.end)
        if len(taps) > 1:
            for tap, m in members.items():
                others = [members[t].rid for t in taps if t != tap]
                self.copies.add((m.pos, m.rid, others, method))
        lo, hi = FIRST_EVENT_HELD
        for outer, o in members.items():
            for inner, n in members.items():
                # seen inside the other tap's copy: began after it, ended before it, with
                # as many events (a tap behind sees the request while the one in front
                # waits for the answer it relays)
                if (
                    inner != outer
                    and n.start >= o.start
                    and n.end <= o.end + self._slack
                    and n.events == o.events
                ):
                    self._inside[(outer, inner)] += 1
                if lo <= o.wait <= hi and 0 <= n.wait <= FIRST_EVENT_PROMPT:
                    self.first_held[(outer, inner)].add(o.wait - n.wait, (o.pos, n.pos))
        if any(m.rel or m.coal for m in members.values()):
            self._groups.append(group)

    def _tap_order(self, counts: dict[str, int]) -> list[str]:
        """Taps from the client side to the engine side: by which held their shared
        requests longer (``PairClock.b_behind``: each tap's own durations, which no clock
        offset changes — by time, a clock a millisecond behind would put the tap behind in
        front), where that is clear; else by when they saw them."""
        taps = sorted(counts)
        if len(taps) < 2:
            return taps
        score = dict.fromkeys(taps, 0.0)
        for a in taps:
            for b in taps:
                if a >= b:
                    continue
                later = self._pairs[(a, b)].later() if (a, b) in self._pairs else None
                clock = self.clocks.get((a, b))
                if clock is not None and clock.b_behind() is not None:
                    later = clock.b_behind()
                if later is not None:
                    score[b] += 1 if later else -1
                    score[a] += -1 if later else 1
        return sorted(taps, key=lambda t: (score[t], t))

    def joined(self) -> list[dict[str, RequestRow]]:
        """Per join key whose front-most request did not complete cleanly: the request as
        each tap saw it (taps in name order), in order of first appearance."""
        return self._resolve()[0]

    def masked(self, request_id: str) -> dict[str, RequestRow]:
        """A request that went wrong at a tap behind the front one while its front copy
        was answered well (a hop in front retried or repaired it), as each tap saw it;
        empty otherwise."""
        return self._resolve()[2].get(request_id, {})

    def masked_groups(self) -> list[dict[str, RequestRow]]:
        """Every request ``masked`` knows, as each tap saw it."""
        return list(self._resolve()[2].values())

    def bunched_groups(self) -> list[dict[str, RequestRow]]:
        """Every request ``seen_with`` knows, as each tap saw it."""
        return list({id(g): g for g in self._resolve()[1].values()}.values())

    def seen_with(self, r: RequestRow) -> dict[str, RequestRow]:
        """A request whose events came bunched, as each tap saw it (empty when alone)."""
        return self._resolve()[1].get(r.id, {})

    def tap_pairs(self) -> list[dict[str, Any]]:
        """Each tap and the taps one hop behind it (``next_taps``), client side first, and
        how much later the second saw requests."""
        out: list[dict[str, Any]] = []
        joined = any(pair.positive + pair.other for pair in self._pairs.values())
        for a in self.order:  # (nothing joined: each next in order, none shared)
            for b in self.next_taps(a) if joined else self.order[self.order.index(a) + 1 :][:1]:
                pair, sign = (
                    (self._pairs.get((a, b)), 1.0) if a < b else (self._pairs.get((b, a)), -1.0)
                )
                median = pair.median() if pair is not None else None
                out.append(
                    {
                        "from": a,
                        "to": b,
                        "shared": self.shared(a, b),
                        "median_delay": None if median is None else round(sign * median, 6),
                        "one_clock": self.one_clock(a, b),
                        "joined_by": dict(sorted(self.methods.get(pair_key(a, b), {}).items())),
                    }
                )
        return out

    def clock_pairs(self) -> list[dict[str, Any]]:
        """Each pair of taps not on one clock that answered requests in common: the
        offset of the second's clock against the first's (in front), with its bounds."""
        out = []
        for (a, b), clock in sorted(self.clocks.items()):
            estimate = None if self.one_clock(a, b) else clock.estimate(a, b)
            if estimate is not None:
                out.append(estimate)
        return out

    def one_clock(self, *taps: str) -> bool:
        """Whether these taps read one wall clock (``shared_clock``)."""
        return shared_clock([self.taps.get(t, {}) for t in taps])

    def slack(self, a: str, b: str) -> float:
        """How far apart two taps' times of one moment may be."""
        return SHARED_CLOCK_SLACK if self.one_clock(a, b) else JOIN_SLACK

    def shared(self, a: str, b: str) -> int:
        pair = self._pairs.get((a, b) if a < b else (b, a))
        return 0 if pair is None else pair.positive + pair.other

    def _relays(self, outer: str, inner: str) -> bool:
        """Whether tap ``inner`` is behind tap ``outer`` on the way to the engine: they saw
        requests in common, and on one clock, ``outer`` relayed what ``inner`` got for at
        least three in four of them (its copy began before and ended after, with as many
        events). Not so the taps of two engines a router sent the same request to: one
        after the other (a 5xx sent again to another engine), or at once with different
        answers (the prefill and decode legs of PD disaggregation)."""
        shared = self.shared(outer, inner)
        if not shared:
            return False
        if not self.one_clock(outer, inner):
            return True
        return self._inside.get((outer, inner), 0) * 4 >= shared * 3

    def next_taps(self, tap: str) -> list[str]:
        """The taps one hop behind ``tap`` toward the engine: the taps after it in order
        that saw some of its requests, less those another of them relays (``_relays``: in
        a chain, the next tap only) and those side by side with it (both one hop behind
        an earlier tap, neither relaying the other: the taps in front of each engine a
        router sends to). None where no two taps saw a request in common: nothing then
        says that one tap is behind another."""
        if self._next is None:
            self._next = {}
            for i, a in enumerate(self.order):
                siblings = {t for n in self._next.values() if a in n for t in n}
                sharing = [
                    t
                    for t in self.order[i + 1 :]
                    if self.shared(a, t) and (t not in siblings or self._relays(a, t))
                ]
                self._next[a] = [
                    t
                    for k, t in enumerate(sharing)
                    if not any(self._relays(u, t) for u in sharing[:k])
                ]
        return self._next.get(tap, [])

    def _resolve(self) -> _Joined:
        """The rows of the groups the analyzers ask about (one more pass over the rows
        when some are not among the interesting ones)."""
        if self._joined is not None:
            return self._joined
        rank = {tap: i for i, tap in enumerate(self.order)}
        fronts: list[_Group] = []
        bunched: list[_Group] = []
        masked: list[tuple[_Group, list[str]]] = []  # with the taps where it went wrong
        for g in self._groups:
            front = min(g.members, key=lambda t: rank.get(t, 0))
            if g.members[front].rel:
                fronts.append(g)
            else:
                wrong = [t for t, m in g.members.items() if m.rel]
                if wrong:
                    masked.append((g, wrong))
            if any(m.coal for m in g.members.values()):
                bunched.append(g)
        groups = fronts + bunched + [g for g, _ in masked]
        rows = self.rows_at(m.pos for g in groups for m in g.members.values())

        def seen(g: _Group) -> dict[str, RequestRow]:
            return {tap: rows[m.pos] for tap, m in g.members.items()}

        with_others = {r.id: seen(g) for g in bunched for r in seen(g).values()}
        hidden = {seen(g)[t].id: seen(g) for g, wrong in masked for t in wrong}
        self._joined = ([seen(g) for g in fronts], with_others, hidden)
        return self._joined

    # -- queries -----------------------------------------------------------------------
