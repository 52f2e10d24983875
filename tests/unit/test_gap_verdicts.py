"""What the analysis says of a packet capture with gaps: a request with bytes missing is
unknown (``packet_gap``), never healthy nor anyone's fault; the others on its connection
are read as they were, and a finding that still stands there is at most low confidence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.unit.test_pcap import chunk
from tests.unit.test_pcap_gaps import EVENTS, SSE_HEAD, Conn, answer, get, post
from tracer.analysis.summary import Summary


def _second_stream_loses(event: int, *, third: int) -> Conn:
    """Three requests on one connection; the second's stream loses its ``event``-th event
    to the capture; the third is answered with status ``third``."""
    c = Conn()
    c.client(get(1))
    c.server(answer(1))
    c.client(post(2, b'{"model":"m","stream":true}'))
    c.server(SSE_HEAD)
    for i, e in enumerate(EVENTS):
        c.server(chunk(e), lose=i == event)
    c.server(b"0\r\n\r\n")
    c.client(get(3))
    c.server(answer(3, status=third))
    c.close()
    return c


def _analyze(c: Conn, tmp_path: Path) -> dict[str, Any]:
    summary = Summary()
    for event in c.read(tmp_path):
        summary.feed(event)
    return summary.result()


def test_a_response_that_lost_a_segment_is_unknown_not_healthy(tmp_path: Path) -> None:
    c = _second_stream_loses(2, third=200)
    result = _analyze(c, tmp_path)
    verdict = result["verdict"]
    assert (verdict["party"], verdict["kind"], verdict["confidence"]) == (
        "unknown",
        "packet_gap",
        "low",
    )
    [gap] = [f for f in result["findings"] if f["kind"] == "packet_gap"]
    assert gap["requests"] == ["pcap/1/2"] and gap["evidence"][0]["figures"]["gap"] > 0
    rows = {r["seq"]: r for r in result["requests"]}
    assert rows[2]["capture_gap"] and rows[2]["termination"] != "complete"
    assert rows[1]["termination"] == rows[3]["termination"] == "complete"
    assert rows[1]["capture_gap"] is None and rows[3]["capture_gap"] is None
    caveats = verdict["caveats"]
    assert [c["kind"] for c in caveats] == ["packet_capture_loss"]
    assert "writer" not in caveats[0]["text"] and "disk" not in caveats[0]["text"]


def test_a_request_head_the_capture_lost_is_named_not_a_ghost_row(tmp_path: Path) -> None:
    c = Conn()
    c.client(get(1))
    c.server(answer(1))
    c.client(get(2), lose=True)
    c.server(answer(2))
    c.client(get(3))
    c.server(answer(3))
    c.close()
    result = _analyze(c, tmp_path)
    assert sorted(r["seq"] for r in result["requests"]) == [1, 3]
    [gap] = [f for f in result["findings"] if f["kind"] == "packet_gap"]
    assert [e["request"] for e in gap["evidence"]] == ["pcap/1/2"]
    assert result["verdict"]["kind"] == "packet_gap"


def test_a_fault_on_a_gapped_connection_stands_at_low_confidence_and_says_why(
    tmp_path: Path,
) -> None:
    """Request 3's 500 came after the gap: read again after the resync, it still names
    the engine, but at low confidence, quoting the gap on its connection."""
    c = _second_stream_loses(1, third=500)
    result = _analyze(c, tmp_path)
    faults = [f for f in result["findings"] if not f["note"] and f["kind"] != "packet_gap"]
    assert faults, result["findings"]
    for f in faults:
        assert f["confidence"] == "low" and "pcap/1/2" not in f["requests"]
        assert [e for e in f["evidence"] if e["figures"].get("gapped_connections") == 1]
    assert result["verdict"]["confidence"] == "low"


def test_a_connection_the_capture_joined_mid_way_is_said_not_a_client_failure(
    tmp_path: Path,
) -> None:
    """No handshake and the first exchange not in the capture (its response bytes come
    before any request head): the bytes skipped are said as the packet capture's own loss,
    never a client connection that failed, and the all-clear is not high."""
    c = Conn()
    c.lost += c.flow.packets[:3]  # the handshake
    c.client(get(1), lose=True)
    c.server(answer(1))
    c.client(get(2))
    c.server(answer(2))
    c.close()
    result = _analyze(c, tmp_path)
    assert not [f for f in result["findings"] if f["kind"] == "client_connection_failed"]
    caveats = [v for v in result["verdict"]["caveats"] if v["kind"] == "packet_capture_loss"]
    assert any("began before the capture" in v["text"] for v in caveats)
    assert result["verdict"]["confidence"] != "high"
