"""What the server behind a port is, declared for a packet capture (``--upstream-role``,
``--tap-by-port 30000=back:engine``).

A tap asks its upstream what it is (its fingerprint); a capture cannot, so without a
declared role a stream the server cut is ``stream_cut`` (unknown). Declared, the role goes
into the tap's header and a ``topology`` record (basis ``declared``), as ``tracer proxy
--upstream-role`` writes it, and the analysis reads it as it reads the proxy's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import structlog

from tests.support.analyze import analyze_here
from tests.unit.test_pcap import (
    REQUEST_1,
    RESPONSE_HEAD_1,
    SSE,
    T0,
    Flow,
    chunk,
    write_pcap,
)
from tracer import events as ev
from tracer.capture.files import PacketOptions, read_events
from tracer.observe.passive import PacketTap, TapsByPort, parse_tap_by_port
from tracer.observe.pcap import events_from_pcap, events_from_pcap_by_port
from tracer.observe.tcp import ACK, FIN

DATA = Path(__file__).parent.parent / "data" / "pcap"
PCAP = DATA / "hang_on_reuse_lo.pcap"
META: dict[str, Any] = json.loads((DATA / "hang_on_reuse_lo.json").read_text())


# ---- the spec ----------------------------------------------------------------------------


def test_a_role_after_a_tap_name() -> None:
    spec = parse_tap_by_port("8000=front, 30000=back:engine")
    assert spec == TapsByPort({8000: "front", 30000: "back"}, {"back": "engine"})
    assert parse_tap_by_port("8000=front").roles == {}
    for role in ("engine", "router", "proxy"):
        assert parse_tap_by_port(f"1=a:{role}").roles == {"a": role}
    # a tap of two ports: its role given on one of them, or alike on both
    assert parse_tap_by_port("1=a:router,2=a").roles == {"a": "router"}
    assert parse_tap_by_port("1=a:router,2=a:router").roles == {"a": "router"}
    assert parse_tap_by_port(" 1 = a : proxy ").taps == {1: "a"}


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("30000=back:engin", "'30000=back:engin': role must be engine, router or proxy"),
        ("30000=back:", "'30000=back:': role must be engine, router or proxy"),
        ("30000=back:Engine", "'30000=back:Engine': role must be engine, router or proxy"),
        ("30000=:engine", "'30000=:engine': expected PORT=TAP or PORT=TAP:ROLE"),
        ("1=a:engine,2=a:router", "'2=a:router': tap a is given role engine too"),
        ("x=a:engine", "'x=a:engine': 'x' is not a port number"),
    ],
)
def test_a_bad_role_is_named_with_its_part(spec: str, said: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_tap_by_port(spec)
    assert str(raised.value).startswith(said) and "\n" not in str(raised.value)


def test_the_packet_tap_takes_only_a_role_that_may_be_declared() -> None:
    with pytest.raises(ValueError, match="engine, router or proxy"):
        PacketTap(emit=lambda e: None, roles={"pcap": "unknown"})


# ---- the header and the topology record --------------------------------------------------


def test_a_declared_role_is_written_as_the_proxy_writes_it() -> None:
    out: list[ev.Event] = []
    tap = PacketTap(emit=out.append, taps={8000: "front", 30000: "back"}, roles={"back": "engine"})
    tap.finish(T0)
    heads = {e.tap: e for e in out if isinstance(e, ev.CaptureStart)}
    assert {name: h.upstream_role for name, h in heads.items()} == {
        "front": None,
        "back": "engine",
    }
    (topo,) = [e for e in out if isinstance(e, ev.Topology)]
    assert (topo.tap, topo.upstream_role, topo.basis, topo.upstream) == (
        "back",
        "engine",
        "declared",
        "*:30000",
    )
    assert topo.evidence == ["declared: --tap-by-port 30000=back:engine"]
    assert [type(e).__name__ for e in out if e.tap == "back"][:2] == ["CaptureStart", "Topology"]
    ends = {e.tap: e.records for e in out if isinstance(e, ev.CaptureEnd)}
    assert ends == {"front": 2, "back": 3}  # (the topology record counted)


def test_the_one_taps_role(tmp_path: Path) -> None:
    path = write_pcap(tmp_path / "cut.pcap", cut_stream().packets)
    events = list(events_from_pcap(path, ports=[8000], upstream_role="router"))
    (head,) = [e for e in events if isinstance(e, ev.CaptureStart)]
    (topo,) = [e for e in events if isinstance(e, ev.Topology)]
    assert (head.tap, head.upstream_role) == ("pcap", "router")
    assert (topo.upstream_role, topo.basis, topo.evidence) == (
        "router",
        "declared",
        ["declared: --upstream-role router"],
    )
    # not declared: no role, no topology record
    plain = list(events_from_pcap(path, ports=[8000]))
    assert [e.upstream_role for e in plain if isinstance(e, ev.CaptureStart)] == [None]
    assert not [e for e in plain if isinstance(e, ev.Topology)]
    # as `tracer analyze` reads it (PacketOptions)
    read = list(read_events(path, packets=PacketOptions(ports=(8000,), upstream_role="engine")))
    assert [e.upstream_role for e in read if isinstance(e, ev.CaptureStart)] == ["engine"]
    with pytest.raises(ValueError, match="for one tap"):
        list(events_from_pcap(path, taps={8000: "a"}, upstream_role="engine"))


# ---- what the analysis makes of it -------------------------------------------------------


def cut_stream() -> Flow:
    """A streamed completion the server ends (FIN) after two of its events."""
    flow = Flow()
    t = T0
    flow.handshake(t)
    flow.send(t + 0.001, True, REQUEST_1)
    flow.ack(t + 0.0011, False)
    flow.send(t + 0.010, False, RESPONSE_HEAD_1)
    for i, event in enumerate(SSE[:2]):
        flow.send(t + 0.050 + i * 0.020, False, chunk(event))
        flow.ack(t + 0.0501 + i * 0.020, True)
    flow.send(t + 0.200, False, flags=FIN | ACK)
    flow.send(t + 0.201, True, flags=FIN | ACK)
    flow.ack(t + 0.202, False)
    return flow


def analysed(*args: Path | str) -> dict[str, Any]:
    saved = structlog.get_config()
    try:
        return analyze_here(*args)
    finally:
        structlog.configure(**saved)


def test_a_stream_the_engine_cut_is_the_engines_once_declared(tmp_path: Path) -> None:
    path = write_pcap(tmp_path / "cut.pcap", cut_stream().packets)
    plain = analysed(path, "--port", "8000")
    engine = analysed(path, "--port", "8000", "--upstream-role", "engine")
    by_port = analysed(path, "--tap-by-port", "8000=back:engine")
    kinds = lambda doc: {(f["kind"], f["party"]) for f in doc["findings"]}  # noqa: E731
    assert kinds(plain) == {("stream_cut", "unknown")}
    assert kinds(engine) == kinds(by_port) == {("engine_truncated", "engine")}
    (tap,) = engine["taps"]
    assert (tap["topology"]["upstream_role"], tap["topology"]["basis"]) == ("engine", "declared")
    assert plain["taps"][0]["topology"] is None


def test_the_recorded_incident_with_the_engine_declared_behind_back() -> None:
    """``tests/data/pcap/hang_on_reuse_lo.pcap`` with ``back:engine``: the role is in
    back's header (declared), and the verdict is the same (the proxy held the reused
    connection)."""
    spec = f"{META['front']}=front,{META['back']}=back:engine"
    events = list(events_from_pcap_by_port(PCAP, spec))
    heads = {e.tap: e.upstream_role for e in events if isinstance(e, ev.CaptureStart)}
    assert heads == {"front": None, "back": "engine"}
    doc = analysed(PCAP, "--tap-by-port", spec)
    taps = {t["tap"]: t for t in doc["taps"]}
    assert taps["back"]["topology"]["upstream_role"] == "engine"
    assert taps["back"]["topology"]["basis"] == "declared"
    assert taps["front"]["topology"] is None
    v = doc["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == (
        META["verdict"]["party"],
        META["verdict"]["kind"],
        META["verdict"]["confidence"],
    )
    assert (v["party"], v["kind"]) == ("proxy", "proxy_hung_on_reuse")
    assert doc["topology"]["chain"].endswith("back → engine")
