"""Claims that hold (issue 35): what the failed requests share, each claim against its
counter-evidence, one story, the hang mark always answered. Sans-I/O, on built event
streams (``test_findings.Cap``); the recorded scenarios are in ``test_scenarios``."""

from __future__ import annotations

from typing import Any

from tests.unit.test_findings import ENGINE, PROXY, ROUTER, Cap, analyze, evidence, kinds


def _swallowing_hop(cap: Cap, *, fresh_big: bool) -> None:
    """Small requests complete, on fresh and reused connections; a large one on a reused
    connection hangs, and (``fresh_big``) another on a fresh connection; the engine idle."""
    cap.health(0.0)
    cap.exchange(1, 1, 0.0, body=2_000)
    cap.exchange(1, 2, 1.0, idle=0.8, body=30_000)
    cap.exchange(
        1, 3, 2.0, idle=0.8, body=70_000, end="client_abort", ttfb=None, events=0, duration=5.0
    )
    cap.stall(1, 3, 2.0, 7.0)
    cap.exchange(2, 1, 2.5, body=5_000)
    cap.exchange(2, 2, 3.0, idle=0.4, body=37_000)
    cap.exchange(3, 1, 3.5, body=1_000)
    if fresh_big:
        cap.exchange(4, 1, 4.0, body=65_000, end="client_abort", ttfb=None, events=0, duration=5.0)
        cap.stall(4, 1, 4.0, 9.0)
    for t in range(0, 12):
        cap.engine(float(t), running=0, delta=0 if t > 1 else 3)


def _contrast(f: dict[str, Any]) -> dict[str, Any]:
    (item,) = [e for e in f["evidence"] if "separating" in e["figures"]]
    return dict(item["figures"])


def test_reuse_is_not_claimed_where_a_fresh_connection_hung_the_same_way() -> None:
    cap = Cap(upstream=PROXY)
    _swallowing_hop(cap, fresh_big=True)
    result = analyze(cap)
    found = kinds(result)
    assert ("proxy", "proxy_hung_on_reuse") not in found, found
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_swallowed_request")
    swallowed = [f for f in result["findings"] if f["kind"] == "proxy_swallowed_request"]
    names = {q for f in swallowed for q in f["requests"]}
    assert names == {"front/1/3", "front/4/1"}
    # what separates them is the body size, quoted with its figures; reuse does not
    figures = _contrast(swallowed[0])
    assert figures["failed"] == 2 and figures["completed"] == 5
    assert "request_bytes" in figures["separating"]
    assert figures["request_bytes"] == {"failed": [65_000, 70_000], "completed": [1_000, 37_000]}
    assert figures["reuse_separates"] is False
    assert figures["reused_failed"] == 1 and figures["fresh_failed"] == 1


def test_reuse_is_claimed_where_only_reused_connections_hung() -> None:
    cap = Cap(upstream=PROXY)
    _swallowing_hop(cap, fresh_big=False)
    result = analyze(cap)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_hung_on_reuse")
    (top,) = [f for f in result["findings"] if f["id"] == v["finding"]]
    figures = _contrast(top)
    assert figures["reuse_separates"] is True
    assert figures["failed"] == 1 and figures["completed"] == 5


def test_a_non_streamed_request_while_the_engine_decodes_is_a_wait_not_a_hold() -> None:
    """At a tap in front of the engine, a non-streamed request gets nothing for 3 s while
    the engine runs it and its live progress moves: not "held without answering"."""
    cap = Cap(upstream=ENGINE)
    cap.exchange(1, 1, 0.0, stream=False, sse=False, events=0, end="client_abort", ttfb=None,
                 duration=3.0)  # fmt: skip
    cap.stall(1, 1, 0.0, 3.0)
    for t in range(0, 6):
        cap.engine(float(t), running=1, delta=40)
    result = analyze(cap)
    faults = [f for f in result["findings"] if not f["note"]]
    assert not [f for f in faults if f["party"] == "engine"], kinds(result)
    (note,) = [f for f in result["findings"] if f["kind"] == "answer_in_progress"]
    assert note["note"] is True and note["requests"] == ["front/1/1"]
    assert evidence(note, running_max=1)


def test_a_hops_own_timeout_takes_the_engines_work_behind_it_as_context() -> None:
    """front -> hop (3 s read timeout) -> back -> engine generating a non-streamed answer:
    the hop's 504 is the verdict; the engine's decoding is its context, not a second fault
    ruling the proxy out."""
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ENGINE)
    for seq, t in ((1, 0.0), (2, 1.0)):
        front.exchange(1, seq, t, rid=f"ok{seq}", idle=0.5)
        back.exchange(1, seq, t + 0.002, rid=f"ok{seq}", idle=0.5)
    front.exchange(2, 1, 2.0, rid="slow", stream=False, sse=False, events=0, ttfb=3.0,
                   status=504)  # fmt: skip
    front.stall(2, 1, 2.0, 5.0)
    back.exchange(2, 1, 2.002, rid="slow", stream=False, sse=False, events=0, ttfb=None,
                  end="client_abort", duration=3.0)  # fmt: skip
    back.stall(2, 1, 2.002, 5.0)
    for t in range(0, 8):
        back.engine(float(t), running=1, delta=40)
    result = analyze(front, back)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_error_status")
    assert "contradicted_by" not in v
    faults = [f for f in result["findings"] if not f["note"]]
    # nothing else claims the request was held by the serving stack, nor rules out the proxy
    for f in faults:
        if "back/2/1" in f["requests"]:
            assert f["kind"] == "proxy_error_status", kinds(result)
            assert "proxy" not in {r["party"] for r in f["ruled_out"]}
    (top,) = [f for f in result["findings"] if f["id"] == v["finding"]]
    (context,) = [e for e in top["evidence"] if "waited" in e["figures"]]
    assert context["figures"]["generating"] is True and context["tap"] == "back"


def test_contradicting_findings_are_said_and_lower_the_confidence() -> None:
    from tracer.analysis.findings.claims import one_story
    from tracer.analysis.findings.model import Finding, RuledOut

    def f(fid: str, party: str, ruled: list[str]) -> Finding:
        return Finding(
            party=party,
            kind="k",
            summary="s",
            requests=["front/1/1"],
            connections=["front/1"],
            evidence=[],
            ruled_out=[RuledOut(p, "why") for p in ruled],
            confidence="high",
            id=fid,
        )

    verdict, other = f("F1", "proxy", ["engine"]), f("F2", "engine", ["proxy"])
    (c,) = one_story([verdict, other], verdict, ["front"])
    assert (c.other.id, c.party) == ("F2", "proxy")
    assert verdict.confidence == "medium"
    assert verdict.evidence[-1].figures == {"contradicted_by": "F2", "ruled_out": "proxy"}
    # a finding about a tap behind the verdict's front one speaks of what lies behind it
    behind = f("F3", "engine", ["proxy"])
    behind.requests = ["back/1/1"]
    verdict2 = f("F1", "proxy", [])
    verdict2.requests = ["front/1/1", "back/1/1"]
    assert one_story([verdict2, behind], verdict2, ["front", "back"]) == []


def _agents(cap: Cap, *, stop_after: int | None) -> None:
    """Four agents on connections 1-4, a round each second; agent 2 stops after
    ``stop_after`` rounds; the others go on to +9 s."""
    for conn in (1, 2, 3, 4):
        for seq in range(1, 10):
            if conn == 2 and stop_after is not None and seq > stop_after:
                break
            start = seq * 1.0 + conn * 0.05
            cap.exchange(conn, seq, start, idle=0.0 if seq == 1 else 0.8, itl=0.04)
    # agent 4's last round is still streaming at the mark
    cap.exchange(4, 10, 10.0, idle=0.8, events=40, itl=0.05)
    for t in range(0, 12):
        cap.engine(float(t), running=2, delta=30)


def test_one_agent_that_stopped_amid_others_is_the_client_at_the_mark() -> None:
    cap = Cap(upstream=ENGINE)
    _agents(cap, stop_after=2)
    mark = cap.t0 + 10.5
    result = analyze(cap, hang_at=[mark], client_facing=["front"])
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("client", "client_idle_hang"), kinds(result)
    (top,) = [f for f in result["findings"] if f["id"] == v["finding"]]
    assert top["connections"] == ["front/2"]
    assert top["requests"] == ["front/2/2"]
    assert v["confidence"] == "medium"  # others still moved: the quiet is read from timing
    # every client-facing connection's state at the mark is given
    (states,) = result["evidence"]["mark_states"]
    by_conn = {s["connection"]: s for s in states["connections"]}
    assert by_conn["front/2"]["state"] == "idle" and by_conn["front/2"]["quiet"] is True
    assert by_conn["front/4"]["state"] == "moving"
    assert states["counts"] == {"idle": 2, "moving": 1, "quiet": 1}


def test_a_mark_with_streams_moving_and_nobody_quiet_is_never_healthy() -> None:
    cap = Cap(upstream=ENGINE)
    _agents(cap, stop_after=None)
    result = analyze(cap, hang_at=[cap.t0 + 10.5], client_facing=["front"])
    v = result["verdict"]
    assert v["kind"] != "healthy"
    assert (v["party"], v["kind"], v["confidence"]) == ("unknown", "moving_at_hang", "low")
    assert result["findings"][0]["settle"]


def test_without_a_mark_the_same_traffic_is_healthy() -> None:
    cap = Cap(upstream=ENGINE)
    _agents(cap, stop_after=2)
    assert analyze(cap)["verdict"]["kind"] == "healthy"


def test_a_held_streams_sentence_says_what_reached_the_tap() -> None:
    """Every event and [DONE] reached the tap, then the body's end never came, while the
    engine produced tokens: the summary says so, never "none reached the tap"."""
    cap = Cap(upstream=PROXY)
    cap.exchange(1, 1, 0.0, events=27, end="client_abort", done=True, duration=6.0)
    cap.stall(1, 1, 0.7, 6.0)
    for t in range(0, 8):
        cap.engine(float(t), running=1, delta=20)
    result = analyze(cap)
    (held,) = [f for f in result["findings"] if f["kind"] == "proxy_held_stream"]
    assert "none reached" not in held["summary"]
    (out,) = [e for e in held["evidence"] if "events" in e["figures"]]
    assert out["figures"]["done"] is True
    assert f"all {out['figures']['events']} events and data: [DONE]" in held["summary"]


def test_rows_carry_the_prompt_size() -> None:
    from tracer.capture.bodies import openai_fields

    body = b'{"messages":[{"role":"user","content":"hello"},{"role":"user","content":[{"type":"text","text":"abc"}]}]}'
    assert openai_fields(body)["prompt_chars"] == 8
    assert openai_fields(b'{"prompt":"xyz"}')["prompt_chars"] == 3
    assert "prompt_chars" not in openai_fields(b'{"model":"m"}')
    assert ROUTER  # (the shared constants)


# --- what an attack on the claims found (issue 35's tester) -------------------------------


def test_a_client_that_stops_mid_body_is_the_client_not_a_lost_request() -> None:
    from tracer import events as ev

    cap = Cap(upstream=ENGINE)
    cap.exchange(2, 1, 0.0)
    cap._e(ev.ConnOpen, 0.999, conn=1, peer="127.0.0.1:5", local="127.0.0.1:6")
    cap._e(ev.RequestHead, 1.0, conn=1, seq=1, idle_before=0.0, method="POST",
           target="/v1/chat/completions", version="1.1", headers=[])  # fmt: skip
    cap._e(ev.RequestEnd, 21.0, conn=1, seq=1, complete=False, body_bytes=5_059)
    cap._e(ev.ResponseEnd, 21.0, conn=1, seq=1, termination="client_abort", body_bytes=0,
           duration=20.0)  # fmt: skip
    cap.stall(1, 1, 1.0, 21.0, direction="client_silent")
    for t in range(23):
        cap.engine(float(t), running=0)
    result = analyze(cap)
    assert kinds(result) == [("client", "client_body_stalled")]
    assert evidence(result["findings"][0], request_complete=False, request_bytes=5_059)


def test_a_mark_over_a_request_that_only_has_notes_is_still_answered() -> None:
    cap = Cap(upstream=ENGINE)
    cap.exchange(1, 1, 0.0)
    cap.exchange(2, 1, 1.0, ttfb=15.0, events=10)
    cap.stall(2, 1, 1.0, 16.0)
    for t in range(25):
        cap.engine(float(t), running=8, queued=5, delta=40)
    result = analyze(cap, hang_at=[cap.t0 + 10], client_facing=["front"])
    v = result["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == ("unknown", "silent_at_hang", "low")
    (top,) = [f for f in result["findings"] if f["id"] == v["finding"]]
    assert top["connections"] == ["front/2"]
    assert ("engine", "engine_queueing") in kinds(result)  # the note that says why


def test_a_mark_after_the_front_taps_capture_ended_is_not_the_client() -> None:
    from tracer import events as ev

    front, back = Cap("front", upstream=PROXY), Cap("back", upstream=ENGINE)
    for seq in (1, 2):
        front.exchange(1, seq, seq * 1.0, rid=f"r{seq}", idle=0.5)
        back.exchange(1, seq, seq * 1.0 + 0.002, rid=f"r{seq}", idle=0.5)
    front._e(ev.CaptureEnd, 5.0, records=10, dropped=0, reason="stopped")
    for i in range(20):
        back.exchange(2, i + 1, 10.0 + i * 4, rid=f"b{i}", idle=3.0)
    result = analyze(front, back, hang_at=[front.t0 + 50])
    assert result["verdict"]["kind"] == "not_recording_at_hang"
    assert ("client", "client_idle_hang") not in kinds(result)


def test_a_fresh_request_the_capture_cut_does_not_cancel_reuse() -> None:
    cap = Cap(upstream=PROXY)
    _swallowing_hop(cap, fresh_big=False)
    # sent 1.5 s before the capture ends, a stall recorded after 1 s: no hang yet
    cap.exchange(5, 1, 10.0, ttfb=None, events=0, end="in_flight", duration=1.5)
    cap.stall(5, 1, 10.0, None)
    assert analyze(cap)["verdict"]["kind"] == "proxy_hung_on_reuse"


def test_cuts_at_one_age_are_no_total_timeout_when_longer_requests_completed() -> None:
    cap = Cap(upstream=PROXY)
    for i in range(6):
        cap.exchange(10 + i, 1, i * 3.0, events=160, itl=0.05)  # 8 s streams, complete
    cap.exchange(1, 1, 1.0, events=100, itl=0.05, end="truncated")
    cap.exchange(2, 1, 11.0, events=90, itl=0.0555, end="truncated")
    found = [f for f in analyze(cap)["findings"] if f["kind"] == "stream_cut"]
    assert found and not [e for f in found for e in f["evidence"] if "same_age" in e["figures"]]
