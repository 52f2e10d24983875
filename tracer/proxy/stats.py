"""What the tap counts (``/metrics``, ``/status``) and the log lines it writes, from the
events on its bus: a sink like any other (``Tap.bus``), so that a bug here switches
it off and never stops forwarding."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import structlog

from .. import events as ev

log = structlog.get_logger("tracer.proxy.relay")


@dataclass
class TapStats:
    connections_total: int = 0
    connections_open: int = 0
    connections_refused: int = 0  # over --max-connections: answered 503 by the tap
    header_timeouts: int = 0  # connections closed: their request head took too long
    requests_total: int = 0
    upstream_connect_failures: int = 0
    anomalies: int = 0
    bytes_from_client: int = 0
    bytes_from_upstream: int = 0
    terminations: Counter[str] = field(default_factory=Counter)
    stalls: Counter[str] = field(default_factory=Counter)
    stalls_active: int = 0
    faults: Counter[str] = field(default_factory=Counter)


def count_event(stats: TapStats, event: ev.Event) -> None:
    """The counters of /metrics and /status, and a log line for what deserves one."""
    if type(event) is ev.BodyData:  # the hot path: nothing to count or log
        return
    match event:
        case ev.RequestHead():
            stats.requests_total += 1
        case ev.ResponseEnd(termination=term):
            stats.terminations[term] += 1
            if term != "complete":
                log.warning(
                    "response ended " + term,
                    conn=event.conn,
                    seq=event.seq,
                    status=event.status,
                    bytes=event.body_bytes,
                    close=event.close,
                    mid_event=event.mid_event,
                    detail=event.detail,
                )
            elif event.events and not event.done:
                log.info("stream complete without [DONE]", conn=event.conn, seq=event.seq)
        case ev.Stall(phase="start", direction=direction):
            stats.stalls[direction] += 1
            stats.stalls_active += 1
            log.warning(
                "stall started",
                conn=event.conn,
                seq=event.seq,
                direction=direction,
                silent_for=event.silent_for,
                unsent_bytes=event.unsent_bytes,
            )
        case ev.Stall(phase="end"):
            stats.stalls_active -= 1
            log.info(
                "stall ended",
                conn=event.conn,
                seq=event.seq,
                direction=event.direction,
                lasted=event.silent_for,
            )
        case ev.Anomaly():
            stats.anomalies += 1
            log.warning(
                "protocol anomaly; forwarding unchanged",
                conn=event.conn,
                direction=event.direction,
                error=event.error,
                offset=event.offset,
            )
        case ev.FaultInjected():
            stats.faults[event.fault] += 1
            log.warning(
                "fault injected",
                conn=event.conn,
                seq=event.seq,
                fault=event.spec,
                detail=event.detail,
            )
        case ev.UpstreamConnect(phase="failed"):
            stats.upstream_connect_failures += 1
            log.warning("upstream connect failed", conn=event.conn, error=event.error)
        case _:
            pass
