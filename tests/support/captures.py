"""Captures written by hand, for commands that read one (replay, info, report)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from tracer import events as ev
from tracer.analysis.summary import Summary
from tracer.capture.files import write_all

BODY = json.dumps(
    {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "pace me"}],
    }
).encode()


def slow_reader_capture(path: Path) -> None:
    """One connection, two requests: the first response was read by a slow client (100
    body bytes, then 100 more 0.3 s later, then 0.6 s later the rest); the second request
    came right after it ended."""
    tap, t0 = "orig", 1_800_000_000.0
    events: list[ev.Event] = [
        ev.CaptureStart(t=t0, m=0.0, tap=tap, tracer_version="0.1.0", kind="proxy"),
        ev.ConnOpen(t=t0 + 0.1, m=0.1, tap=tap, conn=1, peer="127.0.0.1:5000", local="x:1"),
    ]
    for seq, start in ((1, 0.101), (2, 0.75)):
        head = [["Host", "x"], ["content-type", "application/json"]]
        head.append(["content-length", str(len(BODY))])
        events += [
            ev.RequestHead(
                t=t0 + start,
                m=start,
                tap=tap,
                conn=1,
                seq=seq,
                idle_before=0.001 if seq == 1 else 0.04,
                method="POST",
                target="/v1/chat/completions",
                version="1.1",
                headers=head,
                content_length=len(BODY),
            ),
            ev.RequestEnd(
                t=t0 + start,
                m=start,
                tap=tap,
                conn=1,
                seq=seq,
                complete=True,
                body_bytes=len(BODY),
                body_sha256=hashlib.sha256(BODY).hexdigest(),
                body=BODY.decode(),
                body_encoding="utf-8",
                body_kept=True,
            ),
            ev.ResponseHead(
                t=t0 + start + 0.01,
                m=start + 0.01,
                tap=tap,
                conn=1,
                seq=seq,
                status=200,
                reason="OK",
                version="1.1",
                headers=[],
                ttfb=0.01,
                sse=True,
                chunked=True,
            ),
            ev.BodyData(
                t=t0 + start + 0.01,
                m=start + 0.01,
                tap=tap,
                conn=1,
                seq=seq,
                size=2000,
                reads=[[0.0, 100, 1], [0.3, 100, 1], [0.6, 1800, 9]],
            ),
            ev.ResponseEnd(
                t=t0 + start + 0.61,
                m=start + 0.61,
                tap=tap,
                conn=1,
                seq=seq,
                termination="complete",
                status=200,
                body_bytes=2000,
                duration=0.61,
                done=True,
                finish_reason="length",
            ),
        ]
    write_all(path, events)


def start_event() -> ev.CaptureStart:
    return ev.CaptureStart(t=1.0, m=1.0, tap="t", tracer_version="test", kind="proxy")


def open_event(conn: int) -> ev.ConnOpen:
    return ev.ConnOpen(t=2.0, m=2.0, tap="t", conn=conn, peer="127.0.0.1:1", local="127.0.0.1:2")


# ---- a big capture of two taps, made up ---------------------------------------------------

ROUTER = "http://127.0.0.1:8000"
ENGINE = "http://127.0.0.1:30000/metrics"
TAPS = ("back", "front")  # front: in front of a proxy; back: behind it, before the router
SMALL = {"spill_rows": 97, "recent_rows": 16, "finished_keys": 64, "spill_samples": 16}
IN_MEMORY = {"spill_rows": 10**9, "recent_rows": 10**9, "finished_keys": 10**9}


def capture(requests: int, *, hangs: int = 4) -> Iterator[ev.Event]:
    """Two taps on keep-alive connections of 4 requests; ``hangs`` requests (at most,
    whatever the size) hang on reuse between the taps, a few are slow or fail."""
    t0 = 1000.0
    for tap in TAPS:
        upstream = ROUTER if tap == "back" else "http://127.0.0.1:8001"
        yield ev.CaptureStart(
            t=t0, m=0, tap=tap, tracer_version="t", kind="proxy", upstream=upstream
        )
    hang_at = {requests * (k + 1) // (hangs + 1) // 4 * 4 + 2 for k in range(hangs)}
    for i in range(requests):
        conn, seq, t = i // 4 + 1, i % 4 + 1, t0 + i * 0.1
        rid = f"r{i}" if i % 3 else None  # a third joined by fingerprint and order
        hung = i in hang_at
        slow = i % 997 == 5 and i < 3000
        for k, tap in enumerate(TAPS[::-1]):  # front first
            at = t + 0.002 * k
            if hung and tap == "back":
                continue  # the proxy never forwarded it
            if seq == 1:
                yield ev.ConnOpen(t=at, m=0, tap=tap, conn=conn, peer="127.0.0.1:5", local="x")
            yield ev.RequestHead(
                t=at,
                m=0,
                tap=tap,
                conn=conn,
                seq=seq,
                idle_before=0.05 if seq > 1 else 0.0,
                method="POST",
                target="/v1/chat/completions",
                version="1.1",
                headers=[],
                request_id=rid,
            )
            yield ev.RequestEnd(
                t=at, m=0, tap=tap, conn=conn, seq=seq, complete=True, body_bytes=9,
                body_sha256=f"b{i % 7}",
            )  # fmt: skip
            if hung:
                yield ev.Stall(
                    t=at + 5, m=0, tap=tap, conn=conn, seq=seq, phase="start",
                    direction="upstream_silent", silent_for=5.0,
                )  # fmt: skip
                yield ev.ResponseEnd(
                    t=at + 6, m=0, tap=tap, conn=conn, seq=seq, termination="client_abort",
                    duration=6.0, body_bytes=0,
                )  # fmt: skip
                continue
            ttfb = 2.5 if slow else 0.01
            status = 503 if i % 1999 == 7 else 200
            yield ev.ResponseHead(
                t=at + ttfb, m=0, tap=tap, conn=conn, seq=seq, status=status, reason="",
                version="1.1", headers=[], ttfb=ttfb, sse=status == 200,
            )  # fmt: skip
            if status == 200:
                sse = [[j * 0.002, 60, "content"] for j in range(10)]
                yield ev.BodyData(
                    t=at + ttfb, m=0, tap=tap, conn=conn, seq=seq, size=600, reads=[], sse=sse
                )
            yield ev.ResponseEnd(
                t=at + ttfb + 0.03, m=0, tap=tap, conn=conn, seq=seq, termination="complete",
                status=status, body_bytes=600, duration=ttfb + 0.03, events=10,
                done=status == 200, first_token=ttfb, finish_reason="stop",
            )  # fmt: skip
            if seq == 4:
                yield ev.ConnClose(
                    t=at + 0.05, m=0, tap=tap, conn=conn, closed_by="client", how="fin",
                    in_flight=False, requests=4, bytes_from_client=40, bytes_from_upstream=2400,
                    upstream_opened=True, duration=0.35,
                )  # fmt: skip
        if i % 10 == 0:
            yield ev.EngineSample(
                t=t, m=0, tap="back", url=ENGINE, ok=True, elapsed=0.001, profile="sglang",
                state={"running": 0 if i in hang_at or i - 1 in hang_at else 3, "queued": 0},
                deltas={"generation_tokens_total": 0 if i - 2 in hang_at else 40},
                interval=1.0,
            )  # fmt: skip


def fed(requests: int, **bounds: int) -> Summary:
    summary = Summary(**bounds)
    for event in capture(requests):
        summary.feed(event)
    return summary
