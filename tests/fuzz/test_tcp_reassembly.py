"""TCP reassembly (``tracer/observe/tcp.py``) under random segment orders, overlaps,
duplicates, drops, cuts (snaplen), acknowledgments and memory bounds.

What must hold whatever the capture: the ``Data`` and ``Gap`` items of a direction tile
its stream from offset 0 (each starts where the one before ended: no byte delivered
twice, none skipped silently); the bytes delivered are the stream's at their offsets;
delivered + gap bytes = the furthest offset reached, which is the stream's length once it
ended with a FIN; every byte of every segment is delivered, a duplicate, outside the
stream, or part of a snaplen gap; without drops nor bounds reached, every byte comes
through whatever the order. A table of connections never gives an item of a connection
before its ``Opened`` or after its ``Closed``, and at most one ``Fin`` per direction."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from hypothesis import example, given
from hypothesis import strategies as st

from tracer.observe.tcp import (
    ACK,
    FIN,
    RST,
    SYN,
    Closed,
    Data,
    Endpoint,
    Fin,
    Gap,
    HalfStream,
    Item,
    Opened,
    Reset,
    Segment,
    Syn,
    TcpTable,
)

from .support import budget, no_hang, ran

SRC = Endpoint("10.0.0.1", 40000)
MOD = 1 << 32


@dataclass
class Plan:
    """A stream, and the segments a capture shows of it, in capture order."""

    stream: bytes
    isn: int
    fin: bool
    # (offset, kept bytes, wire length or None, fin) in capture order; ("ack", offset) too
    segments: list[tuple[int, bytes, int | None, bool]] = field(default_factory=list)
    acks: dict[int, int] = field(default_factory=dict)  # segment index -> ack offset before it
    dropped: bool = False
    cut: bool = False
    max_pieces: int = 1024
    max_buffer: int = 4 << 20


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    stream = draw(st.binary(max_size=2000))
    isn = draw(st.sampled_from([0, MOD - 1, MOD - 300, 1 << 31, (1 << 31) - 1])) + draw(
        st.integers(0, 5)
    )
    plan = Plan(stream, isn % MOD, draw(st.booleans()))
    n = len(stream)
    edges = sorted({0, n, *draw(st.lists(st.integers(0, n), max_size=20))})
    pieces = list(pairwise(edges))
    if draw(st.booleans()) and pieces:  # drops
        keep = draw(st.lists(st.booleans(), min_size=len(pieces), max_size=len(pieces)))
        plan.dropped = not all(keep)
        pieces = [p for p, k in zip(pieces, keep, strict=True) if k]
    extra = draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, 300)), max_size=8))
    pieces += [(a, min(n, a + k)) for a, k in extra if min(n, a + k) > a]  # overlaps, copies
    pieces += draw(st.lists(st.sampled_from(pieces), max_size=4)) if pieces else []
    segments: list[tuple[int, bytes, int | None, bool]] = []
    for a, b in pieces:
        wire = None
        keep_to = b
        if draw(st.integers(0, 7)) == 0:  # the capture kept only the first bytes
            keep_to = draw(st.integers(a, b))
            wire = b - a if keep_to < b else None
            plan.cut = plan.cut or keep_to < b
        segments.append((a, stream[a:keep_to], wire, plan.fin and b == n))
    if plan.fin:
        segments += [(n, b"", None, True)] * draw(st.integers(0 if segments else 1, 2))
    plan.segments = draw(st.permutations(segments))
    if draw(st.booleans()):
        for _ in range(draw(st.integers(1, 4))):
            plan.acks[draw(st.integers(0, len(segments)))] = draw(st.integers(0, n))
    if draw(st.booleans()):
        plan.max_pieces = draw(st.integers(1, 8))
        plan.max_buffer = draw(st.integers(1, 600))
    return plan


def check_direction(items: list[Item], stream: bytes | None) -> tuple[int, int, int]:
    """The tiling of one direction's items: (offset reached, bytes delivered, gap bytes)."""
    pos = delivered = gapped = 0
    ended = False
    for item in items:
        if isinstance(item, Data | Gap):
            assert not ended, f"{item} after the stream's end"
            assert item.offset == pos, f"{item} at {item.offset}, expected at {pos}"
            if isinstance(item, Data):
                assert item.data
                if stream is not None:
                    assert item.data == stream[pos : pos + len(item.data)]
                pos += len(item.data)
                delivered += len(item.data)
            else:
                assert item.size > 0
                pos += item.size
                gapped += item.size
        elif isinstance(item, Fin | Reset):  # (a reset may follow the sender's FIN)
            assert not (ended and isinstance(item, Fin)), f"{item} after the stream's end"
            assert item.offset == pos, f"{item} at {item.offset}, the stream at {pos}"
            ended = True
    return pos, delivered, gapped


def run(plan: Plan) -> tuple[HalfStream, list[Item]]:
    hs = HalfStream(1, SRC, max_buffer=plan.max_buffer, max_pieces=plan.max_pieces)
    out = hs.syn(0.0, plan.isn, ack=False)
    base = plan.isn + 1
    for i, (offset, payload, wire, fin) in enumerate(plan.segments):
        if i in plan.acks:
            out += hs.acknowledged(float(i), (base + plan.acks[i]) % MOD)
        out += hs.segment(float(i), (base + offset) % MOD, payload, fin=fin, wire_len=wire)
    last = len(plan.segments)
    if last in plan.acks:
        out += hs.acknowledged(float(last), (base + plan.acks[last]) % MOD)
    out += hs.end(float(last))
    return hs, out


@budget(1.5)
@given(plan=plans())
@example(  # a byte held beyond the FIN before the FIN came: not delivered after it
    plan=Plan(
        stream=b"a",
        isn=0,
        fin=True,
        segments=[(1, b"b", None, False), (0, b"a", None, True)],
    )
)
@example(  # an acknowledgment over a hole, held bytes, and a hole: both holes are gaps
    plan=Plan(
        stream=bytes(7),
        isn=0,
        fin=False,
        segments=[(4, b"\0", None, False), (5, b"\0", None, False)],
        acks={1: 7},
        dropped=True,
    )
).via("discovered failure")
def test_one_direction(plan: Plan) -> None:
    ran("tcp.half_stream")
    with no_hang():
        hs, out = run(plan)
    pos, delivered, gapped = check_direction(out, plan.stream)
    assert (pos, delivered, gapped) == (hs.next, hs.delivered, hs.gap_bytes)
    assert hs.pending == 0  # nothing held once the stream ended
    assert sum(isinstance(i, Gap) for i in out) == hs.gaps
    n = len(plan.stream)
    seen = [o + max(len(p), w or 0) for o, p, w, _ in plan.segments]
    assert pos == max([0, *seen, *plan.acks.values()]) if not plan.fin else pos <= n
    fins = [i for i in out if isinstance(i, Fin)]
    if plan.fin and any(f for *_, f in plan.segments):
        assert pos == n and len(fins) == 1 and delivered + gapped == n
    wire = sum(max(len(p), w or 0) for _, p, w, _ in plan.segments)
    snaplen = sum(i.size for i in out if isinstance(i, Gap) and i.cause == "snaplen")
    assert wire == hs.delivered + hs.duplicate + hs.outside + snaplen
    if not (plan.dropped or plan.cut or plan.acks) and plan.max_pieces >= 1024:
        assert gapped == 0  # every byte came through, whatever the order
        assert b"".join(i.data for i in out if isinstance(i, Data)) == plan.stream[:pos]


# ---- a table of connections, fed anything ------------------------------------------

ENDPOINTS = st.sampled_from(
    [Endpoint("10.0.0.1", 40000), Endpoint("10.0.0.2", 8000), Endpoint("::1", 8000)]
)
SEQS = st.sampled_from([0, 1000, MOD - 1, MOD - 100, 1 << 31]).flatmap(
    lambda s: st.integers(0, 300).map(lambda k: (s + k) % MOD)
)


@st.composite
def segments(draw: st.DrawFn) -> tuple[Endpoint, Endpoint, Segment]:
    src, dst = draw(ENDPOINTS), draw(ENDPOINTS)
    flags = draw(st.sampled_from([SYN, SYN | ACK, ACK, ACK | FIN, RST, RST | ACK, ACK | 0x08]))
    flags |= draw(st.sampled_from([0, 0, 0, FIN, RST, SYN]))
    payload = draw(st.binary(max_size=40))
    seg = Segment(
        t=draw(st.floats(0.0, 200.0)),
        seq=draw(SEQS),
        flags=flags,
        payload=payload,
        ack=draw(SEQS) if flags & ACK else None,
        window=draw(st.integers(0, 0xFFFF)),
        wire_len=draw(st.none() | st.integers(len(payload), 200)),
    )
    return src, dst, seg


@budget(1.0)
@given(
    feed=st.lists(segments(), max_size=40),
    max_pieces=st.sampled_from([1, 3, 1024]),
    max_connections=st.sampled_from([1, 2, 100]),
)
def test_a_table_of_connections(
    feed: list[tuple[Endpoint, Endpoint, Segment]], max_pieces: int, max_connections: int
) -> None:
    ran("tcp.table")
    table = TcpTable(max_pieces=max_pieces, max_buffer=64, max_connections=max_connections)
    out: list[Item] = []
    with no_hang():
        for src, dst, seg in feed:
            out += table.feed(src, dst, seg)
        out += table.close_all(300.0)
    assert len(table) == 0
    opened: set[int] = set()
    closed: set[int] = set()
    per: dict[tuple[int, Endpoint], list[Item]] = {}
    for item in out:
        if isinstance(item, Opened):
            assert item.conn not in opened
            opened.add(item.conn)
            continue
        assert item.conn in opened and item.conn not in closed, item
        if isinstance(item, Closed):
            closed.add(item.conn)
        elif not isinstance(item, Syn):
            per.setdefault((item.conn, item.src), []).append(item)
    assert opened == closed
    for items in per.values():
        check_direction(items, None)
        assert sum(isinstance(i, Fin) for i in items) <= 1
        assert sum(isinstance(i, Reset) for i in items) <= 1
