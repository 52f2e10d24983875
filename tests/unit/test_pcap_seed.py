"""The seed incident from a recorded tcpdump capture, analysed in this process.

``tests/data/pcap/hang_on_reuse_lo.pcap`` (``python -m tests.scenarios.record_pcap``
records it again): ``tcpdump -i lo`` on both sides of a proxy that hangs on the 3rd
request of a reused keep-alive connection (``tracer proxy --fault hang-on-reuse:3``), the
openai-SDK harness in front of it (2 sessions, rounds 1-2 complete, round 3 hangs and is
given up after 3 s), the simulated engine behind; the ports the kernel chose are in
``hang_on_reuse_lo.json``. Read as two taps by server port, it must blame the proxy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import structlog

from tests.support.analyze import analyze_here
from tracer import events as ev
from tracer.observe.pcap import PcapStats, events_from_pcap_by_port

DATA = Path(__file__).parent.parent / "data" / "pcap"
PCAP = DATA / "hang_on_reuse_lo.pcap"
META: dict[str, Any] = json.loads((DATA / "hang_on_reuse_lo.json").read_text())


@pytest.fixture(scope="module")
def analysis() -> dict[str, Any]:
    """``tracer analyze PCAP --tap-by-port ... --format json``, its ``main`` in this process
    (once for the module; structlog, which ``main`` configures, put back as it was)."""
    saved = structlog.get_config()
    try:
        return analyze_here(PCAP, "--tap-by-port", META["tap_by_port"])
    finally:
        structlog.configure(**saved)


def test_both_sides_of_the_proxy_blame_it_for_holding_the_reused_connection(
    analysis: dict[str, Any],
) -> None:
    v = analysis["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == ("proxy", "proxy_hung_on_reuse", "high")
    assert {r["party"] for r in v["ruled_out"]} == {"client", "engine"}
    (f,) = [f for f in analysis["findings"] if f["id"] == v["finding"]]
    assert (f["kind"], f["party"]) == ("proxy_hung_on_reuse", "proxy")
    assert sorted(f["requests"]) == ["front/1/3", "front/2/3"]
    assert any(e["figures"].get("never_seen_at") == ["back"] for e in f["evidence"])


def test_the_two_taps_are_the_two_ports(analysis: dict[str, Any]) -> None:
    taps = {t["tap"]: t for t in analysis["taps"]}
    assert {name: t["kind"] for name, t in taps.items()} == {"front": "pcap", "back": "pcap"}
    assert taps["front"]["listen"] == f"*:{META['front']}"
    assert taps["back"]["listen"] == f"*:{META['back']}"
    by_tap = {
        tap: sorted(
            (r["conn"], r["seq"], r["termination"]) for r in analysis["requests"] if r["tap"] == tap
        )
        for tap in taps
    }
    assert by_tap["front"] == [
        (c, s, "client_abort" if s == 3 else "complete") for c in (1, 2) for s in (1, 2, 3)
    ]
    assert by_tap["back"] == [(c, s, "complete") for c in (1, 2) for s in (1, 2)]
    front_ids = {r["request_id"] for r in analysis["requests"] if r["tap"] == "front"}
    back_ids = {r["request_id"] for r in analysis["requests"] if r["tap"] == "back"}
    assert back_ids < front_ids and len(front_ids - back_ids) == 2  # the two hung ones


def test_the_capture_is_whole() -> None:
    """Every connection seen from its SYN to its end, no byte missing, nothing cut."""
    stats = PcapStats()
    events = list(events_from_pcap_by_port(PCAP, META["tap_by_port"], stats=stats))
    assert stats.format == "pcap" and not stats.torn_tail
    p = stats.passive
    assert (p.followed, p.without_start, p.truncated_packets) == (4, 0, 0)
    assert sum(p.gaps.values()) == 0 and p.skipped_bytes == 0
    assert not [e for e in events if isinstance(e, (ev.CaptureLoss, ev.Anomaly))]
    closes = [e for e in events if isinstance(e, ev.ConnClose)]
    assert sorted((e.tap, e.closed_by, e.how) for e in closes) == [
        ("back", "client", "fin"),
        ("back", "client", "fin"),
        ("front", "client", "fin"),
        ("front", "client", "fin"),
    ]


def test_the_report_reads_the_pcap_as_the_same_two_taps(tmp_path: Path) -> None:
    """``tracer report PCAP --tap-by-port ...``: the incident document from packets alone."""
    from tracer.cli import commands

    saved = structlog.get_config()
    out, doc = tmp_path / "incident.md", tmp_path / "incident.json"
    try:
        by_port = ["--tap-by-port", META["tap_by_port"]]
        code = commands.main(["report", str(PCAP), *by_port, "-o", str(out), "--json", str(doc)])
    finally:
        structlog.configure(**saved)
    assert code == 0
    report = json.loads(doc.read_text())
    v = report["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_hung_on_reuse")
    assert out.stat().st_size > 0
