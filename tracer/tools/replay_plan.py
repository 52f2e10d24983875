"""``tracer replay``'s plan: which connections open when, and what each carries.

Sans-I/O, in the original's seconds: the schedule is decided from the capture alone,
before any socket, so it can be checked apart from the client that follows it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .replay_capture import Capture, CapturedRequest
from .replay_select import Selection


@dataclass
class Job:
    """One captured connection's replay: when it opens and what it carries."""

    conn: int
    start: float  # original seconds after the first job's start
    requests: list[CapturedRequest]
    gaps: list[float]  # original seconds before each request (see ``plan``)
    offsets: list[float]  # original seconds from the first job's start to each request
    aborts: list[float | None]  # close this long after sending, as the original client did
    hold: float = 0.0  # a connection without requests: how long it stayed open


def plan(capture: Capture, selection: Selection, *, fresh: bool) -> list[Job]:
    """The replay's schedule, in original seconds.

    A connection whose first selected request is its first opens when the original
    opened and sends after the original's ``idle_before``; otherwise it opens when that
    request was sent. Each later request goes after its ``idle_before`` from the end of
    the previous response (when requests in between are left out: after the original
    time from the previous selected response's end to its head), and never before its
    original offset. A request the original client closed while bytes still flowed is
    closed at the same time after sending.
    """
    jobs: list[Job] = []
    for conn in sorted(capture.conns.values(), key=lambda c: c.open_m):
        chosen = [r for r in conn.requests if selection.selects(r)]
        if not chosen:
            wanted = selection.everything or conn.conn in selection.conns
            if conn.requests or not wanted or fresh:
                continue
            close = conn.close_m if conn.close_m is not None else capture.end_m
            hold = max(0.0, close - conn.open_m)
            jobs.append(Job(conn.conn, conn.open_m, [], [], [], [], hold=hold))
            continue
        first = chosen[0]
        start = conn.open_m if first.seq == 1 else first.head_m
        gaps = [first.idle_before if first.seq == 1 else 0.0]
        for prev, req in itertools.pairwise(chosen):
            if req.seq == prev.seq + 1:
                gaps.append(req.idle_before)
            else:
                gaps.append(max(0.0, req.head_m - (prev.end_m or prev.head_m)))
        aborts = [
            r.end_m - r.head_m if r.end_m is not None and capture.outcome(r) == "aborted" else None
            for r in chosen
        ]
        jobs.append(Job(conn.conn, start, chosen, gaps, [r.head_m for r in chosen], aborts))
    if jobs:
        t0 = min(j.start for j in jobs)
        for job in jobs:
            job.start -= t0
            job.offsets = [at - t0 for at in job.offsets]
    return jobs


def missing_bodies(jobs: list[Job]) -> list[CapturedRequest]:
    return [r for j in jobs for r in j.requests if r.body is None]
