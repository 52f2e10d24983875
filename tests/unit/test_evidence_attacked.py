"""The tester's attack on this round's evidence (issues 36 and 37), each case rebuilt
from its description: a claim that outran its evidence, and what it says now."""

from __future__ import annotations

import pytest

from tests.unit.test_engine_requests import _record
from tests.unit.test_findings import ROUTER, Cap, analyze
from tracer import events as ev
from tracer.protocol.probe_mark import KnownTaps, probe_value

A = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_a_request_the_capture_cut_after_a_moment_is_no_ones_hang() -> None:
    """A tap killed 0.4 s after a request went out (no capture_end): a silence that short
    was read as the engine's (engine_lost_request, medium). It is not long enough to
    tell anything: no fault finding."""
    cap = Cap(upstream=ROUTER)
    cap.exchange(1, 1, 0.0)
    cap.exchange(2, 1, 1.0, end=None)
    for t in (0.5, 1.0, 1.4):
        cap.engine(t, running=0, delta=0)
    result = analyze(cap)
    assert not [f for f in result["findings"] if f["party"] in ("engine", "proxy", "client")]
    assert "no_capture_end" in {c["kind"] for c in result["verdict"].get("caveats", [])}


@pytest.mark.parametrize("when", [-86400.0, -30.0])
def test_an_engine_record_from_another_time_is_not_this_requests_account(when: float) -> None:
    """Another run's record with the same x-request-id (ids repeat; a folder of exports
    holds every hour's) said 'the engine finished it' at high confidence: a record that
    finished before the request began is not its account."""
    cap = Cap()
    cap.exchange(1, 1, 0.0, rid="ok-1")
    cap.exchange(2, 1, 1.0, rid="held", end=None)
    cap.stall(2, 1, 1.0, None)
    other_run = _record(
        "chatcmpl-held", received=1001.0 + when, finished=1001.5 + when, finish="stop", e2e=0.5
    )
    result = analyze(cap, engine_requests=[other_run])
    assert not [f for f in result["findings"] if f["kind"] == "lost_after_engine"]
    assert result["evidence"]["engine_requests"]["joined"] == 0


def test_a_clock_a_millisecond_behind_does_not_put_the_tap_behind_in_front() -> None:
    """The tap order came from the sign of the median delay: a clock 2 ms behind, more
    than the hop's transit, reversed it. Each tap's own durations say who is in front."""
    front = Cap("front")
    back = Cap("back", upstream=ROUTER, t0=1000.0 - 0.002)
    for i in range(6):
        start = 1.0 + i * 0.5
        front.exchange(i + 1, 1, start, rid=f"r{i}", duration=0.1006)
        back.exchange(i + 1, 1, start + 0.0003, rid=f"r{i}", duration=0.1)
    [pair] = analyze(front, back)["evidence"]["tap_pairs"]
    assert (pair["from"], pair["to"]) == ("front", "back")


def test_one_trace_id_on_two_bodies_is_not_one_request() -> None:
    """A hop that sent the next request with the previous one's traceparent: joined by
    trace id, the swallowed request got the next one's copy. Bodies that differ contradict
    the join, so content joins them instead."""
    front, back = Cap("front"), Cap("back")
    tp = [["traceparent", f"00-{A}-00f067aa0ba902b7-01"]]
    front.exchange(1, 1, 1.0, headers=tp, end=None, body=10)
    front.stall(1, 1, 1.0, None)
    front.exchange(2, 1, 1.5, body=20)
    back.exchange(1, 1, 1.502, headers=tp, body=20)  # the second request, the first's trace
    for c in (front, back):  # (bodies told apart by their hashes)
        for e in c.events:
            if isinstance(e, ev.RequestEnd):
                e.content_sha256 = f"body-{e.body_bytes}"
    rows = {r["id"]: r for r in analyze(front, back)["requests"]}
    assert rows["front/1/1"]["copies"] == []
    assert rows["front/2/1"]["copies"] == ["back/1/1"]
    assert rows["back/1/1"]["joined_by"] == "content"


def test_a_nonce_is_its_taps_own_and_never_seen_at_that_tap() -> None:
    """A client that copied the front tap's nonce (from its capture) and sent it to the
    front tap, or sent it naming another tap, hid its request: both are clients'."""
    known = KnownTaps.of(
        [
            {"tap": "front", "kind": "proxy", "probe_nonce": "NF"},
            {"tap": "back", "kind": "proxy", "probe_nonce": "NB"},
            {"tap": "lo", "kind": "sniff", "probe_nonce": "NS"},
        ]
    )
    assert known.own(probe_value("topology", "front", "NF"), at="back")
    assert not known.own(probe_value("topology", "front", "NF"), at="front")
    assert not known.own(probe_value("topology", "front", "NB"), at="back")
    assert known.own(probe_value("metrics", "lo", "NS"), at="lo")  # a sniff sees its own
