"""Attribution: whose fault is it — client, proxy or engine — from evidence only.

Theory of operation
-------------------
``find(evidence)`` is a pure function of the analysis rows (requests, connections) and
the evidence timelines (engine samples, probes, health, injected faults, hang marks). It
runs a list of analyzers, each a small function from the evidence to findings, the
shape structlog gives its processors. Every finding names:

* ``party``: client | proxy | engine | unknown — *proxy* is any hop between the client
  and the serving stack; *engine* is the serving stack (router, prefill, decode);
* ``kind``: a stable name (documented in ``captures/ANALYSIS.md``);
* ``requests`` / ``connections``: the ids it concerns;
* ``evidence``: quoted observations with their times;
* ``ruled_out``: the parties the evidence excludes, each with why;
* ``confidence``: high | medium | low; ``settle``: for ``unknown``, the observation that
  would decide it;
* ``note``: true for a finding that is not a fault (load) — it never becomes the verdict.

Rules of evidence: the engine is "idle" only when its own samples say running=0 and
queued=0 *and* its token counters did not move (SGLang's gauges can be 30 s old; the
counters cannot); the engine is "wedged" when something runs and the counters are flat;
"busy" when running/queued are high and counters rise — which is load, reported with the
figures, never as a fault and never as "cold start". A hop is blamed only when the
evidence places the fault there: between two taps (a request seen by one and not the
next), or in front of an idle engine whose fresh connections answer.
"""

from __future__ import annotations

import itertools
import math
import statistics
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple
from urllib.parse import urlsplit

from . import engines
from .analysis import ZERO_GAP, ConnectionRow, RequestRow
from .spill import ChunkLog, SortedSpool

CONFIDENCE = {"high": 0, "medium": 1, "low": 2}
ENGINE_PROFILES = {"sglang", "vllm", "llamacpp"}
ROUTER_PROFILES = {"smg", "sgl_router"}
STREAM_RESET = "stream reset by client"  # mitmproxy's words for an HTTP/2 RST_STREAM
SLOW_FIRST_TOKEN = 2.0  # seconds: below this a first token is never "slow"
MAX_QUOTED = 10  # requests quoted one by one in a note about many
JOIN_SLACK = 1.0  # seconds: clock offset between taps tolerated when joining by time
# ... between taps that read one wall clock (the same boot, the same wall offset): only
# the few ms between a tap reading bytes and writing down when
SHARED_CLOCK_SLACK = 0.005
# On one clock, a fingerprint seen 2..this many times at a tap is joined by time (the same
# body sent again: a retry); seen more often (a load test's one prompt) it is joined by
# occurrence, as without a shared clock. At most this many such fingerprints are kept.
TIME_JOINED_REPEATS = 16
TIME_JOINED_PRINTS = 10_000
# A hop that writes a response's head and its first event separately without TCP_NODELAY
# holds the event until the head's ACK, which the next host delays (Linux: 40 ms and up,
# at most 200 ms): the first event comes that long after the head at the taps in front
# of the hop, at once (within FIRST_EVENT_PROMPT) at the taps behind it.
FIRST_EVENT_HELD = (0.030, 0.220)
FIRST_EVENT_PROMPT = 0.010
IDLE_REUSE_RACE = 1.0  # seconds idle before a request for a stale-connection race
# the observer's detail for a request sent after the upstream's FIN or reset had been
# passed on, then "S s before" (captures before it: the words alone)
UPSTREAM_GONE = "upstream already closed"
# a request that came this soon after the FIN was passed on may have been on its way
# before the client could see it (the keep-alive race): not told from one that ignored it
RACE_WINDOW = 0.010
# injected faults that close a connection between requests: what they do shows on the
# next request, at the tap in front, which never reaches the faulting tap
CLOSING_FAULTS = frozenset({"close-idle-after"})
SPILL_ITEMS = 16384  # join records (a few small fields each) in memory before a run spills
# A progress figure must stay flat this long, and FLAT_CADENCES times as long as the
# engine takes between writes of it (SGLang: every 40 decode steps), to mean "no progress".
MIN_FLAT = 1.5
FLAT_CADENCES = 2.0
TOGETHER = 0.5  # seconds: streams whose silences began this close stopped together
LOST_MARGIN = 0.2  # seconds after reaching the tap before a request must be counted
UNCOUNTED_CHECKS = 64  # hang windows checked against the engines' counts (a pass each)
SAMPLED_CADENCE = 5.0  # seconds assumed between writes of a sampled figure never seen move


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
    # filled by ``find``: adjacent taps, client side first, with the median of t(b) - t(a)
    # over the requests both saw (clock offset plus the hop's transit time)
    tap_pairs: list[dict[str, Any]] = field(default_factory=list)
    # filled by ``find``: the chain of hops the evidence shows, and why
    topology: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineView:
    """What the serving stack's own metrics said during a time window.

    ``progress`` counts tokens from a figure that moves while streams decode (SGLang's
    ``realtime_tokens_total{mode="decode"}``, vLLM's token counter: ``engines.
    progress_delta``) over ``progress_span`` seconds of samples inside the window;
    ``finished`` is the finish-time token counter's increase (SGLang's tokenizer adds a
    request's tokens only when it ends), quoted but never read as "no tokens".
    ``cadence``: how often the progress figure is written on this engine (sampled
    figures), so that a flat stretch shorter than it proves nothing.
    """

    samples: int = 0
    urls: int = 0
    failures: int = 0
    running_max: int | None = None
    queued_max: int | None = None
    progress: float | None = None
    progress_span: float = 0.0
    finished: float | None = None
    cadence: float = 0.0
    router_in_flight: int | None = None
    start: float = 0.0
    end: float = 0.0

    @property
    def known(self) -> bool:
        return self.samples > 0

    @property
    def flat_long_enough(self) -> bool:
        """The progress figure stayed flat over enough of the window to mean it."""
        return self.progress == 0 and self.progress_span >= max(
            MIN_FLAT, FLAT_CADENCES * self.cadence
        )

    @property
    def idle(self) -> bool:
        return (
            self.known
            and self.running_max == 0
            and (self.queued_max or 0) == 0
            and not self.progress
            and not self.finished
        )

    @property
    def wedged(self) -> bool:
        """Running work and no progress, from a figure that would have moved: positive
        evidence of a stall (a finish-time counter alone can never say this)."""
        return self.known and (self.running_max or 0) >= 1 and self.flat_long_enough

    @property
    def loaded(self) -> bool:
        """Requests running or queued and no sign of a wedge: load (a queue, a full batch)."""
        return (
            self.known
            and ((self.running_max or 0) + (self.queued_max or 0)) >= 1
            and not self.wedged
        )

    @property
    def busy(self) -> bool:
        return self.loaded

    @property
    def producing(self) -> bool:
        """Tokens were produced in the window (progress, or requests finishing)."""
        return bool(self.progress) or bool(self.finished)

    def quote(self) -> str:
        progress = (
            "no progress figure"
            if self.progress is None
            else f"decode progress +{self.progress:g} tokens over {self.progress_span:.1f} s"
        )
        finished = "" if self.finished is None else f", finished-request tokens +{self.finished:g}"
        text = (
            f"engine metrics {_ts(self.start)} to {_ts(self.end)}: running≤{self.running_max}, "
            f"queued≤{self.queued_max}, {progress}{finished} "
            f"({self.samples} samples from {self.urls} URL(s))"
        )
        if self.router_in_flight is not None:
            text += f"; router in flight≤{self.router_in_flight}"
        if self.failures:
            text += f"; {self.failures} failed scrapes"
        return text


def _ts(t: float) -> str:
    return f"t={t:.3f}"


def _base(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc


def _delivery_kind(r: RequestRow) -> str | None:
    """``coalesced`` or ``buffered`` when the stream's arrival statistics say so."""
    if not r.sse or r.event_gaps < 8 or r.first_event is None or r.last_event is None:
        return None
    zero = r.zero_gaps / r.event_gaps
    spread = r.last_event - r.first_event
    duration = (r.end or r.last_event) - r.start
    if zero >= 0.5 and r.bunch_gaps >= 2 and spread > 0.05:
        return "coalesced"
    if (
        duration > 1.0
        and spread < 0.05
        and r.events >= 5
        and zero >= 0.8
        and (r.first_event - r.start > 0.8 * duration)
    ):
        return "buffered"
    return None


def _bursts(r: RequestRow) -> bool:
    """Events that came in a few bursts with long waits between (a hop releasing the
    stream buffer by buffer: nginx's 4 KiB pieces). Only told against a copy of the same
    stream that flowed at a tap behind (``_buffered_between``): alone it proves nothing."""
    return (
        r.sse
        and r.event_gaps >= 8
        and r.events >= 5
        and r.max_gap is not None
        and r.max_gap >= BURST_GAP
        and r.zero_gaps >= 0.8 * r.event_gaps
    )


def _worth_keeping(r: RequestRow) -> bool:
    """Whether any analyzer could make a finding of this request (the union of what they
    look at, wider where that is cheaper to say): these rows stay in memory, the healthy
    rest is only counted and streamed past."""
    return (
        r.termination != "complete"  # hangs, aborts, truncations, the joins' front rows
        or bool(r.stalls)
        or r.after_close
        or r.detail is not None
        or bool(r.error)
        or r.by_tracer
        or (r.status is not None and r.status >= 500)
        or (r.sse and r.events > 0 and not r.done and r.finish_reason is None)
        or (r.first_token is not None and r.first_token >= SLOW_FIRST_TOKEN)
        or _delivery_kind(r) is not None
        or _bursts(r)
    )


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


class _Seen(NamedTuple):
    """A request as one tap saw it, in a join record (``Context._scan``): ``item`` is the
    record less its key, ``(tap, start, position, relevant at the front, coalesced, end
    (-1: open), first event wait, events)``."""

    start: float
    pos: int
    rel: bool
    coal: bool
    end: float  # inf: still open
    wait: float  # _first_event_wait
    events: int

    @classmethod
    def of(cls, item: tuple[Any, ...]) -> tuple[str, _Seen]:
        tap, start, pos, rel, coal, end, wait, events = item
        return tap, cls(start, pos, rel, coal, end if end >= 0 else math.inf, wait, events)


@dataclass
class _Group:
    """The requests that share one join key, as seen at each tap (the first per tap)."""

    first: tuple[str, float, int]  # (tap, start, position): where the key appears first
    members: dict[str, _Seen]


def _shared_clock(taps: list[dict[str, Any]]) -> bool:
    """Whether these taps read one wall clock: started in the same boot (``boot_id``) with
    the same wall offset (no clock step between their starts)."""
    boots = {t.get("boot_id") for t in taps}
    offsets = [o for t in taps if isinstance(o := t.get("wall_offset"), (int, float))]
    if len(boots) != 1 or None in boots or len(offsets) != len(taps):
        return False
    return max(offsets) - min(offsets) <= 0.001


def _addr_key(addr: str) -> str:
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


def _relevant_at_front(r: RequestRow, end: float | None) -> bool:
    return (
        _hang_window(r, end) is not None
        or r.termination != "complete"
        or bool(r.stalls)
        or _error_status(r)
    )


def _error_status(r: RequestRow) -> bool:
    """A 5xx the tap passed on (not its own answer)."""
    return r.status is not None and r.status >= 500 and not r.by_tracer


def _first_event_wait(r: RequestRow) -> float:
    """Seconds from a stream's response head to its first event (-1: not a stream)."""
    if not r.sse or r.first_event is None or r.ttfb is None:
        return -1.0
    return max(0.0, r.first_event - r.start - r.ttfb)  # (both rounded: -1e-7 is at once)


# the groups of requests the analyzers ask about: those whose front copy went wrong, each
# request as every tap saw it; by request id, the groups of bunched requests and those
# that went wrong behind a front copy that was answered well
_Joined = tuple[
    list[dict[str, RequestRow]], dict[str, dict[str, RequestRow]], dict[str, dict[str, RequestRow]]
]


class _Holds:
    """First events one tap got late and another at once: how many, how late (the first
    ``SAMPLE``), and the first few (their positions at the two taps)."""

    SAMPLE = 1024

    def __init__(self) -> None:
        self.count = 0
        self.delays: list[float] = []
        self.examples: list[tuple[int, int]] = []

    def add(self, delay: float, positions: tuple[int, int]) -> None:
        self.count += 1
        if len(self.delays) < self.SAMPLE:
            self.delays.append(delay)
        if len(self.examples) < 3:
            self.examples.append(positions)


class _FreshReused:
    """One tap's streams by how soon their first event came after the response head: on
    fresh connections at once (within ``FIRST_EVENT_PROMPT``) or not, on reused ones
    within ``FIRST_EVENT_HELD`` or not; the held ones' waits (the first ``SAMPLE``) and
    the first few of each kind (positions)."""

    SAMPLE = 1024

    def __init__(self) -> None:
        self.fresh = self.fresh_prompt = self.reused = self.reused_held = 0
        self.waits: list[float] = []
        self.examples: dict[bool, list[int]] = {False: [], True: []}  # reused -> positions

    def add(self, reused: bool, wait: float, pos: int) -> None:
        if reused:
            self.reused += 1
            fits = FIRST_EVENT_HELD[0] <= wait <= FIRST_EVENT_HELD[1]
            self.reused_held += fits
            if fits and len(self.waits) < self.SAMPLE:
                self.waits.append(wait)
        else:
            self.fresh += 1
            fits = wait <= FIRST_EVENT_PROMPT
            self.fresh_prompt += fits
        if fits and len(self.examples[reused]) < 2:
            self.examples[reused].append(pos)

    @property
    def pattern(self) -> bool:
        """Most streams on reused connections held, most on fresh ones not: the hold
        depends on the connection, not on the engine's first token."""
        return (
            self.reused_held >= 3
            and self.reused_held * 2 >= self.reused
            and self.fresh_prompt >= 1
            and self.fresh_prompt * 2 >= self.fresh
        )


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
        self.serving_hosts = {_base(u) for u in urls}
        self.marks = sorted(e.marks)
        self.interesting: list[RequestRow] = []
        self.counts: dict[str, int] = defaultdict(int)  # requests (parsed) per tap
        self.rows = 0
        self._positions: dict[int, RequestRow] = {}
        self._mark_stats: dict[str, list[list[int]]] = {}
        self._groups: list[_Group] = []
        self._pairs: dict[tuple[str, str], _PairOrder] = defaultdict(_PairOrder)
        self._retry_taps: set[str] = set()  # taps that saw the openai SDK's retry counts
        self._inside: dict[tuple[str, str], int] = defaultdict(int)  # see _close_group
        self._next: dict[str, list[str]] | None = None  # see next_taps
        self._slack = JOIN_SLACK  # the join's (SHARED_CLOCK_SLACK on one clock)
        # (tap where first events came late, tap where they came at once) -> the holds
        self.first_held: dict[tuple[str, str], _Holds] = defaultdict(_Holds)
        # per tap: how soon first events came after the head, fresh against reused
        self.first_waits: dict[str, _FreshReused] = defaultdict(_FreshReused)
        self._fresh: dict[int, tuple[int, RequestRow | None]] | None = None
        self._joined: _Joined | None = None
        self._serving_conns: set[tuple[str, int]] | None = None  # see upstream_is_serving
        self._cadences: dict[str, float] | None = None  # see _cadence
        self._uncounted_checks = 0  # see uncounted
        self._together: dict[str, list[tuple[float, str]]] | None = None  # stopped_together
        self._completions: dict[tuple[str, float], bool] = {}
        # per tap: requests on fresh connections that completed, and that did not
        self.fresh_outcomes: dict[str, tuple[int, int]] = {}
        self._scan()
        self.order = self._tap_order()

    # -- the pass over the rows --------------------------------------------------------

    def _scan(self) -> None:
        taps = self.e.request_taps
        joining = taps is None or len(taps) >= 2
        by_id: SortedSpool[tuple[Any, ...]] = _tuple_spool()
        by_print: SortedSpool[tuple[Any, ...]] = _tuple_spool()
        end = self.e.end
        try:
            for pos, r in enumerate(self.e.requests):
                self.rows += 1
                if _worth_keeping(r):
                    self.interesting.append(r)
                    self._positions[pos] = r
                if not r.method:
                    continue
                self.counts[r.tap] += 1
                if not r.reused:
                    ok, bad = self.fresh_outcomes.get(r.tap, (0, 0))
                    complete = r.termination == "complete"
                    self.fresh_outcomes[r.tap] = (ok + complete, bad + (not complete))
                if self.marks:
                    self._count_marks(r)
                wait = _first_event_wait(r)
                if wait >= 0:
                    self.first_waits[r.tap].add(r.reused, wait, pos)
                if joining:
                    rel = _relevant_at_front(r, end)
                    coal = _delivery_kind(r) is not None or _bursts(r)  # bunched, buffered
                    end_at = r.end if r.end is not None else -1.0  # (-1: still open)
                    if r.retry_count is not None:
                        self._retry_taps.add(r.tap)
                    if r.request_id:
                        key = f"id:{r.request_id}"
                        by_id.add((key, r.tap, r.start, pos, rel, coal, end_at, wait, r.events))
                    elif r.request_bytes:  # a request without a body has nothing to join by
                        content = r.content_sha256 or r.body_sha256
                        fingerprint = f"{r.method} {r.target} {content}"
                        retry = -1 if r.retry_count is None else r.retry_count
                        by_print.add(
                            (
                                r.tap,
                                fingerprint,
                                r.start,
                                retry,
                                pos,
                                rel,
                                coal,
                                end_at,
                                wait,
                                r.events,
                            )
                        )
            if joining and len(self.counts) >= 2:
                self._join(by_id, by_print)
        finally:
            by_id.close()
            by_print.close()

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

    def _join(self, by_id: SortedSpool[tuple[Any, ...]], by_print: SortedSpool[Any]) -> None:
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
        shared = self.one_clock(*self.counts)
        slack = self._slack = SHARED_CLOCK_SLACK if shared else JOIN_SLACK
        # a hop that drops the SDK's retry count (the SGLang router does) leaves it out
        retries = self._retry_taps >= self.counts.keys()
        by_time = _repeated_prints(_print_keys(by_print, retries)) if shared else set()
        keyed: SortedSpool[tuple[Any, ...]] = _tuple_spool()
        try:
            for item in by_id:
                keyed.add(item)
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
        taps = [item[1] for item in items]
        if len(set(taps)) == len(taps):
            _, tap, start, pos, *_ = items[0]
            members = dict(_Seen.of(item[1:]) for item in items)
            self._close_group(_Group(first=(tap, start, pos), members=members))
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
            self._close_group(group)

    def _close_group(self, group: _Group | None) -> None:
        if group is None:
            return
        taps = sorted(group.members)
        members = group.members
        for i, a in enumerate(taps):
            for b in taps[i + 1 :]:
                self._pairs[(a, b)].add(members[b].start - members[a].start)
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

    def _tap_order(self) -> list[str]:
        """Taps from the client side to the engine side (by when they saw shared requests)."""
        taps = sorted(self.counts)
        if len(taps) < 2:
            return taps
        score = dict.fromkeys(taps, 0.0)
        for a in taps:
            for b in taps:
                if a >= b:
                    continue
                later = self._pairs[(a, b)].later() if (a, b) in self._pairs else None
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
                    }
                )
        return out

    def one_clock(self, *taps: str) -> bool:
        """Whether these taps read one wall clock (``_shared_clock``)."""
        return _shared_clock([self.e.taps.get(t, {}) for t in taps])

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
        return _base(str(upstream)) in self.serving_hosts if upstream else None

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
                by_peer[_addr_key(c.peer)].append(c)
        nearest: dict[str, tuple[float, ConnectionRow]] = {}
        for front in self.e.connections:
            if not front.upstream_local:
                continue
            for back in by_peer.get(_addr_key(front.upstream_local), []):
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
        nexts = self.next_taps(front.tap)
        if nexts and back.tap not in nexts:
            return False
        slack = self.slack(front.tap, back.tap)
        return front.opened - slack <= back.opened and (
            front.closed is None or back.opened <= front.closed + slack
        )

    def _engine_between(self, lo: float, hi: float) -> Iterable[dict[str, Any]]:
        if isinstance(self.e.engine, ChunkLog):
            return self.e.engine.window(lo, hi)
        return (s for s in self.e.engine if lo <= s["t"] <= hi)

    def engine_view(self, start: float, end: float) -> EngineView:
        """The engines' own figures over a window.

        running/queued come from SGLang's live ``/v1/loads`` samples when the capture has
        them (its gauges can be 30 s old), else from the metrics gauges; progress comes
        from the deltas of a figure that moves while streams decode (``engines.
        progress_delta``) whose interval lies inside the window; finish-time token
        counters are kept apart (``EngineView.finished``).
        """
        view = EngineView(start=start, end=end)
        urls: set[str] = set()
        spans: dict[str, float] = defaultdict(float)
        owner: dict[str, Any] = {}  # the tap whose samples of a URL count its deltas
        gauges: list[tuple[float, dict[str, Any]]] = []
        live: list[tuple[float, dict[str, Any]]] = []
        for s in self._engine_between(start - 1.5, end + 1.5):
            if not s["ok"]:
                view.failures += 1
                continue
            state = s.get("state") or {}
            profile = s.get("profile")
            if profile in ROUTER_PROFILES:
                in_flight = state.get("in_flight")
                if in_flight is not None:
                    view.router_in_flight = max(view.router_in_flight or 0, int(in_flight))
                continue
            if profile not in ENGINE_PROFILES:
                continue
            view.samples += 1
            urls.add(s["url"])
            (live if s.get("source") == "loads" else gauges).append((s["t"], state))
            deltas = s.get("deltas") or {}
            interval = s.get("interval") or 0.0
            if not deltas or s["t"] - interval < start or s["t"] > end:
                continue  # the delta covers (t - interval, t]: only those inside count
            if owner.setdefault(s["url"], s.get("tap")) != s.get("tap"):
                continue  # the same engine polled by another tap too: counted once
            progress = engines.progress_delta(deltas, profile)
            if progress is not None:
                view.progress = (view.progress or 0.0) + progress
                spans[s["url"]] += interval
                view.cadence = max(view.cadence, self._cadence(s["url"]))
            finished = deltas.get("generation_tokens_total")
            if finished is not None and (
                engines.figure_timing(profile, "generation_tokens_total") == "finish"
            ):
                view.finished = (view.finished or 0.0) + float(finished)
        chosen = live or gauges
        inside = [(t, st) for t, st in chosen if start <= t <= end]
        for _, state in inside or chosen:  # samples around it only when none fell inside
            running, queued = state.get("running"), state.get("queued")
            if running is not None:
                view.running_max = max(view.running_max or 0, int(running))
            if queued is not None:
                view.queued_max = max(view.queued_max or 0, int(queued))
        view.urls = len(urls)
        view.progress_span = max(spans.values(), default=0.0)
        return view

    def _cadence(self, url: str) -> float:
        """Seconds between writes of this engine's progress figure: the scrape interval
        for a live figure; for a sampled one (SGLang writes it every 40 decode steps) the
        median gap between the increases seen while it ran requests, or
        ``SAMPLED_CADENCE`` when it was never seen to move twice."""
        if self._cadences is None:
            self._cadences = self._find_cadences()
        return self._cadences.get(url, SAMPLED_CADENCE)

    def _find_cadences(self) -> dict[str, float]:
        rises: dict[str, list[float]] = defaultdict(list)
        intervals: dict[str, list[float]] = defaultdict(list)
        timing: dict[str, str | None] = {}
        for s in self.e.engine:
            if not s["ok"] or s.get("profile") not in ENGINE_PROFILES:
                continue
            url, deltas = s["url"], s.get("deltas")
            progress = engines.progress_delta(deltas, s.get("profile"))
            if progress is None:
                continue
            if url not in timing:
                key = engines.PROGRESS_KEY if engines.PROGRESS_KEY in (deltas or {}) else ""
                timing[url] = engines.figure_timing(s.get("profile"), key) if key else "live"
            if s.get("interval") and len(intervals[url]) < 1024:
                intervals[url].append(float(s["interval"]))
            if progress > 0 and len(rises[url]) < 4096:
                rises[url].append(float(s["t"]))
        out: dict[str, float] = {}
        for url, kind in timing.items():
            if kind == "live":
                out[url] = statistics.median(intervals[url]) if intervals[url] else 1.0
                continue
            gaps = [b - a for a, b in itertools.pairwise(rises[url])]
            out[url] = statistics.median(gaps) if len(gaps) >= 2 else SAMPLED_CADENCE
        return out

    def uncounted(self, r: RequestRow, start: float, end: float) -> tuple[int, int] | None:
        """(requests in flight at the tap, the engines' running + queued) at a moment of
        the window when the engines counted fewer, if they did at half the moments or more: some
        request the tap handed to the serving stack is neither running nor queued there.
        Read from live figures only (``/v1/loads``, or gauges whose timing is live): a
        sampled gauge written before a request came cannot count it. Each engine's
        latest figure is summed (other clients only add to it); a request counts as in
        flight from ``LOST_MARGIN`` after it reached the tap. None otherwise, or past
        ``UNCOUNTED_CHECKS`` windows (each costs a pass over the rows)."""
        if end - start < MIN_FLAT or self._uncounted_checks >= UNCOUNTED_CHECKS:
            return None
        points: list[tuple[float, str, int]] = []
        for s in self._engine_between(start, end):
            state = s.get("state") or {}
            profile = s.get("profile")
            if not s["ok"] or profile not in ENGINE_PROFILES or state.get("running") is None:
                continue
            live = s.get("source") == "loads" or engines.figure_timing(profile, "running") == "live"
            if live:
                points.append(
                    (s["t"], s["url"], int(state["running"]) + int(state.get("queued") or 0))
                )
        if len(points) < 2:
            return None
        self._uncounted_checks += 1
        spans = [
            (o.start, math.inf if o.end is None else o.end)
            for o in self.e.requests
            if o.tap == r.tap and o.method and o.start <= end and (o.end is None or o.end >= start)
        ]
        latest: dict[str, int] = {}
        short: list[tuple[int, int]] = []
        for t, url, count in sorted(points):
            latest[url] = count
            counted = sum(latest.values())
            in_flight = sum(1 for a, b in spans if a <= t - LOST_MARGIN and b >= t)
            if in_flight > counted:
                short.append((in_flight, counted))
        if len(short) < 2 or len(short) * 2 < len(points):
            return None
        return max(short)

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
            silence = _upstream_silence(o) if o.method else None
            if silence is not None and _began_before(o, silence["start"]):
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
        reused one and fresh connections answered meanwhile, or at its tap only requests
        on reused connections failed while some on fresh ones completed."""
        if not r.reused:
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
            window = _hang_window(r, self.e.end) if r.method else None
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


def _identity(item: tuple[Any, ...]) -> tuple[Any, ...]:
    return item


def _tuple_spool() -> SortedSpool[tuple[Any, ...]]:
    return SortedSpool(_identity, _identity, tuple, limit=SPILL_ITEMS)


def _finding(
    kind: str,
    party: str,
    summary: str,
    requests: list[RequestRow],
    evidence: list[str],
    ruled_out: list[dict[str, str]],
    confidence: str,
    *,
    settle: str | None = None,
    note: bool = False,
    t: float | None = None,
) -> dict[str, Any]:
    return {
        "party": party,
        "kind": kind,
        "summary": summary,
        "requests": [r.id for r in requests],
        "connections": sorted({f"{r.tap}/{r.conn}" for r in requests}),
        "evidence": evidence,
        "ruled_out": ruled_out,
        "confidence": confidence,
        "settle": settle,
        "note": note,
        "t": t if t is not None else (requests[0].start if requests else None),
    }


def _multiplexed(r: RequestRow) -> bool:
    """An HTTP/2 (or 3) request: a stream among others, not a keep-alive turn."""
    return r.version is not None and r.version[:1] in ("2", "3")


def _reused_words(r: RequestRow) -> str:
    major = (r.version or "1")[:1]
    return f"reused HTTP/{major} connection" if _multiplexed(r) else "reused keep-alive connection"


def _req_quote(r: RequestRow) -> str:
    pos = f"request {r.seq} on connection {r.tap}/{r.conn}"
    if r.reused and _multiplexed(r):
        pos += f" (HTTP/{r.version} stream on a connection already open)"
    elif r.reused:
        pos += f" (keep-alive reuse after {r.idle_before:.3f} s idle)"
    else:
        pos += " (fresh connection)"
    rid = f" x-request-id={r.request_id}" if r.request_id else ""
    return f"{_ts(r.start)} {r.method} {r.target}{rid}: {pos}"


def _outcome_quote(r: RequestRow) -> str:
    parts = [f"termination={r.termination}"]
    if r.status is not None:
        parts.append(f"status={r.status}")
    parts.append(f"response bytes={r.response_bytes}")
    if r.sse:
        parts.append(f"events={r.events}, [DONE]={'yes' if r.done else 'no'}")
    if r.close:
        parts.append(f"upstream {r.close}")
    if r.end is not None:
        parts.append(f"ended {_ts(r.end)}")
    return ", ".join(parts)


def _probe_quote(p: dict[str, Any]) -> str:
    return (
        f"probe {_ts(p['t'])} {p['target']} {p['url']} over a fresh connection: {p['outcome']}"
        + (f" in {p['latency']:.3f} s" if p.get("latency") is not None else "")
        + (f" ({p['reason']})" if p.get("reason") else "")
    )


def _hang_window(r: RequestRow, end: float | None) -> tuple[float, float] | None:
    """When the request sat with no bytes arriving from upstream, if it did."""
    if _gone_before(r) is not None:
        return None  # sent after the upstream closed: the client's reuse, not a hang
    stall = _upstream_silence(r)
    if stall is not None:
        return stall["start"], stall["end"] or r.end or end or stall["start"]
    if r.termination in ("in_flight", "truncated", "client_abort") and r.status is None:
        return r.start, r.end or end or r.start
    return None


# ---- analyzers ---------------------------------------------------------------------------


def _injected(ctx: Context, r: RequestRow) -> list[str]:
    if not r.injected:
        return []
    return [f"the tap injected this fault itself: {', '.join(r.injected)} (opt-in --fault)"]


def _gone_before(r: RequestRow) -> float | None:
    """For a request sent after its tap had passed the upstream's close on to the client:
    how long before (``math.inf`` when the capture does not say); None for any other."""
    detail = r.detail
    if detail is None or not detail.startswith(UPSTREAM_GONE):
        return None
    try:
        return float(detail[len(UPSTREAM_GONE) :].split()[0])
    except (IndexError, ValueError):
        return math.inf


def _stale_race(r: RequestRow, end: float | None) -> bool:
    """A request on a connection idle long enough for a keep-alive timeout, ended at once
    with nothing: the upstream closed the connection as it was written."""
    return (
        r.termination == "truncated"
        and r.response_bytes == 0
        and r.status is None
        and r.reused
        and r.idle_before >= IDLE_REUSE_RACE
        and _hang_window(r, end) is not None
        and r.end is not None
        and (r.end - r.start) < 1.0
    )


def _written_on_closed(r: RequestRow, end: float | None) -> bool:
    """The request was written on a connection its upstream had closed, or said it would
    close, or closed as it came (the race): the connection's end came before it, from
    behind the tap, and no hop held it."""
    return r.after_close or _gone_before(r) is not None or _stale_race(r, end)


def _began_before(r: RequestRow, start: float) -> bool:
    """The response's body had begun before the silence at ``start``: a stall mid-stream,
    not a wait for the first token (a request queued behind others waits like that, and
    so does one whose head an engine sends before its first token)."""
    if r.sse:
        began = r.first_event
    else:
        began = r.start + r.ttfb if r.ttfb is not None and r.response_bytes > 0 else None
    return began is not None and began <= start + ZERO_GAP


def analyze_request_hangs(ctx: Context) -> list[dict[str, Any]]:
    """Requests that sat with nothing from upstream: engine wedge, lost, or a hop on reuse."""
    out: list[dict[str, Any]] = []
    for r in ctx.interesting:
        if not r.method:
            continue
        window = _hang_window(r, ctx.e.end)
        if window is None:
            continue
        start, end = window
        view = ctx.engine_view(start, end)
        evidence = [_req_quote(r), _outcome_quote(r)]
        evidence += [
            f"stall {_ts(s['start'])} {s['direction']} for {s['duration'] or 'ever'} s"
            for s in r.stalls
        ]
        evidence += _injected(ctx, r)
        if view.known:
            evidence.append(view.quote())
        probes = ctx.probes_during(start, end, r)
        fresh_ok = [p for p in probes if p["outcome"] == "ok"]
        evidence += [_probe_quote(p) for p in probes]
        fresh, example = ctx.fresh_completed(r)
        if example is not None:
            evidence.append(
                f"{fresh} request(s) on fresh connections completed meanwhile "
                f"(e.g. {example.id}, {example.duration or 0:.3f} s)"
            )
        mid_stream = _began_before(r, start)
        client_ok = {
            "party": "client",
            "why": "the request reached the tap complete and the tap forwarded it; the client "
            "was waiting for the answer",
        }
        if view.wedged:
            kind = "engine_stall_mid_stream" if mid_stream else "engine_stall"
            out.append(
                _finding(
                    kind,
                    "engine",
                    "The engine held the request running while its decode progress stayed flat.",
                    [r],
                    evidence,
                    [
                        client_ok,
                        {
                            "party": "proxy",
                            "why": "the engine reports requests running and its decode "
                            "progress figure did not move",
                        },
                    ],
                    "high",
                    t=start,
                )
            )
            continue
        if view.idle and not mid_stream:
            if view.router_in_flight:
                out.append(
                    _finding(
                        "engine_lost_request",
                        "engine",
                        "The router counts the request in flight while no engine runs or "
                        "queues anything: it was lost in the serving stack.",
                        [r],
                        evidence,
                        [client_ok, {"party": "proxy", "why": "the router received it"}],
                        "high",
                        t=start,
                    )
                )
                continue
            serving = ctx.upstream_is_serving(r)
            answered = bool(fresh_ok or fresh)
            reuse = ctx.reuse_implicated(r, answered)
            kind = "proxy_hung_on_reuse" if reuse else "proxy_swallowed_request"
            party = "engine" if serving else "proxy"
            if serving:  # the tap's upstream is the serving stack: it lost the request
                kind = "engine_lost_request"
            what = f"held the {_reused_words(r)}" if reuse else "swallowed the request"
            # the tap's upstream is a hop in between, or the serving stack's own front
            # (the router's or the engine's HTTP server): say which
            who = "The serving stack behind tap" if serving else "The hop after tap"
            summary = f"{who} {r.tap} {what}: the engine was idle the whole time" + (
                " and fresh connections answered." if answered else "."
            )
            ruled = [
                client_ok,
                {
                    "party": "engine" if party == "proxy" else "proxy",
                    "why": view.quote()
                    if party == "proxy"
                    else "the tap's upstream is the serving stack itself",
                },
            ]
            out.append(
                _finding(
                    kind,
                    party,
                    summary,
                    [r],
                    evidence,
                    ruled,
                    "high" if answered else "medium",
                    t=start,
                    settle=None
                    if answered
                    else "probes on fresh connections (--probe-on-stall) would show whether "
                    f"{'it' if serving else 'the hop'} answers at all",
                )
            )
            continue
        serving = ctx.upstream_is_serving(r)
        uncounted = (
            ctx.uncounted(r, start, end)
            if serving and not mid_stream and r.status is None and (view.producing or fresh)
            else None
        )
        if uncounted is not None:
            in_flight, counted = uncounted
            out.append(
                _finding(
                    "engine_lost_request",
                    "engine",
                    f"The serving stack behind tap {r.tap} lost the request: with {in_flight} "
                    f"request(s) in flight at the tap the engines counted {counted} running "
                    "or queued, and answered others meanwhile.",
                    [r],
                    [
                        *evidence,
                        f"{in_flight} request(s) in flight at tap {r.tap} while the engines' "
                        f"live running + queued said {counted}, at most moments from "
                        f"{_ts(start)} to {_ts(end)}",
                    ],
                    [
                        client_ok,
                        {"party": "proxy", "why": "the tap's upstream is the serving stack itself"},
                    ],
                    "high",
                    t=start,
                    settle=None
                    if ctx.role(r.tap) == "engine"
                    else "the router's own metrics (in flight per worker) would tell the "
                    "router from an engine",
                )
            )
            continue
        answered_late = r.status is not None and (
            r.response_bytes > 0 or r.termination == "complete"
        )
        if view.loaded and not mid_stream and answered_late:
            continue  # it was answered, late: queued under load (the load analyzer's note)
        if mid_stream and serving:
            # its bytes stopped mid-stream with no hop between the tap and the serving stack
            together = ctx.stopped_together(r, start)
            if together:
                evidence.append(
                    f"{together} other stream(s) at tap {r.tap} went silent within "
                    f"{TOGETHER:g} s of it, and no request there completed meanwhile"
                )
            out.append(
                _finding(
                    "engine_stall_mid_stream",
                    "engine",
                    "The stream stopped mid-way together with the others from the serving "
                    "stack, at a tap whose upstream is the serving stack itself."
                    if together
                    else "The stream stopped mid-way at a tap whose upstream is the serving "
                    "stack itself.",
                    [r],
                    evidence,
                    [
                        client_ok,
                        {
                            "party": "proxy",
                            "why": "there is no hop between the tap and the serving stack",
                        },
                    ],
                    "high" if view.producing or together else "medium",
                    t=start,
                )
            )
            continue
        if mid_stream and view.producing:
            out.append(
                _finding(
                    "proxy_held_stream",
                    "proxy",
                    "Tokens were generated while none reached the tap.",
                    [r],
                    evidence,
                    [client_ok],
                    "medium",
                    t=start,
                )
            )
            continue
        if serving:
            out.append(
                _finding(
                    "upstream_silent",
                    "engine",
                    "The serving stack held the request without answering; its figures do not "
                    "tell a stall from a wait.",
                    [r],
                    evidence,
                    [
                        client_ok,
                        {"party": "proxy", "why": "the tap's upstream is the serving stack itself"},
                    ],
                    "medium",
                    settle="a decode-progress figure (SGLang's realtime_tokens_total with "
                    "--enable-metrics, vLLM's generation_tokens_total) or /v1/loads would tell "
                    "a stalled engine from a busy one"
                    if view.known
                    else "give --engine-metrics so the engine's own state during the silence "
                    "can tell a stall from a wait",
                    t=start,
                )
            )
            continue
        settle = (
            "give --engine-metrics (and --probe-on-stall) so the engine's own state during "
            "the silence can decide between the engine and a hop in between"
            if not view.known
            else f"place a second tap behind the hop after tap {r.tap}, in front of the "
            "serving stack"
        )
        out.append(
            _finding(
                "upstream_silent",
                "unknown",
                "Nothing came back from upstream; the evidence does not say which hop held it.",
                [r],
                evidence,
                [client_ok],
                "low",
                settle=settle,
                t=start,
            )
        )
    return out


def analyze_client(ctx: Context) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in ctx.interesting:
        if not r.method:
            continue
        blocked = [s for s in r.stalls if s["direction"] == "client_not_reading"]
        if blocked:
            s = blocked[0]
            out.append(
                _finding(
                    "client_not_reading",
                    "client",
                    "The client stopped reading: writes to it backed up while data waited.",
                    [r],
                    [
                        _req_quote(r),
                        f"stall {_ts(s['start'])} client_not_reading "
                        f"for {s['duration'] or 'ever'} s",
                        _outcome_quote(r),
                    ],
                    [
                        {"party": "engine", "why": "upstream data was waiting to be written"},
                        {"party": "proxy", "why": "the tap's writes to the client were blocked"},
                    ],
                    "high",
                    t=s["start"],
                )
            )
        if r.termination == "client_abort" and _hang_window(r, ctx.e.end) is None:
            out.append(
                _finding(
                    "client_abort",
                    "client",
                    "The client reset the HTTP/2 stream while the response was still flowing."
                    if _multiplexed(r) and (r.detail or "").startswith(STREAM_RESET)
                    else "The client closed the connection while the response was still flowing.",
                    [r],
                    [_req_quote(r), _outcome_quote(r)],
                    [{"party": "engine", "why": "bytes were arriving until the client closed"}],
                    "medium",
                    t=r.end,
                )
            )
        if r.after_close:
            out.append(
                _finding(
                    "client_reused_closed_connection",
                    "client",
                    "The client sent a request on a connection the server had said it would "
                    "close (Connection: close).",
                    [r],
                    [_req_quote(r), _outcome_quote(r)],
                    [],
                    "high",
                    t=r.start,
                )
            )
        elif (gone := _gone_before(r)) is not None:
            out.append(_reused_after_fin(r, gone))
    return out


def _reused_after_fin(r: RequestRow, gone: float) -> dict[str, Any]:
    """A request the client wrote after the upstream had closed the connection (the tap
    passed the FIN on): the client's pool keeps idle connections longer than the upstream
    does. Written well after the FIN, the client missed the close; within
    ``RACE_WINDOW`` of it, it may have been on its way before the FIN could reach it."""
    evidence = [_req_quote(r), _outcome_quote(r)]
    confidence = "high"
    if math.isinf(gone):  # a capture that does not say when
        summary = (
            "The client sent a request on a connection the upstream had already closed "
            "(its FIN had been passed on to the client)."
        )
    elif gone < RACE_WINDOW:
        summary = (
            f"The client wrote a request on its keep-alive connection {gone * 1000:.1f} ms "
            f"after the tap passed on the upstream's close, after {r.idle_before:.3f} s idle: "
            "too soon to tell a client that ignored the close from the keep-alive race (the "
            "request already on its way); either way the upstream drops idle connections "
            "sooner than the client's pool."
        )
        confidence = "medium"
    else:
        summary = (
            f"The client sent a request on a connection the upstream had closed {gone:.3f} s "
            f"before (its FIN had been passed on to the client), after {r.idle_before:.3f} s "
            "idle: the client's pool kept it longer than the upstream keeps idle connections."
        )
    if not math.isinf(gone):
        evidence.append(
            f"the upstream's close had been passed on to the client {gone:.6f} s before"
        )
    return _finding(
        "client_reused_closed_connection",
        "client",
        summary,
        [r],
        evidence,
        [],
        confidence,
        t=r.start,
    )


def analyze_client_connections(ctx: Context) -> list[dict[str, Any]]:
    """Client connections that failed before a first request: bytes that are not HTTP
    (a TLS handshake sent to a plain HTTP/1.1 tap), a failed TLS handshake with a proxy
    that terminates TLS (a client that does not trust mitmproxy's certificate)."""
    failures, total = ctx.e.client_failures, ctx.e.client_failures_total
    if not failures:
        return []
    first = failures[0]
    shown = 5
    evidence = [
        f"connection {f['tap']}/{f['conn']} at {_ts(f['t'])}: {f['error']}"
        for f in failures[:shown]
    ]
    if total > shown:
        evidence.append(f"... {total - shown} more such connection(s)")
    finding = _finding(
        "client_connection_failed",
        "client",
        f"A client connection failed before its first request: {first['error']}"
        if total == 1
        else f"{total} client connections failed before their first request; the first: "
        f"{first['error']}",
        [],
        evidence,
        [{"party": "engine", "why": "no request on these connections reached the upstream"}],
        "high",
        t=first["t"],
    )
    finding["connections"] = sorted({f"{f['tap']}/{f['conn']}" for f in failures})
    return [finding]


def analyze_upstream_endings(ctx: Context) -> list[dict[str, Any]]:
    """Truncations, errors, unreachable upstreams, stale-connection races."""
    out: list[dict[str, Any]] = []
    for r in ctx.interesting:
        if not r.method:
            continue
        serving = ctx.upstream_is_serving(r)
        hop = "engine" if serving else "unknown"
        evidence = [_req_quote(r), _outcome_quote(r), *_injected(ctx, r)]
        if r.by_tracer and r.status == 502:
            tls = _tls_words(r.detail)
            out.append(
                _finding(
                    "upstream_unreachable",
                    "engine" if serving else "unknown",
                    "The tap's TLS handshake with its upstream failed."
                    if tls
                    else "The tap could not connect to its upstream.",
                    [r],
                    [*evidence, f"the tap's connect to its upstream failed: {r.detail}"]
                    if r.detail
                    else evidence,
                    [{"party": "client", "why": "the request reached the tap"}],
                    "high",
                    settle="does the upstream speak TLS (an https:// URL to a plain HTTP port, "
                    "or the reverse), and is its certificate trusted by the proxy?"
                    if tls
                    else None
                    if serving
                    else "is the tap's upstream a proxy or the router?",
                )
            )
            continue
        if r.error:
            out.append(
                _finding(
                    "engine_error_event",
                    "engine",
                    f"The stream carried an error event: {r.error}",
                    [r],
                    evidence,
                    [
                        {"party": "client", "why": "the error came from upstream"},
                        {"party": "proxy", "why": "proxies do not write OpenAI error events"},
                    ],
                    "high",
                    t=r.end,
                )
            )
        elif r.status is not None and r.status >= 500 and not r.by_tracer:
            out.append(
                _finding(
                    "engine_error_status",
                    hop,
                    f"Upstream answered {r.status}.",
                    [r],
                    evidence,
                    [{"party": "client", "why": "the error came from upstream"}],
                    "high" if serving else "medium",
                    settle=None
                    if serving
                    else "a tap in front of the router would show whether the router sent it",
                    t=r.end,
                )
            )
        if _stale_race(r, ctx.e.end):
            out.append(
                _finding(
                    "stale_connection_race",
                    "proxy" if not serving else "engine",
                    "The hop after the tap closed an idle keep-alive connection just as a "
                    "request was written on it (keep-alive timeouts do not match).",
                    [r],
                    evidence,
                    [{"party": "client", "why": "the connection was open when it wrote"}],
                    "medium",
                    t=r.start,
                )
            )
        elif (
            r.termination == "truncated"
            and (r.response_bytes > 0 or r.status is not None)
            and _upstream_silence(r) is None
        ):  # (a cut after a silence: the silence is the finding)
            out.append(
                _finding(
                    "engine_truncated" if serving else "stream_cut",
                    hop,
                    "Upstream closed the response before its end.",
                    [r],
                    evidence,
                    [{"party": "client", "why": "upstream closed first"}],
                    "high" if serving else "medium",
                    settle=None
                    if serving
                    else "a tap in front of the router would show which hop cut it",
                    t=r.end,
                )
            )
        elif (
            r.termination == "complete"
            and r.sse
            and r.events
            and not r.done
            and r.finish_reason is None
            and not r.error
        ):
            out.append(
                _finding(
                    "logical_truncation",
                    hop,
                    "The body ended cleanly but without [DONE] or a finish_reason.",
                    [r],
                    evidence,
                    [{"party": "client", "why": "upstream ended the body"}],
                    "medium",
                    t=r.end,
                )
            )
    return out


def analyze_delivery(ctx: Context) -> list[dict[str, Any]]:
    """Coalesced (≈40 ms bunches) and buffered (all at the end) streams."""
    out: list[dict[str, Any]] = []
    for r in ctx.interesting:
        kind = _delivery_kind(r)
        if r.first_event is None or r.last_event is None or (kind is None and not _bursts(r)):
            continue
        zero = r.zero_gaps / r.event_gaps
        spread = r.last_event - r.first_event
        duration = (r.end or r.last_event) - r.start
        seen = ctx.seen_with(r)
        steady = next((seen[t] for t in ctx.next_taps(r.tap) if t in seen), None)
        if (
            steady is not None
            and steady.event_gaps >= 8
            and _delivery_kind(steady) is None
            and not _bursts(steady)
        ):
            if kind == "coalesced":
                out.append(_coalesced_between(r, steady))
            elif kind == "buffered" or (steady.max_gap or 0.0) * 4 < (r.max_gap or 0.0):
                out.append(_buffered_between(r, steady))
        elif kind is None:
            continue  # bursts alone prove nothing
        elif kind == "coalesced":
            out.append(
                _finding(
                    "delivery_coalesced",
                    "proxy" if not ctx.upstream_is_serving(r) else "engine",
                    f"Events arrived in bunches about 40 ms apart (a hop upstream of tap "
                    f"{r.tap} without TCP_NODELAY meeting a delayed ACK).",
                    [r],
                    [
                        _req_quote(r),
                        f"{r.events} events: {zero:.0%} of gaps < 1 ms, "
                        f"{r.bunch_gaps} gaps of 30-60 ms",
                    ],
                    [{"party": "client", "why": "bunching is seen before the client"}],
                    "medium",
                    t=r.first_event,
                )
            )
        else:
            view = ctx.engine_view(r.start, r.end or r.last_event)
            party = "proxy" if view.producing and not ctx.upstream_is_serving(r) else "unknown"
            out.append(
                _finding(
                    "buffered_response",
                    party,
                    "The whole stream arrived in one burst at the end: a hop upstream held it "
                    "(as nginx with proxy_buffering on does).",
                    [r],
                    [
                        _req_quote(r),
                        f"{r.events} events within {spread * 1000:.1f} ms, "
                        f"{duration:.3f} s after the request",
                        *([view.quote()] if view.known else []),
                    ],
                    [{"party": "client", "why": "the burst is seen before the client"}],
                    "medium" if party != "unknown" else "low",
                    settle=None
                    if party != "unknown"
                    else "engine metrics showing tokens "
                    "generated steadily would place it on the hop in between",
                    t=r.first_event,
                )
            )
    return out


def _gap_figures(r: RequestRow) -> str:
    zero = r.zero_gaps / r.event_gaps if r.event_gaps else 0.0
    return f"{r.events} events: {zero:.0%} of gaps < 1 ms, {r.bunch_gaps} gaps of 30-60 ms"


def _coalesced_between(r: RequestRow, steady: RequestRow) -> dict[str, Any]:
    """Bunched at one tap, steady at the next one toward the engine: the hop between."""
    return _finding(
        "delivery_coalesced",
        "proxy",
        f"Events arrived in bunches about 40 ms apart at tap {r.tap} but steadily at tap "
        f"{steady.tap}: the hop between tap {r.tap} and tap {steady.tap} holds them (no "
        "TCP_NODELAY meeting a delayed ACK).",
        [r, steady],
        [
            _req_quote(r),
            f"at tap {r.tap}: {_gap_figures(r)}",
            _req_quote(steady),
            f"at tap {steady.tap}: {_gap_figures(steady)}",
        ],
        [
            {"party": "client", "why": "bunching is seen before the client"},
            {"party": "engine", "why": f"the events passed tap {steady.tap} steadily"},
        ],
        "high",
        t=r.first_event,
    )


def _buffered_between(r: RequestRow, steady: RequestRow) -> dict[str, Any]:
    """In one burst at one tap, spread over the stream at the next one toward the engine
    (whatever the hop did to the framing between: chunked in front, close-delimited
    behind an HTTP/1.0 upstream): the hop between buffered it."""
    assert r.first_event is not None and r.last_event is not None
    spread = r.last_event - r.first_event
    steady_spread = (steady.last_event or 0.0) - (steady.first_event or 0.0)
    whole = _delivery_kind(r) == "buffered"
    return _finding(
        "buffered_response",
        "proxy",
        f"The stream arrived at tap {r.tap} "
        + ("in one burst at its end" if whole else "in bursts with long waits between")
        + f" while tap {steady.tap} received it as it came: the hop between tap {r.tap} and "
        f"tap {steady.tap} buffered it (as nginx with proxy_buffering on does).",
        [r, steady],
        [
            _req_quote(r),
            f"at tap {r.tap}: {r.events} events over {spread:.3f} s, "
            f"{r.zero_gaps} of {r.event_gaps} gaps < 1 ms, longest gap {r.max_gap or 0.0:.3g} s, "
            f"first {(r.first_event - r.start):.3f} s after the request",
            _req_quote(steady),
            f"at tap {steady.tap}: {steady.events} events over {steady_spread:.3f} s, "
            f"longest gap {steady.max_gap or 0.0:.3g} s"
            + (f", HTTP/{steady.version}" if steady.version else ""),
        ],
        [
            {"party": "client", "why": "the burst is seen before the client"},
            {"party": "engine", "why": f"the events passed tap {steady.tap} as they came"},
        ],
        "high",
        t=r.first_event,
    )


def _held_first_events(ctx: Context) -> dict[str, tuple[str, _Holds]]:
    """Per tap in front: the tap one hop behind it where the first events it got late
    came at once, where that happened to at least 2 streams and a tenth of those both
    taps saw (the one that shows it most: the same request may reach two taps behind a
    router, the legs of PD)."""
    best: dict[str, tuple[str, _Holds]] = {}
    for (a, b), holds in sorted(ctx.first_held.items()):
        if b not in ctx.next_taps(a) or holds.count < 2 or holds.count * 10 < ctx.shared(a, b):
            continue
        if a not in best or holds.count > best[a][1].count:
            best[a] = (b, holds)
    return best


def _ms_spread(seconds: list[float]) -> tuple[str, str]:
    """The median in ms, and "median; LO to HI ms", of a sample of waits."""
    ordered = sorted(seconds)
    median = f"{ordered[len(ordered) // 2] * 1000:.0f}"
    return median, f"median; {ordered[0] * 1000:.0f} to {ordered[-1] * 1000:.0f} ms"


def analyze_first_events(ctx: Context) -> list[dict[str, Any]]:
    """First events held ~40 ms by the hop between two taps (no TCP_NODELAY meeting a
    delayed ACK): late after the response head at one tap, at once at the next toward the
    engine, for the same requests (``_held_first_events``). A note: a latency the hop
    adds to every such stream, not why anything hung."""
    out: list[dict[str, Any]] = []
    for a, (b, holds) in sorted(_held_first_events(ctx).items()):
        rows = ctx.rows_at(p for pair in holds.examples for p in pair)
        examples = sorted(
            ((rows[p], rows[q]) for p, q in holds.examples if p in rows and q in rows),
            key=lambda pair: pair[0].start,
        )
        median, spread = _ms_spread(holds.delays)
        evidence = [
            f"{holds.count} of the {ctx.shared(a, b)} requests both taps saw; the first event "
            f"{median} ms later at tap {a} than at tap {b} ({spread})"
        ]
        for held, prompt in examples:
            evidence += [
                f"{_req_quote(held)}: first event "
                f"{_first_event_wait(held) * 1000:.1f} ms after the response head",
                f"at tap {b}: {_first_event_wait(prompt) * 1000:.1f} ms after its response head",
            ]
        out.append(
            _finding(
                "first_event_held",
                "proxy",
                f"The hop between tap {a} and tap {b} held the first event of {holds.count} "
                f"stream(s) about {median} ms after the response head, which tap "
                f"{b} got at once: it writes the two separately without TCP_NODELAY, and the "
                "delayed ACK of the host in front holds the second (the SGLang router does "
                "not set TCP_NODELAY).",
                [r for pair in examples for r in pair],
                evidence,
                [{"party": "engine", "why": f"tap {b}, nearer the engine, got it at once"}],
                "high",
                note=True,
                t=examples[0][0].start if examples else None,
            )
        )
    return out


def analyze_reused_first_events(ctx: Context) -> list[dict[str, Any]]:
    """One tap alone: first events held 30-220 ms after the head on reused connections and
    not on fresh ones (which start in quick-ACK mode: the delayed ACK that holds a write
    Nagle keeps back comes only later on a connection). The engine's first token does not
    depend on which connection a request came on. A note, medium confidence; not told
    for a tap that ``analyze_first_events`` told it for already."""
    told = _held_first_events(ctx)
    out: list[dict[str, Any]] = []
    for tap, stats in sorted(ctx.first_waits.items()):
        if tap in told or not stats.pattern:
            continue
        rows = ctx.rows_at(stats.examples[True] + stats.examples[False])
        quoted = sorted(rows.values(), key=lambda r: r.start)
        median, spread = _ms_spread(stats.waits)
        party = "engine" if quoted and ctx.upstream_is_serving(quoted[0]) else "proxy"
        evidence = [
            f"reused connections: the first event of {stats.reused_held} of {stats.reused} "
            f"streams {median} ms after the response head ({spread})",
            f"fresh connections: {stats.fresh_prompt} of {stats.fresh} within "
            f"{FIRST_EVENT_PROMPT * 1000:.0f} ms",
        ]
        evidence += [
            f"{_req_quote(r)}: first event {_first_event_wait(r) * 1000:.1f} ms after the "
            "response head"
            for r in quoted
        ]
        out.append(
            _finding(
                "first_event_held",
                party,
                f"On reused connections the first event of {stats.reused_held} stream(s) "
                f"came about {median} ms after the response head at tap {tap}, on "
                "fresh ones at once: the hop upstream writes the two separately without "
                "TCP_NODELAY and the tap's delayed ACK holds the second (the SGLang router "
                "does not set TCP_NODELAY). A tap behind that hop would confirm it.",
                quoted,
                evidence,
                [],
                "medium",
                note=True,
                t=quoted[0].start if quoted else None,
            )
        )
    return out


def analyze_load(ctx: Context) -> list[dict[str, Any]]:
    """Slow first tokens while the engine was busy: load, with the figures — not a fault.

    One note per tap, over all its requests that waited (quoting the first
    ``MAX_QUOTED``), with the engine's figures over the whole span of the waits.
    """
    slow: dict[str, list[RequestRow]] = defaultdict(list)
    for r in ctx.interesting:
        if r.first_token is None or r.first_token < SLOW_FIRST_TOKEN:
            continue
        if ctx.engine_view(r.start, r.start + r.first_token).busy:
            slow[r.tap].append(r)
    out: list[dict[str, Any]] = []
    for tap, rows in sorted(slow.items()):
        waits = sorted(r.first_token or 0.0 for r in rows)
        start = min(r.start for r in rows)
        end = max(r.start + (r.first_token or 0.0) for r in rows)
        median = waits[len(waits) // 2]
        evidence = [ctx.engine_view(start, end).quote()]
        evidence += [
            f"{_req_quote(r)}: first token after {r.first_token:.3f} s" for r in rows[:MAX_QUOTED]
        ]
        if len(rows) > MAX_QUOTED:
            evidence.append(f"... and {len(rows) - MAX_QUOTED} more request(s) like these")
        out.append(
            _finding(
                "engine_queueing",
                "engine",
                f"{len(rows)} request(s) at tap {tap} waited {median:.2f} s (median; up to "
                f"{waits[-1]:.2f} s) for their first token because the engine was busy — "
                "load, not a fault, and not a cold start.",
                rows,
                evidence,
                [],
                "high",
                note=True,
                t=start,
            )
        )
    return out


def analyze_marks(ctx: Context) -> list[dict[str, Any]]:
    """A hang reported at a time when no request was in flight at the front-most tap."""
    out: list[dict[str, Any]] = []
    if not ctx.order:
        return out
    front = ctx.order[0]
    for mark in ctx.e.marks:
        before, incomplete, in_flight = ctx.mark_stats(front, mark)
        if in_flight:
            continue
        complete = incomplete == 0
        view = ctx.engine_view(mark - 5.0, mark)
        evidence = [
            f"hang reported at {_ts(mark)}: no request in flight at tap {front}",
            f"{before} request(s) before it, "
            + ("all delivered completely" if complete else "not all complete"),
        ]
        if view.known:
            evidence.append(view.quote())
        ruled = [{"party": "engine", "why": "nothing was outstanding at the serving side"}]
        if front in ctx.e.client_facing:
            out.append(
                _finding(
                    "client_idle_hang",
                    "client",
                    "Every response had been delivered and the client sent nothing: the "
                    "client itself was stuck.",
                    [],
                    evidence,
                    ruled,
                    "high" if complete else "medium",
                    t=mark,
                )
            )
        else:
            out.append(
                _finding(
                    "idle_at_hang",
                    "unknown",
                    "Nothing was outstanding at this tap when the hang was seen: client or a "
                    "proxy in front of the tap; the engine is ruled out.",
                    [],
                    evidence,
                    ruled,
                    "medium",
                    t=mark,
                    settle=f"place a tap on the client side of the proxy, or, if the harness "
                    f"talks to tap {front} directly, pass --client-facing {front}",
                )
            )
    return out


# findings about connections that carried no request: listed, but the verdict only when
# nothing went wrong with a request (a port scanner's failed TLS handshake must not
# hide the stall that hung the harness)
NO_REQUEST_KINDS = {"client_connection_failed"}
MARK_KINDS = {"client_idle_hang", "idle_at_hang"}  # findings about a --hang-at mark
# findings read from timing statistics alone (bunching): they yield the verdict to hard
# evidence (a request never seen at the next tap, bytes that stopped, a status)
TIMING_KINDS = {"delivery_coalesced", "first_event_held"}
GROUP_EVIDENCE = 40  # evidence items kept in a finding that stands for several
BURST_GAP = 0.25  # seconds: a wait between bursts no decode step explains
LAG_LIMIT = 0.030  # a tap whose loop ran this late cannot tell 30-60 ms bunches apart
LAG_REACH = 5.0  # seconds after a finding's time that a starved window still bears on it

ANALYZERS = [
    analyze_request_hangs,
    analyze_client,
    analyze_client_connections,
    analyze_upstream_endings,
    analyze_delivery,
    analyze_first_events,
    analyze_reused_first_events,
    analyze_load,
    analyze_marks,
]


def _join_taps(ctx: Context, findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """With several taps: a request that stopped between two of them blames the hop there."""
    if len(ctx.order) < 2:
        return findings
    rank = {tap: i for i, tap in enumerate(ctx.order)}
    replaced: set[str] = set()
    extra: list[dict[str, Any]] = []
    folded: dict[str, list[RequestRow]] = {}  # the telling tap's request -> it at the others
    for seen in ctx.joined():
        taps = sorted(seen, key=lambda t: rank.get(t, 0))
        rows = [seen[t] for t in taps]  # client side first
        front = rows[0]
        if not _relevant_at_front(front, ctx.e.end):
            continue
        window = _hang_window(front, ctx.e.end)
        legs = [t for t in taps[1:] if t in ctx.next_taps(taps[0])]
        same = [t for t in legs if _same_failure(seen[t], front)]
        if len(legs) > 1 and same:  # side by side (PD's legs): the one that failed as the
            taps = [t for t in taps if t not in legs or t == same[0]]  # front did is its path
            rows = [seen[t] for t in taps]
        if len(taps) > 1 and all(_same_failure(seen[t], seen[taps[-1]]) for t in taps[:-1]):
            # told by the tap nearest the side it came from
            teller = taps[0] if _client_side(front) else taps[-1]
            folded[seen[teller].id] = [seen[t] for t in taps if t != teller]
            continue
        last = taps[-1]
        behind = ctx.next_taps(last)
        if len(taps) < len(ctx.order):  # never reached the taps behind
            # at a hop (none of the taps one hop behind the last that saw it got it), not
            # at a tap that saw it
            stopped = bool(behind) and not any(t in seen for t in behind)
            if stopped and _written_on_closed(seen[last], ctx.e.end):
                continue  # its own tap tells it (the connection's close came first)
            after = " or tap ".join(behind)
            never = _never_seen(behind, ctx.counts)
            if stopped and _error_status(seen[last]):
                extra.append(_answered_alone(seen[last], after, never))
                replaced.update(r.id for r in rows)
                continue
            if stopped:
                view = ctx.engine_view(*(window or (front.start, front.end or front.start)))
                fresh, _ = ctx.fresh_completed(seen[last])
                reuse = ctx.reuse_implicated(seen[last], bool(fresh))
                kind = "proxy_hung_on_reuse" if reuse else "proxy_swallowed_request"
                evidence = [_req_quote(seen[t]) for t in taps] + [never, _outcome_quote(front)]
                if view.known:
                    evidence.append(view.quote())
                if window is not None:  # what the tap's own probes found meanwhile
                    evidence += [_probe_quote(p) for p in ctx.probes_during(*window, seen[taps[0]])]
                ruled = [
                    {"party": "client", "why": f"the request reached tap {last} complete"},
                    {
                        "party": "engine",
                        "why": f"the request never reached tap {after}, in "
                        "front of the serving stack" + (f"; {view.quote()}" if view.known else ""),
                    },
                ]
                extra.append(
                    _finding(
                        kind,
                        "proxy",
                        f"The hop between tap {last} and tap {after} "
                        + (
                            f"held the {_reused_words(seen[last])}"
                            if reuse
                            else "swallowed the request"
                        )
                        + ": it never reached the next tap.",
                        [seen[t] for t in taps],
                        evidence,
                        ruled,
                        "high",
                        t=window[0] if window else front.start,
                    )
                )
                replaced.update(seen[t].id for t in taps)
                continue
        answered = _answered_between(rows)
        if answered is not None:
            extra.append(answered)
            replaced.add(front.id)  # the tap behind keeps its own findings (the cause)
            continue
        held = _held_between(rows)
        if held is not None:
            extra.append(held)
            replaced.update(r.id for r in rows)
            continue
        back = seen[taps[-1]]
        # the stream was whole (or still flowing: the hop then closed that side too) behind
        # the hop, and cut in front of it
        if back.termination in ("complete", "client_abort") and front.termination == "truncated":
            waited = _waited(back)
            extra.append(_cut_between(front, back, waited))
            # a hop that gave up on a silent upstream: the silence is told at the back tap
            replaced.update({front.id} if waited else {front.id, back.id})
    kept = [f for f in findings if not (set(f["requests"]) & replaced)]
    return [_unseen_by_client(ctx, f, rank) for f in _fold(kept, folded)] + extra


def _unseen_by_client(ctx: Context, f: dict[str, Any], rank: dict[str, int]) -> dict[str, Any]:
    """A fault at a tap behind the front one, in requests whose front copies were answered
    well: a hop in front retried them (the SGLang router sends a request that got a 5xx
    to another engine) or answered anyway. Still told, as a note: it is not what the
    client saw."""
    groups = [ctx.masked(rid) for rid in f["requests"]]
    if f["note"] or not groups or not all(groups):
        return f
    lines = []
    how = " The client did not see it: a hop in front answered the client anyway."
    for rid, seen in zip(f["requests"], groups, strict=True):
        front = seen[min(seen, key=lambda t: rank.get(t, 0))]
        failed = next(r for r in seen.values() if r.id == rid)
        line = (
            f"{rid}: its copy at tap {front.tap} ({front.id}) was answered: {_outcome_quote(front)}"
        )
        others = [r for r in seen.values() if r.tap not in (front.tap, failed.tap)]
        answered = [r for r in others if not _relevant_at_front(r, ctx.e.end)]
        if answered and failed.end is not None and answered[0].start >= failed.end:
            line += f"; sent again to tap {answered[0].tap}, which answered it"
            how = (
                " The client did not see it: a hop in front sent the request again to another "
                "engine, which answered."
            )
        elif answered:  # sent to both at once (the prefill and decode legs of PD)
            line += f"; sent at the same time to tap {answered[0].tap}, which answered it"
            how = (
                " The client did not see it: a hop in front sent the request to another "
                "engine at the same time, which answered."
            )
        lines.append(line)
    return f | {
        "summary": f["summary"] + how,
        "settle": None,  # the tap in front answers what it asked
        "evidence": f["evidence"] + lines,
        "note": True,
    }


def _never_seen(taps: list[str], counts: dict[str, int]) -> str:
    """The evidence line for a request none of ``taps`` saw."""
    saw = " and ".join(str(counts.get(t, 0)) for t in taps)
    return f"never seen at tap {' or tap '.join(taps)}, which saw {saw} other request(s)"


def _answered_alone(r: RequestRow, after: str, never: str) -> dict[str, Any]:
    """An error status for a request the next tap toward the engine never saw: the hop
    answered it without forwarding it (a rate limit, an overload page, no upstream)."""
    return _finding(
        "proxy_error_status",
        "proxy",
        f"The hop between tap {r.tap} and tap {after} answered {r.status} itself: the "
        f"request never reached tap {after}.",
        [r],
        [_req_quote(r), _outcome_quote(r), never],
        [{"party": "engine", "why": f"the request never reached tap {after}"}],
        "high",
        t=r.end,
    )


def _upstream_silence(r: RequestRow) -> dict[str, Any] | None:
    """The request's first ``upstream_silent`` stall."""
    return next((s for s in r.stalls if s["direction"] == "upstream_silent"), None)


def _at_tap(r: RequestRow) -> str:
    """The request and how it ended, in one evidence line."""
    return f"{_req_quote(r)}; {_outcome_quote(r)}"


def _waited(r: RequestRow) -> dict[str, Any] | None:
    """The upstream silence a request was in when its client (a hop) closed it."""
    return _upstream_silence(r) if r.termination == "client_abort" else None


def _cut_between(
    front: RequestRow, back: RequestRow, waited: dict[str, Any] | None
) -> dict[str, Any]:
    """The stream cut in front of a hop while whole, or still flowing, behind it; or cut
    by the hop after the tap behind had ``waited`` on a silent upstream (a proxy's read
    timeout meeting an engine's pause: both are findings)."""
    evidence = [_req_quote(front), _outcome_quote(front), _outcome_quote(back)]
    if waited is not None:
        cut = _finding(
            "proxy_cut_stream",
            "proxy",
            f"The hop between tap {front.tap} and tap {back.tap} cut the stream after tap "
            f"{back.tap} had waited {waited['duration'] or 0:.3g} s on its upstream: a "
            "proxy's read timeout (as nginx's proxy_read_timeout) met that silence.",
            [front, back],
            evidence,
            [],
            "high",
            settle=f"the findings at tap {back.tap} say why its upstream was silent; the "
            "hop's timeout may be shorter than the engine's pauses",
            t=front.end,
        )
        cut["after_silence"] = back.id  # the silence behind came first
        return cut
    whole = "ended complete" if back.termination == "complete" else "was still flowing"
    return _finding(
        "proxy_cut_stream",
        "proxy",
        f"The stream {whole} at tap {back.tap} but was cut at tap {front.tap}.",
        [front, back],
        evidence,
        [{"party": "engine", "why": f"the stream {whole} at tap {back.tap}"}],
        "high",
        t=front.end,
    )


def _answered_between(rows: list[RequestRow]) -> dict[str, Any] | None:
    """An error status at one tap that the next tap toward the engine never got: the hop
    between them answered it itself (a proxy's 502/504 after its own timeout, as nginx's
    ``proxy_read_timeout``, or its own error)."""
    for front, back in itertools.pairwise(rows):
        status = front.status
        if not _error_status(front) or back.status == status:
            continue
        if back.status is None:
            what = (
                f"tap {back.tap} got no answer from upstream in "
                f"{(back.end or front.end or back.start) - back.start:.3g} s, then "
                f"the hop closed the request ({back.termination})"
            )
        else:
            what = f"tap {back.tap} got {back.status} ({back.termination})"
        answered = _finding(
            "proxy_error_status",
            "proxy",
            f"The hop between tap {front.tap} and tap {back.tap} answered {status} itself: {what}.",
            [front, back],
            [
                _req_quote(front),
                _outcome_quote(front),
                f"at tap {back.tap}: {_at_tap(back)}",
            ],
            [{"party": "engine", "why": f"tap {back.tap} never got a {status} from upstream"}],
            "high",
            settle="if the hop timed out waiting, the findings at tap "
            f"{back.tap} say why the answer was slow; the hop's timeout may be shorter "
            "than the engine's time to first token",
            t=front.end,
        )
        if back.status is None and _upstream_silence(back) is not None:
            answered["after_silence"] = back.id  # the silence behind came first
        return answered
    return None


def _held_between(rows: list[RequestRow]) -> dict[str, Any] | None:
    """A stream silent at one tap for longer than any gap at the next one toward the
    engine, which was receiving it when the silence began and saw no such silence: the
    bytes came that far and the hop between the two held them (a buffering or stuck
    proxy). "When the silence began" is read within ``JOIN_SLACK`` (the taps' clocks may
    differ), and not through the pair's median delay: a request joined to the wrong one
    (its body sent again after a first attempt that a hop dropped: fingerprints are
    paired by their count at each tap) makes that delay itself."""
    for front, back in itertools.pairwise(rows):
        silent = _upstream_silence(front)
        if (
            silent is None
            or silent["duration"] is None
            or back.ttfb is None
            or back.max_gap is None
            or back.max_gap >= silent["duration"]
            or _upstream_silence(back) is not None
            or back.start > silent["start"] + JOIN_SLACK
            or (back.end is not None and back.end < silent["start"] - JOIN_SLACK)
        ):
            continue
        buffered = _delivery_kind(front) == "buffered"
        return _finding(
            "buffered_response" if buffered else "proxy_held_stream",
            "proxy",
            f"The whole stream arrived at tap {front.tap} in one burst at its end while tap "
            f"{back.tap} received it as it came, with no gap over {back.max_gap:.3g} s: the "
            "hop between them buffered it (as nginx with proxy_buffering on does)."
            if buffered
            else f"Tap {front.tap} got nothing for {silent['duration']:.3g} s while tap "
            f"{back.tap} received the stream with no gap over {back.max_gap:.3g} s: the hop "
            "between them held it.",
            [front, back],
            [
                _req_quote(front),
                f"stall t={silent['start']:.3f} upstream_silent for {silent['duration']:.3g} s "
                f"at tap {front.tap}",
                _outcome_quote(front),
                f"the same at tap {back.tap}: {_at_tap(back)}; longest gap "
                f"{back.max_gap:.3g} s, no stall",
            ],
            [
                {"party": "engine", "why": f"the bytes reached tap {back.tap} in time"},
                {"party": "client", "why": f"tap {front.tap} had nothing to send it"},
            ],
            "high",
            t=silent["start"],
        )
    return None


def _tls_words(detail: str | None) -> bool:
    """A connect failure in TLS's words (mitmproxy's: "The remote server does not speak
    TLS.", "Certificate verify failed: …", "TLS handshake failed: …")."""
    text = (detail or "").lower()
    return "tls" in text or "certificate" in text or "ssl" in text


def _client_side(r: RequestRow) -> bool:
    """A failure that came from the client's side: it gave up, or stopped reading or
    sending, with the upstream not silent."""
    directions = {s["direction"] for s in r.stalls}
    return "upstream_silent" not in directions and (
        r.termination == "client_abort"
        or bool(directions & {"client_not_reading", "client_silent"})
    )


def _same_failure(front: RequestRow, back: RequestRow) -> bool:
    """The request failed in front as it did behind: the same end, the same status, the
    same stalls (the taps in front only passed on what came to them)."""
    return (
        front.termination == back.termination
        and front.status == back.status
        and front.done == back.done
        and [s["direction"] for s in front.stalls] == [s["direction"] for s in back.stalls]
    )


def _fold(
    findings: list[dict[str, Any]], folded: dict[str, list[RequestRow]]
) -> list[dict[str, Any]]:
    """A failure seen the same at every tap is told once, by the finding at the tap nearest
    the side it came from (the engine's, or the client's), which names the request at
    the others too; their own findings, which could only say "upstream of me" (or "my
    client", of a proxy), go."""
    teller_of = {r.id: teller for teller, others in folded.items() for r in others}
    told = {rid for f in findings if not f["note"] for rid in f["requests"] if rid in folded}
    out = []
    for f in findings:
        ids = f["requests"]
        if f["note"]:
            out.append(f)
            continue
        if ids and all(teller_of.get(i) in told for i in ids):
            continue  # told by the teller's finding
        for r in [r for rid in ids if rid in folded for r in folded[rid] if r.id not in ids]:
            ids.append(r.id)
            f["connections"] = sorted({*f["connections"], f"{r.tap}/{r.conn}"})
            f["evidence"].append(f"the same at tap {r.tap}: {_at_tap(r)}")
        out.append(f)
    return out


def _injected_by_the_tap(ctx: Context, findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a tap injected on purpose (``--fault``: its ``fault`` records) is never a fault
    of the client, a proxy or the engine: a finding whose requests were all injected (at
    some tap, for a request joined across taps, or found at a tap in front through the
    connection both recorded or by its head) gives way to one ``injected_fault`` note per
    tap and spec, which says what the clients got and what the analysis would have
    called it without the record (what a resilience test, or a test of the analysis,
    wants to read)."""
    if not ctx.e.faults:
        return findings
    records: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    faults_of: dict[str, set[tuple[str, str]]] = defaultdict(set)  # request id -> its faults
    for rec in ctx.e.faults:
        key = (str(rec.get("tap")), str(rec.get("spec") or rec.get("fault")))
        records[key].append(rec)
        if isinstance(rec.get("conn"), int) and isinstance(rec.get("seq"), int):
            faults_of[f"{key[0]}/{rec['conn']}/{rec['seq']}"].add(key)
    groups = [*ctx.joined(), *ctx.masked_groups(), *ctx.bunched_groups()]
    for seen in groups:  # a request's copies at other taps
        keys = set().union(*(faults_of.get(r.id, set()) for r in seen.values()))
        if keys:
            for r in seen.values():
                faults_of[r.id] |= keys
    later = _through_the_connection(ctx, records, set(faults_of))
    linked = {hit.row.id for found in later.values() for hit in found}
    for key, found in _by_head(ctx, records, set(faults_of) | linked, groups).items():
        later[key] = later.get(key, []) + found
    for key, found in later.items():
        for hit in found:
            faults_of[hit.row.id].add(key)
    kept: list[dict[str, Any]] = []
    read_as: dict[tuple[str, str], set[str]] = defaultdict(set)
    for f in findings:
        if f["requests"] and all(rid in faults_of for rid in f["requests"]):
            for rid in f["requests"]:
                for key in faults_of[rid]:
                    read_as[key].add(f["kind"])
        else:
            kept.append(f)
    rows = {r.id: r for r in ctx.interesting if r.injected}
    return kept + [
        _injected_note(k, records[k], rows, read_as[k], later.get(k, [])) for k in sorted(records)
    ]


class _Found(NamedTuple):
    """A request at a tap in front that a fault of the tap behind acted on, found without
    a request join: ``there`` is what it is at the faulting tap (its connection, or for
    ``by_head`` its request), ``how`` how it was found."""

    row: RequestRow
    there: str
    how: Literal["after_close", "same_position", "by_head"]


def _through_the_connection(
    ctx: Context, records: dict[tuple[str, str], list[dict[str, Any]]], covered: set[str]
) -> dict[tuple[str, str], list[_Found]]:
    """Requests at a tap in front that a fault of the tap behind acted on, found through
    the connection the two taps share (``Context.conns_in_front``) where no request join
    found them: a request written after the faulting tap had closed the connection
    (``close-idle-after``) never reached it, and one it stopped reading (``half-open``)
    reached it without the body a join goes by. The request in front is the one at the
    same position on the connection (a tap relays a connection's requests in order), or
    for a close, any after it. By fault."""
    acts: dict[tuple[str, int], list[tuple[tuple[str, str], int, float, bool]]] = defaultdict(list)
    for key, recs in records.items():
        for rec in recs:
            conn, seq = rec.get("conn"), rec.get("seq")
            if isinstance(conn, int) and isinstance(seq, int):
                closing = rec.get("fault") in CLOSING_FAULTS
                acts[(key[0], conn)].append((key, seq, float(rec["t"]), closing))
    if not acts:
        return {}
    ids = {f"{tap}/{conn}": (tap, conn) for tap, conn in acts}
    fronts = {(f.tap, f.conn): back for back, f in ctx.conns_in_front(set(acts)).items()}
    found: dict[tuple[str, str], list[_Found]] = defaultdict(list)
    for r in ctx.interesting:
        back = fronts.get((r.tap, r.conn))
        if back is None or r.id in covered or not r.method:
            continue
        for key, seq, t, closing in acts[ids[back]]:
            slack = ctx.slack(r.tap, key[0])
            after = r.seq > seq and r.start >= t - slack
            same = r.seq == seq and r.start <= t + slack
            if closing and after:
                found[key].append(_Found(r, back, "after_close"))
                break
            if not closing and same:
                found[key].append(_Found(r, back, "same_position"))
                break
    return found


def _by_head(
    ctx: Context,
    records: dict[tuple[str, str], list[dict[str, Any]]],
    covered: set[str],
    groups: list[dict[str, RequestRow]],
) -> dict[tuple[str, str], list[_Found]]:
    """The copies at taps in front of a request the faulting tap read only the head of
    (``half-open``), where a hop between the taps leaves no shared connection: no body to
    join them by, so the latest unjoined request with the same method and target that a
    tap in front began at most ``JOIN_SLACK`` before it."""
    rows = {r.id: r for r in ctx.interesting}
    joined = {r.id for g in groups if len(g) > 1 for r in g.values()}  # to another tap
    rank = {tap: i for i, tap in enumerate(ctx.order)}
    by_head: dict[tuple[str, str], list[RequestRow]] = defaultdict(list)
    for r in ctx.interesting:
        if r.id not in covered and r.id not in joined:
            by_head[(r.method, r.target)].append(r)
    taken: set[str] = set()
    found: dict[tuple[str, str], list[_Found]] = defaultdict(list)
    for key, recs in records.items():
        for rec in recs:
            back = rows.get(f"{key[0]}/{rec.get('conn')}/{rec.get('seq')}")
            if back is None or back.request_complete or back.id in joined:
                continue
            fronts: dict[str, RequestRow] = {}
            for r in by_head.get((back.method, back.target), []):
                slack = ctx.slack(r.tap, back.tap)
                if (
                    rank.get(r.tap, 0) < rank.get(back.tap, 0)
                    and r.id not in taken
                    and back.start - JOIN_SLACK <= r.start <= back.start + slack
                    and (r.tap not in fronts or r.start > fronts[r.tap].start)
                ):
                    fronts[r.tap] = r
            taken.update(r.id for r in fronts.values())
            found[key] += [_Found(r, back.id, "by_head") for r in fronts.values()]
    return found


def _injected_note(
    key: tuple[str, str],
    records: list[dict[str, Any]],
    rows: dict[str, RequestRow],
    read_as: set[str],
    later: list[_Found],
) -> dict[str, Any]:
    tap, spec = key
    ids = sorted(
        {f"{tap}/{r['conn']}/{r['seq']}" for r in records if isinstance(r.get("seq"), int)}
        | {hit.row.id for hit in later},
        key=lambda rid: (
            rid.split("/")[0],
            *(int(x) if x.isdigit() else 0 for x in rid.split("/")[-2:]),
        ),
    )
    evidence = []
    for rec in records[:MAX_QUOTED]:
        seq = rec.get("seq")
        rid = f"{tap}/{rec.get('conn')}" + (f"/{seq}" if isinstance(seq, int) else "")
        row = rows.get(rid)
        line = f"{_ts(rec['t'])} {rid}" + (f" {row.method} {row.target}" if row else "")
        line += f": {rec.get('detail') or spec}"
        if row is not None:
            line += f"; the client got {_outcome_quote(row)}"
        evidence.append(line)
    if len(records) > MAX_QUOTED:
        evidence.append(f"... and {len(records) - MAX_QUOTED} more injection(s)")
    for r, there, found in later[:MAX_QUOTED]:
        link = f" ({r.tap}/{r.conn} is {there}, one TCP connection)"
        how = {
            "after_close": f"written at tap {r.tap} after tap {tap} had closed the connection"
            + link,
            "same_position": f"the same request at tap {r.tap}, request {r.seq} on both" + link,
            "by_head": f"the same request at tap {r.tap} as {there}, matched by its head",
        }[found]
        evidence.append(
            f"{_ts(r.start)} {r.id} {r.method} {r.target}: {how}; the client got "
            f"{_outcome_quote(r)}"
        )
    if len(later) > MAX_QUOTED:
        evidence.append(f"... and {len(later) - MAX_QUOTED} more such request(s)")
    summary = (
        f"Tap {tap} injected `{spec}` itself (opt-in --fault), {len(records)} time(s)"
        + (f", on {len(ids)} request(s)" if ids else "")
        + ": not a fault of the client, a proxy or the engine."
    )
    if read_as:
        summary += f" Without its fault records it would read as: {', '.join(sorted(read_as))}."
    why = f"tap {tap} injected it on purpose (its fault records)"
    return {
        "party": "none",
        "kind": "injected_fault",
        "summary": summary,
        "requests": ids,
        "connections": sorted({f"{tap}/{r.get('conn')}" for r in records}),
        "evidence": evidence,
        "ruled_out": [{"party": p, "why": why} for p in ("client", "proxy", "engine")],
        "confidence": "high",
        "settle": None,
        "note": True,
        "t": min(float(r["t"]) for r in records),
    }


def _lagged(ctx: Context, f: dict[str, Any]) -> dict[str, Any] | None:
    """The worst window in which a tap of the finding was itself starved (its event loop
    blocked past ``LAG_LIMIT``) around the finding's time."""
    if not ctx.e.lags or f["t"] is None:
        return None
    taps = {c.split("/", 1)[0] for c in f["connections"]}
    t = float(f["t"])
    around = [
        lag
        for lag in ctx.e.lags
        if lag["tap"] in taps
        and lag["max_lag"] >= LAG_LIMIT
        and lag["start"] - 1.0 <= t + LAG_REACH
        and t - 1.0 <= lag["end"]
    ]
    return max(around, key=lambda lag: lag["max_lag"], default=None)


def _discount_starved(ctx: Context, findings: list[dict[str, Any]]) -> None:
    """A timing heuristic at a tap that was itself starved cannot testify about
    milliseconds: the finding becomes a note, with the lag quoted."""
    for f in findings:
        if f["kind"] not in TIMING_KINDS or f["note"]:
            continue
        lag = _lagged(ctx, f)
        if lag is None:
            continue
        f["note"] = True
        f["confidence"] = "low"
        f["evidence"].append(
            f"tap {lag['tap']} itself ran late around then: its event loop was blocked up to "
            f"{lag['max_lag'] * 1000:.0f} ms ({_ts(lag['blocked'][0])} to "
            f"{_ts(lag['blocked'][1])}): its timings cannot testify about tens of ms"
        )
        f["summary"] += " (The tap itself was starved then: a note, not a verdict.)"


def _grouped(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Identical findings (the same kind, party, confidence and summary: the same fault
    met by several requests) as one, naming all their requests; its evidence keeps the
    first ``GROUP_EVIDENCE`` items and says how many findings it stands for."""
    out: list[dict[str, Any]] = []
    first: dict[tuple[Any, ...], dict[str, Any]] = {}
    for f in findings:
        key = (f["kind"], f["party"], f["confidence"], f["note"], f["summary"])
        group = first.get(key)
        if group is None:
            first[key] = f
            out.append(f)
            continue
        group["requests"] += [q for q in f["requests"] if q not in group["requests"]]
        group["connections"] = sorted({*group["connections"], *f["connections"]})
        group["grouped"] = group.get("grouped", 1) + 1
        if len(group["evidence"]) < GROUP_EVIDENCE:
            group["evidence"] += f["evidence"][: GROUP_EVIDENCE - len(group["evidence"])]
        if f["t"] is not None and (group["t"] is None or f["t"] < group["t"]):
            group["t"] = f["t"]
    return out


def _topology(ctx: Context) -> dict[str, Any]:
    """The chain of hops the evidence shows, client side first, and why: what each
    tap's upstream is (declared, fingerprinted, or an engine URL's host), and whether two
    adjacent taps share their TCP connections (no hop between) or not (a hop, "?")."""
    taps = ctx.order or sorted(ctx.e.taps)
    if not taps:
        return {}
    why: list[str] = []
    first = taps[0]
    if first in ctx.e.client_facing:
        parts = ["client", first]
        why.append(f"tap {first} is client-facing (--client-facing)")
    else:
        parts = ["client", "?", first]
        why.append(f"nothing says the client connects to tap {first} directly (--client-facing)")
    locals_: dict[str, set[str]] = defaultdict(set)
    peers: dict[str, set[str]] = defaultdict(set)
    for c in ctx.e.connections:
        if c.upstream_local and len(locals_[c.tap]) < 65536:
            locals_[c.tap].add(_addr_key(c.upstream_local))
        if len(peers[c.tap]) < 65536:
            peers[c.tap].add(_addr_key(c.peer))
    for a, b in itertools.pairwise(taps):
        if locals_[a] & peers[b]:
            why.append(f"tap {a}'s upstream connections are tap {b}'s client connections")
        else:
            parts.append("?")
            why.append(f"tap {a}'s upstream connections were not seen at tap {b}: a hop between")
        parts.append(b)
    last = taps[-1]
    topo = ctx.e.taps.get(last, {}).get("topology") or {}
    server = topo.get("server") or {}
    role = ctx.role(last)
    engines = len(
        {_base(str(x["url"])) for x in ctx.e.engine if x.get("profile") in ENGINE_PROFILES}
    )
    if role == "router":
        parts.append("router")
        if engines:
            parts.append(f"{engines} engine{'s' if engines != 1 else ''}")
    elif role == "engine":
        kind = server.get("kind")
        parts.append(f"engine ({kind})" if kind else "engine")
    elif role == "proxy":
        parts += ["proxy", "?"]
    elif ctx.tap_serving(last):
        parts.append("serving stack")
        why.append(f"tap {last}'s upstream is the host of an --engine-metrics/--health URL")
    else:
        parts.append("?")
    for tap in taps:
        t = ctx.e.taps.get(tap, {}).get("topology") or {}
        if t.get("upstream_role"):
            basis = t.get("basis", "unknown")
            said = "; ".join(t.get("evidence") or [])
            why.append(
                f"tap {tap}'s upstream: {t['upstream_role']} ({basis})"
                + (f": {said}" if said else "")
            )
    return {"chain": " → ".join(parts), "taps": taps, "why": why}


def find(e: Evidence) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """All findings (sorted, numbered) and the verdict."""
    ctx = Context(e)
    e.tap_pairs = ctx.tap_pairs()
    e.topology = _topology(ctx)
    findings: list[dict[str, Any]] = []
    for analyzer in ANALYZERS:
        findings += analyzer(ctx)
    findings = _join_taps(ctx, findings)
    findings = _injected_by_the_tap(ctx, findings)
    _discount_starved(ctx, findings)
    findings = _grouped(findings)
    # what the user saw hang: requests that never completed (or stalled), and the marks
    hung = {r.id for r in ctx.interesting if r.termination != "complete" or r.stalls}
    # requests whose silence a finding explains with high confidence (a wedge): a hop's
    # timeout that met it comes second; a silence the figures cannot explain does not
    # outrank the status or cut the hop produced itself
    silences = {
        q
        for f in findings
        if not f["note"] and f["confidence"] == "high" and f.get("after_silence") is None
        for q in f["requests"]
    }
    findings.sort(
        key=lambda f: (
            f["note"],
            f["kind"] in NO_REQUEST_KINDS,
            not (f["kind"] in MARK_KINDS or hung.intersection(f["requests"])),
            # a hop's timeout that met a silence behind it yields to that silence's finding
            f.get("after_silence") in silences,
            f["kind"] in TIMING_KINDS,  # heuristics yield to hard evidence
            CONFIDENCE[f["confidence"]],
            f["party"] == "unknown",
            f["t"] if f["t"] is not None else 0.0,
            f["kind"],
        )
    )
    for i, f in enumerate(findings, 1):
        f["id"] = f"F{i}"
    faults = [f for f in findings if not f["note"]]
    if not faults:
        notes = [f for f in findings if f["note"]]
        verdict = {
            "party": "none",
            "kind": "healthy",
            "summary": "No fault found in the captures."
            + (
                f" {len(notes)} note(s): {', '.join(sorted({n['kind'] for n in notes}))}."
                if notes
                else ""
            ),
            "finding": None,
            "confidence": "high" if ctx.rows else "low",
        }
    else:
        top = faults[0]
        verdict = {
            "party": top["party"],
            "kind": top["kind"],
            "summary": top["summary"],
            "finding": top["id"],
            "confidence": top["confidence"],
            "ruled_out": top["ruled_out"],
        }
    return findings, verdict
