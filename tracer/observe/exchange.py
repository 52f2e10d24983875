"""The exchange tracker: the lifecycle of a connection's HTTP exchanges, whatever tap
follows them, so that both observers write the same events for the same exchange.

``ExchangeTracker`` owns what does not depend on how an exchange is seen: numbering,
the requests whose response has not ended (``pending``), the records of request and
response heads and ends (each stamped ``t`` = ``m`` + the wall offset, the tap, the
connection), the tap's own answer, body batching, stalls and activity. Two thin
translators drive it: ``wire.ConnectionObserver`` (bytes, through h11) and the
connections of ``flows.FlowObserver`` (mitmproxy's facts); each keeps what is its own
(parsing, protocol switches, HTTP/2 streams, mitmproxy's wording).

Body batching: a record per read would cost more than the read itself on a paced
stream (one read per token), so ``body`` records cover ``BODY_BATCH_SECONDS`` or
``BODY_BATCH_READS`` reads at most. A batch keeps each read's arrival time, size and
data chunks, its SSE entries and, when needed, its bytes; the figures that depend on
all the reads (bytes, gaps, offsets from the record's ``m``) are made when it is
written. A byte-reading tap adds a read at a time with its SSE events found
(``add_read``); mitmproxy's pieces come in lists and their SSE is read when the batch is
written (``add_pieces``, the subclass's ``batch_sse``).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from itertools import repeat
from math import floor
from typing import Any, Final, Literal

from .. import events as ev
from ..capture.bodies import RequestBody, encode_body
from ..protocol.sse import SseEvent
from .exchange_state import (
    RequestHeadFacts,
    ResponseState,
    StallDirection,
    count_sse,
    stall_direction,
)

Emit = Callable[[ev.Event], None]
Bodies = Literal["none", "requests", "all"]
Close = Literal["fin", "reset"]

MAX_BODY_KEEP: Final = 16 * 1024 * 1024
BODY_BATCH_SECONDS: Final = 0.1  # a body record covers the reads of at most this long
BODY_BATCH_READS: Final = 256  # ... and at most this many reads
# The pieces a batch of mitmproxy's keeps until it is written (SSE, bodies=all) stay under
# about MAX_KEPT_BYTES: pieces under BIG_PIECE are bounded by BODY_BATCH_READS (256 x 4
# KiB); a bigger one makes the batch due once the batch would pass the bound.
MAX_KEPT_BYTES: Final = 1 << 20
BIG_PIECE: Final = 4096


def _round6(seconds: float) -> float:
    """``round(seconds, 6)`` for the offsets of a body record, the cheaper way (the
    same for these non-negative times)."""
    return floor(seconds * 1e6 + 0.5) / 1e6


def tick_interval(stall_after: float) -> float:
    """How often a tap looks for stalls and old body batches: often enough for a stall
    to be seen within a quarter of ``stall_after``, never busier than 20 times a second."""
    return max(0.05, min(0.25, stall_after / 4))


class ExchangeTracker[R: ResponseState[Any]]:
    """The exchanges of one client connection: numbered in order, ``pending`` until their
    response ends, each of their records stamped and emitted here.

    Subclasses add what their tap sees: ``ended`` runs after each response end,
    ``batch_sse`` gives a batch's SSE entries when it is written (default: those added
    with the reads), ``flush_body`` may be extended. This module is compiled with mypyc
    (``tracer/compiled.py``): a subclass must be in a compiled module too (``HOT``), or
    compiled callers would not see its overrides.
    """

    def __init__(
        self,
        *,
        tap: str,
        conn: int,
        emit: Emit,
        wall: float,
        opened_m: float,
        bodies: str = "requests",
        redact_fields: frozenset[str] = frozenset(),
    ) -> None:
        self.tap = tap
        self.conn = conn
        self.emit = emit
        self.wall = wall
        self.bodies = bodies
        self.keep_data = bodies == "all"  # response bytes go into body records
        self.redact_fields = redact_fields  # --redact-json-field, in kept JSON bodies
        self.seq = 0
        self.pending: deque[R] = deque()  # requests whose response has not ended, in order
        self.stalls = 0  # stalls started (``start_stall``): while 0, bytes end none
        self.last_end_m = opened_m
        self.last_activity_m = opened_m

    def record(self, kind: Callable[..., ev.Event], m: float, **fields: Any) -> None:
        """Emit a record of this connection at ``m``."""
        self.emit(kind(t=m + self.wall, m=m, tap=self.tap, conn=self.conn, **fields))

    # ---- requests -----------------------------------------------------------------------

    def begin(self, st: R) -> R:
        """Number an exchange and put it in flight (no record: see ``request_head``)."""
        self.seq += 1
        st.seq = self.seq
        self.pending.append(st)
        return st

    def request_head(
        self,
        st: R,
        *,
        method: str,
        target: str,
        version: str,
        headers: list[list[str]],
        facts: RequestHeadFacts,
    ) -> None:
        """A request begins at ``st.head_m``: its ``request`` record. ``idle_before`` is the
        time since the previous response ended (or the connection opened)."""
        pipelined = bool(self.pending)  # sent before the previous response ended
        self.begin(st)
        m = st.head_m
        idle = 0.0 if pipelined else max(0.0, m - self.last_end_m)
        self.emit(  # (as ``record`` would: the hot records are made here, without a **splat)
            ev.RequestHead(
                t=m + self.wall,
                m=m,
                tap=self.tap,
                conn=self.conn,
                seq=st.seq,
                idle_before=round(idle, 6),
                method=method,
                target=target,
                version=version,
                headers=headers,
                request_id=facts.request_id,
                content_length=facts.content_length,
                chunked=facts.chunked,
                expect_continue=facts.expect_continue,
                pipelined=pipelined,
            )
        )

    def request_end(self, st: R, m: float, body: RequestBody, *, complete: bool) -> None:
        st.request_done = True
        fields = body.record(
            keep=self.bodies != "none", json_body=st.json_body, redact=self.redact_fields
        )
        self.record(ev.RequestEnd, m, seq=st.seq, complete=complete, body_bytes=body.size, **fields)

    # ---- responses ----------------------------------------------------------------------

    def response_head(
        self,
        st: R,
        m: float,
        *,
        status: int,
        reason: str,
        version: str,
        headers: list[list[str]],
        sse: bool,
        content_length: int | None,
        chunked: bool,
        keep_alive: bool,
        by_tracer: bool = False,
    ) -> None:
        """The upstream's response head (or, ``by_tracer``, one an addon answered with)."""
        st.status = status
        st.resp_head_m = st.last_data_m = m
        self.emit(
            ev.ResponseHead(
                t=m + self.wall,
                m=m,
                tap=self.tap,
                conn=self.conn,
                seq=st.seq,
                status=status,
                reason=reason,
                version=version,
                headers=headers,
                ttfb=round(m - st.head_m, 6),
                sse=sse,
                content_length=content_length,
                chunked=chunked,
                keep_alive=keep_alive,
                by_tracer=by_tracer,
            )
        )

    def tracer_answer(self, st: R, m: float, status: int, reason: str, detail: str | None) -> None:
        """A response the tap wrote itself (the upstream unreachable, a bad request): its
        head and its end (``tracer_response``); ``detail`` says why."""
        st.status = status
        self.record(
            ev.ResponseHead,
            m,
            seq=st.seq,
            status=status,
            reason=reason,
            version="1.1",
            headers=[],
            ttfb=round(m - st.head_m, 6),
            keep_alive=False,
            by_tracer=True,
        )
        self.end_response(st, m, "tracer_response", detail=detail)

    def add_read(
        self,
        st: R,
        m: float,
        size: int,
        chunks: int,
        sse: list[SseEvent] | None,
        raw: list[bytes] | None,
    ) -> None:
        """One read of body bytes at ``m``: ``size`` body bytes, ``chunks`` data chunks
        begun, the SSE events it completed (counted here) and its bytes when kept."""
        dt = self._batch_read(st, m, size, chunks)
        if sse:
            entries = st.sse_entries
            for event in sse:  # (each entry as ``[dt, *event.as_record()]``)
                reason = event.finish_reason
                if reason is None:
                    entries.append([dt, event.size, event.kind])
                else:
                    entries.append([dt, event.size, event.kind, reason])
                count_sse(st, event, m)
        if raw and st.kept is not None:
            st.kept.extend(raw)

    def add_content_read(self, st: R, m: float, size: int) -> None:
        """``add_read`` of a read that is one data chunk holding one plain content event
        of ``size`` bytes (``SseSplitter.whole_content``), without the event built: the
        same entries and counts (``count_sse`` of a content event)."""
        dt = self._batch_read(st, m, size, 1)  # (first: writing the batch renews the list)
        st.sse_entries.append([dt, size, "content"])
        st.events += 1
        if st.first_token_m is None:
            st.first_token_m = m

    def _batch_read(self, st: R, m: float, size: int, chunks: int) -> float:
        """Add a read to the batch (the batch written first when it is due); returns the
        read's offset from the batch's first, as the record has it."""
        times = st.times
        if times and (m - times[0] >= BODY_BATCH_SECONDS or len(times) >= BODY_BATCH_READS):
            self.flush_body(st)
        times.append(m)
        st.sizes.append(size)
        st.chunks.append(chunks)
        return _round6(m - times[0])

    def add_pieces(self, st: R, times: list[float], pieces: list[bytes | int]) -> None:
        """Body pieces (or their sizes, when not kept) with their arrival times. A batch is
        due when a piece comes ``BODY_BATCH_SECONDS`` after its first, after
        ``BODY_BATCH_READS`` pieces, or when a big piece would take the bytes it keeps over
        ``MAX_KEPT_BYTES``."""
        batch_times, sizes, kept = st.times, st.sizes, st.kept
        for m, piece in zip(times, pieces, strict=True):
            size = piece if isinstance(piece, int) else len(piece)
            if batch_times and (
                m - batch_times[0] >= BODY_BATCH_SECONDS
                or len(batch_times) >= BODY_BATCH_READS
                or (
                    size >= BIG_PIECE and kept is not None and st.kept_bytes + size > MAX_KEPT_BYTES
                )
            ):
                self.flush_body(st)
            batch_times.append(m)
            sizes.append(size)
            if kept is not None and not isinstance(piece, int):
                kept.append(piece)
                st.kept_bytes += size

    def batch_sse(self, st: R, dts: list[float]) -> list[Any] | None:
        """The batch's ``sse`` entries (``dts``: each read's offset from the first)."""
        return st.sse_entries or None

    def flush_body(self, st: R) -> None:
        """Write the batch as one ``body`` record; its reads count from now (bytes, gaps,
        the last sign of life)."""
        times = st.times
        n = len(times)
        if not n:
            return
        first, last = times[0], times[-1]
        sizes, chunks = st.sizes, st.chunks
        # in one pass (plain loops: compiled, they are what costs least): each read's
        # offset from the first; the longest gap between two
        # reads within the batch (max() of the differences: the first of them, then
        # any greater one); the bytes and the data chunks
        dts = [0.0] * n
        gap = 0.0
        total = started = 0
        before = first
        for i in range(n):
            m = times[i]
            dts[i] = _round6(m - first)
            if i == 1 or (i and m - before > gap):
                gap = m - before
            before = m
        for size in sizes:
            total += size
        for count in chunks:
            started += count
        prev = st.last_data_m
        if prev is not None and first - prev > gap:
            gap = first - prev
        if gap > st.max_gap:
            st.max_gap = gap
        st.last_data_m = last
        st.resp_bytes += total
        if last > self.last_activity_m:
            self.last_activity_m = last
        sse = self.batch_sse(st, dts)
        data = encoding = None
        if st.kept and self.keep_data:
            data, encoding = encode_body(b"".join(st.kept))
        if len(sizes) != n or (chunks and len(chunks) != n):  # (never: zip's error, as was)
            reads = list(
                zip(dts, sizes, chunks, strict=True) if chunks else zip(dts, sizes, repeat(0))
            )
        elif chunks:
            reads = [(dts[i], sizes[i], chunks[i]) for i in range(n)]
        else:
            reads = [(dts[i], sizes[i], 0) for i in range(n)]
        self.emit(
            ev.BodyData(
                t=first + self.wall,
                m=first,
                tap=self.tap,
                conn=self.conn,
                seq=st.seq,
                size=total,
                chunks=started,
                reads=reads,
                sse=sse,
                data=data,
                data_encoding=encoding,
            )
        )
        st.clear_batch()

    def flush(self, m: float) -> None:
        """Write the batches old enough by ``m``, or of an exchange stalled (called
        periodically: a stream that pauses still gets its reads written)."""
        for st in self.pending:
            times = st.times
            if times and (m - times[0] >= BODY_BATCH_SECONDS or st.stall_start_m is not None):
                self.flush_body(st)

    def body_done(self, st: R, m: float) -> None:
        """The upstream's end of the body at ``m``: the batch written, the silence before
        the end counted as a gap."""
        self.flush_body(st)
        last = st.last_data_m
        if last is not None and m - last > st.max_gap:
            st.max_gap = m - last

    def end_response(
        self,
        st: R,
        m: float,
        termination: ev.Termination,
        *,
        close: Close | None = None,
        detail: str | None = None,
    ) -> None:
        """The response ends (once): what is batched written, its stall ended, its
        ``response_end`` record."""
        if st.ended:
            return
        st.ended = True
        self.flush_body(st)
        pending = self.pending
        oldest = bool(pending) and pending[0] is st
        if oldest:
            pending.popleft()
        else:
            with contextlib.suppress(ValueError):
                pending.remove(st)
        self.end_stall(st, m)
        self.last_end_m = m
        head = st.head_m
        self.emit(
            ev.ResponseEnd(
                t=m + self.wall,
                m=m,
                tap=self.tap,
                conn=self.conn,
                seq=st.seq,
                termination=termination,
                status=st.status,
                body_bytes=st.resp_bytes,
                duration=round(m - head, 6),
                ttfb=None if st.resp_head_m is None else round(st.resp_head_m - head, 6),
                first_token=None if st.first_token_m is None else round(st.first_token_m - head, 6),
                events=st.events,
                comments=st.comments,
                done=st.done,
                finish_reason=st.finish_reason,
                usage=st.usage,
                error=st.error,
                max_gap=round(st.max_gap, 6) if st.resp_head_m is not None else None,
                close=close,
                mid_event=bool(termination != "complete" and st.sse is not None and st.sse.pending),
                detail=detail,
            )
        )
        self.ended(st, m, oldest=oldest)

    def ended(self, st: R, m: float, *, oldest: bool) -> None:
        """After a response's end (``oldest``: it was the first pending)."""

    # ---- stalls -------------------------------------------------------------------------

    def activity(self, m: float) -> None:
        """Bytes moved at ``m``: the stall of the request the connection waits for (the
        oldest) ends."""
        if m > self.last_activity_m:
            self.last_activity_m = m
        if self.stalls and self.pending:
            st = self.pending[0]
            if st.stall_start_m is not None:
                self.end_stall(st, m)

    def tick(
        self, m: float, *, stall_after: float, client_blocked: bool, unsent: int | None
    ) -> None:
        """Start a stall for the oldest request when nothing has moved on the connection for
        ``stall_after`` (one exchange at a time is answered: HTTP/1)."""
        if not self.pending:
            return
        st = self.pending[0]
        since = self.last_activity_m
        if st.times and st.times[-1] > since:  # reads batched after the last activity
            since = st.times[-1]
        if st.stall_start_m is not None or m - since < stall_after:
            return
        direction = stall_direction(st, client_blocked=client_blocked, unsent=unsent)
        self.start_stall(st, m, since, direction, unsent)

    def start_stall(
        self, st: R, m: float, since: float, direction: StallDirection, unsent: int | None
    ) -> None:
        """The ``stall`` start record: ``st`` silent since ``since``."""
        self.flush_body(st)  # the last bytes before the stall go on record first
        self.stalls += 1
        st.stall_start_m = since
        st.stall_direction = direction
        self.record(
            ev.Stall,
            m,
            seq=st.seq,
            phase="start",
            direction=direction,
            silent_for=round(m - since, 6),
            unsent_bytes=unsent,
        )

    def end_stall(self, st: R, m: float) -> None:
        """The ``stall`` end record when ``st`` was stalled."""
        since, direction = st.stall_start_m, st.stall_direction
        if since is None or direction is None:
            return
        st.stall_start_m = st.stall_direction = None
        self.record(
            ev.Stall,
            m,
            seq=st.seq,
            phase="end",
            direction=direction,
            silent_for=round(m - since, 6),
        )
