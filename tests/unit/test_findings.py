"""Attribution as a pure function: synthetic event streams in, findings and verdict out."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tracer import events as ev
from tracer.analysis.findings import (
    TIME_JOINED_REPEATS,
    Evidence,
    EvidenceItem,
    Finding,
    RuledOut,
    find,
)
from tracer.analysis.summary import Summary

PROXY = "http://127.0.0.1:8001"  # a hop between the tap and the router
ROUTER = "http://127.0.0.1:8000"
ENGINE = "http://127.0.0.1:30000"


class Cap:
    """Builds one tap's event stream."""

    def __init__(
        self,
        tap: str = "front",
        upstream: str | None = PROXY,
        t0: float = 1000.0,
        boot_id: str | None = None,
    ) -> None:
        self.tap, self.t0 = tap, t0
        self.events: list[ev.Event] = [
            ev.CaptureStart(
                t=t0,
                m=t0,
                tap=tap,
                tracer_version="t",
                kind="proxy",
                upstream=upstream,
                boot_id=boot_id,
            )
        ]
        self._opened: set[int] = set()

    def _e(self, cls: type[Any], t: float, **kw: Any) -> None:
        self.events.append(cls(t=self.t0 + t, m=self.t0 + t, tap=self.tap, **kw))

    def exchange(
        self,
        conn: int,
        seq: int,
        t: float,
        *,
        rid: str | None = None,
        idle: float = 0.0,
        ttfb: float = 0.01,
        events: int = 5,
        itl: float = 0.02,
        end: str | None = "complete",
        error: str | None = None,
        status: int = 200,
        headers: list[list[str]] | None = None,
        duration: float | None = None,
        first_event_after: float = 0.0,  # seconds from the response head to the first event
        body: int = 10,  # request body bytes
        stream: bool | None = None,  # the request body's "stream"
        sse: bool = True,  # the response is an event stream
        done: bool | None = None,  # data: [DONE] came (default: the end is complete)
    ) -> None:
        if conn not in self._opened:
            self._opened.add(conn)
            self._e(ev.ConnOpen, t - 0.001, conn=conn, peer="127.0.0.1:5", local="127.0.0.1:6")
        self._e(
            ev.RequestHead,
            t,
            conn=conn,
            seq=seq,
            idle_before=idle,
            method="POST",
            target="/v1/chat/completions",
            version="1.1",
            headers=headers or [],
            request_id=rid,
        )
        self._e(
            ev.RequestEnd,
            t,
            conn=conn,
            seq=seq,
            complete=True,
            body_bytes=body,
            body_sha256="x",
            stream=stream,
        )
        if end is None:
            return
        if ttfb is not None and status:
            self._e(
                ev.ResponseHead,
                t + ttfb,
                conn=conn,
                seq=seq,
                status=status,
                reason="",
                version="1.1",
                headers=[],
                ttfb=ttfb,
                sse=sse,
                chunked=True,
            )
            arrivals = [[i * itl, 100, "content"] for i in range(events)]
            if events:
                self._e(
                    ev.BodyData,
                    t + ttfb + first_event_after,
                    conn=conn,
                    seq=seq,
                    size=100 * events,
                    reads=[[i * itl, 100, 1] for i in range(events)],
                    sse=arrivals if sse else None,
                )
        done_at = t + (
            duration if duration is not None else (ttfb or 0.0) + first_event_after + events * itl
        )
        self._e(
            ev.ResponseEnd,
            done_at,
            conn=conn,
            seq=seq,
            termination=end,
            status=status if ttfb is not None else None,
            body_bytes=100 * events if ttfb is not None and status else 0,
            duration=done_at - t,
            events=events,
            done=end == "complete" if done is None else done,
            first_token=ttfb if events and ttfb is not None else None,
            max_gap=itl if events > 1 else None,
            finish_reason="stop" if end == "complete" and not error else None,
            error=error,
        )

    def stall(
        self,
        conn: int,
        seq: int,
        start: float,
        end: float | None,
        direction: str = "upstream_silent",
    ) -> None:
        self._e(
            ev.Stall,
            start + 5,
            conn=conn,
            seq=seq,
            phase="start",
            direction=direction,
            silent_for=5.0,
        )
        if end is not None:
            self._e(
                ev.Stall,
                end,
                conn=conn,
                seq=seq,
                phase="end",
                direction=direction,
                silent_for=end - start,
            )

    def engine(
        self,
        t: float,
        running: int,
        queued: int = 0,
        delta: int = 0,
        url: str = ENGINE + "/metrics",
        profile: str = "sglang",
        in_flight: int | None = None,
        *,
        finished: int | None = None,
        progress_figure: bool = True,
        interval: float = 1.0,
    ) -> None:
        """One scrape. ``delta``: decode progress since the previous one (SGLang's
        realtime_tokens_total); ``finished``: the finish-time token counter's increase
        (default ``delta``); ``progress_figure`` false: an engine without the progress
        figure (its finish-time counter only)."""
        generated = delta if finished is None else finished
        state: dict[str, Any] = {
            "running": running,
            "queued": queued,
            "generation_tokens_total": 1000 + generated,
        }
        deltas: dict[str, Any] = {"generation_tokens_total": generated}
        if progress_figure:
            state["decode_tokens_total"] = 1000 + delta
            deltas["decode_tokens_total"] = delta
        if in_flight is not None:
            state = {"in_flight": in_flight}
        self._e(
            ev.EngineSample,
            t,
            url=url,
            ok=True,
            elapsed=0.001,
            profile=profile,
            state=state,
            deltas=deltas if profile == "sglang" else None,
            interval=interval if profile == "sglang" else None,
        )

    def probe(self, t: float, conn: int, seq: int, outcome: str = "ok") -> None:
        self._e(
            ev.Probe,
            t,
            url=PROXY + "/v1/models",
            target="upstream",
            kind="models",
            outcome=outcome,
            trigger_conn=conn,
            trigger_seq=seq,
            status=200,
            latency=0.004,
        )

    def health(self, t: float, url: str = ROUTER + "/readiness") -> None:
        self._e(ev.HealthSample, t, url=url, ok=True, elapsed=0.001, status=200)


def analyze(*caps: Cap, **kw: Any) -> dict[str, Any]:
    s = Summary()
    for cap in caps:
        for e in cap.events:
            s.feed(e)
    return s.result(**kw)


def kinds(result: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f["party"], f["kind"]) for f in result["findings"]]


def evidence(f: dict[str, Any], **want: Any) -> list[dict[str, Any]]:
    """The finding's evidence items with these values: ``tap``, ``request`` and ``t`` are
    the item's own fields, any other name one of its figures."""
    return [
        e
        for e in f["evidence"]
        if all(
            k in (have := {"tap": e["tap"], "request": e["request"], "t": e["t"], **e["figures"]})
            and have[k] == v
            for k, v in want.items()
        )
    ]


def verdict_finding(result: dict[str, Any]) -> dict[str, Any]:
    """The finding the verdict names."""
    (f,) = [f for f in result["findings"] if f["id"] == result["verdict"]["finding"]]
    return f


def test_healthy_capture_has_no_findings() -> None:
    cap = Cap()
    for i in range(3):
        cap.exchange(1, i + 1, i * 1.0, idle=0.5 if i else 0.0)
        cap.engine(i * 1.0 + 0.5, running=1, delta=5)
    result = analyze(cap)
    assert result["findings"] == [] and result["verdict"]["kind"] == "healthy"


def _hang_on_reuse(cap: Cap, *, probes: bool = True) -> None:
    cap.health(0.0)
    cap.exchange(1, 1, 0.0)
    cap.exchange(1, 2, 1.0, idle=0.8)
    cap.exchange(1, 3, 2.0, idle=0.8, end=None)  # never answered
    cap.stall(1, 3, 2.0, None)
    cap.exchange(2, 1, 8.0)  # a fresh connection completes meanwhile
    for t in range(0, 20):
        cap.engine(float(t), running=0, delta=0 if t > 1 else 3)
    if probes:
        cap.probe(7.1, 1, 3)
    cap._e(
        ev.ResponseEnd, 20.0, conn=1, seq=3, termination="in_flight", body_bytes=0, duration=18.0
    )


def test_hang_on_reuse_in_front_of_a_proxy_is_the_proxy() -> None:
    cap = Cap(upstream=PROXY)
    _hang_on_reuse(cap)
    result = analyze(cap)
    v = result["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == ("proxy", "proxy_hung_on_reuse", "high")
    assert {r["party"] for r in v["ruled_out"]} == {"client", "engine"}
    top = result["findings"][0]
    assert top["requests"] == ["front/1/3"]
    assert evidence(top, tap="front", probe_outcome="ok")  # a probe over a fresh connection
    assert evidence(top, running_max=0, queued_max=0)  # the engine's own figures: idle


def test_hang_on_reuse_when_the_upstream_is_the_router_is_the_engine() -> None:
    cap = Cap(upstream=ROUTER)
    _hang_on_reuse(cap)
    result = analyze(cap)
    v = result["verdict"]
    # not "a hop": the tap's upstream is the serving stack's own front
    assert (v["party"], v["kind"]) == ("engine", "engine_lost_request")
    assert {r["party"] for r in v["ruled_out"]} == {"client", "proxy"}
    # it held the request on a reused connection while a fresh one answered
    f = verdict_finding(result)
    assert evidence(f, request="front/1/3", reused=True, idle_before=0.8)
    assert evidence(f, tap="front", fresh_completed=1, request="front/2/1")


def test_hang_without_engine_evidence_is_unknown_and_says_how_to_settle() -> None:
    cap = Cap()
    cap.exchange(1, 1, 0.0)
    cap.exchange(1, 2, 1.0, idle=0.8, end=None)
    cap.stall(1, 2, 1.0, None)
    result = analyze(cap)
    f = result["findings"][0]
    assert (f["party"], f["kind"]) == ("unknown", "upstream_silent")
    assert "--engine-metrics" in f["settle"]


def test_client_connections_that_failed_are_listed_not_the_verdict_over_a_hang() -> None:
    """Connections that never carried a request (a TLS handshake to the plain port, a
    scanner) are a client finding of their own; the verdict stays with the request that
    hung, however early they came."""
    cap = Cap(upstream=PROXY)
    for conn in (7, 8, 9):
        cap._e(ev.ConnOpen, -0.5, conn=conn, peer="127.0.0.1:9", local="127.0.0.1:6")
        cap._e(
            ev.Anomaly,
            -0.4,
            conn=conn,
            seq=None,
            direction="client",
            error="TLS handshake on a plain HTTP/1.1 listener (illegal request line)",
            offset=0,
        )
    _hang_on_reuse(cap)
    result = analyze(cap)
    assert result["verdict"]["kind"] == "proxy_hung_on_reuse"
    (failed,) = [f for f in result["findings"] if f["kind"] == "client_connection_failed"]
    assert failed["party"] == "client" and failed["connections"] == [
        "front/7",
        "front/8",
        "front/9",
    ]
    assert [(e["tap"], e["figures"]["conn"]) for e in failed["evidence"]] == [
        ("front", 7),
        ("front", 8),
        ("front", 9),
    ]
    assert failed["id"] == result["findings"][-1]["id"]
    # alone, they are the verdict: nothing got through
    alone = Cap(upstream=PROXY)
    alone._e(ev.ConnOpen, 0.0, conn=1, peer="127.0.0.1:9", local="127.0.0.1:6")
    alone._e(ev.Anomaly, 0.1, conn=1, seq=None, direction="client", error="TLS handshake", offset=0)
    verdict = analyze(alone)["verdict"]
    assert (verdict["party"], verdict["kind"]) == ("client", "client_connection_failed")


def test_a_forward_proxys_connections_say_where_they_went() -> None:
    """A tap without one upstream (mitmproxy's regular mode) is placed by each
    connection's own upstream: the router's address makes the hang the engine's."""
    router = ROUTER.removeprefix("http://")

    def hang(upstream: str | None) -> dict[str, Any]:
        cap = Cap(upstream=None)
        _hang_on_reuse(cap)
        if upstream is not None:
            for conn in (1, 2):
                cap._e(ev.UpstreamConnect, -0.0005, conn=conn, phase="start", addr=upstream)
        return analyze(cap)

    assert hang(router)["verdict"]["party"] == "engine"
    conns = {c["id"]: c for c in hang(router)["connections"]}
    assert conns["front/1"]["upstream"] == router
    assert hang("127.0.0.1:8001")["verdict"]["party"] == "proxy"  # a hop in between
    assert hang(None)["verdict"]["party"] == "proxy"


def test_engine_wedged_mid_stream() -> None:
    cap = Cap(upstream=ROUTER)
    cap.health(0.0)
    cap.exchange(1, 1, 0.0, events=3, end=None)
    cap._e(
        ev.ResponseHead,
        0.01,
        conn=1,
        seq=1,
        status=200,
        reason="",
        version="1.1",
        headers=[],
        ttfb=0.01,
        sse=True,
    )
    cap._e(ev.BodyData, 0.01, conn=1, seq=1, size=300, reads=[], sse=[[0.0, 100, "content"]])
    cap.stall(1, 1, 0.2, 10.0)
    cap._e(
        ev.ResponseEnd,
        10.0,
        conn=1,
        seq=1,
        termination="truncated",
        status=200,
        body_bytes=300,
        duration=10.0,
        events=1,
        close="reset",
    )
    for t in range(0, 12):
        cap.engine(float(t), running=1, delta=0)
    v = analyze(cap)["verdict"]
    assert (v["party"], v["kind"]) == ("engine", "engine_stall_mid_stream")


def test_request_lost_in_the_serving_stack() -> None:
    cap = Cap(upstream=ROUTER)
    cap.exchange(1, 1, 0.0, end=None)
    cap.stall(1, 1, 0.0, None)
    for t in range(0, 12):
        cap.engine(float(t), running=0, delta=0)
        cap.engine(float(t), running=0, url=ROUTER + "/metrics", profile="smg", in_flight=1)
    v = analyze(cap)["verdict"]
    assert (v["party"], v["kind"]) == ("engine", "engine_lost_request")


def _lost_records(cap: Cap, first: float, last: float, dropped: int = 40) -> None:
    """A capture_loss record: the tap's writer dropped records from ``first`` to ``last``."""
    cap.events.append(
        ev.CaptureLoss(
            t=cap.t0 + last + 0.1,
            m=cap.t0 + last + 0.1,
            tap=cap.tap,
            dropped=dropped,
            dropped_bytes=dropped * 300,
            reason="OSError: No space left on device",
            first_t=cap.t0 + first,
            last_t=cap.t0 + last,
            resumed=True,
        )
    )


@pytest.mark.parametrize("window", [(0.5, 3.0), (-2.0, -0.5)])
def test_a_request_open_while_the_capture_lost_records_is_unknown_not_a_fault(
    window: tuple[float, float],
) -> None:
    """The same silence as engine_lost_request: while the tap's writer was dropping
    records it is the capture's loss (capture_lost, unknown, the window quoted); a loss
    that ended before the request began leaves the finding as it was."""
    cap = Cap(upstream=ROUTER)
    cap.exchange(1, 1, 0.0, end=None)
    cap.stall(1, 1, 0.0, None)
    cap.exchange(2, 1, 0.2)  # completed within the window: not set aside
    for t in range(0, 12):
        cap.engine(float(t), running=0, delta=0)
        cap.engine(float(t), running=0, url=ROUTER + "/metrics", profile="smg", in_flight=1)
    _lost_records(cap, *window)
    result = analyze(cap)
    v = result["verdict"]
    if window[1] < 0:
        assert (v["party"], v["kind"]) == ("engine", "engine_lost_request")
        return
    assert (v["party"], v["kind"]) == ("unknown", "capture_lost")
    lost = verdict_finding(result)
    assert lost["requests"] == ["front/1/1"]
    assert not [f for f in result["findings"] if f["party"] in ("engine", "proxy", "client")]
    assert evidence(lost, dropped=40, first_t=1000.5, last_t=1003.0, resumed=True)
    assert result["totals"]["capture_records_lost"] == 40


def test_two_taps_place_the_hang_between_them() -> None:
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER, t0=1000.0)
    for seq in (1, 2):
        front.exchange(1, seq, seq * 1.0, rid=f"r{seq}", idle=0.5 if seq > 1 else 0)
        back.exchange(1, seq, seq * 1.0 + 0.002, rid=f"r{seq}", idle=0.5 if seq > 1 else 0)
    front.exchange(1, 3, 3.0, rid="r3", idle=0.5, end=None)
    front.stall(1, 3, 3.0, None)
    result = analyze(front, back)
    v = result["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == ("proxy", "proxy_hung_on_reuse", "high")
    # the hop between tap front (which saw it) and tap back (which never did)
    f = verdict_finding(result)
    assert f["requests"] == ["front/1/3"]
    assert evidence(f, never_seen_at=["back"], requests_there=[2])


def test_a_failure_seen_the_same_at_every_tap_is_one_finding_from_the_nearest() -> None:
    """Cut by the engine and stalled by it, seen the same through the tap in front: one
    finding each, the back tap's (which knows its upstream is the router), naming the
    request at both taps; the front tap's "somewhere upstream" findings go. What the
    client did is told by the front tap."""
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER, t0=1000.0)
    back.health(0.0)
    for cap, lag in ((front, 0.0), (back, 0.002)):
        cap.exchange(1, 1, 1.0 + lag, rid="ok")
        cap.exchange(1, 2, 2.0 + lag, rid="cut", idle=0.5, events=3, end="truncated")
        cap.exchange(2, 1, 3.0 + lag, rid="stalled", ttfb=None, events=0, end="client_abort",
                     duration=6.0)  # fmt: skip
        cap.stall(2, 1, 3.0 + lag, 9.0 + lag)
        # a stall the hop between added: seen in front only
        cap.exchange(3, 1, 10.0 + lag, rid="held")
        # the client's doing, seen the same at both: told by the tap nearest the client
        cap.exchange(4, 1, 20.0 + lag, rid="gone", events=3, end="client_abort")
        cap.exchange(5, 1, 22.0 + lag, rid="slow")
        cap.stall(5, 1, 22.0 + lag, 28.0 + lag, direction="client_not_reading")
    front.stall(3, 1, 10.0, 16.0)
    # buffered by the hop: nothing in front until the whole stream, in one burst
    front.exchange(6, 1, 30.0, rid="buffered", ttfb=5.0, events=9, itl=0.0)
    front.stall(6, 1, 30.0, 35.0)
    back.exchange(6, 1, 30.002, rid="buffered", events=9)
    result = analyze(front, back)
    by_request = {tuple(f["requests"]): f for f in result["findings"]}
    cut = by_request[("back/1/2", "front/1/2")]
    assert (cut["kind"], cut["party"]) == ("engine_truncated", "engine")
    assert evidence(cut, tap="front", request="front/1/2", same_failure=True)
    assert cut["connections"] == ["back/1", "front/1"]
    stalled = by_request[("back/2/1", "front/2/1")]
    assert stalled["kind"] == "upstream_silent"
    # silent in front, flowing behind: the hop between held it
    held = by_request[("front/3/1", "back/3/1")]
    assert (held["kind"], held["party"], held["confidence"]) == (
        "proxy_held_stream",
        "proxy",
        "high",
    )
    # nothing for 6 s at tap front while tap back received the stream without a stall
    assert evidence(held, tap="front", direction="upstream_silent", duration=6.0)
    assert evidence(held, tap="back", request="back/3/1", stalls=0)
    assert {r["party"] for r in held["ruled_out"]} == {"engine", "client"}
    buffered = by_request[("front/6/1", "back/6/1")]
    assert (buffered["kind"], buffered["party"]) == ("buffered_response", "proxy")
    assert buffered["confidence"] == "high"  # seen flowing at the tap behind the hop
    assert evidence(buffered, tap="back", request="back/6/1", stalls=0)
    assert by_request[("front/4/1", "back/4/1")]["kind"] == "client_abort"
    assert by_request[("front/5/1", "back/5/1")]["kind"] == "client_not_reading"
    assert sorted(by_request) == [
        ("back/1/2", "front/1/2"),
        ("back/2/1", "front/2/1"),
        ("front/3/1", "back/3/1"),
        ("front/4/1", "back/4/1"),
        ("front/5/1", "back/5/1"),
        ("front/6/1", "back/6/1"),
    ]


def test_a_hop_that_times_out_on_a_silent_engine_answers_or_cuts_by_itself() -> None:
    """The engine goes silent; the hop between the taps gives up after 1 s: before the
    first byte it answers 504 itself, mid-stream it cuts the stream. The 504 is not the
    engine's, and the engine's silence is still told, at the tap behind."""
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER, t0=1000.0)
    back.health(0.0)
    # before the first byte: 504 in front; behind, no answer, then the hop closed it
    front.exchange(1, 1, 1.0, rid="early", ttfb=1.0, events=0, status=504)
    front.stall(1, 1, 1.0, 2.0)
    back.exchange(1, 1, 1.002, rid="early", ttfb=None, events=0, end="client_abort", duration=1.0)
    back.stall(1, 1, 1.002, 2.0)
    # mid-stream: cut in front; behind, the client (the hop) closed during the silence
    front.exchange(2, 1, 5.0, rid="mid", events=3, end="truncated")
    front.stall(2, 1, 5.1, 6.1)
    back.exchange(2, 1, 5.002, rid="mid", events=3, end="client_abort")
    back.stall(2, 1, 5.102, 6.1)
    result = analyze(front, back)
    by_request = {tuple(f["requests"]): f for f in result["findings"]}
    answered = by_request[("front/1/1", "back/1/1")]
    assert (answered["kind"], answered["party"]) == ("proxy_error_status", "proxy")
    # 504 at tap front; tap back got no status from upstream: the hop answered it itself
    assert evidence(answered, tap="front", request="front/1/1", status=504)
    behind = [
        e
        for e in evidence(answered, tap="back", request="back/1/1")
        if "termination" in e["figures"]
    ]
    assert behind and all("status" not in e["figures"] for e in behind)
    assert answered["after_silence"] == "back/1/1"
    # the silence behind is the hop's context (issue 35), not a second fault: how long tap
    # back had waited, and what tap back alone would have read it as
    (waited,) = [e for e in evidence(answered, tap="back") if "waited" in e["figures"]]
    assert waited["figures"]["waited"] == pytest.approx(1.0, abs=0.01)
    assert evidence(answered, tap="back", request="back/1/1", context_of="upstream_silent")
    assert answered["ruled_out"] == []  # the engine's silence came first: not ruled out
    cut = by_request[("front/2/1", "back/2/1")]
    # the hop's read timeout met the silence behind it, which came first
    assert cut["kind"] == "proxy_cut_stream" and cut["after_silence"] == "back/2/1"
    assert cut["ruled_out"] == []  # the engine was silent: not ruled out
    # mid-stream the silence behind keeps its own finding: tap back's upstream is the
    # router (its health URL), no hop between it and the serving stack, so a stream that
    # stopped there is the serving stack's stall (medium: no progress figure). Before the
    # first byte it is a wait tap back cannot name: the hop's context, above
    mid = by_request[("back/2/1",)]
    assert (mid["kind"], mid["party"], mid["confidence"]) == (
        "engine_stall_mid_stream",
        "engine",
        "medium",
    )
    assert sorted(by_request) == [
        ("back/2/1",),
        ("front/1/1", "back/1/1"),
        ("front/2/1", "back/2/1"),
    ]


def test_a_hop_answering_an_error_without_forwarding_is_the_proxy() -> None:
    """A 503 at the tap in front for a request the tap behind never saw (it saw the
    others): the hop answered it itself, not the engine."""
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER, t0=1000.0)
    for seq in (1, 2):
        front.exchange(1, seq, seq * 1.0, rid=f"r{seq}", idle=0.5)
        back.exchange(1, seq, seq * 1.0 + 0.002, rid=f"r{seq}", idle=0.5)
    front.exchange(2, 1, 3.0, rid="limited", events=0, status=503)
    result = analyze(front, back)
    v = result["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == ("proxy", "proxy_error_status", "high")
    # answered 503 at tap front, never seen at tap back
    f = verdict_finding(result)
    assert f["requests"] == ["front/2/1"]
    assert evidence(f, tap="front", status=503)
    assert evidence(f, never_seen_at=["back"])
    assert [r["party"] for r in v["ruled_out"]] == ["engine"]
    assert [f["kind"] for f in result["findings"]] == ["proxy_error_status"]


def test_client_not_reading_and_bare_abort() -> None:
    cap = Cap()
    cap.exchange(1, 1, 0.0, events=3, end="client_abort")
    cap.stall(1, 1, 0.1, 6.0, direction="client_not_reading")
    cap.exchange(2, 1, 10.0, events=3, end="client_abort")
    found = kinds(analyze(cap))
    assert ("client", "client_not_reading") in found
    assert ("client", "client_abort") in found


def test_slow_because_busy_is_load_not_a_fault() -> None:
    cap = Cap(upstream=ROUTER)
    cap.exchange(1, 1, 0.0, ttfb=5.0)
    for t in range(0, 8):
        cap.engine(float(t), running=53, queued=12, delta=2000)
    result = analyze(cap)
    assert result["verdict"]["kind"] == "healthy"
    assert kinds(result) == [("engine", "engine_queueing")]
    (note,) = result["findings"]
    assert note["note"] is True and note["requests"] == ["front/1/1"]
    # load, with the engine's figures: running and queued while the request waited
    assert evidence(note, running_max=53, queued_max=12)
    assert evidence(note, request="front/1/1", first_token=5.0)


def test_hang_mark_with_nothing_in_flight() -> None:
    cap = Cap()
    cap.exchange(1, 1, 0.0)
    cap.exchange(1, 2, 1.0, idle=0.5)
    result = analyze(cap, hang_at=[cap.t0 + 30.0])
    f = result["findings"][0]
    assert (f["party"], f["kind"]) == ("unknown", "idle_at_hang")
    assert {r["party"] for r in f["ruled_out"]} == {"engine"}
    client = analyze(cap, hang_at=[cap.t0 + 30.0], client_facing=["front"])
    assert kinds(client) == [("client", "client_idle_hang")]


def test_sse_error_event_is_the_engine() -> None:
    cap = Cap(upstream=ROUTER)
    cap.exchange(1, 1, 0.0, error="out of memory")
    assert kinds(analyze(cap))[0] == ("engine", "engine_error_event")


def test_coalesced_delivery() -> None:
    cap = Cap()
    cap.exchange(1, 1, 0.0, events=0)
    sse = []
    for bunch in range(6):  # 6 bunches of 4 events, 40 ms apart
        sse += [[bunch * 0.040, 100, "content"]] * 4
    cap._e(ev.BodyData, 0.02, conn=1, seq=1, size=2400, reads=[], sse=sse)
    assert ("proxy", "delivery_coalesced") in kinds(analyze(cap))


def test_every_finding_has_a_summary_and_evidence_items() -> None:
    """Findings are records until the output edge: in the document each has a sentence of
    why, and evidence items with their text, time, tap, request and figures (null where
    not known, ``{}`` for no figures)."""
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER, t0=1000.0)
    _hang_on_reuse(front)
    front.exchange(3, 1, 30.0, rid="cut", events=3, end="truncated")
    back.exchange(1, 1, 30.002, rid="cut", events=3, end="truncated")
    result = analyze(front, back, hang_at=[front.t0 + 40.0])
    assert len({f["kind"] for f in result["findings"]}) >= 2
    for f in result["findings"]:
        assert isinstance(f["summary"], str) and f["summary"].strip(), f
        assert f["evidence"], f
        for e in f["evidence"]:
            assert set(e) == {"text", "t", "tap", "request", "figures"}, e
            assert e["text"] and isinstance(e["figures"], dict)
            assert e["request"] is None or e["request"] in f["requests"] or e["tap"], e
        for r in f["ruled_out"]:
            assert set(r) == {"party", "why"} and r["why"]
    json.dumps(result["findings"])  # plain JSON


def test_find_gives_typed_records() -> None:
    cap = Cap(upstream=PROXY)
    _hang_on_reuse(cap)
    s = Summary()
    for e in cap.events:
        s.feed(e)
    evidence_in = Evidence(
        taps=s.taps,
        connections=list(s.connections.values()),
        requests=list(s.requests.values()),
        engine=s.engine,
        probes=s.probes,
        health=s.health,
        faults=s.faults,
        marks=[],
    )
    found, verdict = find(evidence_in)
    (top,) = [f for f in found if f.id == verdict["finding"]]
    assert isinstance(top, Finding) and top.kind == "proxy_hung_on_reuse"
    assert all(isinstance(e, EvidenceItem) for e in top.evidence)
    assert [r.party for r in top.ruled_out] == ["client", "engine"]
    assert all(isinstance(r, RuledOut) for r in top.ruled_out)
    (quoted,) = [e for e in top.evidence if e.request == "front/1/3" and "seq" in e.figures]
    assert quoted.t == cap.t0 + 2.0 and quoted.figures["reused"] is True


def test_same_capture_same_findings() -> None:
    cap = Cap()
    _hang_on_reuse(cap)
    assert analyze(cap) == analyze(cap)


def test_two_taps_join_by_fingerprint_without_request_ids() -> None:
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER)
    for seq in (1, 2):
        front.exchange(1, seq, seq * 1.0, idle=0.5 if seq > 1 else 0)
        back.exchange(1, seq, seq * 1.0 + 0.002, idle=0.5 if seq > 1 else 0)
    front.exchange(1, 3, 3.0, idle=0.5, end=None)
    front.stall(1, 3, 3.0, None)
    v = analyze(front, back)["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_hung_on_reuse")


def _swallowed_then_sent_again(front_boot: str | None, back_boot: str | None) -> dict[str, Any]:
    """A hop swallows a request; the client gives up after 1.5 s and at once sends the same
    body (no request id, no retry count) on a fresh connection, which gets through."""
    front = Cap("front", upstream=PROXY, boot_id=front_boot)
    back = Cap("back", upstream=ROUTER, boot_id=back_boot)
    front.exchange(1, 1, 1.0, end="client_abort", ttfb=None, events=0, duration=1.5)
    front.stall(1, 1, 1.0, 2.5)
    front.exchange(2, 1, 2.505)
    back.exchange(1, 1, 2.508)
    return analyze(front, back)


def test_taps_on_one_clock_join_the_same_body_sent_again_by_time() -> None:
    result = _swallowed_then_sent_again("boot-1", "boot-1")
    v = result["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == ("proxy", "proxy_swallowed_request", "high")
    assert result["findings"][0]["requests"] == ["front/1/1"]
    assert result["evidence"]["tap_pairs"] == [
        {
            "from": "front",
            "to": "back",
            "shared": 1,
            "median_delay": 0.003,
            "one_clock": True,
            "joined_by": {"content_time": 1},
        }
    ]
    assert {t["tap"]: t["boot_id"] for t in result["taps"]} == {"front": "boot-1", "back": "boot-1"}


@pytest.mark.parametrize("boots", [(None, None), ("boot-1", "boot-2"), ("boot-1", None)])
def test_taps_on_clocks_not_known_to_agree_join_by_occurrence(
    boots: tuple[str | None, str | None],
) -> None:
    """Without one clock a few ms cannot be trusted across taps: the n-th copy of a body at
    one tap is the n-th at the next (here that pairs the retry's copy with the swallowed
    first attempt, 1.5 s apart: the limit this join has without a shared clock)."""
    result = _swallowed_then_sent_again(*boots)
    assert result["evidence"]["tap_pairs"][0]["median_delay"] == 1.508
    assert result["verdict"]["kind"] != "proxy_swallowed_request"


def test_a_body_sent_many_times_on_one_clock_joins_by_occurrence() -> None:
    """A load test's one prompt, over and over: past TIME_JOINED_REPEATS copies at a tap a
    fingerprint is joined by occurrence (bounded work), and every copy still pairs up."""
    front = Cap("front", upstream=PROXY, boot_id="boot-1")
    back = Cap("back", upstream=ROUTER, boot_id="boot-1")
    for i in range(TIME_JOINED_REPEATS + 4):
        front.exchange(1, i + 1, i * 0.5, idle=0.1 if i else 0.0)
        back.exchange(1, i + 1, i * 0.5 + 0.002, idle=0.1 if i else 0.0)
    (pair,) = analyze(front, back)["evidence"]["tap_pairs"]
    assert (pair["shared"], pair["median_delay"]) == (TIME_JOINED_REPEATS + 4, 0.002)


def _held_first_events(front_hold: float, back_hold: float) -> dict[str, Any]:
    """Three streams on a reused connection through taps front and back, the first event
    ``front_hold`` / ``back_hold`` seconds after the response head at each."""
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER)
    for seq in (1, 2, 3):
        t, idle = seq * 1.0, 0.5 if seq > 1 else 0.0
        front.exchange(1, seq, t, rid=f"r{seq}", idle=idle, first_event_after=front_hold)
        back.exchange(1, seq, t + 0.002, rid=f"r{seq}", idle=idle, first_event_after=back_hold)
    return analyze(front, back)


def test_a_first_event_held_40_ms_between_two_taps_is_the_hop_between() -> None:
    result = _held_first_events(0.041, 0.0002)
    assert result["verdict"]["kind"] == "healthy"  # a note: latency, not a hang
    assert result["verdict"]["finding"] is None
    (f,) = result["findings"]
    assert (f["kind"], f["party"], f["confidence"], f["note"]) == (
        "first_event_held",
        "proxy",
        "high",
        True,
    )
    assert f["requests"][:2] == ["front/1/1", "back/1/1"]
    # held about 41 ms at tap front, at once at tap back (the hop between), for all 3
    assert f["evidence"][0]["tap"] == "front"
    assert f["evidence"][0]["figures"] == {
        "held": 3,
        "shared": 3,
        "median_ms": 41.0,
        "min_ms": 41.0,
        "max_ms": 41.0,
        "behind": "back",
    }


@pytest.mark.parametrize(
    ("front_hold", "back_hold"),
    [(0.041, 0.040), (0.005, 0.0002), (0.500, 0.0002)],
    ids=["the-engine's-own-first-token", "prompt-at-both", "longer-than-a-delayed-ack"],
)
def test_first_events_not_held_by_the_hop_between(front_hold: float, back_hold: float) -> None:
    found = kinds(_held_first_events(front_hold, back_hold))
    assert ("proxy", "first_event_held") not in found


def _one_tap_first_events(fresh_hold: float, reused_hold: float) -> dict[str, Any]:
    """Two connections of three streams each at one tap: the first event ``fresh_hold``
    after the head on a connection's first request, ``reused_hold`` on the others."""
    cap = Cap("front", upstream=ROUTER)
    for conn in (1, 2):
        for seq in (1, 2, 3):
            hold = fresh_hold if seq == 1 else reused_hold
            t = conn * 10.0 + seq
            cap.exchange(conn, seq, t, idle=0.5 if seq > 1 else 0.0, first_event_after=hold)
    return analyze(cap)


@pytest.mark.parametrize("fresh", [0.0005, 0.0, -1e-7], ids=["0.5ms", "0", "rounded-below-0"])
def test_first_events_held_on_reused_connections_only_at_one_tap(fresh: float) -> None:
    """(The head and the first event in one read: their times, rounded each, can come out
    a hair apart either way.)"""
    result = _one_tap_first_events(fresh, 0.041)
    assert result["verdict"]["kind"] == "healthy"
    (f,) = result["findings"]
    assert (f["kind"], f["party"], f["confidence"], f["note"]) == (
        "first_event_held",
        "proxy",
        "medium",
        True,
    )
    reused, fresh = f["evidence"][:2]
    assert reused["tap"] == fresh["tap"] == "front"
    assert reused["figures"] == {
        "reused_held": 4,
        "reused": 4,
        "median_ms": 41.0,
        "min_ms": 41.0,
        "max_ms": 41.0,
    }
    assert fresh["figures"] == {"fresh_prompt": 2, "fresh": 2}


@pytest.mark.parametrize(("fresh", "reused"), [(0.041, 0.041), (0.0005, 0.0005), (0.0005, 0.4)])
def test_first_events_alike_on_fresh_and_reused_connections_are_not_held(
    fresh: float, reused: float
) -> None:
    assert ("proxy", "first_event_held") not in kinds(_one_tap_first_events(fresh, reused))


def test_taps_that_share_no_request_are_not_taken_for_a_chain() -> None:
    """The taps in front of two engines, analysed without the router's tap: each saw its
    own requests only. A request hung at one was not 'swallowed by the hop' to the other."""
    e1, e2 = Cap("e1", upstream=ENGINE), Cap("e2", upstream=ENGINE)
    for i in range(3):
        e1.exchange(1, i + 1, i * 1.0, rid=f"a{i}", idle=0.5 if i else 0.0)
        e2.exchange(1, i + 1, i * 1.0 + 0.3, rid=f"b{i}", idle=0.5 if i else 0.0)
    e1.exchange(1, 4, 3.0, rid="a3", idle=0.5, end=None)
    e1.stall(1, 4, 3.0, None)
    result = analyze(e1, e2)
    assert not [f for f in result["findings"] if f["party"] == "proxy"], result["findings"]
    assert result["verdict"]["kind"] == "upstream_silent"
    assert result["evidence"]["tap_pairs"] == [
        {
            "from": "e1",
            "to": "e2",
            "shared": 0,
            "median_delay": None,
            "one_clock": False,
            "joined_by": {},
        }
    ]


def test_a_5xx_behind_a_tap_whose_client_was_answered_is_a_note() -> None:
    """The tap behind a proxy saw a 500; the proxy answered its client 200 anyway (a
    cache, a fallback): the engine's error is told, as a note."""
    front, back = Cap("front", upstream=PROXY), Cap("back", upstream=ROUTER)
    front.exchange(1, 1, 1.0, rid="r1")
    back.exchange(1, 1, 1.002, rid="r1", status=500, events=0)
    result = analyze(front, back)
    assert result["verdict"]["kind"] == "healthy", result["findings"]
    (f,) = result["findings"]
    assert (f["kind"], f["note"], f["requests"]) == ("engine_error_status", True, ["back/1/1"])
    # the client did not see it: its copy at tap front was answered, and not sent again
    answered = f["evidence"][-1]
    assert (answered["tap"], answered["request"]) == ("front", "front/1/1")
    assert answered["figures"]["answered_copy_of"] == "back/1/1"
    assert (answered["figures"]["termination"], answered["figures"]["status"]) == (
        "complete",
        200,
    )
    assert "sent_to" not in answered["figures"]


def test_a_request_sent_again_to_another_engine_is_not_a_chain_of_taps() -> None:
    """On one clock: engine 1's tap saw the request and answered 500 before engine 2's saw
    it (the router's retry). The two engine taps are each one hop behind the front tap;
    seen one after the other, they are not a chain."""
    caps = [Cap(tap, upstream=up, boot_id="boot-1") for tap, up in
            (("front", ROUTER), ("e1", ENGINE), ("e2", ENGINE))]  # fmt: skip
    front, e1, e2 = caps
    for i in range(3):
        t = 1.0 + i
        front.exchange(1, i + 1, t, rid=f"r{i}", idle=0.5 if i else 0.0, ttfb=0.06)
        e1.exchange(1, i + 1, t + 0.001, rid=f"r{i}", status=500, events=0, ttfb=0.001)
        e2.exchange(1, i + 1, t + 0.05, rid=f"r{i}", idle=0.5 if i else 0.0)
    result = analyze(*caps)
    pairs = {(p["from"], p["to"]): p["shared"] for p in result["evidence"]["tap_pairs"]}
    assert pairs == {("front", "e1"): 3, ("front", "e2"): 3}
    assert result["verdict"]["kind"] == "healthy"
    assert {f["kind"] for f in result["findings"]} == {"engine_error_status"}
    assert all(
        (f["evidence"][-1]["figures"]["sent_to"], f["evidence"][-1]["figures"]["sent"])
        == ("e2", "again")
        for f in result["findings"]
    )


def test_a_cut_on_the_decode_leg_of_pd_is_told_once() -> None:
    """PD: each request goes to the prefill and the decode leg at once; the decode leg's
    stream is the client's. A cut there is the same failure at the front tap: one finding,
    from the decode leg's tap; the prefill leg (answered, one event) is not on its path."""
    caps = [Cap(tap, upstream=up, boot_id="boot-1") for tap, up in
            (("front", ROUTER), ("p", ENGINE), ("d", ENGINE))]  # fmt: skip
    front, p, d = caps
    for i in range(4):
        t, idle, cut = 1.0 + i, 0.5 if i else 0.0, "truncated" if i == 2 else "complete"
        front.exchange(1, i + 1, t, rid=f"r{i}", idle=idle, end=cut, ttfb=0.003)
        p.exchange(1, i + 1, t + 0.0005, rid=f"r{i}", idle=idle, events=1, ttfb=0.001)
        d.exchange(1, i + 1, t + 0.0004, rid=f"r{i}", idle=idle, end=cut, ttfb=0.002)
    result = analyze(*caps)
    pairs = {(q["from"], q["to"]) for q in result["evidence"]["tap_pairs"]}
    assert pairs == {("front", "p"), ("front", "d")}
    (f,) = [f for f in result["findings"] if not f["note"]]
    assert f["requests"] == ["d/1/3", "front/1/3"], result["findings"]


def _bunched(cap: Cap, t: float, *, bunched: bool) -> None:
    cap.exchange(1, 1, t, events=0)
    sse = []
    for bunch in range(6):  # 6 bunches of 4 events, 40 ms apart; or 24 events 10 ms apart
        sse += [[bunch * 0.040, 100, "content"]] * 4 if bunched else []
    sse = sse or [[i * 0.010, 100, "content"] for i in range(24)]
    cap._e(ev.BodyData, t + 0.02, conn=1, seq=1, size=2400, reads=[], sse=sse)


def test_coalesced_at_one_tap_and_steady_behind_it_names_the_hop_between() -> None:
    front, back = Cap("front", upstream=PROXY), Cap("back", upstream=ROUTER)
    _bunched(front, 0.0, bunched=True)
    _bunched(back, 0.002, bunched=False)
    result = analyze(front, back)
    f = next(f for f in result["findings"] if f["kind"] == "delivery_coalesced")
    assert f["party"] == "proxy" and f["confidence"] == "high"
    assert f["requests"] == ["front/1/1", "back/1/1"]
    assert {r["party"] for r in f["ruled_out"]} == {"client", "engine"}
    # bunched at tap front (6 gaps of 30-60 ms), steady at tap back: the hop between
    assert evidence(f, tap="front", bunch_gaps=5)
    assert evidence(f, tap="back", bunch_gaps=0)
    # bunched at both taps: the bunching starts behind the back tap, not between them
    both = analyze(front, _bunched_cap("back", 0.002))
    assert all(len(f["requests"]) == 1 for f in both["findings"])
    assert all(f["confidence"] != "high" for f in both["findings"])


def _bunched_cap(tap: str, t: float) -> Cap:
    cap = Cap(tap, upstream=ROUTER)
    _bunched(cap, t, bunched=True)
    return cap


def test_an_sdk_retry_without_request_ids_is_joined_to_its_own_attempt() -> None:
    """No x-request-id: requests join by method, target and body, counted at each tap.
    The openai SDK sends a hung request again, the same body on a fresh connection; its
    retry count tells the attempts apart, so the first attempt is the one the next tap
    never saw (the retry is not taken for it arriving 5 s late)."""

    def attempt(n: int) -> list[list[str]]:
        return [["X-Stainless-Retry-Count", str(n)]]

    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER, t0=1000.0)
    for seq in (1, 2):
        front.exchange(1, seq, seq * 1.0, idle=0.5, headers=attempt(0))
        back.exchange(1, seq, seq * 1.0 + 0.002, idle=0.5, headers=attempt(0))
    front.exchange(1, 3, 3.0, idle=0.5, end="client_abort", headers=attempt(0))
    front.stall(1, 3, 3.0, 8.0)
    front.exchange(2, 1, 8.1, headers=attempt(1))
    back.exchange(2, 1, 8.102, headers=attempt(1))
    result = analyze(front, back)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_hung_on_reuse"), result["findings"]
    f = verdict_finding(result)
    assert f["requests"] == ["front/1/3"] and evidence(f, never_seen_at=["back"])
    (pair,) = result["evidence"]["tap_pairs"]
    assert (pair["shared"], pair["median_delay"]) == (3, 0.002)
    rows = {r["id"]: r for r in result["requests"]}
    assert rows["front/1/3"]["retry_count"] == 0 and rows["front/2/1"]["retry_count"] == 1


def test_a_retry_with_the_same_id_is_another_request() -> None:
    """The first attempt hangs in the proxy; the client gives up and retries with the same
    x-request-id on a fresh connection, which gets through: the hang is still the proxy's."""
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER, t0=1000.0)
    for seq in (1, 2):
        front.exchange(1, seq, seq * 1.0, rid=f"r{seq}", idle=0.5 if seq > 1 else 0)
        back.exchange(1, seq, seq * 1.0 + 0.002, rid=f"r{seq}", idle=0.5 if seq > 1 else 0)
    front.exchange(1, 3, 3.0, rid="r3", idle=0.5, end="client_abort")
    front.stall(1, 3, 3.0, 8.0)
    front.exchange(2, 1, 9.0, rid="r3")  # the retry
    back.exchange(2, 1, 9.002, rid="r3")
    result = analyze(front, back)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_hung_on_reuse"), result["findings"]
    f = verdict_finding(result)
    assert f["requests"] == ["front/1/3"] and evidence(f, never_seen_at=["back"])


def test_tap_pairs_give_the_order_and_the_median_delay() -> None:
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER, t0=1000.0 + 30.0)  # back's clock 30 s ahead
    for seq in (1, 2, 3):
        front.exchange(1, seq, seq * 1.0, rid=f"r{seq}", idle=0.5 if seq > 1 else 0)
        back.exchange(1, seq, seq * 1.0 + 0.002, rid=f"r{seq}", idle=0.5 if seq > 1 else 0)
    pairs = analyze(back, front)["evidence"]["tap_pairs"]
    assert len(pairs) == 1
    assert (pairs[0]["from"], pairs[0]["to"], pairs[0]["shared"]) == ("front", "back", 3)
    assert pairs[0]["median_delay"] == pytest.approx(30.002, abs=1e-6)


def test_a_clean_end_without_done_or_finish_reason_is_a_logical_truncation() -> None:
    cap = Cap(upstream=ROUTER)
    cap.exchange(1, 1, 0.0, events=4)
    end = cap.events[-1]
    assert isinstance(end, ev.ResponseEnd)
    end.done, end.finish_reason = False, None  # the body ended cleanly, the stream did not
    found = kinds(analyze(cap))
    assert ("engine", "logical_truncation") in found or ("unknown", "logical_truncation") in found


def _injected(cap: Cap, t: float, conn: int, seq: int, spec: str, detail: str) -> None:
    fault = spec.partition(":")[0].partition("@")[0]
    cap._e(ev.FaultInjected, t, conn=conn, seq=seq, fault=fault, spec=spec, detail=detail)


HELD = "request 3 on its connection read and not forwarded"


def test_a_hang_the_tap_injected_itself_is_a_note_not_the_proxy() -> None:
    """The same capture as the proxy's hang on reuse, but the tap says it held the request
    itself (``--fault``): no fault of the client, a proxy or the engine, and the note says
    what the analysis would have called it and what the client got."""
    cap = Cap(upstream=PROXY)
    _hang_on_reuse(cap)
    _injected(cap, 2.0, 1, 3, "hang-on-reuse:3", HELD)
    result = analyze(cap)
    v = result["verdict"]
    assert (v["party"], v["kind"], v["finding"]) == ("none", "healthy", None)
    (note,) = result["findings"]
    assert (note["party"], note["kind"], note["note"]) == ("none", "injected_fault", True)
    assert note["requests"] == ["front/1/3"] and note["connections"] == ["front/1"]
    injected = note["evidence"][0]
    assert (injected["tap"], injected["request"]) == ("front", "front/1/3")
    assert injected["figures"]["fault"] == "hang-on-reuse:3"
    assert injected["figures"]["read_as"] == ["proxy_hung_on_reuse"]
    assert injected["figures"]["detail"] == HELD  # read and not forwarded
    assert injected["figures"]["termination"] == "in_flight"  # what the client got
    assert {r["party"] for r in note["ruled_out"]} == {"client", "proxy", "engine"}


def test_an_injected_fault_beside_an_external_one_leaves_the_verdict_to_the_external() -> None:
    cap = Cap(upstream=ROUTER)
    cap.exchange(1, 1, 0.0, status=503, events=0)
    _injected(cap, 0.0, 1, 1, "status:503@pos=1", "answered 503 without forwarding")
    cap.exchange(1, 2, 1.0, idle=0.5)
    cap.exchange(1, 3, 2.0, idle=0.5, status=500, events=0)  # the router's own
    result = analyze(cap)
    v = result["verdict"]
    assert v["kind"] == "engine_error_status"
    assert result["findings"][0]["requests"] == ["front/1/3"]
    notes = [f for f in result["findings"] if f["kind"] == "injected_fault"]
    assert [n["requests"] for n in notes] == [["front/1/1"]]
    assert notes[0]["evidence"][0]["figures"]["read_as"] == ["engine_error_status"]


def test_a_fault_injected_behind_another_tap_is_a_note_at_both() -> None:
    """A tap behind the front one injected the hang: the front tap's copy of the request
    (joined by id) is injected too, so nothing blames the hop between them."""
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER)
    for seq in (1, 2):
        front.exchange(1, seq, seq * 1.0, rid=f"r{seq}", idle=0.5 if seq > 1 else 0)
        back.exchange(1, seq, seq * 1.0 + 0.002, rid=f"r{seq}", idle=0.5 if seq > 1 else 0)
    front.exchange(1, 3, 3.0, rid="r3", idle=0.5, end=None)
    front.stall(1, 3, 3.0, None)
    back.exchange(1, 3, 3.002, rid="r3", idle=0.5, end=None)
    back.stall(1, 3, 3.002, None)
    assert analyze(front, back)["verdict"]["party"] != "none"  # the record is what tells
    _injected(back, 3.002, 1, 3, "hang-on-reuse:3", HELD)
    result = analyze(front, back)
    assert result["verdict"]["kind"] == "healthy"
    assert kinds(result) == [("none", "injected_fault")]
    assert result["findings"][0]["requests"] == ["back/1/3"]


def _closed_under(fault: bool) -> tuple[Cap, Cap]:
    """Tap front's connection 1 is tap back's connection 1 (front's upstream left from the
    address back saw as its peer). After one exchange, back closes it (idle, by an injected
    ``close-idle-after``, or its upstream did and it passed the FIN on); front passes the
    close on and the client writes its next request anyway: front records it as sent after
    the upstream had closed, and back never sees it."""
    front = Cap("front", upstream="http://127.0.0.1:7001", boot_id="b")
    back = Cap("back", upstream=ROUTER, boot_id="b")
    front._e(ev.ConnOpen, 0.0, conn=1, peer="127.0.0.1:50000", local="127.0.0.1:7000")
    front._e(ev.ConnOpen, 0.0, conn=2, peer="127.0.0.1:50002", local="127.0.0.1:7000")
    front._e(
        ev.UpstreamConnect, 0.0005, conn=1, phase="done", addr="127.0.0.1:7001",
        local="127.0.0.1:40001", elapsed=0.0004,
    )  # fmt: skip
    front._e(
        ev.UpstreamConnect, 0.0005, conn=2, phase="done", addr="127.0.0.1:7001",
        local="127.0.0.1:40002", elapsed=0.0004,
    )  # fmt: skip
    back._e(ev.ConnOpen, 0.0004, conn=1, peer="127.0.0.1:40002", local="127.0.0.1:7001")
    back._e(ev.ConnOpen, 0.0006, conn=2, peer="[::ffff:127.0.0.1]:40001", local="127.0.0.1:7001")
    front._opened |= {1, 2}
    back._opened |= {1, 2}
    front.exchange(1, 1, 0.001, rid="r1")
    back.exchange(2, 1, 0.0012, rid="r1")
    if fault:
        _injected(back, 0.5, 2, 1, "close-idle-after:0.4", "connection closed after 0.4s idle")
    back._e(
        ev.ConnClose, 0.5, conn=2, closed_by="tracer" if fault else "upstream",
        how="tracer" if fault else "fin", in_flight=False, requests=1,
        bytes_from_client=100, bytes_from_upstream=500, upstream_opened=True, duration=0.5,
    )  # fmt: skip
    front._e(
        ev.RequestHead, 0.5005, conn=1, seq=2, idle_before=0.4, method="POST",
        target="/v1/chat/completions", version="1.1", headers=[], request_id="r2",
    )  # fmt: skip
    front._e(ev.RequestEnd, 0.5005, conn=1, seq=2, complete=True, body_bytes=10)
    front._e(
        ev.ResponseEnd, 0.5006, conn=1, seq=2, termination="truncated", body_bytes=0,
        duration=0.0001, close="fin", detail="upstream already closed",
    )  # fmt: skip
    return front, back


def test_a_request_written_after_the_upstream_closed_is_not_a_hop_that_held_it() -> None:
    """The request never reached the next tap because the connection had already closed
    under it, not because a hop held it: the front tap's own reading stands."""
    result = analyze(*_closed_under(fault=False))
    assert result["verdict"]["kind"] == "client_reused_closed_connection"
    assert ("proxy", "proxy_hung_on_reuse") not in kinds(result)


def test_a_close_injected_behind_another_tap_covers_the_request_written_after_it() -> None:
    """The tap behind closed the connection by an injected fault: the request the front
    tap's client wrote on it afterwards (never seen behind) is the fault's doing, found
    through the connection the two taps share, and the note says so."""
    result = analyze(*_closed_under(fault=True))
    assert result["verdict"]["kind"] == "healthy"
    (note,) = result["findings"]
    assert note["kind"] == "injected_fault"
    assert note["requests"] == ["back/2/1", "front/1/2"]
    assert note["evidence"][0]["figures"]["read_as"] == ["client_reused_closed_connection"]
    # written at tap front after tap back had closed the connection (one TCP connection)
    later = note["evidence"][1]
    assert (later["tap"], later["request"]) == ("front", "front/1/2")
    assert (later["figures"]["found"], later["figures"]["there"]) == ("after_close", "back/2")


def test_connections_are_linked_only_while_both_are_open() -> None:
    """The same address at the tap behind, long after the front connection closed (an
    ephemeral port used again), is another connection: nothing is linked to it."""
    front, back = _closed_under(fault=True)
    for e in back.events:  # back's connection opens two minutes later
        if isinstance(e, ev.ConnOpen) and e.conn == 2:
            e.t += 120
    front._e(
        ev.ConnClose, 1.0, conn=1, closed_by="upstream", how="fin", in_flight=False,
        requests=2, bytes_from_client=200, bytes_from_upstream=500, upstream_opened=True,
        duration=1.0,
    )  # fmt: skip
    notes = [f for f in analyze(front, back)["findings"] if f["kind"] == "injected_fault"]
    assert notes and notes[0]["requests"] == ["back/2/1"]


def _written_after_fin(detail: str) -> dict[str, Any]:
    """One tap: a request answered, then, after 2 s idle, one sent on the connection whose
    upstream had closed (the tap had passed the FIN on); the observer's detail says when."""
    cap = Cap(upstream=ROUTER)
    cap.exchange(1, 1, 0.0)
    cap._e(
        ev.RequestHead, 2.2, conn=1, seq=2, idle_before=2.0, method="POST",
        target="/v1/chat/completions", version="1.1", headers=[],
    )  # fmt: skip
    cap._e(ev.RequestEnd, 2.2, conn=1, seq=2, complete=True, body_bytes=10)
    cap._e(
        ev.ResponseEnd, 2.2, conn=1, seq=2, termination="truncated", body_bytes=0,
        duration=0.0, close="fin", detail=detail,
    )  # fmt: skip
    (f,) = analyze(cap)["findings"]
    assert (f["party"], f["kind"]) == ("client", "client_reused_closed_connection")
    return f


@pytest.mark.parametrize(
    ("detail", "confidence", "words"),
    [
        (
            "upstream already closed 1.500000 s before",
            "high",
            "the upstream had closed 1.500 s before (its FIN had been passed on to the client), "
            "after 2.000 s idle: the client's pool kept it longer",
        ),
        (
            "upstream already closed 0.000400 s before",
            "medium",
            "0.4 ms after the tap passed on the upstream's close, after 2.000 s idle: too soon "
            "to tell a client that ignored the close from the keep-alive race",
        ),
        (  # a capture from before the observer said when
            "upstream already closed",
            "high",
            "the upstream had already closed (its FIN had been passed on to the client).",
        ),
    ],
)
def test_a_request_after_the_upstreams_close_says_how_long_after(
    detail: str, confidence: str, words: str
) -> None:
    """Long after the FIN the client ignored the close; within a few ms it may have been
    the keep-alive race, which the tap cannot tell apart: said, at medium confidence."""
    f = _written_after_fin(detail)
    assert f["confidence"] == confidence
    assert evidence(f, request="front/1/2", reused=True, idle_before=2.0)
    said = [e["figures"]["upstream_closed_before"] for e in evidence(f, request="front/1/2")
            if "upstream_closed_before" in e["figures"]]  # fmt: skip
    assert said == ([] if detail.endswith("closed") else [float(detail.split()[3])])


def test_bunching_injected_behind_another_tap_is_a_note() -> None:
    """``coalesce`` at the tap behind: its own events are steady, the front tap's come in
    bunches, which read as the hop between them unless the fault record says otherwise.
    The request is healthy at both taps, so it is joined only for the bunching."""
    front, back = Cap("front", upstream=PROXY), Cap("back", upstream=ROUTER)
    _bunched(front, 0.0, bunched=True)
    _bunched(back, 0.002, bunched=False)
    _injected(back, 0.02, 1, 1, "coalesce:0.04", "response delivered in bunches: held 0.04s")
    result = analyze(front, back)
    assert result["verdict"]["kind"] == "healthy"
    (note,) = result["findings"]
    assert note["kind"] == "injected_fault" and note["requests"] == ["back/1/1"]
    assert note["evidence"][0]["figures"]["read_as"] == ["delivery_coalesced"]


def test_a_request_the_tap_behind_stopped_reading_is_found_through_the_connection() -> None:
    """``half-open`` at the tap behind: it read the head of request 2 and then neither
    read nor wrote, so it has no body to join the front tap's copy by (and there is no
    request id). The two taps' records of the connection are one TCP connection, and a
    tap relays its requests in order: request 2 in front is request 2 behind."""
    front, back = _closed_under(fault=False)
    front.events = [e for e in front.events if getattr(e, "seq", None) != 2]
    back.events = [e for e in back.events if not isinstance(e, ev.ConnClose)]
    front._e(
        ev.RequestHead, 0.5005, conn=1, seq=2, idle_before=0.4, method="POST",
        target="/v1/chat/completions", version="1.1", headers=[],
    )  # fmt: skip
    front._e(ev.RequestEnd, 0.5005, conn=1, seq=2, complete=True, body_bytes=10)
    front.stall(1, 2, 0.5005, None)
    back._e(
        ev.RequestHead, 0.5006, conn=2, seq=2, idle_before=0.4, method="POST",
        target="/v1/chat/completions", version="1.1", headers=[],
    )  # fmt: skip
    _injected(back, 0.5006, 2, 2, "half-open@pos=2", "the tap stopped reading and writing")
    result = analyze(front, back)
    assert result["verdict"]["kind"] == "healthy", result["findings"]
    (note,) = result["findings"]
    assert note["requests"] == ["back/2/2", "front/1/2"]
    # the same request at tap front, request 2 on both (one TCP connection)
    later = note["evidence"][1]
    assert (later["tap"], later["request"]) == ("front", "front/1/2")
    assert (later["figures"]["found"], later["figures"]["there"]) == ("same_position", "back/2")


def test_a_request_the_tap_behind_a_hop_stopped_reading_is_matched_by_its_head() -> None:
    """``half-open`` behind a hop (nginx, the router): no shared connection, and no body at
    the faulting tap to join by. The front tap's copy is the latest unjoined request with
    the same method and target that began just before it; an older one is not."""
    front, back = Cap("front", upstream=PROXY), Cap("back", upstream=ROUTER)
    front.exchange(1, 1, 0.0, rid="r1")
    back.exchange(1, 1, 0.003, rid="r1")
    front.exchange(2, 1, 0.5)  # the same method and target, answered long before
    front.exchange(3, 1, 2.0, end=None)
    front.stall(3, 1, 2.0, None)
    back._e(
        ev.RequestHead, 2.003, conn=1, seq=2, idle_before=1.9, method="POST",
        target="/v1/chat/completions", version="1.1", headers=[],
    )  # fmt: skip
    back._e(ev.RequestEnd, 2.5, conn=1, seq=2, complete=False, body_bytes=0)
    _injected(back, 2.003, 1, 2, "half-open@pos=2", "the tap stopped reading and writing")
    result = analyze(front, back)
    assert result["verdict"]["kind"] == "healthy", result["findings"]
    (note,) = result["findings"]
    assert note["requests"] == ["back/1/2", "front/3/1"]
    later = note["evidence"][1]  # the same request at tap front, matched by its head
    assert (later["tap"], later["request"]) == ("front", "front/3/1")
    assert (later["figures"]["found"], later["figures"]["there"]) == ("by_head", "back/1/2")


# ---- busy is not broken ----------------------------------------------------------------


def _queued_then_streamed(cap: Cap, wait: float = 8.0) -> None:
    """A request that waited ``wait`` s for its first byte (the tap's stall record), then
    streamed to its end."""
    cap.exchange(1, 1, 0.0, ttfb=wait, events=20, itl=0.05)
    cap.stall(1, 1, 0.0, wait)


def test_a_queue_at_capacity_with_flat_finish_counters_is_load_not_a_stall() -> None:
    """SGLang adds generated tokens to generation_tokens_total only when a request
    finishes: while 50 long streams decode it stays flat on a healthy engine. Its decode
    progress (realtime_tokens_total) moves, so a request that waited in the queue and then
    streamed is load: a note, never engine_stall."""
    cap = Cap(upstream=ENGINE)
    _queued_then_streamed(cap)
    for t in range(0, 12):
        cap.engine(float(t), running=50, queued=1 if t < 8 else 0, delta=400, finished=0)
    result = analyze(cap)
    assert result["verdict"]["kind"] == "healthy"
    assert kinds(result) == [("engine", "engine_queueing")]
    (note,) = result["findings"]
    assert note["note"] is True and note["requests"] == ["front/1/1"]


def test_flat_finish_counters_without_a_progress_figure_prove_nothing() -> None:
    """The same load with only the finish-time counter (no progress figure): the engine
    cannot be called stalled, and the request was answered: load."""
    cap = Cap(upstream=ENGINE)
    _queued_then_streamed(cap)
    for t in range(0, 12):
        cap.engine(float(t), running=50, queued=1, finished=0, progress_figure=False)
    result = analyze(cap)
    assert not [k for k in kinds(result) if k[1].startswith("engine_stall")]
    assert result["verdict"]["kind"] == "healthy"


def test_a_silence_at_a_tap_in_front_of_an_engine_without_progress_is_the_engine_unknown_why() -> (
    None
):
    """Never answered, the engine running requests, no progress figure: the serving stack
    held it (there is no hop in between), but nothing says stall rather than wait."""
    cap = Cap(upstream=ENGINE)
    cap.exchange(1, 1, 0.0, end=None)
    cap.stall(1, 1, 0.0, None)
    for t in range(0, 12):
        cap.engine(float(t), running=3, finished=0, progress_figure=False)
    (f,) = analyze(cap)["findings"]
    assert (f["party"], f["kind"], f["confidence"]) == ("engine", "upstream_silent", "medium")
    assert "proxy" in {r["party"] for r in f["ruled_out"]}
    assert f["settle"]


def test_flat_progress_while_running_is_a_stall() -> None:
    cap = Cap(upstream=ENGINE)
    cap.exchange(1, 1, 0.0, end=None)
    cap.stall(1, 1, 0.0, None)
    for t in range(0, 12):
        cap.engine(float(t), running=3, delta=0)
    (f,) = analyze(cap)["findings"]
    assert (f["party"], f["kind"], f["confidence"]) == ("engine", "engine_stall", "high")


def test_flat_progress_shorter_than_the_engines_cadence_is_no_stall() -> None:
    """SGLang writes its progress figure every 40 decode steps: on an engine seen to
    write it every 4 s, 3 s flat prove nothing."""
    cap = Cap(upstream=ENGINE)
    for t in range(0, 40):  # before: progress rises every 4th scrape
        cap.engine(float(t) - 60.0, running=5, delta=160 if t % 4 == 0 else 0)
    cap.exchange(1, 1, 0.0, ttfb=None, end="client_abort", duration=3.5)
    cap.stall(1, 1, 0.0, 3.5)
    for t in range(1, 4):
        cap.engine(float(t), running=5, delta=0)
    assert not [k for k in kinds(analyze(cap)) if k[1].startswith("engine_stall")]


def test_a_burst_in_front_and_a_flowing_stream_behind_is_the_hop_between() -> None:
    """nginx with proxy_buffering and proxy_http_version 1.0 between two taps: behind it
    the stream flows for 3 s (close-delimited), in front it comes in one burst with no
    silence long enough for a stall record. Both copies are joined: the hop between,
    with high confidence and each tap's evidence."""
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ENGINE, t0=1000.0)
    front.exchange(1, 1, 0.0, rid="b", ttfb=3.1, events=20, itl=0.0)
    back.exchange(1, 1, 0.002, rid="b", ttfb=0.05, events=20, itl=0.15)
    result = analyze(front, back)
    (f,) = [f for f in result["findings"] if f["kind"] == "buffered_response"]
    assert (f["party"], f["confidence"]) == ("proxy", "high")
    assert f["requests"] == ["front/1/1", "back/1/1"]
    assert {r["party"] for r in f["ruled_out"]} == {"client", "engine"}
    assert (result["verdict"]["party"], result["verdict"]["kind"]) == ("proxy", "buffered_response")


def test_hard_evidence_outranks_bunching_for_the_verdict() -> None:
    """A starved machine bunches a stream (30-60 ms gaps) before the real fault: a request
    on a reused connection that never reached the next tap. The verdict answers the hang:
    the request never seen behind, not the earlier, high-confidence bunching."""
    front, back = Cap("front", upstream=PROXY), Cap("back", upstream=ROUTER)
    _bunched(front, 0.0, bunched=True)
    _bunched(back, 0.002, bunched=False)
    for seq in (1, 2):
        front.exchange(2, seq, seq * 1.0, rid=f"r{seq}", idle=0.5 if seq > 1 else 0)
        back.exchange(2, seq, seq * 1.0 + 0.002, rid=f"r{seq}", idle=0.5 if seq > 1 else 0)
    front.exchange(2, 3, 3.0, rid="r3", idle=0.5, end=None)
    front.stall(2, 3, 3.0, None)
    result = analyze(front, back)
    assert ("proxy", "delivery_coalesced") in kinds(result)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_hung_on_reuse")


# ---- topology, the tap's own traffic, a starved tap ---------------------------------


def _topology(cap: Cap, role: str, basis: str = "declared", client_facing: bool = False) -> None:
    cap._e(
        ev.Topology,
        0.0,
        upstream=PROXY,
        upstream_role=role,
        basis=basis,
        evidence=["declared with --upstream-role"],
        client_facing=client_facing,
    )


def test_a_declared_engine_upstream_makes_a_lost_request_the_engines() -> None:
    """The upstream URL matches no metrics URL (an engine behind a port mapping), but the
    tap was told its upstream is the engine: a request the idle engine never ran was lost
    by the serving stack, not by "the hop after the tap"."""
    cap = Cap(upstream=PROXY)
    _topology(cap, "engine")
    cap.exchange(1, 1, 0.0, end=None)
    cap.stall(1, 1, 0.0, None)
    for t in range(0, 12):
        cap.engine(float(t), running=0, delta=0)
    result = analyze(cap)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("engine", "engine_lost_request")
    assert result["topology"]["chain"] == "client → ? → front → engine"
    # declared a proxy: the same silence is the hop's
    cap2 = Cap(upstream=PROXY)
    _topology(cap2, "proxy", client_facing=True)
    cap2.exchange(1, 1, 0.0, end=None)
    cap2.stall(1, 1, 0.0, None)
    for t in range(0, 12):
        cap2.engine(float(t), running=0, delta=0)
    result = analyze(cap2)
    assert result["verdict"]["party"] == "proxy"
    assert result["topology"]["chain"] == "client → front → proxy → ?"


def test_a_taps_own_probe_seen_behind_it_is_not_client_traffic() -> None:
    """The front tap's probe (x-tracer-probe, with its run's nonce, which its capture
    vouches for) passes the back tap: not a request there."""
    front = Cap("front", upstream="http://127.0.0.1:9")
    start = front.events[0]
    assert isinstance(start, ev.CaptureStart)
    start.probe_nonce = "N1"
    back = Cap("back", upstream=ENGINE)
    back.exchange(1, 1, 0.0, headers=[["x-tracer-probe", "probe; tap=front; nonce=N1"]], end=None)
    back.stall(1, 1, 0.0, None)
    back.exchange(1, 2, 1.0)
    result = analyze(front, back)
    assert [r["id"] for r in result["requests"]] == ["back/1/2"]
    assert result["totals"]["tap_own_requests"] == 1
    (conn,) = result["connections"]
    assert conn["probes"] == 1
    assert [f for f in result["findings"] if not f["note"]] == []


def test_bunching_at_a_starved_tap_is_only_a_note() -> None:
    """The tap's own loop ran 120 ms late while it saw a stream bunched: its timings
    cannot testify about 40 ms bunches; the finding becomes a note quoting the lag."""
    cap = Cap("front", upstream=PROXY)
    _bunched(cap, 0.0, bunched=True)
    assert analyze(cap)["verdict"]["kind"] == "delivery_coalesced"
    cap._e(
        ev.TapLag,
        0.5,
        window_start=cap.t0 - 0.5,
        window=1.0,
        max_lag=0.12,
        max_lag_at=cap.t0 + 0.1,
        late_ticks=3,
        ticks=20,
        threshold=0.02,
        interval=0.05,
    )
    result = analyze(cap)
    assert result["verdict"]["kind"] == "healthy"
    (f,) = [f for f in result["findings"] if f["kind"] == "delivery_coalesced"]
    assert f["note"] is True and f["confidence"] == "low"
    assert evidence(f, tap="front", max_lag=0.12)  # the lag, quoted
    assert result["evidence"]["tap_lags"][0]["max_lag"] == 0.12


def test_identical_findings_are_one_with_all_their_requests() -> None:
    front = Cap("front", upstream=PROXY)
    back = Cap("back", upstream=ROUTER, t0=1000.0)
    for conn in (1, 2):
        for seq in (1, 2):
            rid = f"c{conn}r{seq}"
            front.exchange(conn, seq, seq * 1.0, rid=rid, idle=0.5 if seq > 1 else 0)
            back.exchange(conn, seq, seq * 1.0 + 0.002, rid=rid, idle=0.5 if seq > 1 else 0)
        front.exchange(conn, 3, 3.0, rid=f"c{conn}r3", idle=0.5, end=None)
        front.stall(conn, 3, 3.0, None)
    result = analyze(front, back)
    (f,) = [f for f in result["findings"] if not f["note"]]
    assert (f["kind"], f["grouped"]) == ("proxy_hung_on_reuse", 2)
    assert f["requests"] == ["front/1/3", "front/2/3"]
    assert f["connections"] == ["front/1", "front/2"]


def test_a_reused_connection_is_blamed_only_where_reuse_is_implicated() -> None:
    """Idle engine, nothing answered on fresh connections meanwhile, and a request on a
    fresh connection hung too: the hop swallowed requests, reuse is not implicated."""
    cap = Cap(upstream=PROXY)
    cap.exchange(1, 1, 0.0)
    cap.exchange(1, 2, 1.0, idle=0.5, end=None)
    cap.stall(1, 2, 1.0, None)
    cap.exchange(2, 1, 1.5, end=None)
    cap.stall(2, 1, 1.5, None)
    for t in range(0, 12):
        cap.engine(float(t), running=0, delta=0)
    assert {k for k in kinds(analyze(cap))} == {("proxy", "proxy_swallowed_request")}
