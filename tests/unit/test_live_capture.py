"""Live capture's sans-I/O parts (``tracer/observe/live.py``): the BPF program the kernel
runs (checked against ``tcpdump -dd`` and run by a small interpreter over crafted
frames), the loopback's doubled packets, the packets' times, the kernel's drops, and the
reader driving a ``PacketTap`` from a scripted socket; and a start without the right to
capture (``tracer sniff`` as a user sees it: one line, exit 1, no capture file)."""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dpkt  # type: ignore[import-untyped]
import pytest

from tests.support.cli import run
from tracer import events as ev
from tracer.errors import StartError
from tracer.observe import live
from tracer.observe.live import (
    ARPHRD_ETHER,
    ARPHRD_LOOPBACK,
    ARPHRD_NONE,
    NO_LINKTYPE,
    PACKET_OUTGOING,
    SO_TIMESTAMPNS,
    LiveCapture,
    keep_frame,
    kernel_time,
    linktype_of,
    open_packet_socket,
    pack_filter,
    tcp_ports_filter,
)
from tracer.observe.packets import LINKTYPE_ETHERNET, LINKTYPE_RAW
from tracer.observe.passive import PacketTap
from tracer.observe.tcp import ACK, FIN, PSH, SYN

PACKET_HOST = 0
T0 = 1_700_000_000.0

# ``tcpdump -dd 'tcp port 8000'`` and ``tcpdump -dd 'tcp port 8000 or tcp port 30000'``
# (libpcap 1.10, Ethernet): the first is what tcp_ports_filter must give, word for word;
# the second is shorter (its optimizer shares the last comparison) but must decide alike.
TCPDUMP_8000 = [
    (0x28, 0, 0, 0x0000000C),
    (0x15, 0, 6, 0x000086DD),
    (0x30, 0, 0, 0x00000014),
    (0x15, 0, 15, 0x00000006),
    (0x28, 0, 0, 0x00000036),
    (0x15, 12, 0, 0x00001F40),
    (0x28, 0, 0, 0x00000038),
    (0x15, 10, 11, 0x00001F40),
    (0x15, 0, 10, 0x00000800),
    (0x30, 0, 0, 0x00000017),
    (0x15, 0, 8, 0x00000006),
    (0x28, 0, 0, 0x00000014),
    (0x45, 6, 0, 0x00001FFF),
    (0xB1, 0, 0, 0x0000000E),
    (0x48, 0, 0, 0x0000000E),
    (0x15, 2, 0, 0x00001F40),
    (0x48, 0, 0, 0x00000010),
    (0x15, 0, 1, 0x00001F40),
    (0x6, 0, 0, 0x00040000),
    (0x6, 0, 0, 0x00000000),
]
TCPDUMP_8000_30000 = [
    (0x28, 0, 0, 0x0000000C),
    (0x15, 0, 7, 0x000086DD),
    (0x30, 0, 0, 0x00000014),
    (0x15, 0, 18, 0x00000006),
    (0x28, 0, 0, 0x00000036),
    (0x15, 15, 0, 0x00001F40),
    (0x15, 14, 0, 0x00007530),
    (0x28, 0, 0, 0x00000038),
    (0x15, 12, 11, 0x00001F40),
    (0x15, 0, 12, 0x00000800),
    (0x30, 0, 0, 0x00000017),
    (0x15, 0, 10, 0x00000006),
    (0x28, 0, 0, 0x00000014),
    (0x45, 8, 0, 0x00001FFF),
    (0xB1, 0, 0, 0x0000000E),
    (0x48, 0, 0, 0x0000000E),
    (0x15, 4, 0, 0x00001F40),
    (0x15, 3, 0, 0x00007530),
    (0x48, 0, 0, 0x00000010),
    (0x15, 1, 0, 0x00001F40),
    (0x15, 0, 1, 0x00007530),
    (0x6, 0, 0, 0x00040000),
    (0x6, 0, 0, 0x00000000),
]


def bpf_run(program: list[tuple[int, int, int, int]], packet: bytes) -> int:
    """A classic BPF interpreter for the instructions these programs use: what the
    kernel keeps of ``packet`` (0: dropped; a load past the end drops, as the kernel's)."""
    a = x = 0
    pc = 0
    for _ in range(len(program)):  # no backward jumps: each instruction once at most
        code, jt, jf, k = program[pc]
        pc += 1
        try:
            if code == 0x28:
                (a,) = struct.unpack_from("!H", packet, k)
            elif code == 0x30:
                a = packet[k]
            elif code == 0x48:
                (a,) = struct.unpack_from("!H", packet, x + k)
            elif code == 0xB1:
                x = 4 * (packet[k] & 0xF)
            elif code == 0x15:
                pc += jt if a == k else jf
            elif code == 0x45:
                pc += jt if a & k else jf
            elif code == 0x06:
                return k
            else:
                raise AssertionError(f"opcode {code:#x} not interpreted")
        except (IndexError, struct.error):
            return 0
    raise AssertionError("ran off the program's end")


# ---- crafted frames -------------------------------------------------------------------------


def tcp(sport: int, dport: int, payload: bytes = b"", flags: int = ACK | PSH, **kw: Any) -> Any:
    return dpkt.tcp.TCP(sport=sport, dport=dport, flags=flags, win=512, data=payload, **kw)


def eth4(seg: Any, *, p: int = 6, offset: int = 0) -> bytes:
    ip = dpkt.ip.IP(
        src=socket.inet_aton("127.0.0.1"), dst=socket.inet_aton("127.0.0.1"), p=p, data=seg
    )
    ip.offset = offset  # (bytes; a fragment past the first has one)
    return bytes(dpkt.ethernet.Ethernet(type=dpkt.ethernet.ETH_TYPE_IP, data=bytes(ip)))


def eth6(seg: Any, *, nxt: int = 6) -> bytes:
    loop6 = socket.inet_pton(socket.AF_INET6, "::1")
    ip6 = dpkt.ip6.IP6(src=loop6, dst=loop6, nxt=nxt, hlim=64, data=seg)
    ip6.plen = len(bytes(seg))
    return bytes(dpkt.ethernet.Ethernet(type=dpkt.ethernet.ETH_TYPE_IP6, data=bytes(ip6)))


FRAMES = {
    "v4 to 8000": (eth4(tcp(40000, 8000, b"GET / HTTP/1.1\r\n\r\n")), True, True),
    "v4 from 8000": (eth4(tcp(8000, 40000, b"HTTP/1.1 200 OK\r\n")), True, True),
    "v4 to 30000": (eth4(tcp(40000, 30000)), False, True),
    "v4 from 30000": (eth4(tcp(30000, 40001)), False, True),
    "v4 to 8001": (eth4(tcp(40000, 8001)), False, False),
    "v4 udp to 8000": (eth4(dpkt.udp.UDP(sport=40000, dport=8000), p=17), False, False),
    "v4 fragment past the first": (eth4(tcp(40000, 8000), offset=128), False, False),
    "v4 with options": (
        bytes(
            dpkt.ethernet.Ethernet(
                type=dpkt.ethernet.ETH_TYPE_IP,
                data=bytes(
                    dpkt.ip.IP(
                        src=b"\x7f\0\0\1",
                        dst=b"\x7f\0\0\1",
                        p=6,
                        hl=6,
                        opts=b"\x01\x01\x01\x00",
                        data=tcp(40000, 8000),
                    )
                ),
            )
        ),
        True,
        True,
    ),
    "v6 to 8000": (eth6(tcp(40000, 8000, b"GET / HTTP/1.1\r\n\r\n")), True, True),
    "v6 from 30000": (eth6(tcp(30000, 40000)), False, True),
    "v6 to 9": (eth6(tcp(40000, 9)), False, False),
    "v6 udp to 8000": (eth6(dpkt.udp.UDP(sport=1, dport=8000), nxt=17), False, False),
    "arp": (
        bytes(dpkt.ethernet.Ethernet(type=dpkt.ethernet.ETH_TYPE_ARP, data=b"\0" * 28)),
        False,
        False,
    ),
    "runt": (b"\0" * 10, False, False),
}


# ---- the filter -------------------------------------------------------------------------------


def test_the_filter_for_one_port_is_tcpdumps() -> None:
    assert tcp_ports_filter([8000]) == TCPDUMP_8000
    assert len(pack_filter(TCPDUMP_8000)) == 8 * len(TCPDUMP_8000)
    assert pack_filter([(0x28, 1, 2, 12)]) == struct.pack("=HBBI", 0x28, 1, 2, 12)


@pytest.mark.parametrize("name", list(FRAMES))
def test_the_filter_keeps_the_ports_tcp_segments_and_nothing_else(name: str) -> None:
    frame, for_8000, for_both = FRAMES[name]
    one, both = tcp_ports_filter([8000]), tcp_ports_filter([30000, 8000, 8000])
    assert (bpf_run(one, frame) > 0) is for_8000
    assert (bpf_run(both, frame) > 0) is for_both
    assert bpf_run(one, frame) == bpf_run(TCPDUMP_8000, frame)  # tcpdump decides alike
    assert bpf_run(both, frame) == bpf_run(TCPDUMP_8000_30000, frame)
    if for_8000:
        assert bpf_run(one, frame) == live.SNAPLEN  # kept whole


def test_a_filter_takes_a_bounded_number_of_real_ports() -> None:
    program = tcp_ports_filter(range(1, live.MAX_PORTS + 1))
    assert all(0 <= jt <= 255 and 0 <= jf <= 255 for _, jt, jf, _ in program)
    frame = eth4(tcp(40000, live.MAX_PORTS))
    assert bpf_run(program, frame) == live.SNAPLEN
    for bad in ([], range(1, live.MAX_PORTS + 2), [0], [70000]):
        with pytest.raises(ValueError):
            tcp_ports_filter(bad)


# ---- frames: which copy, which link type, what time -----------------------------------------


def test_on_loopback_only_the_arriving_copy_is_kept() -> None:
    assert not keep_frame(PACKET_OUTGOING, ARPHRD_LOOPBACK)
    assert keep_frame(PACKET_HOST, ARPHRD_LOOPBACK)
    assert keep_frame(PACKET_OUTGOING, ARPHRD_ETHER)  # this host's own sends, once each
    assert keep_frame(PACKET_HOST, ARPHRD_ETHER)


def test_link_types_by_hardware_type() -> None:
    assert linktype_of(ARPHRD_ETHER) == linktype_of(ARPHRD_LOOPBACK) == LINKTYPE_ETHERNET
    assert linktype_of(ARPHRD_NONE) == LINKTYPE_RAW
    assert linktype_of(32) == NO_LINKTYPE  # infiniband: not decoded


def test_the_kernels_time_of_arrival() -> None:
    stamp = struct.pack("=qq", 1_700_000_123, 456_789_000)
    assert kernel_time([(socket.SOL_SOCKET, SO_TIMESTAMPNS, stamp)]) == pytest.approx(
        1_700_000_123.456789, abs=1e-9
    )
    assert kernel_time([]) is None
    assert kernel_time([(socket.SOL_SOCKET, 99, stamp)]) is None


# ---- the reader, from a scripted socket -----------------------------------------------------


class ScriptedSocket:
    """A packet socket that hands out frames (``None``: a read that times out)."""

    def __init__(self, reads: list[Any], drops: list[int] | None = None) -> None:
        self.reads = list(reads)
        self.drops = list(drops or [])
        self.timeout: float | None = None

    def recvmsg_into(self, buffers: Any, ancbufsize: int = 0, flags: int = 0) -> Any:
        assert flags & socket.MSG_TRUNC
        item = self.reads.pop(0)
        if item is None:
            raise TimeoutError
        frame, t, pkttype, hatype = item
        (buf,) = buffers
        kept = frame[: len(buf)]
        buf[: len(kept)] = kept
        anc = [] if t is None else [(socket.SOL_SOCKET, SO_TIMESTAMPNS, stamp(t))]
        return (
            len(frame),
            anc,
            socket.MSG_TRUNC if len(frame) > len(buf) else 0,
            (
                "lo",
                0x0800,
                pkttype,
                hatype,
                b"\0" * 6,
            ),
        )

    def getsockopt(self, level: int, option: int, buflen: int) -> bytes:
        assert (level, option, buflen) == (live.SOL_PACKET, live.PACKET_STATISTICS, 8)
        drops = self.drops.pop(0) if self.drops else 0
        return struct.pack("=II", 10 + drops, drops)

    def settimeout(self, value: float | None) -> None:
        self.timeout = value

    def close(self) -> None:
        pass


def stamp(t: float) -> bytes:
    sec = int(t)
    return struct.pack("=qq", sec, round((t - sec) * 1e9))


class Conn:
    """A loopback TCP connection's frames (client 127.0.0.1:40000 -> :8000)."""

    def __init__(self) -> None:
        self.cseq, self.sseq = 1000, 5000
        self.frames: list[tuple[bytes, float]] = []

    def send(
        self, t: float, from_client: bool, payload: bytes = b"", flags: int = ACK | PSH
    ) -> None:
        sport, dport = (40000, 8000) if from_client else (8000, 40000)
        seq, ack = (self.cseq, self.sseq) if from_client else (self.sseq, self.cseq)
        self.frames.append((eth4(tcp(sport, dport, payload, flags, seq=seq, ack=ack)), t))
        used = len(payload) + (1 if flags & (SYN | FIN) else 0)
        if from_client:
            self.cseq += used
        else:
            self.sseq += used


REQUEST = b"GET /v1/models HTTP/1.1\r\nhost: engine\r\n\r\n"
MODELS = b'{"object":"list","data":[]}'
RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(MODELS), MODELS)
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def loopback(frames: list[tuple[bytes, float]]) -> Iterator[tuple[bytes, float, int, int]]:
    """Each frame twice, as lo shows it: leaving, then arriving."""
    for frame, t in frames:
        yield frame, t, PACKET_OUTGOING, ARPHRD_LOOPBACK
        yield frame, t, PACKET_HOST, ARPHRD_LOOPBACK


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def reader(sock: ScriptedSocket, clock: Clock, **kw: Any) -> tuple[LiveCapture, list[ev.Event]]:
    out: list[ev.Event] = []
    tap = PacketTap(emit=out.append, tap="sniff", ports=[8000], kind="sniff", stall_after=5.0)
    tap.start(T0)
    capture = LiveCapture(
        sock, tap, loss_tap="sniff", emit=out.append, where="lo", clock=clock, **kw
    )
    return capture, out


def feed(capture: LiveCapture, sock: ScriptedSocket) -> None:
    """Every scripted read, as ``run`` would make them (a timeout: the reader is idle)."""
    while sock.reads:
        try:
            got = sock.recvmsg_into([capture._view], 64, socket.MSG_TRUNC)
        except TimeoutError:
            capture.idle(capture.clock())
            continue
        capture.frame(*got)


def of[E: ev.Event](events: list[ev.Event], kind: type[E]) -> list[E]:
    return [e for e in events if isinstance(e, kind)]


def test_a_loopback_exchange_is_one_connection_with_the_kernels_times() -> None:
    conn = Conn()
    conn.send(T0 + 0.001, True, flags=SYN)
    conn.send(T0 + 0.002, False, flags=SYN | ACK)
    conn.send(T0 + 0.003, True, flags=ACK)
    conn.send(T0 + 0.010, True, REQUEST)
    conn.send(T0 + 0.020, False, RESPONSE)
    conn.send(T0 + 0.030, True, flags=FIN | ACK)
    conn.send(T0 + 0.031, False, flags=FIN | ACK)
    conn.send(T0 + 0.032, True, flags=ACK)
    sock = ScriptedSocket(list(loopback(conn.frames)))
    clock = Clock(T0 + 1.0)
    capture, out = reader(sock, clock)
    feed(capture, sock)
    capture.finish("SIGINT")
    assert capture.stats.frames == 16 and capture.stats.duplicates == 8
    assert capture.stats.time_source == "kernel" and capture.tap.stats.packets == 8
    (opened,) = of(out, ev.ConnOpen)
    assert (opened.peer, opened.local, opened.t) == (
        "127.0.0.1:40000",
        "127.0.0.1:8000",
        T0 + 0.001,
    )
    (head,) = of(out, ev.RequestHead)
    assert (head.method, head.target, head.seq) == ("GET", "/v1/models", 1)
    assert head.t == pytest.approx(T0 + 0.010, abs=1e-6)  # the packet's time, not the read's
    (end,) = of(out, ev.ResponseEnd)
    assert (end.status, end.termination, end.body_bytes) == (200, "complete", len(MODELS))
    (closed,) = of(out, ev.ConnClose)
    assert (closed.closed_by, closed.how, closed.requests) == ("client", "fin", 1)
    assert not of(out, ev.CaptureLoss)
    (last,) = of(out, ev.CaptureEnd)
    assert (last.reason, last.t) == ("SIGINT", T0 + 1.0) and out[-1] is last


def test_without_the_kernels_stamp_the_read_time_stands_for_it() -> None:
    conn = Conn()
    conn.send(T0, True, REQUEST)
    frame, _ = conn.frames[0]
    sock = ScriptedSocket([(frame, None, PACKET_HOST, ARPHRD_ETHER)])
    capture, out = reader(sock, Clock(T0 + 3.5))
    feed(capture, sock)
    assert capture.stats.time_source == "recvmsg"
    assert of(out, ev.RequestHead)[0].t == T0 + 3.5


def test_a_silent_request_stalls_while_no_packet_comes_and_ends_in_flight() -> None:
    conn = Conn()
    conn.send(T0, True, REQUEST.replace(b"GET /v1/models", b"GET /v1/stream"))
    conn.send(T0 + 0.01, False, STREAM_HEAD + b"5\r\nhello\r\n")
    clock = Clock(T0 + 0.02)
    sock = ScriptedSocket([*loopback(conn.frames), None, None])
    capture, out = reader(sock, clock)
    feed(capture, sock)  # idle at T0 + 0.02: nothing due yet
    assert not of(out, ev.Stall)
    clock.now = T0 + 6.0  # no packet since: the tap's clock moves with the wall's
    sock.reads.append(None)
    feed(capture, sock)
    (stall,) = of(out, ev.Stall)
    assert (stall.phase, stall.direction, stall.conn, stall.seq) == (
        "start",
        "upstream_silent",
        1,
        1,
    )
    assert stall.t == pytest.approx(T0 + 0.01 + 5.0, abs=1e-6)
    capture.finish("SIGTERM")
    (end,) = of(out, ev.ResponseEnd)
    assert (end.termination, end.detail) == ("in_flight", "tap stopped")
    (closed,) = of(out, ev.ConnClose)
    assert (closed.closed_by, closed.in_flight) == ("none", True)


def test_the_kernels_drops_are_capture_loss_when_read() -> None:
    clock = Clock(T0)
    sock = ScriptedSocket([], drops=[7, 0, 2])
    capture, out = reader(sock, clock, stats_every=1.0)
    for now in (T0 + 0.5, T0 + 1.5, T0 + 3.0):  # read at 1.5 (7) and 3.0 (none)
        clock.now = now
        capture.idle(now)
    assert sock.drops == [2]
    clock.now = T0 + 3.2
    capture.finish("SIGINT")  # the last read, at the end (2)
    losses = of(out, ev.CaptureLoss)
    assert [(loss.tap, loss.dropped, loss.t) for loss in losses] == [
        ("sniff", 7, T0 + 1.5),
        ("sniff", 2, T0 + 3.2),
    ]
    assert all(loss.reason.startswith("packet capture: ") for loss in losses)
    assert capture.stats.kernel_dropped == 9 == capture.tap.stats.kernel_dropped
    assert out[-1] == of(out, ev.CaptureEnd)[0] and out[-1].t == T0 + 3.2


def test_a_frame_longer_than_the_buffer_is_kept_cut_and_counted() -> None:
    conn = Conn()
    conn.send(T0, True, REQUEST)
    frame, _ = conn.frames[0]
    sock = ScriptedSocket([(frame, T0, PACKET_HOST, ARPHRD_ETHER)])
    capture, _ = reader(sock, Clock(T0), bufsize=len(frame) - 10)
    feed(capture, sock)
    assert capture.stats.truncated == 1 and capture.tap.stats.truncated_packets == 1


def test_a_frame_of_a_link_layer_not_decoded_is_counted_and_skipped() -> None:
    sock = ScriptedSocket([(b"\x01" * 60, T0, PACKET_HOST, 32)])
    capture, out = reader(sock, Clock(T0))
    feed(capture, sock)
    assert capture.tap.stats.skipped["link"] == 1 and not of(out, ev.ConnOpen)


# ---- a start without the right to capture ------------------------------------------------------


class RefusingSocket:
    def __init__(self, *args: Any) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")


def test_without_cap_net_raw_the_start_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live.socket, "if_nametoindex", lambda name: 1)
    monkeypatch.setattr(live.socket, "socket", RefusingSocket)
    with pytest.raises(StartError) as caught:
        open_packet_socket("lo", [8000])
    assert str(caught.value) == (
        "cannot capture on lo: needs root or CAP_NET_RAW (operation not permitted)"
    )


def test_sniff_without_the_right_is_one_line_exit_1_and_no_capture(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    in_process: None,
) -> None:
    monkeypatch.setattr(live.socket, "if_nametoindex", lambda name: 1)
    monkeypatch.setattr(live.socket, "socket", RefusingSocket)
    capture = tmp_path / "f.jsonl"
    code, err = run(["sniff", "--iface", "lo", "--port", "8000", "--capture", str(capture)], capsys)
    assert code == 1
    assert (
        err == "tracer: cannot capture on lo: needs root or CAP_NET_RAW (operation not permitted)\n"
    )
    assert not capture.exists()


def test_a_missing_interface_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], in_process: None
) -> None:
    def no_such(name: str) -> int:
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(live.socket, "if_nametoindex", no_such)
    code, err = run(["sniff", "--iface", "nope0", "--port", "80", "--capture", "x.jsonl"], capsys)
    assert (code, err) == (
        1,
        "tracer: cannot capture on nope0: no such network interface (ip link lists them)\n",
    )


class BindFails:
    """A packet socket whose bind fails with ``errno``; records what was set on it."""

    made: list[BindFails] = []

    def __init__(self, family: int, kind: int, proto: int, *, fail: int = errno.ENODEV) -> None:
        assert (kind, proto) == (socket.SOCK_RAW, 0)  # nothing is received before the filter
        self.options: list[tuple[int, int]] = []
        self.closed = False
        self.fail = fail
        BindFails.made.append(self)

    def setsockopt(self, level: int, option: int, value: Any) -> None:
        self.options.append((level, option))

    def getsockopt(self, level: int, option: int) -> int:
        return 1 << 20

    def bind(self, address: tuple[str, int]) -> None:
        assert address[1] == live.ETH_P_ALL
        raise OSError(self.fail, "nope")

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("fail", "said"),
    [
        (errno.ENODEV, "no such network interface"),
        (errno.EPERM, "needs root or CAP_NET_RAW"),
        (errno.ENETDOWN, "nope"),
    ],
)
def test_a_bind_that_fails_closes_the_socket_and_says_why(
    monkeypatch: pytest.MonkeyPatch, fail: int, said: str
) -> None:
    BindFails.made.clear()
    monkeypatch.setattr(live.socket, "if_nametoindex", lambda name: 1)
    monkeypatch.setattr(live.socket, "socket", lambda *a: BindFails(*a, fail=fail))
    monkeypatch.setattr(live, "_hatype", lambda iface: ARPHRD_LOOPBACK)
    with pytest.raises(StartError, match=said):
        open_packet_socket("lo", [8000])
    (sock,) = BindFails.made
    assert sock.closed
    filter_at = sock.options.index((socket.SOL_SOCKET, live.SO_ATTACH_FILTER))
    assert filter_at == 0  # the filter is on before anything else, and before bind


# ---- tracer sniff's arguments and its probes ----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "give the server port to follow"),
        (["--port", "8000", "--tap-by-port", "30000=back"], "not both"),
        (["--port", "0"], "a port is 1 to 65535"),
        (["--tap-by-port", "8000"], "expected PORT=TAP"),
        (["--tap-by-port", "30000=back:engin"], "'30000=back:engin': role must be engine"),
        (["--tap-by-port", "30000=back", "--upstream-role", "engine"], "it is for --port"),
        (["--port", "8000", "--upstream-role", "engin"], "invalid choice: 'engin'"),
        (["--tap-by-port", "8000=a,9000=b", "--capture-max-bytes", "5"], "not rolled"),
        (["--port", "8000", "--buffer-size", "0"], "must be more than 0"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_sniff_refuses_bad_arguments_in_one_line_before_capturing(
    args: list[str],
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    in_process: None,
) -> None:
    monkeypatch.setattr(live.socket, "socket", RefusingSocket)  # (never reached)
    capture = tmp_path / "f.jsonl"
    code, err = run(["sniff", "--iface", "lo", "--capture", str(capture), *args], capsys)
    assert code == 2 and said in err, err
    assert len(err.splitlines()) <= 2 and not capture.exists()


def test_probes_go_to_the_server_the_stalled_connection_talked_to() -> None:
    made: list[tuple[str, str]] = []
    fired: list[tuple[str, str, int]] = []

    class Prober:
        def __init__(self, tap: str, url: str) -> None:
            made.append((tap, url))
            self.tap = tap
            self.config = type("Config", (), {"upstream_url": url})()

        def __call__(self, event: ev.Event) -> None:
            assert isinstance(event, ev.Stall)
            fired.append((self.tap, self.config.upstream_url, event.conn))

    from tracer.cli.sniff import StallProbes

    probes = StallProbes(Prober)

    def stall(tap: str, conn: int, phase: Any = "start") -> ev.Stall:
        return ev.Stall(
            t=T0,
            m=T0,
            tap=tap,
            conn=conn,
            seq=1,
            phase=phase,
            direction="upstream_silent",
            silent_for=5.0,
        )

    probes(
        ev.ConnOpen(t=T0, m=T0, tap="front", conn=1, peer="127.0.0.1:4000", local="127.0.0.1:8000")
    )
    probes(ev.ConnOpen(t=T0, m=T0, tap="back", conn=1, peer="127.0.0.1:4001", local="[::1]:30000"))
    probes(stall("front", 1))
    probes(stall("back", 1))
    probes(stall("back", 1, "end"))  # an end probes nothing
    probes(stall("front", 9))  # a connection not seen open: nothing to probe
    probes(
        ev.ConnClose(
            t=T0,
            m=T0,
            tap="front",
            conn=1,
            closed_by="client",
            how="fin",
            in_flight=False,
            requests=1,
            bytes_from_client=1,
            bytes_from_upstream=1,
            upstream_opened=True,
            duration=1.0,
        )
    )
    probes(stall("front", 1))  # closed since
    assert made == [("front", "http://127.0.0.1:8000"), ("back", "http://[::1]:30000")]
    assert fired == [("front", "http://127.0.0.1:8000", 1), ("back", "http://[::1]:30000", 1)]
