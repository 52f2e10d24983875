"""Packet capture files (tcpdump's pcap, pcapng) in, a tap's events out.

dpkt reads the files: ``dpkt.pcap.Reader`` a pcap file (microsecond or nanosecond,
either byte order); a pcapng file is walked block by block, each block decoded by
dpkt's block classes (and by ``InterfaceStatisticsBlock``, dpkt's block base given the
statistics block's fields), because ``dpkt.pcapng.Reader`` reads only the first
interface and skips the statistics: a capture of several interfaces (each with its own
link type and time resolution) and the kernel's drop counts need every block.

Each frame goes to a ``passive.PacketTap`` with its time as the capture wrote it: the
events are those a tap would have written, with ``t`` the packet times.
``events_from_pcap`` gives them for one tap; with ``taps`` (``{8000: "front", 30000:
"back"}``, or ``parse_tap_by_port("8000=front,30000=back")``) one tap per server port,
each with its own header, numbering and end, and one clock: the two are joined as
two captures taken on one host are. A capture cannot ask a server what it is: the role
of the server behind a port (``engine``, ``router``, ``proxy``) may be declared
(``upstream_role``, ``roles``, ``"30000=back:engine"``), and goes into the tap's header
and a ``topology`` record as ``tracer proxy --upstream-role`` writes it. What the file says of itself (format, link types,
snapshot length, the kernel's drops) and what the tap saw are in ``PcapStats``. The
events are given as a capture's reader gives them (a request's OpenAI fields and hashes
derived from its kept body): a reader of capture files can hand them on as they come.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, NamedTuple

import dpkt  # type: ignore[import-untyped]

from .. import events as ev
from ..capture.bodies import derive_request_end
from .packets import PassiveStats
from .passive import STALL_AFTER, PacketTap, TapsByPort, parse_tap_by_port
from .wire import Bodies

PCAPNG_SHB = 0x0A0D0D0A
PCAPNG_IDB = 1
PCAPNG_PB = 2
PCAPNG_SPB = 3
PCAPNG_ISB = 5
PCAPNG_EPB = 6
PCAPNG_BOM = 0x1A2B3C4D
OPT_IF_TSRESOL = 9
OPT_IF_TSOFFSET = 14
OPT_EPB_DROPCOUNT = 4
OPT_ISB_IFRECV = 4
OPT_ISB_IFDROP = 5
OPT_ISB_OSDROP = 7
MAX_BLOCK = 256 * 1024 * 1024  # a block claiming more is a broken file
_MAGICS = {
    b"\xd4\xc3\xb2\xa1": "pcap",
    b"\xa1\xb2\xc3\xd4": "pcap",
    b"\x4d\x3c\xb2\xa1": "pcap",  # nanosecond
    b"\xa1\xb2\x3c\x4d": "pcap",
    b"\x0a\x0d\x0d\x0a": "pcapng",
}

__all__ = [
    "Frame",
    "InterfaceStatisticsBlock",
    "InterfaceStatisticsBlockLE",
    "PcapError",
    "PcapStats",
    "TapsByPort",
    "events_from_pcap",
    "events_from_pcap_by_port",
    "parse_tap_by_port",
    "pcap_format",
    "read_frames",
]


class PcapError(ValueError):
    """A file that is not a packet capture this can read (or stops being one early)."""


class Frame(NamedTuple):
    """One captured frame: its time, its link type, its bytes as kept, and its length
    on the wire where the file says (pcapng; None for pcap, where dpkt does not)."""

    t: float
    linktype: int
    data: bytes
    orig_len: int | None = None


class InterfaceStatisticsBlock(dpkt.pcapng._PcapngBlock):  # type: ignore[misc]
    """A pcapng Interface Statistics Block (type 5): an interface's counters at a time,
    in options (``isb_ifrecv`` 4, ``isb_ifdrop`` 5, ``isb_osdrop`` 7 ... as uint64)."""

    __hdr__ = (
        ("type", "I", PCAPNG_ISB),
        ("len", "I", 24),
        ("iface_id", "I", 0),
        ("ts_high", "I", 0),
        ("ts_low", "I", 0),
        # ( options, variable size )
        ("_len", "I", 24),
    )

    def __bytes__(self) -> bytes:
        opts = self._do_pack_options()
        n = len(opts) + self.__hdr_len__
        self.len = self._len = n
        head = self._pack_hdr(self.type, n, self.iface_id, self.ts_high, self.ts_low, n)
        return bytes(head[:-4] + opts + head[-4:])


class InterfaceStatisticsBlockLE(InterfaceStatisticsBlock):
    __byte_order__ = "<"


@dataclass(slots=True)
class PcapStats:
    """What a capture file said of itself, and what the passive tap saw in it."""

    format: Literal["pcap", "pcapng"] | None = None
    linktypes: list[int] = field(default_factory=list)  # per interface (pcap: one)
    snaplen: int | None = None  # the largest interface's
    frames: int = 0
    records: int = 0  # events given
    kernel_dropped: int | None = None  # pcapng: isb_ifdrop + isb_osdrop, epb_dropcount
    frames_without_time: int = 0  # pcapng simple packet blocks: skipped
    torn_tail: bool = False  # the file ends inside a record (still being written, or cut)
    passive: PassiveStats = field(default_factory=PassiveStats)

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "linktypes": self.linktypes,
            "snaplen": self.snaplen,
            "frames": self.frames,
            "records": self.records,
            "kernel_dropped": self.kernel_dropped,
            "frames_without_time": self.frames_without_time,
            "torn_tail": self.torn_tail,
            **self.passive.as_dict(),
        }


def pcap_format(path: str | os.PathLike[str]) -> Literal["pcap", "pcapng"] | None:
    """``pcap`` or ``pcapng`` by the file's magic bytes (None: neither)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    kind = _MAGICS.get(head)
    return "pcap" if kind == "pcap" else "pcapng" if kind == "pcapng" else None


# ---- frames out of files -----------------------------------------------------------


def read_frames(path: str | os.PathLike[str], stats: PcapStats | None = None) -> Iterator[Frame]:
    """Every frame of a pcap or pcapng file, in file order (``stats``: what the file
    says of itself, filled in as it is read)."""
    stats = stats if stats is not None else PcapStats()
    kind = pcap_format(path)
    if kind is None:
        raise PcapError(f"{path}: not a pcap or pcapng file")
    stats.format = kind
    with open(path, "rb") as fh:
        if kind == "pcap":
            yield from _pcap_frames(fh, stats, str(path))
        else:
            yield from _pcapng_frames(fh, stats, str(path))


def _pcap_frames(fh: BinaryIO, stats: PcapStats, name: str) -> Iterator[Frame]:
    try:
        reader = dpkt.pcap.Reader(fh)
    except (ValueError, dpkt.UnpackError, struct.error) as exc:
        raise PcapError(f"{name}: not a readable pcap file ({exc})") from None
    linktype = int(reader.datalink())
    stats.linktypes = [linktype]
    stats.snaplen = int(reader.snaplen)
    packets = iter(reader)
    while True:
        try:
            ts, buf = next(packets)
        except StopIteration:
            return
        except (dpkt.NeedData, dpkt.UnpackError, struct.error, ValueError):
            stats.torn_tail = True  # a record header cut: the file ends there
            return
        stats.frames += 1
        yield Frame(float(ts), linktype, bytes(buf))


@dataclass(slots=True)
class _Interface:
    linktype: int
    divisor: float = 1e6
    offset: int = 0
    dropped: int = 0  # its last statistics block's drop counts


def _pcapng_frames(fh: BinaryIO, stats: PcapStats, name: str) -> Iterator[Frame]:
    """The pcapng blocks one by one: each decoded by dpkt (the byte order is the
    section header's; each section has its own interfaces)."""
    order = "<"
    sections: list[list[_Interface]] = []
    interfaces: list[_Interface] = []
    dropped_in_packets = 0
    saw_drop_counts = False
    first = True
    while True:
        head = fh.read(12)
        if len(head) < 12:
            stats.torn_tail = stats.torn_tail or bool(head)
            break
        (kind,) = struct.unpack("<I", head[:4])  # (the section header's type reads alike both ways)
        if kind == PCAPNG_SHB:
            (bom,) = struct.unpack("<I", head[8:12])
            order = "<" if bom == PCAPNG_BOM else ">"
        elif first:
            raise PcapError(f"{name}: not a pcapng file (no section header first)")
        kind, length = struct.unpack(order + "II", head[:8])
        if length < 12 or length % 4 or length > MAX_BLOCK:
            if first:
                raise PcapError(f"{name}: not a readable pcapng file (block of {length} bytes)")
            stats.torn_tail = True
            break
        rest = fh.read(length - 12)
        if len(rest) < length - 12:
            stats.torn_tail = True
            break
        buf = head + rest
        le = order == "<"
        try:
            if kind == PCAPNG_SHB:
                shb = (dpkt.pcapng.SectionHeaderBlockLE if le else dpkt.pcapng.SectionHeaderBlock)(
                    buf
                )
                if shb.v_major != 1:
                    raise PcapError(f"{name}: pcapng version {shb.v_major}.{shb.v_minor}")
                if interfaces:
                    sections.append(interfaces)
                interfaces = []
            elif kind == PCAPNG_IDB:
                idb = (
                    dpkt.pcapng.InterfaceDescriptionBlockLE
                    if le
                    else dpkt.pcapng.InterfaceDescriptionBlock
                )(buf)
                interfaces.append(_interface(idb, order))
                stats.linktypes.append(int(idb.linktype))
                if idb.snaplen:
                    stats.snaplen = max(stats.snaplen or 0, int(idb.snaplen))
            elif kind in (PCAPNG_EPB, PCAPNG_PB):
                if kind == PCAPNG_EPB:
                    cls = (
                        dpkt.pcapng.EnhancedPacketBlockLE if le else dpkt.pcapng.EnhancedPacketBlock
                    )
                else:
                    cls = dpkt.pcapng.PacketBlockLE if le else dpkt.pcapng.PacketBlock
                block = cls(buf)
                if block.iface_id >= len(interfaces):
                    continue  # no such interface: not a frame this can place
                iface = interfaces[block.iface_id]
                if kind == PCAPNG_PB:
                    dropped_in_packets += int(block.drops_count)
                    saw_drop_counts = True
                for opt in block.opts:
                    if opt.code == OPT_EPB_DROPCOUNT and len(opt.data) == 8:
                        dropped_in_packets += struct.unpack(order + "Q", opt.data)[0]
                        saw_drop_counts = True
                ticks = (int(block.ts_high) << 32) | int(block.ts_low)
                stats.frames += 1
                yield Frame(
                    iface.offset + ticks / iface.divisor,
                    iface.linktype,
                    bytes(block.pkt_data),
                    int(block.pkt_len),
                )
            elif kind == PCAPNG_SPB:
                stats.frames_without_time += 1
            elif kind == PCAPNG_ISB:
                isb = (InterfaceStatisticsBlockLE if le else InterfaceStatisticsBlock)(buf)
                if isb.iface_id < len(interfaces):
                    drops = _counters(isb.opts, order, (OPT_ISB_IFDROP, OPT_ISB_OSDROP))
                    if drops is not None:  # counts since the start: the last one is the total
                        interfaces[isb.iface_id].dropped = drops
                        saw_drop_counts = True
        except (dpkt.UnpackError, dpkt.NeedData, struct.error, UnicodeDecodeError) as exc:
            if first:
                raise PcapError(f"{name}: not a readable pcapng file ({exc})") from None
            continue  # one bad block: the next one may be fine
        first = False
    sections.append(interfaces)
    if saw_drop_counts:
        stats.kernel_dropped = dropped_in_packets + sum(i.dropped for s in sections for i in s)


def _interface(idb: Any, order: str) -> _Interface:
    iface = _Interface(int(idb.linktype))
    for opt in idb.opts:
        if opt.code == OPT_IF_TSRESOL and len(opt.data) >= 1:
            value = opt.data[0]
            iface.divisor = float(2 ** (value & 0x7F) if value & 0x80 else 10**value)
        elif opt.code == OPT_IF_TSOFFSET and len(opt.data) == 8:
            iface.offset = struct.unpack(order + "q", opt.data)[0]
    return iface


def _counters(opts: Any, order: str, codes: tuple[int, ...]) -> int | None:
    values = [
        struct.unpack(order + "Q", o.data)[0] for o in opts if o.code in codes and len(o.data) == 8
    ]
    return sum(values) if values else None


# ---- events ------------------------------------------------------------------------


def events_from_pcap(
    path: str | os.PathLike[str],
    *,
    tap: str = "pcap",
    ports: Collection[int] | None = None,
    taps: Mapping[int, str] | None = None,
    upstream_role: str | None = None,
    roles: Mapping[str, str] | None = None,
    stats: PcapStats | None = None,
    stall_after: float = STALL_AFTER,
    bodies: Bodies = "requests",
    loss_evidence: bool = True,
) -> Iterator[ev.Event]:
    """The events a tap would have written for the HTTP/1.1 connections in a capture
    file, in order: each tap's ``capture_start`` (``kind`` ``pcap``; then its ``topology``
    when its role is declared), the connections'
    events with ``t`` = ``m`` = packet times, what the capture lost (``capture_loss``,
    unless ``loss_evidence`` is False), each tap's ``capture_end``.

    ``ports``: server ports to follow (None: every connection whose first bytes are an
    HTTP request). ``taps``: server port -> tap name (several taps; replaces ``tap`` and
    ``ports``). ``upstream_role``: what the server is (``engine``, ``router``,
    ``proxy``) for the one tap; ``roles``: the same per tap name, with ``taps``; both as
    declared (the header's ``upstream_role`` and a ``topology`` record, basis
    ``declared``). ``stats`` is filled in as the events are read.
    """
    if upstream_role is not None and taps:
        raise ValueError("upstream_role is for one tap: with taps, give roles (tap -> role)")
    stats = stats if stats is not None else PcapStats()
    out: list[ev.Event] = []
    name = Path(path).name
    passive = PacketTap(
        emit=out.append,
        tap=tap,
        ports=ports,
        taps=taps,
        roles={**(roles or {}), **({tap: upstream_role} if upstream_role is not None else {})},
        stall_after=stall_after,
        bodies=bodies,
        kind="pcap",
        options={"source": name},
        boot_id=_file_clock(path),
        loss_evidence=loss_evidence,
    )
    stats.passive = passive.stats
    for frame in read_frames(path, stats):
        passive.packet(frame.t, frame.linktype, frame.data, orig_len=frame.orig_len)
        if out:
            stats.records += len(out)
            yield from map(_as_read, out)
            out.clear()
    passive.finish(kernel_dropped=stats.kernel_dropped, reason="end of the packet capture")
    stats.records += len(out)
    yield from map(_as_read, out)


def _as_read(event: ev.Event) -> ev.Event:
    """An event as a capture's reader gives it: a request's hash and OpenAI fields (what
    joins it across taps) derived from its kept body, as the tap leaves them to the reader."""
    if not isinstance(event, ev.RequestEnd) or event.body is None or event.body_sha256:
        return event
    record = event.to_record()
    derive_request_end(record)
    derived = ev.from_record(record)
    return derived if derived is not None else event


def events_from_pcap_by_port(
    path: str | os.PathLike[str],
    taps: Mapping[int, str] | str | TapsByPort,
    *,
    roles: Mapping[str, str] | None = None,
    stats: PcapStats | None = None,
    stall_after: float = STALL_AFTER,
    bodies: Bodies = "requests",
    loss_evidence: bool = True,
) -> Iterator[ev.Event]:
    """Several taps out of one capture, one per server port: ``taps`` as
    ``{8000: "front", 30000: "back"}`` (with ``roles``, e.g. ``{"back": "engine"}``) or
    ``"8000=front,30000=back:engine"``."""
    spec = parse_tap_by_port(taps) if isinstance(taps, str) else taps
    if isinstance(spec, TapsByPort):
        by_port, declared = dict(spec.taps), {**spec.roles, **(roles or {})}
    else:
        by_port, declared = dict(spec), dict(roles or {})
    return events_from_pcap(
        path,
        taps=by_port,
        roles=declared,
        stats=stats,
        stall_after=stall_after,
        bodies=bodies,
        loss_evidence=loss_evidence,
    )


def _file_clock(path: str | os.PathLike[str]) -> str:
    """One clock id per capture file (its taps read the same clock: the analysis joins
    them as taps of one boot, with no slack between their times)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        digest.update(fh.read(1 << 16))
    digest.update(str(os.path.getsize(path)).encode())
    return "pcap-" + digest.hexdigest()[:16]
