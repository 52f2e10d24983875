"""Rotated captures written by hand: one tap's segments, each beginning with its header,
closed ones compressed as the writer compresses them (``compress_segment``)."""

from __future__ import annotations

from pathlib import Path

from tracer import events as ev
from tracer.capture.files import compress_segment, encode_line, segment_path

T0 = 1_800_000_000.0


def header(tap: str, t0: float = T0) -> ev.CaptureStart:
    return ev.CaptureStart(
        t=t0, m=0.0, tap=tap, tracer_version="test", kind="proxy", upstream="http://r:8000"
    )


def request(tap: str, conn: int, seq: int, start: float, end: float) -> list[ev.Event]:
    """A streamed request's events from ``start`` to ``end`` (seconds after T0)."""
    at = T0 + start
    mid = T0 + (start + end) / 2
    return [
        ev.RequestHead(
            t=at, m=start, tap=tap, conn=conn, seq=seq, idle_before=0.0, method="POST",
            target="/v1/chat/completions", version="1.1", headers=[],
            request_id=f"{tap}-{conn}-{seq}",
        ),
        ev.RequestEnd(t=at, m=start, tap=tap, conn=conn, seq=seq, complete=True, body_bytes=9),
        ev.ResponseHead(
            t=at + 0.01, m=start + 0.01, tap=tap, conn=conn, seq=seq, status=200, reason="OK",
            version="1.1", headers=[], ttfb=0.01, sse=True,
        ),
        ev.BodyData(
            t=mid, m=mid - T0, tap=tap, conn=conn, seq=seq, size=60, reads=[],
            sse=[[0.0, 30, "content"], [0.01, 30, "content"]],
        ),
        ev.ResponseEnd(
            t=T0 + end, m=end, tap=tap, conn=conn, seq=seq, termination="complete", status=200,
            body_bytes=60, duration=end - start, events=2, done=True, finish_reason="stop",
            first_token=0.01,
        ),
    ]  # fmt: skip


def conn_open(tap: str, conn: int, at: float) -> ev.ConnOpen:
    return ev.ConnOpen(t=T0 + at, m=at, tap=tap, conn=conn, peer="10.0.0.1:5000", local="x")


def conn_close(tap: str, conn: int, at: float, requests: int) -> ev.ConnClose:
    return ev.ConnClose(
        t=T0 + at, m=at, tap=tap, conn=conn, closed_by="client", how="fin", in_flight=False,
        requests=requests, bytes_from_client=9, bytes_from_upstream=60, upstream_opened=True,
        duration=1.0,
    )  # fmt: skip


def capture_end(tap: str, at: float) -> ev.CaptureEnd:
    return ev.CaptureEnd(t=T0 + at, m=at, tap=tap, records=0, dropped=0, reason="stopped")


def write_segments(
    folder: Path, tap: str, segments: list[list[ev.Event]], *, compress: bool = False
) -> list[Path]:
    """``TAP.jsonl``, ``TAP.1.jsonl`` ... (the events of each in time order); with
    ``compress``, every segment but the last to ``.zst``."""
    first = folder / f"{tap}.jsonl"
    top = encode_line(header(tap).to_record())
    paths = []
    for n, events in enumerate(segments):
        path = segment_path(first, n)
        path.write_bytes(top + b"".join(encode_line(e.to_record()) for e in events))
        paths.append(path)
    if compress:
        paths[:-1] = [compress_segment(p) for p in paths[:-1]]
    return paths


def minute_of_traffic(tap: str, minute: int, *, rate: float = 1.0) -> list[ev.Event]:
    """A minute of requests on connections of their own (open, request, close), the
    last ones crossing into the next minute."""
    out: list[ev.Event] = []
    n = int(60 * rate)
    for i in range(n):
        start = minute * 60 + i / rate + 0.2
        conn = minute * 1000 + i + 1
        out += [conn_open(tap, conn, start), *request(tap, conn, 1, start, start + 0.5)]
        out.append(conn_close(tap, conn, start + 0.6, 1))
    return sorted(out, key=lambda e: e.t)
