"""TCP reassembly (``tracer/observe/tcp.py``) with crafted segment sequences: in order,
reordered, retransmitted, overlapping, lost, reset mid-stream, FIN from each side, and
connections whose start was not captured."""

from __future__ import annotations

from tracer.observe.tcp import (
    ACK,
    FIN,
    PSH,
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
    TcpConnection,
    TcpTable,
)

C = Endpoint("10.0.0.1", 40000)
S = Endpoint("10.0.0.2", 8000)
CISN = 1000
SISN = 5000


def seg(
    t: float,
    seq: int,
    payload: bytes = b"",
    flags: int = ACK | PSH,
    ack: int | None = None,
    window: int = 512,
    wire_len: int | None = None,
) -> Segment:
    return Segment(t, seq % 2**32, flags, payload, ack, window, wire_len)


def handshake(conn: TcpConnection | TcpTable) -> list[Item]:
    """SYN, SYN-ACK, ACK at t = 1.0, 1.001, 1.002."""
    out: list[Item] = []
    for src, dst, s in (
        (C, S, seg(1.0, CISN, flags=SYN)),
        (S, C, seg(1.001, SISN, flags=SYN | ACK, ack=CISN + 1)),
        (C, S, seg(1.002, CISN + 1, flags=ACK, ack=SISN + 1)),
    ):
        out += conn.feed(src, dst, s) if isinstance(conn, TcpTable) else conn.feed(src, s)
    return out


def data_of(items: list[Item], src: Endpoint | None = None) -> bytes:
    return b"".join(i.data for i in items if isinstance(i, Data) and (src is None or i.src == src))


def of[T](items: list[Item], kind: type[T]) -> list[T]:
    return [i for i in items if isinstance(i, kind)]


def test_in_order_bytes_come_out_at_once_with_their_packet_time() -> None:
    conn = TcpConnection(1, C, S)
    items = handshake(conn)
    assert [(i.src, i.isn, i.ack) for i in of(items, Syn)] == [(C, CISN, False), (S, SISN, True)]
    assert conn.start_seen and conn.client == C and conn.server == S
    first = conn.feed(C, seg(1.01, CISN + 1, b"POST / HTTP/1.1\r\n"))
    second = conn.feed(C, seg(1.02, CISN + 18, b"host: x\r\n\r\n"))
    assert first == [Data(1.01, 1, C, 0, b"POST / HTTP/1.1\r\n")]
    assert second == [Data(1.02, 1, C, 17, b"host: x\r\n\r\n")]
    reply = conn.feed(S, seg(1.03, SISN + 1, b"HTTP/1.1 200 OK\r\n", ack=CISN + 29))
    assert reply == [Data(1.03, 1, S, 0, b"HTTP/1.1 200 OK\r\n")]
    assert conn.streams[C].unacked == 0  # the server acknowledged the request
    assert conn.streams[S].unacked == 17  # the client has not acknowledged the reply yet


def test_out_of_order_segments_wait_for_the_hole_and_come_out_when_it_fills() -> None:
    conn = TcpConnection(1, C, S)
    handshake(conn)
    assert conn.feed(C, seg(1.1, CISN + 1 + 6, b"world")) == []  # beyond a hole: held
    assert conn.feed(C, seg(1.2, CISN + 1 + 11, b"!")) == []
    assert conn.streams[C].pending == 6
    items = conn.feed(C, seg(1.3, CISN + 1, b"hello "))  # fills it: all of it, at 1.3
    assert items == [Data(1.3, 1, C, 0, b"hello world!")]
    assert conn.streams[C].pending == 0


def test_retransmissions_are_delivered_once() -> None:
    conn = TcpConnection(1, C, S)
    handshake(conn)
    assert data_of(conn.feed(C, seg(1.1, CISN + 1, b"abcdef"))) == b"abcdef"
    assert conn.feed(C, seg(1.5, CISN + 1, b"abcdef")) == []  # the same segment again
    assert conn.feed(C, seg(1.6, CISN + 1, b"abc")) == []  # a part of it again
    assert data_of(conn.feed(C, seg(1.7, CISN + 7, b"gh"))) == b"gh"
    assert conn.streams[C].duplicate == 9
    assert conn.streams[C].delivered == 8


def test_overlapping_segments_keep_the_first_copy_of_each_byte() -> None:
    conn = TcpConnection(1, C, S)
    handshake(conn)
    assert data_of(conn.feed(C, seg(1.1, CISN + 1, b"AAAAAAAAAA"))) == b"AAAAAAAAAA"
    # [5, 15): its first half was delivered already, its second half is new
    items = conn.feed(C, seg(1.2, CISN + 1 + 5, b"xxxxxBBBBB"))
    assert items == [Data(1.2, 1, C, 10, b"BBBBB")]
    # held beyond a hole: [20, 30); then [15, 25) overlaps it: the held bytes win
    assert conn.feed(C, seg(1.3, CISN + 1 + 20, b"DDDDDDDDDD")) == []
    items = conn.feed(C, seg(1.4, CISN + 1 + 15, b"CCCCCyyyyy"))
    assert items == [Data(1.4, 1, C, 15, b"CCCCCDDDDDDDDDD")]
    # one segment covering two held pieces and the holes around them
    assert conn.feed(C, seg(1.5, CISN + 1 + 32, b"F")) == []
    assert conn.feed(C, seg(1.6, CISN + 1 + 34, b"H")) == []
    items = conn.feed(C, seg(1.7, CISN + 1 + 30, b"EEzzzGzzII"))
    assert data_of(items) == b"EEFzHGzzII"  # F at 32 and H at 34 were there first
    assert conn.streams[C].next == 40


def test_a_lost_segment_is_a_gap_at_the_streams_end_and_the_rest_is_delivered() -> None:
    conn = TcpConnection(1, C, S)
    handshake(conn)
    conn.feed(C, seg(1.1, CISN + 1, b"aaaa"))
    assert conn.feed(C, seg(1.3, CISN + 1 + 8, b"cccc")) == []  # [4, 8) never comes
    items = conn.close(2.0, "end")
    assert items == [
        Gap(2.0, 1, C, 4, 4, "never_filled"),
        Data(2.0, 1, C, 8, b"cccc"),
        Closed(2.0, 1, "end"),
    ]
    assert conn.streams[C].gaps == 1 and conn.streams[C].gap_bytes == 4


def test_a_hole_the_peer_acknowledged_was_lost_by_the_capture_a_gap_at_once() -> None:
    """The receiver acknowledged bytes the capture never saw: they will not be sent
    again, so the bytes after them are delivered now, not at the stream's end."""
    conn = TcpConnection(1, C, S)
    handshake(conn)
    conn.feed(S, seg(1.1, SISN + 1, b"data: 1\n\n", ack=CISN + 1))
    assert conn.feed(S, seg(1.3, SISN + 1 + 18, b"data: 3\n\n", ack=CISN + 1)) == []
    items = conn.feed(C, seg(1.31, CISN + 1, flags=ACK, ack=SISN + 1 + 27))
    assert items == [Gap(1.31, 1, S, 9, 9, "not_captured"), Data(1.31, 1, S, 18, b"data: 3\n\n")]
    # the tail: acknowledged, never seen (and nothing after it)
    items = conn.feed(C, seg(1.4, CISN + 1, flags=ACK, ack=SISN + 1 + 40))
    assert items == [Gap(1.4, 1, S, 27, 13, "not_captured")]
    assert data_of(conn.feed(S, seg(1.5, SISN + 1 + 40, b"x"))) == b"x"


def test_held_bytes_are_bounded_a_hole_is_given_up_on_when_full() -> None:
    stream = HalfStream(1, S, max_buffer=10, max_pieces=3)
    stream.syn(0.0, 0, ack=True)
    assert stream.segment(1.0, 1 + 2, b"abcd") == []  # [2, 6) behind a hole of 2
    assert stream.segment(1.1, 1 + 8, b"efgh") == []  # [8, 12): 8 bytes held
    items = stream.segment(1.2, 1 + 14, b"ijk")  # 11 held: over the bound
    assert items == [
        Gap(1.2, 1, S, 0, 2, "buffer_full"),
        Data(1.2, 1, S, 2, b"abcd"),
    ]
    assert stream.pending == 7
    assert stream.segment(1.3, 1 + 20, b"l") == []  # three pieces: at the count
    items = stream.segment(1.4, 1 + 23, b"m")  # four: over it
    assert items == [Gap(1.4, 1, S, 6, 2, "buffer_full"), Data(1.4, 1, S, 8, b"efgh")]


def test_bytes_cut_by_the_snapshot_length_are_a_gap_at_once() -> None:
    conn = TcpConnection(1, C, S)
    handshake(conn)
    items = conn.feed(S, seg(1.1, SISN + 1, b"HTTP/1.1 200", wire_len=100))
    assert items == [Data(1.1, 1, S, 0, b"HTTP/1.1 200"), Gap(1.1, 1, S, 12, 88, "snaplen")]
    assert data_of(conn.feed(S, seg(1.2, SISN + 101, b"next"))) == b"next"
    assert conn.feed(S, seg(1.3, SISN + 1, b"HTTP/1.1 200 OK\r\n")) == []  # a copy: too late


def test_a_reset_mid_stream_ends_the_connection_with_its_direction() -> None:
    table = TcpTable()
    items = handshake(table)
    assert isinstance(items[0], Opened) and items[0].connection.client == C
    table.feed(C, S, seg(1.1, CISN + 1, b"GET / HTTP/1.1\r\n\r\n"))
    table.feed(S, C, seg(1.2, SISN + 1, b"HTTP/1.1 200 OK\r\n", ack=CISN + 19))
    table.feed(S, C, seg(1.3, SISN + 1 + 30, b"later", ack=CISN + 19))  # held: a hole before
    items = table.feed(S, C, seg(1.4, SISN + 1 + 35, flags=RST | ACK, ack=CISN + 19))
    assert items == [
        Gap(1.4, 1, S, 17, 13, "never_filled"),
        Data(1.4, 1, S, 30, b"later"),
        Reset(1.4, 1, S, 35),
        Closed(1.4, 1, "reset"),
    ]
    assert len(table) == 0
    # the client's answer to it, its last ACK: a straggler of a closed connection
    assert table.feed(C, S, seg(1.5, CISN + 19, flags=RST)) == []
    assert table.stragglers == 1


def test_fin_from_each_side_in_order_and_a_half_close() -> None:
    table = TcpTable()
    handshake(table)
    table.feed(C, S, seg(1.1, CISN + 1, b"req"))
    items = table.feed(C, S, seg(1.2, CISN + 4, flags=FIN | ACK, ack=SISN + 1))
    assert items == [Fin(1.2, 1, C, 3)]  # the client half-closes
    items = table.feed(S, C, seg(1.3, SISN + 1, b"resp", ack=CISN + 5))
    assert items == [Data(1.3, 1, S, 0, b"resp")]  # the server goes on
    items = table.feed(S, C, seg(1.4, SISN + 5, flags=FIN | ACK, ack=CISN + 5))
    assert items == [Fin(1.4, 1, S, 4), Closed(1.4, 1, "fin")]
    assert table.feed(C, S, seg(1.5, CISN + 5, flags=ACK, ack=SISN + 6)) == []  # the last ACK


def test_a_fin_waits_for_the_bytes_before_it() -> None:
    conn = TcpConnection(1, C, S)
    handshake(conn)
    conn.feed(S, seg(1.1, SISN + 1, b"ab", ack=CISN + 1))
    assert conn.feed(S, seg(1.2, SISN + 5, b"ef", flags=FIN | ACK, ack=CISN + 1)) == []
    items = conn.feed(S, seg(1.3, SISN + 3, b"cd", ack=CISN + 1))
    assert items == [Data(1.3, 1, S, 2, b"cdef"), Fin(1.3, 1, S, 6)]
    assert conn.feed(S, seg(1.4, SISN + 5, b"ef", flags=FIN | ACK)) == []  # FIN again


def test_a_connection_without_its_start_begins_at_the_first_segment_seen() -> None:
    table = TcpTable()
    items = table.feed(S, C, seg(5.0, 777_000, b"data: {}\n\n", ack=123_456))
    opened = items[0]
    assert isinstance(opened, Opened)
    conn = opened.connection
    assert not conn.start_seen and conn.client is None and conn.server is None
    assert items[1:] == [Data(5.0, 1, S, 0, b"data: {}\n\n")]
    assert not conn.streams[S].start_seen
    items = table.feed(C, S, seg(5.1, 123_456, b"GET /b HTTP/1.1\r\n\r\n", ack=777_010))
    assert items == [Data(5.1, 1, C, 0, b"GET /b HTTP/1.1\r\n\r\n")]
    assert table.feed(S, C, seg(5.2, 777_000 - 10, b"0123456789")) == []  # before its start
    assert conn.streams[S].duplicate == 10


def test_sequence_numbers_wrap_around() -> None:
    conn = TcpConnection(1, C, S)
    isn = 2**32 - 3
    conn.feed(C, seg(1.0, isn, flags=SYN))
    items = conn.feed(C, seg(1.1, isn + 1, b"abcdef"))  # wraps inside the segment
    items += conn.feed(C, seg(1.2, isn + 7, b"gh"))  # past the wrap
    assert data_of(items) == b"abcdefgh"
    assert [i.offset for i in of(items, Data)] == [0, 6]


def test_a_new_syn_on_a_used_4_tuple_is_a_new_connection() -> None:
    table = TcpTable()
    handshake(table)
    table.feed(C, S, seg(1.1, CISN + 1, b"x"))
    again = table.feed(C, S, seg(1.2, CISN, flags=SYN))  # the same SYN again: retransmitted
    assert again == []
    items = table.feed(C, S, seg(9.0, 99_999, flags=SYN))
    assert items[0] == Closed(9.0, 1, "reused")
    assert isinstance(items[1], Opened) and items[1].conn == 2
    assert isinstance(items[2], Syn) and items[2].isn == 99_999


def test_a_syn_ack_alone_says_who_the_client_is() -> None:
    conn = TcpConnection(1, S, C)
    conn.feed(S, seg(1.0, SISN, flags=SYN | ACK, ack=CISN + 1))
    assert conn.client == C and conn.server == S and conn.start_seen
    assert not conn.streams[C].start_seen and conn.streams[S].start_seen


def test_zero_window_and_unacknowledged_bytes() -> None:
    conn = TcpConnection(1, C, S)
    handshake(conn)
    conn.feed(S, seg(1.1, SISN + 1, b"x" * 100, ack=CISN + 1))
    conn.feed(C, seg(1.2, CISN + 1, flags=ACK, ack=SISN + 1 + 40, window=0))
    assert conn.streams[C].window == 0
    assert conn.streams[S].unacked == 60


def test_an_ignored_connection_holds_nothing_and_still_ends() -> None:
    table = TcpTable()
    (opened, *_) = handshake(table)
    assert isinstance(opened, Opened)
    table.feed(S, C, seg(1.1, SISN + 1 + 100, b"x" * 1000, ack=CISN + 1))  # held: a hole
    assert opened.connection.streams[S].pending == 1000
    opened.connection.ignore()
    assert opened.connection.streams[S].pending == 0
    assert table.feed(S, C, seg(1.2, SISN + 1, b"y" * 100, ack=CISN + 1)) == []
    assert table.feed(C, S, seg(1.3, CISN + 1, flags=FIN | ACK, ack=SISN + 1)) == []
    items = table.feed(S, C, seg(1.4, SISN + 1101, flags=FIN | ACK, ack=CISN + 2))
    assert items == [Closed(1.4, 1, "fin")]
