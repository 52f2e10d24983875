"""What the analyzers work from: ``Evidence`` in, a ``Context`` gathered in one pass.

``Context`` holds what every analyzer asks — the rows worth a finding, per-tap counts,
the hang marks, the join across taps (``join``), the engines' view of a window
(``engine_view``) — so that each analyzer stays a small function of it.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..rows import ConnectionRow, RequestRow
from .engine_view import EngineFigures, EngineView
from .first_events import FreshReused
from .join import Join, addr_key
from .signs import (
    began_before,
    bursts,
    delivery_kind,
    first_event_wait,
    hang_window,
    relevant_at_front,
    silent_failure,
    upstream_silence,
    worth_keeping,
)

TOGETHER = 0.5  # seconds: streams whose silences began this close stopped together


def netloc(url: str) -> str:
    """A URL's host:port."""
    return urlsplit(url).netloc


@dataclass
class Evidence:
    """What ``find`` works from. ``requests`` and ``connections`` may be any iterable that
    can be iterated several times in table order (a list, or ``analysis.Rows`` that reads
    them back from disk); ``engine`` and ``health`` a list or a ``ChunkLog``."""

    taps: dict[str, dict[str, Any]]
    connections: Iterable[ConnectionRow]
    requests: Iterable[RequestRow]
    engine: Iterable[dict[str, Any]]
    probes: list[dict[str, Any]]
    health: Iterable[dict[str, Any]]
    faults: list[dict[str, Any]]
    marks: list[float]
    client_facing: set[str] = field(default_factory=set)
    end: float | None = None
    request_taps: set[str] | None = None  # taps with parsed requests, when known up front
    sample_urls: set[str] | None = None  # engine and health URLs, when known up front
    # client connections that failed before a first request (the first few; the count)
    client_failures: list[dict[str, Any]] = field(default_factory=list)
    client_failures_total: int = 0
    # windows where a tap's own event loop ran late (``tap_lag`` records, wall times)
    lags: list[dict[str, Any]] = field(default_factory=list)
    # windows where a tap's capture writer dropped records (``capture_loss``: tap, first,
    # last, dropped, reason, resumed; wall times)
    losses: list[dict[str, Any]] = field(default_factory=list)
    # requests that carried x-tracer-probe no capture of the analysis vouches for (the
    # first few ids; how many): client requests, with a note
    unvouched: list[str] = field(default_factory=list)
    unvouched_total: int = 0
    # the engines' own per-request records (``--engine-requests``: ``EngineRequest``s of
    # ``evidence/engine_requests``), and (filled by ``find``) how many rows joined one
    engine_requests: list[Any] = field(default_factory=list)
    engine_requests_joined: int = 0
    # requests a packet capture's gap swallowed whole (no row: id, t, gap; how many)
    headless: list[dict[str, Any]] = field(default_factory=list)
    headless_total: int = 0
    # filled by ``find``: whether any request had bytes a packet capture missed
    gapped: bool = False
    # filled by ``find``: each request joined with others at other taps, by position
    # (position, row id, the others' ids, method), for the rows' ``copies``
    copies: Iterable[tuple[Any, ...]] = ()
    # filled by ``find``: each pair of taps' clock offset, with its bounds (``clocks``)
    clock_pairs: list[dict[str, Any]] = field(default_factory=list)
    # filled by ``find``: adjacent taps, client side first, with the median of t(b) - t(a)
    # over the requests both saw (clock offset plus the hop's transit time)
    tap_pairs: list[dict[str, Any]] = field(default_factory=list)
    # filled by ``find``: the chain of hops the evidence shows, and why
    topology: dict[str, Any] = field(default_factory=dict)
    # filled by ``find``: the front tap's connections at each hang mark (``marks``)
    mark_states: list[dict[str, Any]] = field(default_factory=list)


class Context:
    """What the analyzers need from the evidence, gathered in one pass over the rows.

    Kept in memory: the rows an analyzer could make a finding of (``interesting``,
    bounded by the anomalies, not by the capture), per-tap request counts and hang-mark
    statistics. With several taps the requests are joined across taps by an external
    sort of small (key, tap, start, position) records; the tap order comes from the
    sign of the median time difference per tap pair, kept in O(1) per pair. Requests on
    fresh connections that completed during a hang window are found by a second pass,
    only when there are hang windows.
    """

    def __init__(self, e: Evidence) -> None:
        self.e = e
        e.client_facing = e.client_facing | {
            tap for tap, t in e.taps.items() if (t.get("topology") or {}).get("client_facing")
        }
        urls = e.sample_urls
        if urls is None:
            urls = {s["url"] for s in e.engine} | {h["url"] for h in e.health}
        self.serving_hosts = {netloc(u) for u in urls}
        self.marks = sorted(e.marks)
        self.interesting: list[RequestRow] = []
        self.counts: dict[str, int] = defaultdict(int)  # requests (parsed) per tap
        self.rows = 0
        self._positions: dict[int, RequestRow] = {}
        self._mark_stats: dict[str, list[list[int]]] = {}
        self.join = Join(e.taps, self.rows_at)
        self.engines = EngineFigures(e.engine, e.requests)
        # per tap: how soon first events came after the head, fresh against reused
        self.first_waits: dict[str, FreshReused] = defaultdict(FreshReused)
        self._fresh: dict[int, tuple[int, RequestRow | None]] | None = None
        self._serving_conns: set[tuple[str, int]] | None = None  # see upstream_is_serving
        self._together: dict[str, list[tuple[float, str]]] | None = None  # stopped_together
        self._completions: dict[tuple[str, float], bool] = {}
        self._by_id: dict[str, RequestRow] | None = None  # see row
        # per tap: requests on fresh connections that completed, and that did not
        self.fresh_outcomes: dict[str, tuple[int, int]] = {}
        # per tap: requests on fresh connections that got nothing back (``silent_failure``)
        self.fresh_silent: dict[str, int] = defaultdict(int)
        # per tap: the longest a request took that completed (what a total timeout is not)
        self.longest_complete: dict[str, float] = defaultdict(float)
        self._scan()
        self.order = self.join.ordered(self.counts)
        e.copies = self.join.copies
        e.clock_pairs = self.join.clock_pairs()

    # -- the pass over the rows --------------------------------------------------------

    def _scan(self) -> None:
        taps = self.e.request_taps
        joining = taps is None or len(taps) >= 2
        end = self.e.end
        try:
            for pos, r in enumerate(self.e.requests):
                self.rows += 1
                if worth_keeping(r):
                    self.interesting.append(r)
                    self._positions[pos] = r
                if not r.method:
                    continue
                self.counts[r.tap] += 1
                if r.termination == "complete" and r.end is not None:
                    took = r.end - r.start
                    if took > self.longest_complete[r.tap]:
                        self.longest_complete[r.tap] = took
                if not r.reused:
                    ok, bad = self.fresh_outcomes.get(r.tap, (0, 0))
                    complete = r.termination == "complete"
                    self.fresh_outcomes[r.tap] = (ok + complete, bad + (not complete))
                    if silent_failure(r):
                        self.fresh_silent[r.tap] += 1
                if self.marks:
                    self._count_marks(r)
                wait = first_event_wait(r)
                if wait >= 0:
                    self.first_waits[r.tap].add(r.reused, wait, pos)
                if joining:
                    coal = delivery_kind(r) is not None or bursts(r)  # bunched, buffered
                    self.join.add(r, pos, relevant_at_front(r, end), coal, wait)
            if joining and len(self.counts) >= 2:
                self.join.run(self.counts)
        finally:
            self.join.close()

    def _count_marks(self, r: RequestRow) -> None:
        """Per tap and mark: requests started before it, those not complete, in flight."""
        stats = self._mark_stats.get(r.tap)
        if stats is None:
            stats = self._mark_stats[r.tap] = [[0] * (len(self.marks) + 1) for _ in range(3)]
        before, incomplete, in_flight = stats
        first = bisect_left(self.marks, r.start)  # the marks at or after its start
        before[first] += 1
        if r.termination != "complete":
            incomplete[first] += 1
        last = len(self.marks) if r.end is None else bisect_right(self.marks, r.end)
        if first < last:
            in_flight[first] += 1
            in_flight[last] -= 1

    def mark_stats(self, tap: str, mark: float) -> tuple[int, int, int]:
        """(requests started by the mark, of which not complete, in flight at the mark)."""
        stats = self._mark_stats.get(tap)
        if stats is None:
            return 0, 0, 0
        i = bisect_right(self.marks, mark) - 1
        if i < 0 or self.marks[i] != mark:
            raise ValueError(f"{mark} is not one of the hang marks")
        before, incomplete, in_flight = (sum(column[: i + 1]) for column in stats)
        return before, incomplete, in_flight

    def rows_at(self, positions: Iterable[int]) -> dict[int, RequestRow]:
        """The rows at these positions (one more pass over the rows for those that are
        not among the interesting ones)."""
        need = set(positions)
        rows = {pos: self._positions[pos] for pos in need if pos in self._positions}
        if need - rows.keys():
            for pos, r in enumerate(self.e.requests):
                if pos in need:
                    rows[pos] = r
        return rows

    # -- queries -----------------------------------------------------------------------

    def row(self, rid: str) -> RequestRow | None:
        """An interesting row by its id (a finding's requests are among them)."""
        if self._by_id is None:
            self._by_id = {r.id: r for r in self.interesting}
        return self._by_id.get(rid)

    def role(self, tap: str) -> str | None:
        """What the tap's upstream is, as declared or fingerprinted (``topology``
        records): ``engine``, ``router``, ``proxy``; None when nothing identified it."""
        topo = self.e.taps.get(tap, {}).get("topology") or {}
        role = topo.get("upstream_role")
        return role if role in ("engine", "router", "proxy") else None

    def tap_serving(self, tap: str) -> bool | None:
        """Whether the tap's one upstream is the serving stack (None: a tap without one)."""
        role = self.role(tap)
        if role is not None:
            return role != "proxy"
        upstream = self.e.taps.get(tap, {}).get("upstream")
        return netloc(str(upstream)) in self.serving_hosts if upstream else None

    def upstream_is_serving(self, r: RequestRow) -> bool:
        """Whether the hop after the request's tap is the serving stack: as the tap's
        topology says (declared wins, then its fingerprint); else the tap's upstream is
        an engine or health URL's host, or for a tap without one (a forward proxy:
        mitmproxy's regular mode) the address its connection went to is."""
        serving = self.tap_serving(r.tap)
        if serving is not None:
            return serving
        if self._serving_conns is None:
            self._serving_conns = {
                (c.tap, c.conn)
                for c in self.e.connections
                if c.upstream in self.serving_hosts
                and not self.e.taps.get(c.tap, {}).get("upstream")
            }
        return (r.tap, r.conn) in self._serving_conns

    def conns_in_front(self, backs: set[tuple[str, int]]) -> dict[str, ConnectionRow]:
        """For these connections, the same TCP connection at a tap in front, by the back
        connection's id: that tap's upstream connection left from the address the back
        tap saw as its peer, while both were open. Requests are joined by their content;
        this joins connections, for what happens to one between its requests (a request
        that never crossed because the tap behind had closed the connection). Two passes
        over the connection rows, keeping only those asked about."""
        if not backs:
            return {}
        by_peer: dict[str, list[ConnectionRow]] = defaultdict(list)
        for c in self.e.connections:
            if (c.tap, c.conn) in backs:
                by_peer[addr_key(c.peer)].append(c)
        nearest: dict[str, tuple[float, ConnectionRow]] = {}
        for front in self.e.connections:
            if not front.upstream_local:
                continue
            for back in by_peer.get(addr_key(front.upstream_local), []):
                apart = abs(back.opened - front.opened)
                if self._same_connection(front, back) and (
                    back.id not in nearest or apart < nearest[back.id][0]
                ):
                    nearest[back.id] = (apart, front)
        return {back: front for back, (_, front) in nearest.items()}

    def _same_connection(self, front: ConnectionRow, back: ConnectionRow) -> bool:
        """The back connection opened while the front one was open (within the slack
        between clocks), at another tap behind it (the next one, where the order says)."""
        if front.tap == back.tap:
            return False
        nexts = self.join.next_taps(front.tap)
        if nexts and back.tap not in nexts:
            return False
        slack = self.join.slack(front.tap, back.tap)
        return front.opened - slack <= back.opened and (
            front.closed is None or back.opened <= front.closed + slack
        )

    def engine_view(self, start: float, end: float) -> EngineView:
        """The engines' own figures over a window (``EngineFigures.view``)."""
        return self.engines.view(start, end)

    def stopped_together(self, r: RequestRow, start: float) -> int:
        """How many other streams at the request's tap went silent from upstream within
        ``TOGETHER`` of ``start`` (a stall of theirs began then) while no request at the
        tap completed in the ``TOGETHER`` after it: everything from that upstream stopped
        at once (an engine that wedged), not one stream."""
        if self._together is None:
            self._together = self._find_together()
        starts = self._together.get(r.tap)
        if not starts:
            return 0
        lo, hi = bisect_left(starts, (start - TOGETHER,)), bisect_right(starts, (start + TOGETHER,))
        others = [s for s in starts[lo:hi] if s[1] != r.id]
        if not others:
            return 0
        if self._completed_near(r.tap, start):
            return 0
        return len({rid for _, rid in others})

    def _find_together(self) -> dict[str, list[tuple[float, str]]]:
        out: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for o in self.interesting:
            silence = upstream_silence(o) if o.method else None
            if silence is not None and began_before(o, silence["start"]):
                out[o.tap].append((silence["start"], o.id))
        for starts in out.values():
            starts.sort()
        return out

    def _completed_near(self, tap: str, start: float) -> bool:
        """A request at the tap completed within ``TOGETHER`` after ``start`` (one pass
        over the rows per question; asked only where streams stopped together)."""
        key = (tap, round(start, 3))
        if key not in self._completions:
            self._completions[key] = any(
                o.tap == tap
                and o.termination == "complete"
                and o.end is not None
                and start <= o.end <= start + TOGETHER
                for o in self.e.requests
            )
        return self._completions[key]

    def probes_during(self, start: float, end: float, r: RequestRow) -> list[dict[str, Any]]:
        return [
            p
            for p in self.e.probes
            if p["tap"] == r.tap
            and (start - 0.5 <= p["t"] <= end + 0.5 or p["trigger"] == [r.conn, r.seq])
        ]

    def reuse_implicated(self, r: RequestRow, answered: bool) -> bool:
        """Whether the evidence ties a hang to the reuse of its connection: it was on a
        reused one, no request on a fresh connection at its tap got nothing back (the
        same failure without reuse: reuse is not what separates them), and fresh
        connections answered meanwhile, or at its tap only requests on reused
        connections failed while some on fresh ones completed."""
        if not r.reused or self.fresh_silent.get(r.tap, 0):
            return False
        if answered:
            return True
        fresh_ok, fresh_bad = self.fresh_outcomes.get(r.tap, (0, 0))
        return fresh_ok > 0 and fresh_bad == 0

    def fresh_completed(self, r: RequestRow) -> tuple[int, RequestRow | None]:
        """Requests on fresh connections of the same tap that completed during the
        request's hang window: how many, and the first in table order."""
        if self._fresh is None:
            self._fresh = self._find_fresh()
        return self._fresh.get(id(r), (0, None))

    def _find_fresh(self) -> dict[int, tuple[int, RequestRow | None]]:
        """One pass over the rows, answering every hang window at once."""
        windows: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
        owners: list[RequestRow] = []
        for r in self.interesting:
            window = hang_window(r, self.e.end) if r.method else None
            if window is not None:
                windows[r.tap].append((window[0], window[1] + 0.5, len(owners)))
                owners.append(r)
        found: list[tuple[int, RequestRow | None]] = [(0, None)] * len(owners)
        if owners:
            index = {tap: _Windows(w) for tap, w in windows.items()}
            for o in self.e.requests:
                if (
                    not o.method
                    or o.reused
                    or o.termination != "complete"
                    or o.end is None
                    or o.tap not in index
                ):
                    continue
                for i in index[o.tap].containing(o.start, o.end):
                    if o.id == owners[i].id:
                        continue
                    count, first = found[i]
                    found[i] = (count + 1, first or o)
        return {id(r): found[i] for i, r in enumerate(owners)}


class _Windows:
    """Stabbing queries: which hang windows contain a request's [start, end].

    Windows sorted by start, and a max-tree over their ends, so a query costs
    O(log windows + matches) whatever the number of windows.
    """

    def __init__(self, windows: list[tuple[float, float, int]]) -> None:
        self.items = sorted(windows)  # (start, end + slack, index)
        self.starts = [w[0] for w in self.items]
        size = 1
        while size < len(self.items):
            size *= 2
        self.size = size
        self.tree = [-math.inf] * (2 * size)
        for i, w in enumerate(self.items):
            self.tree[size + i] = w[1]
        for node in range(size - 1, 0, -1):
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])

    def containing(self, start: float, end: float) -> list[int]:
        """Indexes of the windows with ``w.start <= start`` and ``end <= w.end``."""
        limit = bisect_right(self.starts, start)
        out: list[int] = []
        stack = [(1, 0, self.size)]
        tree, items = self.tree, self.items
        while stack:
            node, lo, hi = stack.pop()
            if lo >= limit or tree[node] < end:
                continue
            if hi - lo == 1:
                out.append(items[lo][2])
                continue
            mid = (lo + hi) // 2
            stack.append((2 * node + 1, mid, hi))
            stack.append((2 * node, lo, mid))
        return out
