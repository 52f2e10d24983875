"""TCP stream reassembly for passive captures: segments in, in-order bytes out. Sans-I/O.

Theory of operation
-------------------
A capture shows each TCP segment once as it crossed the wire (or several times:
retransmissions), in capture order, which is not always sequence order. The observer
of a connection needs what each endpoint's application could read: each byte once, in
order, at the time it became readable. ``HalfStream`` does that for one direction:

* sequence numbers become *offsets* from the stream's start (the byte after the SYN;
  without a captured SYN, the first segment seen: ``start_seen`` False), unwrapped
  around 2**32 against the next offset expected, so a long stream never wraps;
* a segment at the next offset is delivered at once (``Data``, with the time of the
  packet); one beyond it is held until the hole before it fills, and then everything
  contiguous is delivered with the time of the packet that filled the hole (when the
  receiving application could first read it);
* bytes seen before (retransmissions, overlapping segments) are dropped: the first copy
  of each byte wins, and the copies are counted (``duplicate``);
* a hole that cannot fill is a ``Gap`` of N bytes and delivery goes on after it: when
  the peer acknowledges bytes the capture never saw (the capture lost them: they will not
  come again), when the held bytes reach the bound (``max_buffer`` bytes or
  ``max_pieces`` pieces: memory per stream is bounded), when the stream ends (a FIN, a
  reset or the end of the capture with bytes still held), or at once for the bytes a
  packet carried beyond what the capture kept (``snaplen``);
* a FIN is delivered in order, after every byte before it (``Fin``); a RST at once
  (``Reset``), after whatever its sender's stream still held (as gaps).

``TcpConnection`` pairs the two directions of one connection (the SYN's sender is the
``client``; acknowledgments of one direction are read against the other's stream), and
``TcpTable`` demultiplexes by 4-tuple: it opens a connection at its first segment
(``Opened``), closes it when both FINs are through or at a reset (``Closed``), starts a
new one when a SYN with another initial sequence reuses a 4-tuple, and ignores the
stragglers of a closed connection (its last ACKs) for ``linger`` seconds.

Every result is a typed record (``Item``) naming its connection and its sender.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, NamedTuple

FIN = 0x01
SYN = 0x02
RST = 0x04
PSH = 0x08
ACK = 0x10

MAX_BUFFER = 4 * 1024 * 1024  # out-of-order bytes held per direction
MAX_PIECES = 1024  # out-of-order pieces held per direction
LINGER = 60.0  # seconds a closed connection's stragglers are ignored
MAX_CONNECTIONS = 100_000  # connections followed at once (the least active is closed)
_MOD = 1 << 32
_HALF = 1 << 31
_SANE = 1 << 30  # an acknowledgment further ahead than this is not believed

GapCause = Literal["not_captured", "buffer_full", "never_filled", "snaplen"]
CloseWhy = Literal["fin", "reset", "reused", "evicted", "end"]


class Endpoint(NamedTuple):
    """One end of a connection; ``str()`` writes it as the taps do (``[v6]:port``)."""

    host: str
    port: int

    def __str__(self) -> str:
        host = self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


class Segment(NamedTuple):
    """One captured TCP segment, as the reassembler needs it."""

    t: float  # capture time
    seq: int  # sequence number (of the SYN itself on a SYN)
    flags: int  # FIN | SYN | RST | PSH | ACK ...
    payload: bytes = b""
    ack: int | None = None  # acknowledgment number (None: the ACK flag is not set)
    window: int | None = None  # advertised window as sent (not scaled)
    wire_len: int | None = None  # payload bytes it carried, when the capture kept fewer


# ---- results ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Opened:
    """A connection's first segment was seen (``connection.start_seen``: it was a SYN)."""

    t: float
    conn: int
    connection: TcpConnection


@dataclass(frozen=True, slots=True)
class Syn:
    """A SYN (``ack`` False) or SYN-ACK: the sender's initial sequence number."""

    t: float
    conn: int
    src: Endpoint
    isn: int
    ack: bool


@dataclass(frozen=True, slots=True)
class Data:
    """In-order bytes of one direction from ``offset`` on, readable from time ``t``."""

    t: float
    conn: int
    src: Endpoint
    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Gap:
    """``size`` bytes of one direction at ``offset`` that the capture does not have;
    delivery goes on after them."""

    t: float
    conn: int
    src: Endpoint
    offset: int
    size: int
    cause: GapCause


@dataclass(frozen=True, slots=True)
class Fin:
    """The sender's FIN, after every byte before it (``offset``: the stream's length)."""

    t: float
    conn: int
    src: Endpoint
    offset: int


@dataclass(frozen=True, slots=True)
class Reset:
    """The sender reset the connection (``offset``: its bytes delivered by then)."""

    t: float
    conn: int
    src: Endpoint
    offset: int


@dataclass(frozen=True, slots=True)
class Closed:
    """The connection is over: both FINs through, a reset, a new connection on its
    4-tuple, evicted at the table's bound, or the capture's end. Nothing follows."""

    t: float
    conn: int
    why: CloseWhy


Item = Opened | Syn | Data | Gap | Fin | Reset | Closed


# ---- one direction ---------------------------------------------------------------------


class _Piece:
    """Bytes held beyond a hole: ``data`` None for bytes the capture cut (snaplen)."""

    __slots__ = ("data", "end", "start")

    def __init__(self, start: int, end: int, data: bytes | None) -> None:
        self.start = start
        self.end = end
        self.data = data


class HalfStream:
    """One direction of one connection: its sender's bytes, reassembled."""

    def __init__(
        self,
        conn: int,
        src: Endpoint,
        *,
        max_buffer: int = MAX_BUFFER,
        max_pieces: int = MAX_PIECES,
    ) -> None:
        self.conn = conn
        self.src = src
        self.max_buffer = max_buffer
        self.max_pieces = max_pieces
        self.base: int | None = None  # sequence number of offset 0
        self.isn: int | None = None
        self.start_seen = False  # its SYN was captured
        self.next = 0  # offset of the next byte to deliver
        self.high = 0  # end of the furthest byte seen (sent, as far as the capture knows)
        self._pieces: list[_Piece] = []
        self._starts: list[int] = []
        self.held = 0  # bytes held in pieces
        self.fin_at: int | None = None  # offset of the FIN (the stream's length)
        self.fin_done = False
        self.reset_seen = False
        self.acked: int | None = None  # furthest offset the peer acknowledged
        self.window: int | None = None  # the window this sender advertised last
        # counts
        self.delivered = 0
        self.duplicate = 0  # bytes seen again (retransmitted, overlapping) and dropped
        self.gaps = 0
        self.gap_bytes = 0
        self.outside = 0  # bytes before the stream's start or after its FIN: dropped

    # ---- input ----------------------------------------------------------------------

    def syn(self, t: float, isn: int, *, ack: bool) -> list[Item]:
        """The sender's SYN (or SYN-ACK): its stream starts after ``isn``."""
        if self.base is not None:
            return []  # retransmitted, or after bytes already seen: the first start wins
        self.base = (isn + 1) % _MOD
        self.isn = isn
        self.start_seen = True
        return [Syn(t, self.conn, self.src, isn, ack)]

    def segment(
        self, t: float, seq: int, payload: bytes, *, fin: bool = False, wire_len: int | None = None
    ) -> list[Item]:
        """Bytes (and maybe the FIN) at sequence number ``seq`` (after the SYN's)."""
        if self.reset_seen or self.fin_done:  # a copy of what came before, or bytes after
            if self.fin_done:  # (counted as the bytes it carried, as everywhere)
                self.duplicate += max(len(payload), wire_len or 0)
            else:
                self.outside += max(len(payload), wire_len or 0)
            return []
        if self.base is None:
            self.base = seq % _MOD  # its start was not captured: begin here
        start = self._offset(seq)
        length = max(len(payload), wire_len or 0)
        end = start + length
        if fin and self.fin_at is None and end >= self.next:
            self.fin_at = end
            self._drop_after(end)
        if (  # the usual case: the next bytes, whole, nothing held
            start == self.next
            and length
            and length == len(payload)
            and not self._pieces
            and (self.fin_at is None or end <= self.fin_at)
        ):
            self.next, self.high = end, max(self.high, end)
            self.delivered += length
            out: list[Item] = [Data(t, self.conn, self.src, start, payload)]
            self._maybe_fin(t, out)
            return out
        if length:
            self.high = max(self.high, end)
            self._add(start, end, payload)
        out = self._deliver(t)
        self._bound(t, out)
        self._maybe_fin(t, out)
        return out

    def acknowledged(self, t: float, ack: int) -> list[Item]:
        """The peer acknowledged up to ``ack``: a hole it acknowledged was received, so
        the capture lost it and it will not come again: a gap now."""
        if self.base is None or self.reset_seen:
            return []
        off = self._offset(ack)
        if off < 0 or off - self.next > _SANE:
            return []  # before the stream's start as seen, or not believable
        if self.fin_at is not None:
            off = min(off, self.fin_at)  # (the FIN takes one sequence number)
        if self.acked is None or off > self.acked:
            self.acked = off
        out: list[Item] = []
        if off > self.next and not self.fin_done:
            while off > self.next:  # each hole up to ``off``, the held bytes between them
                first = self._pieces[0].start if self._pieces else off
                self._skip(t, min(first, off), "not_captured", out)
                out += self._deliver(t)
            self._maybe_fin(t, out)
        self.high = max(self.high, self.next)
        return out

    def reset(self, t: float) -> list[Item]:
        """The sender reset: what it still held is never coming; then ``Reset``."""
        if self.reset_seen:
            return []
        out = self.end(t, fin=False)
        self.reset_seen = True
        out.append(Reset(t, self.conn, self.src, self.next))
        return out

    def end(self, t: float, *, fin: bool = True) -> list[Item]:
        """The stream is over: each hole still open is a gap, the bytes after it are
        delivered, then the FIN if one was seen (``fin``)."""
        out: list[Item] = []
        if self.reset_seen or self.fin_done:
            return out
        while self._pieces:
            self._skip(t, self._pieces[0].start, "never_filled", out)
            out += self._deliver(t)
        if fin and self.fin_at is not None:
            if self.fin_at > self.next:
                self._skip(t, self.fin_at, "never_filled", out)
            self._maybe_fin(t, out)
        return out

    def drop_held(self) -> None:
        """Forget the bytes held beyond a hole (nobody will read them)."""
        self._pieces, self._starts, self.held = [], [], 0

    # ---- queries ----------------------------------------------------------------------

    @property
    def unacked(self) -> int | None:
        """Bytes sent (as far as the capture saw) that the peer has not acknowledged
        (None: no acknowledgment of this stream seen yet)."""
        if self.acked is None:
            return None
        return max(0, self.high - self.acked)

    @property
    def pending(self) -> int:
        """Bytes held beyond a hole."""
        return self.held

    # ---- internals --------------------------------------------------------------------

    def _offset(self, seq: int) -> int:
        """``seq`` as an offset, unwrapped around the next offset expected."""
        assert self.base is not None
        delta = (seq - self.base - self.next) % _MOD
        if delta >= _HALF:
            delta -= _MOD
        return self.next + delta

    def _add(self, start: int, end: int, payload: bytes) -> None:
        """Hold the bytes of [start, end) that are new (the first copy of a byte wins);
        bytes from len(payload) on are the ones the capture cut."""
        cut = start + len(payload)  # the capture kept [start, cut)
        lo = max(start, self.next)
        hi = end if self.fin_at is None else min(end, self.fin_at)
        if start < self.next:
            self.duplicate += min(end, self.next) - start
        if hi < end:
            self.outside += end - max(hi, lo)
        if lo >= hi:
            return
        fresh: list[tuple[int, int]] = []
        pieces, cur = self._pieces, lo
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while i < len(pieces) and pieces[i].start < hi:
            p = pieces[i]
            if p.end > cur:
                if p.start > cur:
                    fresh.append((cur, p.start))
                self.duplicate += min(p.end, hi) - max(p.start, cur)
                cur = p.end
            i += 1
        if cur < hi:
            fresh.append((cur, hi))
        for a, b in fresh:
            if a < cut:
                self._insert(_Piece(a, min(b, cut), payload[a - start : min(b, cut) - start]))
            if b > cut:
                self._insert(_Piece(max(a, cut), b, None))

    def _drop_after(self, at: int) -> None:
        """Bytes held beyond the FIN (they came before it): outside the stream."""
        while self._pieces and self._pieces[-1].end > at:
            piece = self._pieces[-1]
            cut = max(piece.start, at)
            self.outside += piece.end - cut
            if piece.data is not None:
                self.held -= piece.end - cut
                piece.data = piece.data[: cut - piece.start]
            piece.end = cut
            if piece.start == cut:
                self._pieces.pop()
                self._starts.pop()

    def _insert(self, piece: _Piece) -> None:
        i = bisect.bisect_left(self._starts, piece.start)
        self._starts.insert(i, piece.start)
        self._pieces.insert(i, piece)
        if piece.data is not None:
            self.held += piece.end - piece.start

    def _pop(self) -> _Piece:
        piece = self._pieces.pop(0)
        self._starts.pop(0)
        if piece.data is not None:
            self.held -= piece.end - piece.start
        return piece

    def _deliver(self, t: float) -> list[Item]:
        """Everything contiguous from the next offset: one ``Data`` per run of bytes."""
        out: list[Item] = []
        run: list[bytes] = []
        run_at = self.next
        while self._pieces and self._pieces[0].start <= self.next:
            piece = self._pop()
            if piece.data is None:  # bytes the capture cut: a gap, at once
                self._flush(t, run, run_at, out)
                run = []
                self._gap(t, piece.start, piece.end - piece.start, "snaplen", out)
                run_at = piece.end
            else:
                run.append(piece.data)
            self.next = piece.end
        self._flush(t, run, run_at, out)
        return out

    def _flush(self, t: float, run: list[bytes], at: int, out: list[Item]) -> None:
        if run:
            data = run[0] if len(run) == 1 else b"".join(run)
            self.delivered += len(data)
            out.append(Data(t, self.conn, self.src, at, data))

    def _bound(self, t: float, out: list[Item]) -> None:
        """Memory per stream is bounded: past it, the hole is given up on."""
        while self._pieces and (self.held > self.max_buffer or len(self._pieces) > self.max_pieces):
            self._skip(t, self._pieces[0].start, "buffer_full", out)
            out += self._deliver(t)

    def _skip(self, t: float, to: int, cause: GapCause, out: list[Item]) -> None:
        if to > self.next:
            self._gap(t, self.next, to - self.next, cause, out)
            self.next = to

    def _gap(self, t: float, at: int, size: int, cause: GapCause, out: list[Item]) -> None:
        self.gaps += 1
        self.gap_bytes += size
        out.append(Gap(t, self.conn, self.src, at, size, cause))

    def _maybe_fin(self, t: float, out: list[Item]) -> None:
        if self.fin_at is not None and not self.fin_done and self.next >= self.fin_at:
            self.fin_done = True
            out.append(Fin(t, self.conn, self.src, self.fin_at))


# ---- one connection --------------------------------------------------------------------


class TcpConnection:
    """Both directions of one connection."""

    def __init__(
        self,
        conn: int,
        first: Endpoint,
        second: Endpoint,
        *,
        max_buffer: int = MAX_BUFFER,
        max_pieces: int = MAX_PIECES,
    ) -> None:
        self.conn = conn
        self.first = first  # sender of the first segment seen
        self.second = second
        self.streams = {
            first: HalfStream(conn, first, max_buffer=max_buffer, max_pieces=max_pieces),
            second: HalfStream(conn, second, max_buffer=max_buffer, max_pieces=max_pieces),
        }
        self.client: Endpoint | None = None  # the SYN's sender, when a SYN or SYN-ACK was seen
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.closed = False
        self.ignored = False  # not followed: bytes are dropped, only its end is watched

    @property
    def start_seen(self) -> bool:
        """The handshake was captured (a SYN or SYN-ACK): who opened it is known, and
        the streams start at their start."""
        return self.client is not None

    @property
    def server(self) -> Endpoint | None:
        client = self.client
        if client is None:
            return None
        return self.second if client == self.first else self.first

    @property
    def reset_seen(self) -> bool:
        return any(s.reset_seen for s in self.streams.values())

    @property
    def done(self) -> bool:
        """Nothing more can come: a reset, or both FINs delivered."""
        return self.reset_seen or all(s.fin_done for s in self.streams.values())

    def peer(self, src: Endpoint) -> Endpoint:
        return self.second if src == self.first else self.first

    def ignore(self) -> None:
        """Nobody follows this connection: hold none of its bytes from now on; its FINs
        and resets still end it (and nothing else comes of it)."""
        self.ignored = True
        for stream in self.streams.values():
            stream.drop_held()

    def feed(self, src: Endpoint, seg: Segment) -> list[Item]:
        """One segment sent by ``src``."""
        if self.closed:
            return []
        if self.first_t is None:
            self.first_t = seg.t
        self.last_t = seg.t
        stream, peer = self.streams[src], self.streams[self.peer(src)]
        t, flags = seg.t, seg.flags
        if self.ignored:
            if flags & RST:
                stream.reset_seen = True
            elif flags & FIN:
                stream.fin_done = True
            return []
        if flags & RST:
            return stream.reset(t)
        out: list[Item] = []
        seq = seg.seq
        if flags & SYN:
            synack = bool(flags & ACK)
            if self.client is None:
                self.client = self.peer(src) if synack else src
            out += stream.syn(t, seg.seq, ack=synack)
            seq = (seg.seq + 1) % _MOD
        if seg.ack is not None:
            out += peer.acknowledged(t, seg.ack)
            stream.window = seg.window
        if seg.payload or seg.wire_len or flags & FIN:
            out += stream.segment(t, seq, seg.payload, fin=bool(flags & FIN), wire_len=seg.wire_len)
        return out

    def close(self, t: float, why: CloseWhy) -> list[Item]:
        """The connection is over: both streams flushed (client's first), then ``Closed``."""
        if self.closed:
            return []
        out: list[Item] = []
        order = [self.client, self.server] if self.client is not None else [self.first, self.second]
        for ep in order:
            if ep is not None:
                out += self.streams[ep].end(t)
        self.closed = True
        out.append(Closed(t, self.conn, why))
        return out


# ---- many connections ------------------------------------------------------------------


class TcpTable:
    """Connections by 4-tuple: segments in, items of every connection out, in order."""

    def __init__(
        self,
        *,
        max_buffer: int = MAX_BUFFER,
        max_pieces: int = MAX_PIECES,
        linger: float = LINGER,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.max_buffer = max_buffer
        self.max_pieces = max_pieces
        self.linger = linger
        self.max_connections = max_connections
        self._live: dict[tuple[Endpoint, Endpoint], TcpConnection] = {}
        self._recent: OrderedDict[tuple[Endpoint, Endpoint], float] = OrderedDict()
        self._next = 0
        self.stragglers = 0  # segments of a connection already closed, ignored
        self.orphan_resets = 0  # resets of a connection never seen, ignored

    def __len__(self) -> int:
        return len(self._live)

    def connections(self) -> list[TcpConnection]:
        return list(self._live.values())

    def feed(self, src: Endpoint, dst: Endpoint, seg: Segment) -> list[Item]:
        key = (src, dst) if src <= dst else (dst, src)
        out: list[Item] = []
        conn = self._live.get(key)
        pure_syn = seg.flags & (SYN | ACK | RST) == SYN
        if conn is not None and pure_syn:
            stream = conn.streams[src]
            if not (stream.start_seen and stream.isn == seg.seq):  # another connection
                out += self._close(key, conn, seg.t, "reused")
                conn = None
        if conn is None:
            self._forget(seg.t)
            if key in self._recent and not seg.flags & SYN:
                self.stragglers += 1
                return out
            if seg.flags & RST:
                self.orphan_resets += 1
                return out
            self._recent.pop(key, None)
            self._next += 1
            conn = TcpConnection(
                self._next, src, dst, max_buffer=self.max_buffer, max_pieces=self.max_pieces
            )
            self._live[key] = conn
            out.append(Opened(seg.t, conn.conn, conn))
            if len(self._live) > self.max_connections:
                idle_key = min(self._live, key=lambda k: self._live[k].last_t or 0.0)
                out += self._close(idle_key, self._live[idle_key], seg.t, "evicted")
        out += conn.feed(src, seg)
        if conn.done:
            out += self._close(key, conn, seg.t, "reset" if conn.reset_seen else "fin")
        return out

    def close_all(self, t: float) -> list[Item]:
        """The capture is over: every connection still open ends (``why`` ``end``)."""
        out: list[Item] = []
        for key, conn in list(self._live.items()):
            out += self._close(key, conn, t, "end")
        return out

    def _close(
        self, key: tuple[Endpoint, Endpoint], conn: TcpConnection, t: float, why: CloseWhy
    ) -> list[Item]:
        self._live.pop(key, None)
        self._recent[key] = t
        self._recent.move_to_end(key)
        return conn.close(t, why)

    def _forget(self, now: float) -> None:
        recent = self._recent
        while recent:
            at = next(iter(recent.values()))
            if now - at < self.linger and len(recent) <= self.max_connections:
                break
            recent.popitem(last=False)
