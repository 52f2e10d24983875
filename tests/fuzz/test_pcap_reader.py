"""The packet capture reader (``tracer/observe/pcap.py``, through ``read_into``) on
mutated recorded pcaps, pcapng files made from them, and arbitrary bytes: a read, or one
line of ``CaptureError`` naming the file (``events_from_pcap`` itself: ``PcapError``)."""

from __future__ import annotations

import io
import socket
import struct
from pathlib import Path

import dpkt  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tracer import events as ev
from tracer.capture.reader import PACKETS, CaptureError, PacketOptions, read_into
from tracer.observe.pcap import (
    InterfaceStatisticsBlockLE,
    PcapError,
    PcapStats,
    events_from_pcap,
)

from .support import budget, mutated, no_hang, ran

MOD = 1 << 32
PCAPS = tuple(sorted((Path(__file__).parents[1] / "data" / "pcap").glob("*.pcap")))


def _frames(raw: bytes) -> tuple[int, list[tuple[float, bytes]]]:
    reader = dpkt.pcap.Reader(io.BytesIO(raw))
    return int(reader.datalink()), [(float(t), bytes(b)) for t, b in reader]


def _pcap(linktype: int, frames: list[tuple[float, bytes]], *, nano: bool = False) -> bytes:
    out = io.BytesIO()
    writer = dpkt.pcap.Writer(out, snaplen=65535, linktype=linktype, nano=nano)
    for t, frame in frames:
        writer.writepkt(frame, ts=t)
    return out.getvalue()


def _pcapng(linktype: int, frames: list[tuple[float, bytes]]) -> bytes:
    """The frames as dumpcap writes them: a section, an interface with its time
    resolution, enhanced packet blocks with a drop count, a statistics block."""
    opt = dpkt.pcapng.PcapngOptionLE
    out = io.BytesIO()
    idb = dpkt.pcapng.InterfaceDescriptionBlockLE(
        linktype=linktype,
        snaplen=65535,
        opts=[opt(code=9, data=b"\x06"), opt(code=0, data=b"")],  # microseconds
    )
    writer = dpkt.pcapng.Writer(out, shb=dpkt.pcapng.SectionHeaderBlockLE(), idb=idb)
    for t, frame in frames:
        ticks = int(t * 1e6)
        epb = dpkt.pcapng.EnhancedPacketBlockLE(
            ts_high=ticks >> 32,
            ts_low=ticks & 0xFFFFFFFF,
            pkt_len=len(frame),
            pkt_data=frame,
            opts=[opt(code=4, data=struct.pack("<Q", 0)), opt(code=0, data=b"")],
        )
        writer.writepkt(epb)
    ticks = int(frames[-1][0] * 1e6)
    isb = InterfaceStatisticsBlockLE(
        iface_id=0,
        ts_high=ticks >> 32,
        ts_low=ticks & 0xFFFFFFFF,
        opts=[opt(code=5, data=struct.pack("<Q", 3)), opt(code=0, data=b"")],
    )
    out.write(bytes(isb))
    return out.getvalue()


def _seeds() -> tuple[bytes, ...]:
    seeds: list[bytes] = []
    for path in PCAPS:
        raw = path.read_bytes()
        linktype, frames = _frames(raw)
        seeds += [raw, _pcapng(linktype, frames), _pcap(linktype, frames, nano=True)]
        # the first packets alone: the file's structure is most of what a mutation hits
        seeds += [_pcap(linktype, frames[:6]), _pcapng(linktype, frames[:6])]
    return tuple(seeds)


SEEDS = _seeds()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pcap")


def read(path: Path, packets: PacketOptions = PACKETS) -> list[ev.Event] | None:
    """``read_into`` as the analysis calls it, and ``events_from_pcap`` as a tool would."""
    events: list[ev.Event] = []
    with no_hang():
        try:
            stats = read_into(path, events.append, packets)
        except CaptureError as exc:
            text = str(exc)
            assert text and "\n" not in text and str(path) in text, text
            return None
        assert stats.version is not None
        for event in events:
            assert isinstance(event, ev.Event)
            event.to_record()
        try:
            direct = list(events_from_pcap(path, stats=PcapStats()))
        except PcapError:
            pytest.fail("read_into read what events_from_pcap refuses")
        assert len(direct) == len(events) or packets != PACKETS
    return events


OPTIONS = st.sampled_from(
    [
        PacketOptions(),
        PacketOptions(ports=(8000,)),
        PacketOptions(taps=((8000, "front"), (30000, "back")), roles=(("back", "engine"),)),
    ]
)


@budget(1.0)
@given(data=mutated(SEEDS, most=6), packets=OPTIONS)
def test_mutated_packet_captures(scratch: Path, data: bytes, packets: PacketOptions) -> None:
    ran("pcap.mutated")
    path = scratch / "mutated.pcap"
    path.write_bytes(data)
    read(path, packets)


MAGICS = (b"\xd4\xc3\xb2\xa1", b"\xa1\xb2\xc3\xd4", b"\x4d\x3c\xb2\xa1", b"\x0a\x0d\x0d\x0a")


@budget(0.5)
@given(
    data=st.builds(bytes.__add__, st.sampled_from(MAGICS), st.binary(max_size=600))
    | st.binary(max_size=64)
)
def test_arbitrary_bytes(scratch: Path, data: bytes) -> None:
    ran("pcap.arbitrary")
    path = scratch / "arbitrary.pcap"
    path.write_bytes(data)
    read(path)
    try:
        with no_hang():
            list(events_from_pcap(path))
    except PcapError as exc:
        assert "\n" not in str(exc)


# ---- frames of TCP segments, well formed or not, in a well-formed file --------------

ENDS = st.sampled_from([("10.0.0.1", 40000), ("10.0.0.2", 8000), ("10.0.0.2", 30000)])
PAYLOADS = st.sampled_from(
    [
        b"",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}",
        b"GET / HTTP/1.1\r\nhost: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n",
        b'1a\r\ndata: {"content":"x"}\n\n\r\n',
        b"0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
    ]
) | st.binary(max_size=64)


@st.composite
def frames(draw: st.DrawFn) -> tuple[float, bytes]:
    (src, sport), (dst, dport) = draw(ENDS), draw(ENDS)
    tcp = dpkt.tcp.TCP(
        sport=sport,
        dport=dport,
        seq=(draw(st.sampled_from([0, 1000, 2**32 - 1, 2**31])) + draw(st.integers(0, 200))) % MOD,
        ack=(draw(st.sampled_from([0, 5000, 2**32 - 1])) + draw(st.integers(0, 200))) % MOD,
        flags=draw(st.integers(0, 0x3F)),
        win=draw(st.integers(0, 0xFFFF)),
        data=draw(PAYLOADS),
    )
    ip = dpkt.ip.IP(src=socket.inet_aton(src), dst=socket.inet_aton(dst), p=6, ttl=64, data=tcp)
    frame = bytes(dpkt.ethernet.Ethernet(type=dpkt.ethernet.ETH_TYPE_IP, data=bytes(ip)))
    if draw(st.integers(0, 9)) == 0:  # a frame broken in its headers
        frame = frame[: draw(st.integers(0, len(frame)))]
    return draw(st.floats(0.0, 100.0)), frame


@budget(0.8)
@given(
    packets=st.lists(frames(), min_size=1, max_size=30),
    ng=st.booleans(),
    options=OPTIONS,
)
def test_segments_in_any_order_and_shape(
    scratch: Path, packets: list[tuple[float, bytes]], ng: bool, options: PacketOptions
) -> None:
    ran("pcap.segments")
    path = scratch / "segments.pcap"
    path.write_bytes((_pcapng if ng else _pcap)(1, packets))
    read(path, options)


@budget(0.2)
@given(seed=st.sampled_from(range(len(SEEDS))), cut=st.floats(0.0, 1.0))
def test_a_capture_cut_short_is_read_up_to_the_cut(scratch: Path, seed: int, cut: float) -> None:
    ran("pcap.cut")
    whole = SEEDS[seed]
    path = scratch / "cut.pcap"
    path.write_bytes(whole[: int(len(whole) * cut)])
    read(path)


def _shb(options: bytes) -> bytes:
    """A little-endian pcapng section header block with these options."""
    body = struct.pack("<IHHq", 0x1A2B3C4D, 1, 0, -1) + options
    length = 12 + len(body)
    return struct.pack("<II", 0x0A0D0D0A, length) + body + struct.pack("<I", length)


def test_a_section_header_whose_comment_is_not_utf8(scratch: Path) -> None:
    """dpkt decodes a section header's comment option as text: bytes that are not UTF-8
    were a UnicodeDecodeError out of the reader (found by test_mutated_packet_captures)."""
    comment = struct.pack("<HH", 1, 1) + b"\xff\0\0\0" + struct.pack("<HH", 0, 0)
    good = SEEDS[1]  # a pcapng file
    assert good.startswith(b"\x0a\x0d\x0d\x0a")
    for data in (_shb(comment) + good[28:], good + _shb(comment) + good[28:]):
        path = scratch / "comment.pcapng"
        path.write_bytes(data)
        read(path)
