"""Whose x-tracer-probe to believe: only a nonce of a capture in the analysis (or, for a
capture written before nonces, its own tap's name); anything else is a client's."""

from __future__ import annotations

import pytest

from tests.unit.test_findings import Cap, analyze
from tracer import events as ev
from tracer.analysis.summary import Summary
from tracer.protocol.probe_mark import KnownTaps, ProbeClaim, parse_probe, probe_value


def test_the_header_is_read_leniently() -> None:
    assert parse_probe(probe_value("metrics", "front", "abc")) == ProbeClaim(
        "metrics", "front", "abc"
    )
    assert parse_probe("") == ProbeClaim("", None, None)
    assert parse_probe("topology") == ProbeClaim("topology", None, None)
    assert parse_probe("x; tap=; nonce=") == ProbeClaim("x", None, None)


@pytest.mark.parametrize(
    ("value", "own"),
    [
        ("topology; tap=front; nonce=N1", True),  # the nonce of a capture here
        ("probe; tap=anything; nonce=N1", False),  # the nonce is bound to its tap's name
        ("topology; tap=front; nonce=guess", False),
        ("topology; tap=front", False),  # front's capture has a nonce: the old form is forged
        ("topology", False),
        ("", False),
        ("metrics; tap=old", True),  # a capture from before nonces, of that tap
        ("metrics; tap=pcap-tap", False),  # a packet capture's tap makes no requests
        ("topology; tap=front; nonce=N1" + " " * 300, False),  # no tap's header is that long
    ],
)
def test_only_a_capture_here_vouches_for_a_probe(value: str, own: bool) -> None:
    known = KnownTaps.of(
        [
            {"tap": "front", "kind": "proxy", "probe_nonce": "N1"},
            {"tap": "old", "kind": "proxy"},
            {"tap": "pcap-tap", "kind": "pcap"},
        ]
    )
    assert known.own(value) is own


def _with_head(cap: Cap, conn: int, seq: int, probe: str | None) -> None:
    cap.exchange(conn, seq, float(conn))
    if probe is None:
        return
    for e in cap.events:
        if isinstance(e, ev.RequestHead) and (e.conn, e.seq) == (conn, seq):
            e.headers.append(["X-Tracer-Probe", probe])


def _with_nonce(cap: Cap, nonce: str) -> Cap:
    start = cap.events[0]
    assert isinstance(start, ev.CaptureStart)
    start.probe_nonce = nonce
    return cap


def test_a_client_sending_the_header_stays_a_client_with_a_note() -> None:
    front = _with_nonce(Cap("front"), "N1")
    back = _with_nonce(Cap("back", t0=1000.0), "N2")
    _with_head(back, 1, 1, probe_value("topology", "front", "N1"))  # the front tap's own
    _with_head(back, 2, 1, "topology")  # a client's
    _with_head(back, 3, 1, "")  # a client's, empty
    _with_head(back, 4, 1, "topology; tap=front; nonce=N3")  # a client's guess
    _with_head(front, 1, 1, None)
    # the tap behind first, as `tracer analyze back front` reads them: the captures'
    # headers are read before the fold (capture_headers), so the order does not matter
    starts = [c.events[0].to_record() for c in (back, front)]
    summary = Summary(known_taps=KnownTaps.of(starts))
    for cap in (back, front):
        for e in cap.events:
            summary.feed(e)
    result = summary.result()
    assert analyze(front, back)["totals"]["tap_own_requests"] == 1  # in order, it learns as it goes
    ids = sorted(r["id"] for r in result["requests"])
    assert ids == ["back/2/1", "back/3/1", "back/4/1", "front/1/1"]
    assert result["totals"]["tap_own_requests"] == 1
    [note] = [f for f in result["findings"] if f["kind"] == "probe_header_unvouched"]
    assert note["note"] and note["party"] == "unknown"
    assert sorted(note["requests"]) == ["back/2/1", "back/3/1", "back/4/1"]
    assert result["verdict"]["kind"] == "healthy"
