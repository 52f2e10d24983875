"""Live packet capture on Linux (``AF_PACKET``): an interface's frames, as they pass, to a
``passive.PacketTap`` (``tracer sniff``).

Theory of operation
-------------------
``open_packet_socket`` opens a raw packet socket (``socket(AF_PACKET, SOCK_RAW, 0)``: it
receives nothing yet), attaches a classic BPF filter that keeps only the TCP segments to
or from the given ports (``tcp_ports_filter``: the program ``tcpdump -dd 'tcp port P or
tcp port Q'`` gives, built here), and only then binds it to the interface with
``ETH_P_ALL``: no packet of another port is ever queued, not even the few that would
arrive between opening and filtering. The kernel stamps each packet as it arrives
(``SO_TIMESTAMPNS``, ``CLOCK_REALTIME``); where it will not, the time of ``recvmsg``
stands for it (``LiveStats.time_source`` says which was used). The socket's receive
buffer is raised (``SO_RCVBUFFORCE``, else ``SO_RCVBUF``) so that a burst waits in the
kernel rather than being dropped; what the kernel drops anyway is read back with
``PACKET_STATISTICS`` (each read returns the drops since the last, and resets them).

``LiveCapture.run`` reads frames until told to stop: on the loopback interface every
packet is seen twice, leaving (``PACKET_OUTGOING``) and arriving (``PACKET_HOST``), and
only the arriving copy is kept, as libpcap does. Each frame goes to the tap with its
link type (Ethernet for Ethernet and loopback interfaces, raw IP for ``ARPHRD_NONE``
tunnels; any other is skipped and counted) and its length on the wire (``MSG_TRUNC``).
When no packet comes for ``tick`` seconds, the tap's clock is advanced to now, so a
request that stopped moving is a ``stall`` at a live tap too (a passive tap's time
otherwise only moves with packets); every ``stats_every`` seconds the kernel's drops
since the last read become a ``capture_loss`` record, at that time.

Memory is bounded by the tap (``PacketTap``'s buffers) and by the socket's buffer in the
kernel: when the reader falls behind, packets are dropped there, counted, and recorded.
The reader runs in a thread of its own and calls the tap and ``emit`` from it; once it
has returned, ``finish`` is called from the thread that started it.
"""

from __future__ import annotations

import ctypes
import errno
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .. import events as ev
from ..errors import StartError
from .packets import LINKTYPE_ETHERNET, LINKTYPE_RAW
from .passive import PacketTap

# Linux's numbers (include/uapi/linux/{socket,if_packet,if_arp,if_ether}.h, asm-generic)
SOL_PACKET = 263
PACKET_STATISTICS = 6
SO_ATTACH_FILTER = 26
SO_TIMESTAMPNS = 35  # (SCM_TIMESTAMPNS, the control message's type, is the same number)
SO_RCVBUFFORCE = 33
ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
ARPHRD_ETHER = 1
ARPHRD_LOOPBACK = 772
ARPHRD_RAWIP = 519
ARPHRD_NONE = 0xFFFE

SNAPLEN = 262144  # what the filter keeps of a packet (tcpdump's default snapshot length)
BUFFER = SNAPLEN  # the read buffer (a GRO packet on lo is up to 64 KiB; BIG TCP more)
RCVBUF = 8 * 1024 * 1024  # the socket's receive buffer asked for
TICK = 0.2  # seconds without a packet before the tap's clock is moved to now
STATS_EVERY = 1.0  # seconds between reads of the kernel's drop counter
NO_LINKTYPE = -1  # a frame of an interface whose link layer is not decoded: counted, skipped

# ---- classic BPF: the kernel keeps only the TCP segments of the ports ---------------------

# opcodes (include/uapi/linux/filter.h)
LDH_ABS = 0x28  # A = half-word at [k]
LDB_ABS = 0x30  # A = byte at [k]
LDH_IND = 0x48  # A = half-word at [X + k]
LDXB_MSH = 0xB1  # X = 4 * ([k] & 0xf): the IPv4 header's length
JEQ_K = 0x15  # if A == k
JSET_K = 0x45  # if A & k
RET_K = 0x06  # accept k bytes (0: drop)

Instruction = tuple[int, int, int, int]  # (code, jt, jf, k), as struct sock_filter
MAX_PORTS = 60  # a jump skips at most 255 instructions: the chains of comparisons stay short


def tcp_ports_filter(ports: Collection[int], snaplen: int = SNAPLEN) -> list[Instruction]:
    """The classic BPF program for ``tcp port P or tcp port Q ...`` over Ethernet frames
    (IPv4 without fragments past the first, IPv6 with TCP as the next header), the same as
    ``tcpdump -dd`` gives for one port; a kept packet is kept whole up to ``snaplen``."""
    wanted = sorted(set(ports))
    if not wanted or len(wanted) > MAX_PORTS:
        raise ValueError(f"a packet filter takes 1 to {MAX_PORTS} ports ({len(wanted)} given)")
    if any(not 0 < p < 65536 for p in wanted):
        raise ValueError(f"not a port number in {wanted}")
    # instructions with symbolic jumps: a label, or None for the next instruction
    prog: list[tuple[int, str | None, str | None, int]] = []
    labels: dict[str, int] = {}

    def add(code: int, k: int, jt: str | None = None, jf: str | None = None) -> None:
        prog.append((code, jt, jf, k))

    def either_port(last: str) -> None:  # A is a port: one of them accepts, else ``last``
        for i, port in enumerate(wanted):
            add(JEQ_K, port, "accept", last if i == len(wanted) - 1 else None)

    add(LDH_ABS, 12)  # the EtherType
    add(JEQ_K, 0x86DD, None, "ipv4")
    add(LDB_ABS, 14 + 6)  # IPv6: next header
    add(JEQ_K, 6, None, "reject")
    add(LDH_ABS, 14 + 40)  # source port
    either_port("ipv6_dst")
    labels["ipv6_dst"] = len(prog)
    add(LDH_ABS, 14 + 42)  # destination port
    either_port("reject")
    labels["ipv4"] = len(prog)
    add(JEQ_K, 0x0800, None, "reject")
    add(LDB_ABS, 14 + 9)  # IPv4: protocol
    add(JEQ_K, 6, None, "reject")
    add(LDH_ABS, 14 + 6)  # flags and fragment offset
    add(JSET_K, 0x1FFF, "reject", None)  # a fragment past the first: no TCP header in it
    add(LDXB_MSH, 14)
    add(LDH_IND, 14)  # source port
    either_port("ipv4_dst")
    labels["ipv4_dst"] = len(prog)
    add(LDH_IND, 16)  # destination port
    either_port("reject")
    labels["accept"] = len(prog)
    add(RET_K, snaplen)
    labels["reject"] = len(prog)
    add(RET_K, 0)

    def offset(at: int, label: str | None) -> int:
        if label is None:
            return 0
        jump = labels[label] - at - 1
        assert 0 <= jump <= 255, (label, jump)
        return jump

    return [(code, offset(i, jt), offset(i, jf), k) for i, (code, jt, jf, k) in enumerate(prog)]


def pack_filter(program: list[Instruction]) -> bytes:
    """The program as the kernel reads it: an array of ``struct sock_filter``."""
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


def attach_filter(sock: socket.socket, program: list[Instruction]) -> None:
    """``SO_ATTACH_FILTER``: ``struct sock_fprog {unsigned short len; struct sock_filter
    *filter;}`` points at the instructions, which the kernel copies before returning."""
    code = ctypes.create_string_buffer(pack_filter(program))
    fprog = struct.pack("HP", len(program), ctypes.addressof(code))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


# ---- frames ---------------------------------------------------------------------------------


def linktype_of(hatype: int) -> int:
    """A packet socket's hardware type as a capture file's link type (what frames start
    with): Ethernet and loopback interfaces give Ethernet frames, ``ARPHRD_NONE`` and
    ``ARPHRD_RAWIP`` (tun, wireguard) bare IP; anything else ``NO_LINKTYPE``."""
    if hatype in (ARPHRD_ETHER, ARPHRD_LOOPBACK):
        return LINKTYPE_ETHERNET
    if hatype in (ARPHRD_NONE, ARPHRD_RAWIP):
        return LINKTYPE_RAW
    return NO_LINKTYPE


def keep_frame(pkttype: int, hatype: int) -> bool:
    """Whether a frame is the copy to keep: on the loopback interface each packet passes
    twice, leaving and arriving; the leaving copy (``PACKET_OUTGOING``) is dropped, as
    libpcap does. Elsewhere every frame is kept (the host's own sends included)."""
    return not (pkttype == PACKET_OUTGOING and hatype == ARPHRD_LOOPBACK)


def kernel_time(ancdata: Iterable[tuple[int, int, bytes]]) -> float | None:
    """The packet's arrival time from its ``SCM_TIMESTAMPNS`` control message (a
    ``struct timespec``), or None when there is none."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            if len(data) >= 16:
                sec, nsec = struct.unpack("=qq", data[:16])
            elif len(data) >= 8:
                sec, nsec = struct.unpack("=ii", data[:8])
            else:
                continue
            return float(sec) + float(nsec) / 1e9
    return None


# ---- the socket -------------------------------------------------------------------------


class PacketSocket(Protocol):
    """What the reader needs of a packet socket (a real one, or a test's)."""

    def recvmsg_into(
        self, buffers: Iterable[Any], ancbufsize: int = ..., flags: int = ..., /
    ) -> tuple[int, list[tuple[int, int, bytes]], int, Any]: ...

    def getsockopt(self, level: int, option: int, buflen: int, /) -> bytes: ...

    def settimeout(self, value: float | None, /) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class OpenedSocket:
    sock: Any
    iface: str
    filtered: bool  # the kernel keeps only the ports' TCP segments
    stamped: bool  # the kernel stamps packets (SO_TIMESTAMPNS)
    rcvbuf: int | None  # the receive buffer the kernel granted


def open_packet_socket(iface: str, ports: Collection[int], *, rcvbuf: int = RCVBUF) -> OpenedSocket:
    """A packet socket on ``iface`` that sees the TCP segments of ``ports``. A start that
    fails is one ``StartError`` line: no such interface, not Linux, or no right to capture
    (``tracer: cannot capture on lo: needs root or CAP_NET_RAW (operation not permitted)``)."""
    where = f"cannot capture on {iface}"
    family = getattr(socket, "AF_PACKET", None)
    if family is None:
        raise StartError(f"{where}: live capture needs Linux (AF_PACKET); take a pcap with tcpdump")
    try:
        socket.if_nametoindex(iface)
    except OSError:
        raise StartError(f"{where}: no such network interface (ip link lists them)") from None
    try:
        sock = socket.socket(family, socket.SOCK_RAW, 0)  # protocol 0: nothing received yet
    except PermissionError as exc:
        why = (exc.strerror or str(exc)).lower()
        raise StartError(f"{where}: needs root or CAP_NET_RAW ({why})") from None
    except OSError as exc:
        raise StartError(f"{where}: {(exc.strerror or str(exc)).lower()}") from None
    try:
        hatype = _hatype(iface)
        filtered = hatype in (ARPHRD_ETHER, ARPHRD_LOOPBACK)
        if filtered:  # the filter reads Ethernet frames; others are filtered in the tap
            attach_filter(sock, tcp_ports_filter(ports))
        stamped = _try(sock, socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        granted = _receive_buffer(sock, rcvbuf)
        sock.bind((iface, ETH_P_ALL))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.ENODEV:
            raise StartError(f"{where}: no such network interface (ip link lists them)") from None
        if exc.errno in (errno.EPERM, errno.EACCES):
            why = (exc.strerror or str(exc)).lower()
            raise StartError(f"{where}: needs root or CAP_NET_RAW ({why})") from None
        raise StartError(f"{where}: {(exc.strerror or str(exc)).lower()}") from None
    return OpenedSocket(sock, iface, filtered, stamped, granted)


def _hatype(iface: str) -> int | None:
    """The interface's hardware type (``ARPHRD_*``) as sysfs says, or None."""
    try:
        with open(f"/sys/class/net/{iface}/type") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _try(sock: Any, level: int, option: int, value: int) -> bool:
    try:
        sock.setsockopt(level, option, value)
    except OSError:
        return False
    return True


def _receive_buffer(sock: Any, size: int) -> int | None:
    """Ask for a receive buffer of ``size`` (past ``rmem_max`` where allowed); what the
    kernel granted (it reports twice the size it accounts for)."""
    if not _try(sock, socket.SOL_SOCKET, SO_RCVBUFFORCE, size):
        _try(sock, socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
    except OSError:
        return None


def kernel_drops(sock: PacketSocket) -> int:
    """Packets the kernel dropped for this socket since the last call (``struct
    tpacket_stats {unsigned tp_packets, tp_drops}``; reading resets both)."""
    try:
        raw = sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)
    except OSError:
        return 0
    if len(raw) < 8:
        return 0
    _packets, drops = struct.unpack("=II", raw[:8])
    return int(drops)


# ---- the reader ---------------------------------------------------------------------------


@dataclass(slots=True)
class LiveStats:
    """What the reader saw, beside what the tap counts (``PacketTap.stats``)."""

    frames: int = 0  # frames read
    duplicates: int = 0  # loopback frames dropped as the leaving copy
    truncated: int = 0  # frames longer than the read buffer
    kernel_dropped: int = 0  # the kernel's drops, summed
    time_source: str = "kernel"  # "kernel" (SO_TIMESTAMPNS) or "recvmsg" (time.time())


class LiveCapture:
    """Frames from a packet socket to a ``PacketTap``, in one thread, until ``stop``."""

    def __init__(
        self,
        sock: PacketSocket,
        tap: PacketTap,
        *,
        loss_tap: str,
        emit: Callable[[ev.Event], None],
        where: str,
        clock: Callable[[], float] = time.time,
        tick: float = TICK,
        stats_every: float = STATS_EVERY,
        bufsize: int = BUFFER,
    ) -> None:
        self.sock = sock
        self.tap = tap
        self.loss_tap = loss_tap
        self.emit = emit
        self.where = where
        self.clock = clock
        self.tick = tick
        self.stats_every = stats_every
        self.stats = LiveStats()
        self._buf = bytearray(bufsize)
        self._view = memoryview(self._buf)
        self._anc = socket.CMSG_SPACE(16) if hasattr(socket, "CMSG_SPACE") else 64
        self._last_stats = clock()  # the kernel's counters start at zero with the socket

    def run(self, stop: threading.Event) -> None:
        """Read until ``stop`` is set (seen within ``tick`` seconds)."""
        self.sock.settimeout(self.tick)
        while not stop.is_set():
            try:
                got = self.sock.recvmsg_into([self._view], self._anc, socket.MSG_TRUNC)
            except TimeoutError:  # (socket.timeout) no packet for a tick
                self.idle(self.clock())
                continue
            except InterruptedError:
                continue
            except OSError as exc:  # the interface went away, or the socket broke
                why = (exc.strerror or str(exc)).lower()
                raise StartError(f"capture on {self.where} stopped: {why}") from None
            self.frame(*got)
            now = self.clock()
            if now - self._last_stats >= self.stats_every:
                self.idle(now)

    def frame(
        self, nbytes: int, ancdata: list[tuple[int, int, bytes]], msg_flags: int, address: Any
    ) -> None:
        """One ``recvmsg_into`` result: ``address`` is ``(ifname, proto, pkttype, hatype,
        addr)``; with ``MSG_TRUNC`` ``nbytes`` is the frame's whole length."""
        self.stats.frames += 1
        pkttype, hatype = int(address[2]), int(address[3])
        if not keep_frame(pkttype, hatype):
            self.stats.duplicates += 1
            return
        t = kernel_time(ancdata)
        if t is None:
            t = self.clock()
            self.stats.time_source = "recvmsg"
        kept = min(nbytes, len(self._buf))
        if kept < nbytes:
            self.stats.truncated += 1
        self.tap.packet(t, linktype_of(hatype), bytes(self._view[:kept]), orig_len=nbytes)

    def idle(self, now: float) -> None:
        """No packet for a while, or time to read the kernel's counters: the tap's clock
        to ``now`` (stalls due by now), and the drops since the last read as a loss."""
        self.tap.advance(now)
        if now - self._last_stats >= self.stats_every:
            self.read_drops(now)

    def read_drops(self, now: float) -> int:
        """The kernel's drops since the last read, recorded as a ``capture_loss`` at ``now``."""
        self._last_stats = now
        dropped = kernel_drops(self.sock)
        if dropped:
            self.stats.kernel_dropped += dropped
            self.emit(
                ev.CaptureLoss(
                    t=now,
                    m=now,
                    tap=self.loss_tap,
                    dropped=dropped,
                    dropped_bytes=0,
                    reason=f"packet capture: {dropped} packet(s) dropped by the kernel while "
                    f"capturing live on {self.where} (its buffer was full: the reader fell "
                    "behind, or --buffer-size is too small)",
                )
            )
        return dropped

    def finish(self, reason: str) -> None:
        """The capture is over: the last drops, then the tap's end (what is in flight
        ends ``in_flight``, each tap's ``capture_end``)."""
        now = self.clock()
        self.read_drops(now)
        self.tap.finish(now, reason=reason)
        self.tap.stats.kernel_dropped = self.stats.kernel_dropped  # (recorded as it came)
