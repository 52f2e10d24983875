"""Packet captures in (``tracer/observe/pcap.py``, ``passive.py``, ``packets.py``): pcap
and pcapng files written with dpkt's own writers from crafted TCP segments, read back
as the events a tap writes, and those fed to the analysis.

The exchange: a POST /v1/chat/completions answered by a chunked SSE stream (three
content events, a finish, ``data: [DONE]``), then a GET /v1/models on the same
keep-alive connection, then FIN from the client and the server.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dpkt  # type: ignore[import-untyped]
import pytest

from tracer import events as ev
from tracer.analysis.summary import Summary
from tracer.observe.packets import Packet, Skipped, decode_frame
from tracer.observe.passive import PacketTap, looks_like_request, parse_tap_by_port
from tracer.observe.pcap import (
    InterfaceStatisticsBlock,
    InterfaceStatisticsBlockLE,
    PcapError,
    PcapStats,
    events_from_pcap,
    events_from_pcap_by_port,
    read_frames,
)
from tracer.observe.tcp import ACK, FIN, PSH, RST, SYN, Endpoint

T0 = 1_700_000_000.0
CLIENT = ("10.0.0.1", 40000)
SERVER = ("10.0.0.2", 8000)
MAC_C = b"\x02\x00\x00\x00\x00\x01"
MAC_S = b"\x02\x00\x00\x00\x00\x02"

BODY = b'{"model":"m","stream":true,"max_tokens":16,"messages":[{"role":"user","content":"hello"}]}'
REQUEST_1 = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: engine\r\ncontent-type: application/json\r\n"
    b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
)
RESPONSE_HEAD_1 = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
SSE = [
    b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"!"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]
REQUEST_2 = b"GET /v1/models HTTP/1.1\r\nhost: engine\r\n\r\n"
MODELS = b'{"object":"list","data":[{"id":"m"}]}'
RESPONSE_2 = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(MODELS)).encode()
    + b"\r\n\r\n"
    + MODELS
)


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


# ---- crafting segments --------------------------------------------------------------


@dataclass
class Pkt:
    t: float
    frame: bytes  # an Ethernet frame
    ip: bytes  # the IP packet in it
    note: str = ""


@dataclass
class Flow:
    """One TCP connection's packets, with both sides' sequence numbers kept."""

    client: tuple[str, int] = CLIENT
    server: tuple[str, int] = SERVER
    cseq: int = 1000
    sseq: int = 5000
    packets: list[Pkt] = field(default_factory=list)

    def send(
        self,
        t: float,
        from_client: bool,
        payload: bytes = b"",
        flags: int = ACK | PSH,
        *,
        window: int = 512,
        note: str = "",
        advance: bool = True,
    ) -> Pkt:
        src, dst = (self.client, self.server) if from_client else (self.server, self.client)
        seq = self.cseq if from_client else self.sseq
        ack = self.sseq if from_client else self.cseq
        seg = dpkt.tcp.TCP(
            sport=src[1],
            dport=dst[1],
            seq=seq % 2**32,
            ack=ack % 2**32 if flags & ACK else 0,
            flags=flags,
            win=window,
            data=payload,
        )
        ip = dpkt.ip.IP(
            src=socket.inet_aton(src[0]), dst=socket.inet_aton(dst[0]), p=6, ttl=64, data=seg
        )
        raw_ip = bytes(ip)
        eth = dpkt.ethernet.Ethernet(
            src=MAC_C if from_client else MAC_S,
            dst=MAC_S if from_client else MAC_C,
            type=dpkt.ethernet.ETH_TYPE_IP,
            data=raw_ip,
        )
        pkt = Pkt(t, bytes(eth), raw_ip, note)
        self.packets.append(pkt)
        if advance:
            used = len(payload) + (1 if flags & (SYN | FIN) else 0)
            if from_client:
                self.cseq += used
            else:
                self.sseq += used
        return pkt

    def handshake(self, t: float) -> None:
        self.send(t, True, flags=SYN)
        self.send(t + 0.0001, False, flags=SYN | ACK)
        self.send(t + 0.0002, True, flags=ACK)

    def ack(self, t: float, from_client: bool, window: int = 512) -> None:
        self.send(t, from_client, flags=ACK, window=window)


def exchange(flow: Flow, *, t: float = T0) -> dict[str, float]:
    """The two requests; returns the times of the packets that matter."""
    times: dict[str, float] = {"syn": t}
    flow.handshake(t)
    times["req1"] = t + 0.001
    flow.send(times["req1"], True, REQUEST_1)
    flow.ack(t + 0.0011, False)
    times["head1"] = t + 0.010
    flow.send(times["head1"], False, RESPONSE_HEAD_1)
    for i, event in enumerate(SSE):
        times[f"sse{i}"] = t + 0.050 + i * 0.020
        flow.send(times[f"sse{i}"], False, chunk(event), note=f"sse{i}")
        flow.ack(times[f"sse{i}"] + 0.0001, True)
    times["end1"] = t + 0.200
    flow.send(times["end1"], False, b"0\r\n\r\n", note="last-chunk")
    flow.ack(t + 0.2001, True)
    times["req2"] = t + 1.000
    flow.send(times["req2"], True, REQUEST_2)
    times["resp2"] = t + 1.005
    flow.send(times["resp2"], False, RESPONSE_2)
    flow.ack(t + 1.0051, True)
    times["fin_c"] = t + 1.100
    flow.send(times["fin_c"], True, flags=FIN | ACK)
    times["fin_s"] = t + 1.1001
    flow.send(times["fin_s"], False, flags=FIN | ACK)
    flow.ack(t + 1.1002, True)
    return times


def write_pcap(path: Path, packets: list[Pkt], *, snaplen: int | None = None) -> Path:
    with open(path, "wb") as fh:
        writer = dpkt.pcap.Writer(fh, snaplen=snaplen or 65535, linktype=dpkt.pcap.DLT_EN10MB)
        for p in packets:
            writer.writepkt(p.frame if snaplen is None else p.frame[:snaplen], ts=p.t)
    return path


def write_pcapng(path: Path, packets: list[Pkt], *, ifdrop: int | None = None) -> Path:
    with open(path, "wb") as fh:
        writer = dpkt.pcapng.Writer(fh, snaplen=65535, linktype=dpkt.pcapng.DLT_EN10MB)
        for p in packets:
            writer.writepkt(p.frame, ts=p.t)
        if ifdrop is not None:  # the statistics dumpcap writes at the end
            cls = (
                InterfaceStatisticsBlockLE
                if sys.byteorder == "little"
                else InterfaceStatisticsBlock
            )
            le = "<" if sys.byteorder == "little" else ">"
            opt = dpkt.pcapng.PcapngOptionLE if le == "<" else dpkt.pcapng.PcapngOption
            ticks = int(packets[-1].t * 1e6)
            isb = cls(
                iface_id=0,
                ts_high=ticks >> 32,
                ts_low=ticks & 0xFFFFFFFF,
                opts=[
                    opt(code=4, data=(len(packets) + ifdrop).to_bytes(8, sys.byteorder)),
                    opt(code=5, data=ifdrop.to_bytes(8, sys.byteorder)),
                    opt(code=0, data=b""),
                ],
            )
            fh.write(bytes(isb))
    return path


def read(path: Path, **kw: Any) -> tuple[list[ev.Event], PcapStats]:
    stats = PcapStats()
    return list(events_from_pcap(path, stats=stats, **kw)), stats


def of[E: ev.Event](events: list[ev.Event], kind: type[E]) -> list[E]:
    return [e for e in events if isinstance(e, kind)]


def summarize(events: list[ev.Event]) -> dict[str, Any]:
    with Summary() as summary:
        for event in events:
            summary.feed(event)
        result = summary.result()
        # the tables are read as they are iterated (and may be spilled): read them here
        result["requests"] = [dict(r) for r in result["requests"]]
        result["connections"] = [dict(c) for c in result["connections"]]
        return result


# ---- the exchange, whole -------------------------------------------------------------


@pytest.fixture(params=["pcap", "pcapng"])
def capture(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, dict[str, float], Flow]:
    flow = Flow()
    times = exchange(flow)
    writer = write_pcap if request.param == "pcap" else write_pcapng
    return writer(tmp_path / f"run.{request.param}", flow.packets), times, flow


def test_a_capture_gives_the_events_a_tap_writes(
    capture: tuple[Path, dict[str, float], Flow],
) -> None:
    path, times, _ = capture
    events, stats = read(path)
    assert isinstance(events[0], ev.CaptureStart) and events[0].kind == "pcap"
    assert events[0].tap == "pcap" and events[0].t == events[0].m == times["syn"]
    assert isinstance(events[-1], ev.CaptureEnd) and events[-1].records == len(events)
    assert stats.format == path.suffix[1:] and stats.linktypes == [1]
    assert stats.passive.connections == stats.passive.followed == 1
    (opened,) = of(events, ev.ConnOpen)
    assert (opened.peer, opened.local, opened.t) == (
        "10.0.0.1:40000",
        "10.0.0.2:8000",
        times["syn"],
    )
    connect = of(events, ev.UpstreamConnect)
    assert [c.phase for c in connect] == ["start", "done"]
    assert connect[1].addr == "10.0.0.2:8000" and connect[1].elapsed == pytest.approx(
        0.0001, abs=1e-6
    )
    requests = of(events, ev.RequestHead)
    assert [(r.seq, r.method, r.target) for r in requests] == [
        (1, "POST", "/v1/chat/completions"),
        (2, "GET", "/v1/models"),
    ]
    assert [r.t for r in requests] == [times["req1"], times["req2"]]
    assert requests[1].idle_before == pytest.approx(times["req2"] - times["end1"], abs=1e-6)
    (end_req1, _) = of(events, ev.RequestEnd)
    assert end_req1.complete and end_req1.model == "m" and end_req1.stream is True
    heads = of(events, ev.ResponseHead)
    assert [(h.status, h.sse, h.t) for h in heads] == [
        (200, True, times["head1"]),
        (200, False, times["resp2"]),
    ]
    ends = of(events, ev.ResponseEnd)
    assert [(e.seq, e.termination, e.status) for e in ends] == [
        (1, "complete", 200),
        (2, "complete", 200),
    ]
    first = ends[0]
    assert first.events == 5 and first.done and first.finish_reason == "stop"
    assert first.t == times["end1"]
    assert first.first_token == pytest.approx(times["sse0"] - times["req1"], abs=1e-6)
    assert first.ttfb == pytest.approx(times["head1"] - times["req1"], abs=1e-6)
    assert first.body_bytes == sum(len(e) for e in SSE)
    assert ends[1].body_bytes == len(MODELS) and ends[1].t == times["resp2"]
    arrivals = [
        round(b.m + read_[0], 6) for b in of(events, ev.BodyData) for read_ in b.reads
    ]  # every read keeps its packet's time
    assert arrivals[: len(SSE)] == [round(times[f"sse{i}"], 6) for i in range(len(SSE))]
    (closed,) = of(events, ev.ConnClose)
    assert (closed.closed_by, closed.how, closed.half_close) == ("client", "fin", None)
    assert closed.requests == 2 and not closed.in_flight and closed.upstream_opened
    assert closed.bytes_from_client == len(REQUEST_1) + len(REQUEST_2)
    sent = len(RESPONSE_HEAD_1) + sum(len(chunk(e)) for e in SSE) + 5 + len(RESPONSE_2)
    assert closed.bytes_from_upstream == sent
    assert closed.t == times["fin_s"]
    assert not of(events, ev.Stall) and not of(events, ev.Anomaly)
    assert not of(events, ev.CaptureLoss)
    # records parse back as what they are (what a capture file holds)
    assert [ev.from_record(e.to_record()) for e in events] == events


def test_the_analysis_reads_a_capture_as_a_taps(
    capture: tuple[Path, dict[str, float], Flow],
) -> None:
    path, times, _ = capture
    events, _ = read(path)
    result = summarize(events)
    assert result["totals"]["connections"] == 1
    rows = result["requests"]
    assert [(r["method"], r["target"], r["status"], r["termination"]) for r in rows] == [
        ("POST", "/v1/chat/completions", 200, "complete"),
        ("GET", "/v1/models", 200, "complete"),
    ]
    assert rows[0]["events"] == 5 and rows[0]["done"] and not rows[0]["reused"]
    assert rows[1]["reused"] and rows[0]["start"] == times["req1"]
    (conn,) = result["connections"]
    assert conn["peer"] == "10.0.0.1:40000" and conn["upstream"] == "10.0.0.2:8000"
    assert conn["closed_by"] == "client" and conn["requests"] == 2
    assert [t["kind"] for t in result["taps"]] == ["pcap"]
    assert "caveats" not in result["verdict"]


def test_reordered_and_retransmitted_packets_give_the_same_events(tmp_path: Path) -> None:
    flow = Flow()
    exchange(flow)
    clean = of(read(write_pcap(tmp_path / "clean.pcap", flow.packets))[0], ev.ResponseEnd)
    packets = list(flow.packets)
    i = next(n for n, p in enumerate(packets) if p.note == "sse1")
    sse1, ack1, sse2 = packets[i : i + 3]
    assert sse2.note == "sse2"
    # the network reordered them: sse2 came first (the client's ACK of sse1 then waited
    # for it), and sse1 was sent again after
    early = Pkt(sse1.t, sse2.frame, sse2.ip)
    late = Pkt(sse1.t + 0.0005, sse1.frame, sse1.ip)
    again = Pkt(sse1.t + 0.0006, sse1.frame, sse1.ip)
    packets[i : i + 3] = [early, late, again]
    del ack1
    events, stats = read(write_pcap(tmp_path / "messy.pcap", packets))
    ends = of(events, ev.ResponseEnd)
    assert [(e.termination, e.events, e.done, e.body_bytes) for e in ends] == [
        (e.termination, e.events, e.done, e.body_bytes) for e in clean
    ]
    assert stats.passive.duplicate_bytes == len(chunk(SSE[1]))
    assert not of(events, ev.Anomaly)


def test_a_missing_segment_is_marked_and_reported_as_loss(tmp_path: Path) -> None:
    flow = Flow()
    exchange(flow)
    lost = next(p for p in flow.packets if p.note == "sse2")
    packets = [p for p in flow.packets if p is not lost]  # the client still acknowledged it
    events, stats = read(write_pcap(tmp_path / "gap.pcap", packets))
    (anomaly,) = of(events, ev.Anomaly)
    assert anomaly.direction == "upstream" and anomaly.seq == 1
    assert (
        f"{len(chunk(SSE[2]))} byte(s)" in anomaly.error and "not in the capture" in anomaly.error
    )
    assert anomaly.t == pytest.approx(lost.t + 0.0001, abs=1e-6)  # the client's ACK of it
    assert anomaly.gap == len(chunk(SSE[2]))
    end, second = of(events, ev.ResponseEnd)
    assert end.termination == "unparsed"  # not known past the hole: never complete
    assert (second.seq, second.termination) == (2, "complete")  # parsed again after it
    (loss,) = of(events, ev.CaptureLoss)
    assert (loss.dropped, loss.dropped_bytes) == (1, len(chunk(SSE[2])))
    assert sum(stats.passive.gaps.values()) == 1
    closed = of(events, ev.ConnClose)[0]
    sent = len(RESPONSE_HEAD_1) + sum(len(chunk(e)) for e in SSE) + 5 + len(RESPONSE_2)
    assert closed.bytes_from_upstream == sent - len(chunk(SSE[2]))  # what the capture has
    result = summarize(events)
    assert result["totals"]["capture_records_lost"] == 0  # the writer lost nothing
    caveats = {c["kind"]: c for c in result["verdict"]["caveats"]}
    assert "packet capture" in caveats["packet_capture_loss"]["text"]  # the pcap's own loss


def test_packets_cut_by_the_snapshot_length_are_counted(tmp_path: Path) -> None:
    flow = Flow()
    exchange(flow)
    events, stats = read(write_pcap(tmp_path / "short.pcap", flow.packets, snaplen=96))
    assert stats.snaplen == 96
    big = [p for p in flow.packets if len(p.frame) > 96]
    assert stats.passive.truncated_packets == len(big)
    assert stats.passive.truncated_bytes == sum(len(p.frame) - 96 for p in big)
    snap = [e for e in of(events, ev.CaptureLoss) if "snapshot length" in e.reason]
    assert snap and snap[0].dropped == len(big)
    assert of(events, ev.Anomaly)  # the stream is not followed past the first cut


def test_kernel_drops_in_pcapng_statistics_are_reported(tmp_path: Path) -> None:
    flow = Flow()
    exchange(flow)
    events, stats = read(write_pcapng(tmp_path / "drops.pcapng", flow.packets, ifdrop=7))
    assert stats.kernel_dropped == 7
    (loss,) = of(events, ev.CaptureLoss)
    assert loss.dropped == 7 and "kernel" in loss.reason
    assert of(events, ev.ResponseEnd)[0].termination == "complete"
    frames = list(read_frames(tmp_path / "drops.pcapng"))
    assert [f.t for f in frames] == pytest.approx([p.t for p in flow.packets], abs=1e-6)
    assert all(f.orig_len == len(f.data) for f in frames)


# ---- hangs ---------------------------------------------------------------------------


def hung(flow: Flow, *, window: int = 512) -> dict[str, float]:
    """A request whose stream stops after two events; the capture goes on 20 s."""
    flow.handshake(T0)
    flow.send(T0 + 0.001, True, REQUEST_1)
    flow.send(T0 + 0.010, False, RESPONSE_HEAD_1)
    flow.send(T0 + 0.050, False, chunk(SSE[0]))
    flow.ack(T0 + 0.0501, True, window=window)
    last = T0 + 0.070
    flow.send(last, False, chunk(SSE[1]))
    flow.ack(last + 0.0001, True, window=window)
    flow.ack(T0 + 20.0, True, window=window)  # a keep-alive ACK: no bytes, the capture goes on
    return {"last": last, "end": T0 + 20.0}


def test_a_hang_in_a_capture_makes_the_stall_a_live_tap_makes(tmp_path: Path) -> None:
    flow = Flow()
    times = hung(flow)
    other = Flow(client=("10.0.0.3", 41000))  # another connection's packets go on
    other.handshake(T0 + 1)
    other.send(T0 + 19.9, True, b"GET /health HTTP/1.1\r\nhost: e\r\n\r\n")
    packets = sorted(flow.packets + other.packets, key=lambda p: p.t)
    events, _ = read(write_pcap(tmp_path / "hang.pcap", packets))
    stall, stall_end = of(events, ev.Stall)
    assert stall.phase == "start" and stall.direction == "upstream_silent"
    assert stall.conn == 1 and stall.seq == 1
    assert stall.t == times["last"] + 5.0  # its last bytes (ACKs are no bytes to a tap)
    assert stall.silent_for == 5.0
    assert stall_end.phase == "end" and stall_end.t == packets[-1].t  # settled at the end
    assert events.index(stall) < events.index(of(events, ev.RequestHead)[1])  # in time order
    end = of(events, ev.ResponseEnd)[0]
    assert end.termination == "in_flight" and end.events == 2 and end.t == packets[-1].t
    closed = [c for c in of(events, ev.ConnClose) if c.conn == 1][0]
    assert (closed.closed_by, closed.how, closed.in_flight) == ("none", "unknown", True)
    result = summarize(events)
    row = result["requests"][0]
    assert row["termination"] == "in_flight" and row["stalls"][0]["direction"] == "upstream_silent"


def test_a_stall_that_ends_has_its_end(tmp_path: Path) -> None:
    flow = Flow()
    times = hung(flow)
    flow.send(times["last"] + 8.0, False, chunk(SSE[2]))
    events, _ = read(write_pcap(tmp_path / "pause.pcap", flow.packets))
    start, end, again, last = of(events, ev.Stall)
    assert (start.phase, end.phase) == ("start", "end")
    assert (again.phase, again.t) == ("start", times["last"] + 8.0 + 5.0)  # silent again
    assert (last.phase, last.t) == ("end", times["end"])
    assert end.t == times["last"] + 8.0
    assert end.silent_for == 8.0


def test_a_client_advertising_a_zero_window_is_not_reading(tmp_path: Path) -> None:
    flow = Flow()
    hung(flow, window=0)
    events, _ = read(write_pcap(tmp_path / "zero.pcap", flow.packets))
    stall = of(events, ev.Stall)[0]
    assert stall.direction == "client_not_reading" and stall.unsent_bytes == 0


# ---- which connections, which taps -----------------------------------------------------


def test_two_taps_out_of_one_capture_by_server_port(tmp_path: Path) -> None:
    front = Flow(client=("10.0.0.1", 40000), server=("10.0.0.2", 8000))
    exchange(front)
    back = Flow(client=("10.0.0.2", 50000), server=("10.0.0.9", 30000), cseq=7, sseq=9)
    exchange(back, t=T0 + 0.0005)
    packets = sorted(front.packets + back.packets, key=lambda p: p.t)
    path = write_pcapng(tmp_path / "both.pcapng", packets)
    stats = PcapStats()
    events = list(events_from_pcap_by_port(path, "8000=front,30000=back", stats=stats))
    starts = of(events, ev.CaptureStart)
    assert [(s.tap, s.listen) for s in starts] == [("front", "*:8000"), ("back", "*:30000")]
    assert starts[0].boot_id == starts[1].boot_id is not None
    ends = of(events, ev.CaptureEnd)
    assert [e.tap for e in ends] == ["front", "back"]
    for end in ends:
        assert end.records == sum(1 for e in events if e.tap == end.tap)
    opened = of(events, ev.ConnOpen)
    assert [(o.tap, o.conn, o.local) for o in opened] == [
        ("front", 1, "10.0.0.2:8000"),
        ("back", 1, "10.0.0.9:30000"),
    ]
    assert len([r for r in of(events, ev.RequestHead) if r.tap == "back"]) == 2
    result = summarize(events)
    assert sorted(t["tap"] for t in result["taps"]) == ["back", "front"]
    assert len(result["requests"]) == 4
    # only one of the ports: the other connection is not followed
    only, stats = read(path, ports=[30000], tap="engine")
    assert {e.tap for e in only} == {"engine"} and len(of(only, ev.ConnOpen)) == 1
    assert stats.passive.ignored == 1


def test_a_connection_whose_start_was_not_captured_is_followed_from_a_request(
    tmp_path: Path,
) -> None:
    flow = Flow()
    times = exchange(flow)
    cut = next(i for i, p in enumerate(flow.packets) if p.note == "sse2")
    events, stats = read(write_pcap(tmp_path / "late.pcap", flow.packets[cut:]))
    assert stats.passive.without_start == 1
    (opened,) = of(events, ev.ConnOpen)
    assert opened.peer == "10.0.0.1:40000" and opened.t == times["sse2"]
    assert not of(events, ev.UpstreamConnect)[0].elapsed
    requests = of(events, ev.RequestHead)
    assert [(r.seq, r.method, r.target) for r in requests] == [(1, "GET", "/v1/models")]
    (end,) = of(events, ev.ResponseEnd)
    assert end.termination == "complete" and end.status == 200
    closed = of(events, ev.ConnClose)[0]
    assert closed.requests == 1 and closed.bytes_from_upstream > len(RESPONSE_2)
    assert stats.passive.skipped_bytes == closed.bytes_from_upstream - len(RESPONSE_2)
    # the bytes before the first request seen are the capture's own loss, said once
    (late,) = of(events, ev.Anomaly)
    assert (late.seq, late.direction, late.gap) == (None, "client", stats.passive.skipped_bytes)


def test_streams_that_are_not_http_are_left_alone(tmp_path: Path) -> None:
    tls = Flow(client=("10.0.0.1", 40001), server=("10.0.0.2", 443))
    tls.handshake(T0)
    tls.send(T0 + 0.001, True, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 40)
    banner = Flow(client=("10.0.0.1", 40002), server=("10.0.0.2", 5432))
    banner.handshake(T0)
    banner.send(T0 + 0.001, False, b"220 ready\r\n")  # the server speaks first
    http = Flow()
    exchange(http, t=T0 + 0.002)
    packets = sorted(tls.packets + banner.packets + http.packets, key=lambda p: p.t)
    events, stats = read(write_pcap(tmp_path / "mixed.pcap", packets))
    assert stats.passive.connections == 3 and stats.passive.followed == 1
    assert stats.passive.ignored == 2
    assert [o.local for o in of(events, ev.ConnOpen)] == ["10.0.0.2:8000"]
    # on a port asked for, it is followed, and the observer says what it is not
    events, _ = read(write_pcap(tmp_path / "tls.pcap", tls.packets), ports=[443])
    assert of(events, ev.ConnOpen) and of(events, ev.Anomaly)


def test_a_refused_connection(tmp_path: Path) -> None:
    flow = Flow()
    flow.send(T0, True, flags=SYN)
    flow.send(T0 + 0.0001, False, flags=RST | ACK)
    events, _ = read(write_pcap(tmp_path / "refused.pcap", flow.packets), ports=[8000])
    connect = of(events, ev.UpstreamConnect)
    assert [c.phase for c in connect] == ["start", "failed"]
    assert "refused" in (connect[1].error or "")
    (closed,) = of(events, ev.ConnClose)
    assert (closed.closed_by, closed.how, closed.upstream_opened) == ("upstream", "reset", False)


# ---- frames ----------------------------------------------------------------------------


def frames_of(pkt: Pkt) -> Iterator[tuple[str, int, bytes]]:
    ip = pkt.ip
    yield "ethernet", 1, pkt.frame
    vlan = pkt.frame[:12] + b"\x81\x00\x00\x07" + pkt.frame[12:]
    yield "ethernet+vlan", 1, vlan
    yield "raw", 101, ip
    yield "ipv4", 228, ip
    yield "null", 0, (2).to_bytes(4, sys.byteorder) + ip
    yield "loop", 108, (2).to_bytes(4, "big") + ip
    sll = dpkt.sll.SLL(type=4, hrd=772, hlen=6, hdr=b"\0" * 8, ethtype=0x0800, data=ip)
    yield "sll", 113, bytes(sll)
    sll2 = dpkt.sll2.SLL2(ethtype=0x0800, intindex=1, hrd=772, type=4, hlen=6, hdr=b"\0" * 8)
    yield "sll2", 276, bytes(sll2) + ip


def test_every_link_type_gives_the_same_segment() -> None:
    flow = Flow()
    pkt = flow.send(T0, True, b"GET / HTTP/1.1\r\n\r\n")
    seen = {}
    for name, linktype, frame in frames_of(pkt):
        decoded = decode_frame(linktype, frame, T0)
        assert isinstance(decoded, Packet), name
        seen[name] = decoded
    first = seen["ethernet"]
    assert first.src == Endpoint("10.0.0.1", 40000) and first.dst == Endpoint("10.0.0.2", 8000)
    assert first.segment.payload == b"GET / HTTP/1.1\r\n\r\n" and first.segment.seq == 1000
    assert all(d == first for d in seen.values())


def test_ipv6_and_what_is_not_tcp() -> None:
    src, dst = (
        socket.inet_pton(socket.AF_INET6, "fd00::1"),
        socket.inet_pton(socket.AF_INET6, "::1"),
    )
    seg = dpkt.tcp.TCP(sport=40000, dport=8000, seq=1, ack=2, flags=ACK, data=b"xyz")
    ip6 = dpkt.ip6.IP6(src=src, dst=dst, nxt=6, hlim=64, plen=len(bytes(seg)), data=seg)
    eth = dpkt.ethernet.Ethernet(src=MAC_C, dst=MAC_S, type=dpkt.ethernet.ETH_TYPE_IP6, data=ip6)
    decoded = decode_frame(1, bytes(eth), 1.0)
    assert isinstance(decoded, Packet)
    assert str(decoded.src) == "[fd00::1]:40000" and decoded.segment.payload == b"xyz"
    cut = decode_frame(1, bytes(eth)[:-2], 1.0)
    assert isinstance(cut, Packet) and cut.cut == 2 and cut.segment.wire_len == 3
    udp = dpkt.ip.IP(src=b"\1\2\3\4", dst=b"\1\2\3\5", p=17, data=dpkt.udp.UDP(data=b"q"))
    assert decode_frame(101, bytes(udp), 1.0) == Skipped("not_tcp")
    assert decode_frame(1, b"\xff" * 12 + b"\x08\x06" + b"\0" * 28, 1.0) == Skipped("not_ip")
    assert decode_frame(147, b"whatever", 1.0) == Skipped("link")


def test_what_is_an_http_request() -> None:
    assert looks_like_request(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n") is True
    assert looks_like_request(b"GET * HTTP/1.0\r\n") is True
    assert looks_like_request(b"POS") is None
    assert looks_like_request(b"GET /a HT") is None
    assert looks_like_request(b"HTTP/1.1 200 OK\r\n") is False
    assert looks_like_request(b"\x16\x03\x01") is False
    assert looks_like_request(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") is False


def test_tap_by_port_spec() -> None:
    spec = parse_tap_by_port("8000=front, 30000=back")
    assert (spec.taps, spec.roles) == ({8000: "front", 30000: "back"}, {})
    for bad in ("", "8000", "x=front", "8000=", "70000=a", "1=a,1=b", "1=a:engin"):
        with pytest.raises(ValueError):
            parse_tap_by_port(bad)


def test_a_file_that_is_not_a_capture(tmp_path: Path) -> None:
    path = tmp_path / "x.pcap"
    path.write_bytes(b'{"type":"capture_start"}\n')
    with pytest.raises(PcapError):
        list(events_from_pcap(path))


def test_a_capture_cut_mid_record_is_read_up_to_the_cut(tmp_path: Path) -> None:
    flow = Flow()
    exchange(flow)
    last = len(flow.packets[-1].frame)
    # the pcap cut inside the last record's header, the pcapng inside its last block
    for writer, name, cut in ((write_pcap, "cut.pcap", last + 10), (write_pcapng, "cut.pcapng", 7)):
        path = writer(tmp_path / name, flow.packets)
        path.write_bytes(path.read_bytes()[:-cut])
        events, stats = read(path)
        assert stats.torn_tail
        assert len(of(events, ev.RequestHead)) == 2


def test_the_packet_tap_is_sans_io() -> None:
    """Fed frames directly (as a live packet socket would), it writes the same events."""
    flow = Flow()
    exchange(flow)
    events: list[ev.Event] = []
    tap = PacketTap(emit=events.append, tap="live", kind="sniff")
    for p in flow.packets:
        tap.packet(p.t, 1, p.frame)
    tap.finish()
    assert events[0].tap == "live" and isinstance(events[-1], ev.CaptureEnd)
    assert [e.termination for e in of(events, ev.ResponseEnd)] == ["complete", "complete"]


def test_pcapng_interfaces_each_with_its_link_type_and_time_resolution(tmp_path: Path) -> None:
    """Two interfaces in one pcapng file (as dumpcap writes ``-i eth0 -i lo``): Ethernet
    in microseconds, raw IP in nanoseconds; the packets of one connection on both."""
    flow = Flow()
    exchange(flow)
    png = dpkt.pcapng
    le = sys.byteorder == "little"
    opt = png.PcapngOptionLE if le else png.PcapngOption
    idb = png.InterfaceDescriptionBlockLE if le else png.InterfaceDescriptionBlock
    epb = png.EnhancedPacketBlockLE if le else png.EnhancedPacketBlock
    path = tmp_path / "two.pcapng"
    with open(path, "wb") as fh:
        fh.write(bytes(png.SectionHeaderBlockLE() if le else png.SectionHeaderBlock()))
        fh.write(bytes(idb(linktype=1, snaplen=65535)))
        nano = [opt(code=9, data=b"\x09"), opt(code=0, data=b"")]  # if_tsresol: 10^-9
        fh.write(bytes(idb(linktype=101, snaplen=65535, opts=nano)))
        for n, p in enumerate(flow.packets):
            iface, data, ticks = (
                (1, p.ip, round(p.t * 1e9)) if n % 2 else (0, p.frame, round(p.t * 1e6))
            )
            fh.write(
                bytes(
                    epb(
                        iface_id=iface,
                        ts_high=ticks >> 32,
                        ts_low=ticks & 0xFFFFFFFF,
                        pkt_data=data,
                    )
                )
            )
    events, stats = read(path)
    assert stats.linktypes == [1, 101] and stats.frames == len(flow.packets)
    plain, _ = read(write_pcap(tmp_path / "plain.pcap", flow.packets))
    for kind in (ev.RequestHead, ev.ResponseEnd, ev.ConnClose):
        got = [(e.to_record() | {"t": 0, "m": 0}) for e in of(events, kind)]
        assert got == [(e.to_record() | {"t": 0, "m": 0}) for e in of(plain, kind)]
    assert [e.t for e in of(events, ev.RequestHead)] == pytest.approx(
        [e.t for e in of(plain, ev.RequestHead)], abs=1e-6
    )


# ---- real tcpdump captures (tests/data/pcap/record.py made them) ----------------------

REAL = Path(__file__).parent.parent / "data" / "pcap"


def payload_times(path: Path) -> list[tuple[float, bytes]]:
    """(time, payload) of every segment that carries bytes, as the file has them."""
    out = []
    for frame in read_frames(path):
        decoded = decode_frame(frame.linktype, frame.data, frame.t)
        assert isinstance(decoded, Packet)
        if decoded.segment.payload:
            out.append((frame.t, decoded.segment.payload))
    return out


def test_a_real_tcpdump_capture_on_lo(tmp_path: Path) -> None:
    path = REAL / "sse_lo.pcap"
    events, stats = read(path)
    assert stats.linktypes == [1] and stats.passive.followed == 1 and not stats.torn_tail
    sent = payload_times(path)
    post = next(t for t, p in sent if p.startswith(b"POST"))
    get = next(t for t, p in sent if p.startswith(b"GET"))
    requests = of(events, ev.RequestHead)
    assert [(r.method, r.target, r.t) for r in requests] == [
        ("POST", "/v1/chat/completions", post),
        ("GET", "/v1/models", get),
    ]
    ends = of(events, ev.ResponseEnd)
    assert [(e.termination, e.status) for e in ends] == [("complete", 200), ("complete", 200)]
    assert ends[0].events == 5 and ends[0].done and ends[0].finish_reason == "stop"
    assert ends[0].t == next(t for t, p in sent if p == b"0\r\n\r\n")
    (closed,) = of(events, ev.ConnClose)
    assert (closed.closed_by, closed.how, closed.requests) == ("client", "fin", 2)
    assert closed.bytes_from_client == sum(len(p) for _, p in sent if p[:3] in (b"POS", b"GET"))
    (opened,) = of(events, ev.ConnOpen)
    assert opened.local == "127.0.0.1:18000"
    result = summarize(events)
    assert [(r["method"], r["termination"]) for r in result["requests"]] == [
        ("POST", "complete"),
        ("GET", "complete"),
    ]


def test_a_real_hang_captured_on_any_interface() -> None:
    path = REAL / "hang_any.pcap"
    events, stats = read(path)
    assert stats.linktypes == [276]  # Linux cooked v2: tcpdump -i any
    sent = payload_times(path)
    last = max(t for t, p in sent if p.startswith(b"3"))  # the server's last chunk
    starts = [s for s in of(events, ev.Stall) if s.phase == "start"]
    assert [(s.direction, s.t) for s in starts] == [("upstream_silent", last + 5.0)]
    (end,) = of(events, ev.ResponseEnd)
    assert end.termination == "client_abort" and end.events == 2 and not end.done
    (closed,) = of(events, ev.ConnClose)
    assert (closed.closed_by, closed.how, closed.in_flight) == ("client", "fin", True)
    assert closed.t - last == pytest.approx(6.0, abs=0.1)  # the client gave up after 6 s
    row = summarize(events)["requests"][0]
    assert row["termination"] == "client_abort" and row["stalls"]
