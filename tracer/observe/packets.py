"""Captured frames down to TCP segments, and what a capture lost. Sans-I/O.

``decode_frame`` takes one link-layer frame apart with dpkt (Ethernet with its VLAN
tags, Linux cooked v1 and v2 as ``tcpdump -i any`` writes them, raw IPv4/IPv6, BSD
loopback) down to an IPv4 or IPv6 TCP segment (``Packet``), or says why it is not one
(``Skipped``). A frame the capture cut short (its snapshot length) says how many of its
TCP payload bytes were not kept: its IP header gives the length it had on the wire.
``PassiveStats`` counts what a passive tap saw and what the capture lost, and writes the
losses as ``capture_loss`` records.
"""

from __future__ import annotations

import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import dpkt  # type: ignore[import-untyped]

from .. import events as ev
from .tcp import ACK, Endpoint, Segment

SkipReason = Literal["link", "not_ip", "not_tcp", "fragment", "cut_header", "malformed"]

# link types (pcap LINKTYPE_* values, as files and packet sockets name them)
LINKTYPE_NULL = 0  # BSD loopback: a 4-byte address family in the capturing host's order
LINKTYPE_ETHERNET = 1
LINKTYPE_RAW_BSD = 12  # DLT_RAW on most systems, DLT_LOOP on OpenBSD
LINKTYPE_RAW_OPENBSD = 14
LINKTYPE_RAW = 101
LINKTYPE_LOOP = 108  # OpenBSD loopback: the family in network order
LINKTYPE_LINUX_SLL = 113  # tcpdump -i any (libpcap before 1.10)
LINKTYPE_IPV4 = 228
LINKTYPE_IPV6 = 229
LINKTYPE_LINUX_SLL2 = 276  # tcpdump -i any (libpcap 1.10 and later)
LINKTYPES = frozenset(
    {
        LINKTYPE_NULL,
        LINKTYPE_ETHERNET,
        LINKTYPE_RAW_BSD,
        LINKTYPE_RAW_OPENBSD,
        LINKTYPE_RAW,
        LINKTYPE_LOOP,
        LINKTYPE_LINUX_SLL,
        LINKTYPE_IPV4,
        LINKTYPE_IPV6,
        LINKTYPE_LINUX_SLL2,
    }
)


# ---- frames --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Packet:
    """A TCP segment out of a frame; ``cut``: its payload bytes the capture did not keep."""

    src: Endpoint
    dst: Endpoint
    segment: Segment
    cut: int = 0


@dataclass(frozen=True, slots=True)
class Skipped:
    """A frame that is not a TCP segment this can follow, and why."""

    reason: SkipReason
    cut: bool = False  # the capture cut it short (a TCP header cut: it is lost)


def decode_frame(linktype: int, frame: bytes, t: float) -> Packet | Skipped:
    """One frame of a capture, taken apart with dpkt down to its TCP segment."""
    try:
        net = _network(linktype, frame)
    except (dpkt.UnpackError, IndexError, ValueError):
        return Skipped("malformed")
    if net is None:
        return Skipped("link" if linktype not in LINKTYPES else "not_ip")
    try:
        return _transport(net, t)
    except (dpkt.UnpackError, IndexError, ValueError, OSError):
        return Skipped("malformed")


def _network(linktype: int, frame: bytes) -> Any:
    """The IPv4 or IPv6 packet in a frame (a dpkt object), or None."""
    if linktype == LINKTYPE_ETHERNET:
        inner = dpkt.ethernet.Ethernet(frame).data
    elif linktype == LINKTYPE_LINUX_SLL:
        inner = dpkt.sll.SLL(frame).data
    elif linktype == LINKTYPE_LINUX_SLL2:
        inner = dpkt.sll2.SLL2(frame).data
    elif linktype in (LINKTYPE_NULL, LINKTYPE_LOOP):
        inner = _by_version(
            frame[4:]
        )  # the family's number varies by system: the IP version does not
    elif linktype in (LINKTYPE_RAW, LINKTYPE_IPV4, LINKTYPE_IPV6, LINKTYPE_RAW_OPENBSD):
        inner = _by_version(frame)
    elif linktype == LINKTYPE_RAW_BSD:
        inner = _by_version(frame) if frame and frame[0] >> 4 in (4, 6) else _by_version(frame[4:])
    else:
        return None
    return inner if isinstance(inner, (dpkt.ip.IP, dpkt.ip6.IP6)) else None


def _by_version(data: bytes) -> Any:
    if not data:
        return None
    version = data[0] >> 4
    if version == 4:
        return dpkt.ip.IP(data)
    if version == 6:
        return dpkt.ip6.IP6(data)
    return None


def _transport(net: Any, t: float) -> Packet | Skipped:
    if isinstance(net, dpkt.ip.IP):
        if net.p != dpkt.ip.IP_PROTO_TCP:
            return Skipped("not_tcp")
        if net.offset or net.mf:
            return Skipped("fragment")
        family = socket.AF_INET
        # the TCP segment's length on the wire (0: a TSO/GRO packet, its length unsaid)
        on_wire = net.len - net.hl * 4 if net.len else None
    else:
        if net.p != dpkt.ip.IP_PROTO_TCP:
            return Skipped("not_tcp")
        if 44 in net.extension_hdrs:  # a fragment header
            return Skipped("fragment")
        family = socket.AF_INET6
        ext = sum(int(h.length) for h in net.all_extension_headers)
        on_wire = net.plen - ext if net.plen else None
    seg = net.data
    if not isinstance(seg, dpkt.tcp.TCP):
        return Skipped("cut_header", cut=True)  # the TCP header itself was not kept whole
    payload = bytes(seg.data)
    header = seg.off * 4
    wire_len: int | None = None
    cut = 0
    if on_wire is not None and on_wire - header > len(payload):
        wire_len = on_wire - header
        cut = wire_len - len(payload)
    flags = int(seg.flags)
    src = Endpoint(socket.inet_ntop(family, net.src), int(seg.sport))
    dst = Endpoint(socket.inet_ntop(family, net.dst), int(seg.dport))
    segment = Segment(
        t=t,
        seq=int(seg.seq),
        flags=flags,
        payload=payload,
        ack=int(seg.ack) if flags & ACK else None,
        window=int(seg.win),
        wire_len=wire_len,
    )
    return Packet(src, dst, segment, cut)


# ---- what the capture lost -------------------------------------------------------------


@dataclass(slots=True)
class PassiveStats:
    """What a passive tap saw of its packets, and what the capture lost."""

    packets: int = 0
    tcp_packets: int = 0
    skipped: Counter[str] = field(default_factory=Counter)  # frames not followed, by reason
    truncated_packets: int = 0  # cut by the capture's snaplen
    truncated_bytes: int = 0  # TCP payload bytes those lost
    kernel_dropped: int | None = None  # dropped by the kernel while capturing (None: unknown)
    connections: int = 0  # TCP connections seen
    followed: int = 0  # ... followed as HTTP/1.x
    ignored: int = 0  # ... not (another port, not HTTP, no request seen)
    without_start: int = 0  # followed connections whose handshake was not captured
    gaps: Counter[str] = field(default_factory=Counter)  # gaps in followed streams, by tap
    gap_bytes: Counter[str] = field(default_factory=Counter)
    duplicate_bytes: int = 0  # retransmitted or overlapping bytes dropped (followed streams)
    skipped_bytes: int = 0  # bytes before the first request head of a connection (not parsed)
    stragglers: int = 0  # segments of connections already closed, ignored
    first_t: float | None = None
    last_t: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "packets": self.packets,
            "tcp_packets": self.tcp_packets,
            "skipped": dict(self.skipped),
            "truncated_packets": self.truncated_packets,
            "truncated_bytes": self.truncated_bytes,
            "kernel_dropped": self.kernel_dropped,
            "connections": self.connections,
            "followed": self.followed,
            "ignored": self.ignored,
            "without_start": self.without_start,
            "gaps": sum(self.gaps.values()),
            "gap_bytes": sum(self.gap_bytes.values()),
            "duplicate_bytes": self.duplicate_bytes,
            "skipped_bytes": self.skipped_bytes,
            "stragglers": self.stragglers,
        }

    def loss_events(self, taps: list[str], t: float) -> list[ev.CaptureLoss]:
        """What the capture lost, as ``capture_loss`` records: the kernel's drops and the
        snaplen's cuts (the file's, under the first tap), the gaps in each tap's streams."""
        out: list[ev.CaptureLoss] = []
        first = taps[0] if taps else "pcap"
        if self.kernel_dropped:
            out.append(
                ev.CaptureLoss(
                    t=t,
                    m=t,
                    tap=first,
                    dropped=self.kernel_dropped,
                    dropped_bytes=0,
                    reason=f"packet capture: {self.kernel_dropped} packet(s) dropped by the "
                    "kernel while capturing",
                )
            )
        if self.truncated_packets:
            out.append(
                ev.CaptureLoss(
                    t=t,
                    m=t,
                    tap=first,
                    dropped=self.truncated_packets,
                    dropped_bytes=self.truncated_bytes,
                    reason=f"packet capture: {self.truncated_packets} packet(s) cut short by "
                    f"the snapshot length ({self.truncated_bytes} TCP bytes not kept)",
                )
            )
        for tap in taps:
            if self.gaps[tap]:
                out.append(
                    ev.CaptureLoss(
                        t=t,
                        m=t,
                        tap=tap,
                        dropped=self.gaps[tap],
                        dropped_bytes=self.gap_bytes[tap],
                        reason=f"packet capture: {self.gaps[tap]} gap(s) in followed TCP "
                        f"streams ({self.gap_bytes[tap]} bytes the capture does not have)",
                    )
                )
        return out
