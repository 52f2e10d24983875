"""Evidence items quoted from the rows: a request's position, its outcome, its stalls, a
probe, an injected fault.

One function per kind of observation, so that the same observation reads the same in
every finding, and carries the same fields (``tap``, ``request``, ``t``, ``figures``).
"""

from __future__ import annotations

from typing import Any

from ..rows import RequestRow
from .model import EvidenceItem
from .signs import multiplexed

MAX_QUOTED = 10  # requests quoted one by one in a note about many


def ts(t: float) -> str:
    return f"t={t:.3f}"


def reused_words(r: RequestRow) -> str:
    major = (r.version or "1")[:1]
    return f"reused HTTP/{major} connection" if multiplexed(r) else "reused keep-alive connection"


def req_text(r: RequestRow) -> str:
    """The request line and its position on its connection."""
    pos = f"request {r.seq} on connection {r.tap}/{r.conn}"
    if r.reused and multiplexed(r):
        pos += f" (HTTP/{r.version} stream on a connection already open)"
    elif r.reused:
        pos += f" (keep-alive reuse after {r.idle_before:.3f} s idle)"
    else:
        pos += " (fresh connection)"
    rid = f" x-request-id={r.request_id}" if r.request_id else ""
    return f"{ts(r.start)} {r.method} {r.target}{rid}: {pos}"


def outcome_text(r: RequestRow) -> str:
    """How the response ended."""
    parts = [f"termination={r.termination}"]
    if r.status is not None:
        parts.append(f"status={r.status}")
    if r.ttfb is not None:
        parts.append(f"ttfb={r.ttfb:.3g} s")
    parts.append(f"response bytes={r.response_bytes}")
    if r.sse:
        parts.append(f"events={r.events}, [DONE]={'yes' if r.done else 'no'}")
    if r.close:
        parts.append(f"upstream {r.close}")
    if r.end is not None:
        parts.append(f"ended {ts(r.end)}, {r.end - r.start:.3g} s after its request")
    return ", ".join(parts)


def position(r: RequestRow) -> dict[str, Any]:
    """The figures of ``req_text``."""
    out: dict[str, Any] = {"seq": r.seq, "reused": r.reused}
    if r.reused and multiplexed(r):
        out["version"] = r.version  # a stream on a connection already open
    elif r.reused:
        out["idle_before"] = r.idle_before  # a keep-alive turn, after this idle
    return out


def outcome(r: RequestRow) -> dict[str, Any]:
    """The figures of ``outcome_text``."""
    out: dict[str, Any] = {"termination": r.termination}
    if r.status is not None:
        out["status"] = r.status
    if r.ttfb is not None:
        out["ttfb"] = r.ttfb
    out["response_bytes"] = r.response_bytes
    if r.sse:
        out |= {"events": r.events, "done": r.done}
    if r.close:
        out["close"] = r.close
    if r.end is not None:
        out["duration"] = round(r.end - r.start, 6)
    return out


def request_item(r: RequestRow, text: str | None = None, **figures: Any) -> EvidenceItem:
    """The request and its position (``text``: what it says of them, when more)."""
    return EvidenceItem(
        text=req_text(r) if text is None else text,
        t=r.start,
        tap=r.tap,
        request=r.id,
        figures=position(r) | figures,
    )


def outcome_item(r: RequestRow) -> EvidenceItem:
    """How the request's response ended, at its end."""
    return EvidenceItem(text=outcome_text(r), t=r.end, tap=r.tap, request=r.id, figures=outcome(r))


def at_tap_item(r: RequestRow, prefix: str = "", suffix: str = "", **figures: Any) -> EvidenceItem:
    """The request and how it ended, in one evidence line."""
    return EvidenceItem(
        text=f"{prefix}{req_text(r)}; {outcome_text(r)}{suffix}",
        t=r.start,
        tap=r.tap,
        request=r.id,
        figures=position(r) | outcome(r) | figures,
    )


def stall_item(r: RequestRow, s: dict[str, Any], suffix: str = "") -> EvidenceItem:
    """One of the request's stalls."""
    return EvidenceItem(
        text=f"stall {ts(s['start'])} {s['direction']} for {s['duration'] or 'ever'} s{suffix}",
        t=s["start"],
        tap=r.tap,
        request=r.id,
        figures={"direction": s["direction"], "duration": s["duration"]},
    )


def probe_item(p: dict[str, Any]) -> EvidenceItem:
    """A probe the tap sent over a fresh connection, and what came of it."""
    return EvidenceItem(
        text=f"probe {ts(p['t'])} {p['target']} {p['url']} over a fresh connection: "
        f"{p['outcome']}"
        + (f" in {p['latency']:.3f} s" if p.get("latency") is not None else "")
        + (f" ({p['reason']})" if p.get("reason") else ""),
        t=p["t"],
        tap=p["tap"],
        figures={"probe_outcome": p["outcome"], "latency": p.get("latency")}
        | ({"status": p["status"]} if p.get("status") is not None else {}),
    )


def injected_items(r: RequestRow) -> list[EvidenceItem]:
    """The faults the request's tap injected in it itself (``--fault``)."""
    if not r.injected:
        return []
    return [
        EvidenceItem(
            text=f"the tap injected this fault itself: {', '.join(r.injected)} (opt-in --fault)",
            tap=r.tap,
            request=r.id,
            figures={"injected": list(r.injected)},
        )
    ]


def gap_item(r: RequestRow, prefix: str = "") -> EvidenceItem:
    """The stream's arrival statistics: how many gaps were < 1 ms, and 30-60 ms."""
    zero = r.zero_gaps / r.event_gaps if r.event_gaps else 0.0
    return EvidenceItem(
        text=f"{prefix}{r.events} events: {zero:.0%} of gaps < 1 ms, "
        f"{r.bunch_gaps} gaps of 30-60 ms",
        t=r.first_event,
        tap=r.tap,
        request=r.id,
        figures={
            "events": r.events,
            "event_gaps": r.event_gaps,
            "zero_gaps": r.zero_gaps,
            "bunch_gaps": r.bunch_gaps,
        },
    )


def never_seen_item(taps: list[str], counts: dict[str, int]) -> EvidenceItem:
    """A request none of ``taps`` saw, and how many they saw."""
    saw = [counts.get(t, 0) for t in taps]
    return EvidenceItem(
        text=f"never seen at tap {' or tap '.join(taps)}, which saw "
        f"{' and '.join(map(str, saw))} other request(s)",
        figures={"never_seen_at": list(taps), "requests_there": saw},
    )


def more_item(count: int, what: str) -> EvidenceItem:
    """``... and N more <what>`` after the quoted first few."""
    return EvidenceItem(text=f"... and {count} more {what}", figures={"more": count})
