"""The typed records the analyzers build: a finding, its evidence items, what it rules out.

Records, not dicts, so that a consumer (a test, a renderer, a later analyzer) reads the
evidence's fields — which tap, which request, which figures — instead of parsing the
sentence that quotes them. JSON is made from them only at the output edge (``to_json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...times import iso
from ..rows import RequestRow


@dataclass(slots=True, frozen=True)
class RuledOut:
    """A party the evidence excludes, and why (a sentence quoting that evidence)."""

    party: str
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"party": self.party, "why": self.why}


@dataclass(slots=True, kw_only=True)
class EvidenceItem:
    """One observation a finding rests on.

    ``text`` quotes it for a reader; ``t`` is the wall time it concerns, when there is one;
    ``tap`` and ``request`` say where it was seen, when it is about one tap or one request;
    ``figures`` holds the numbers (and the few words, e.g. a termination) it quotes.
    """

    text: str
    t: float | None = None
    tap: str | None = None
    request: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """All five keys, always: null where not known, ``{}`` for no figures."""
        return {
            "text": self.text,
            "t": self.t,
            "tap": self.tap,
            "request": self.request,
            "figures": dict(self.figures),
        }


@dataclass(slots=True, kw_only=True)
class Finding:
    """An anomaly, whose it is, and the evidence for it (``captures/ANALYSIS.md``).

    ``grouped``: how many identical findings this one stands for (set by the grouping);
    ``after_silence``: the request behind whose upstream silence came first (a hop's
    timeout that met it yields the verdict to that silence's finding); ``id``: ``F1`` …,
    set once the findings are ordered.
    """

    party: str
    kind: str
    summary: str
    requests: list[str]
    connections: list[str]
    evidence: list[EvidenceItem]
    ruled_out: list[RuledOut]
    confidence: str
    settle: str | None = None
    note: bool = False
    t: float | None = None
    grouped: int | None = None
    after_silence: str | None = None
    id: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The finding as ``tracer.analysis/4`` writes it (``grouped`` and
        ``after_silence`` only when set)."""
        out: dict[str, Any] = {
            "id": self.id,
            "party": self.party,
            "kind": self.kind,
            "summary": self.summary,
            "requests": list(self.requests),
            "connections": list(self.connections),
            "evidence": [e.to_json() for e in self.evidence],
            "ruled_out": [r.to_json() for r in self.ruled_out],
            "confidence": self.confidence,
            "settle": self.settle,
            "note": self.note,
            "t": self.t,
            "t_iso": iso(self.t) if self.t is not None else None,
        }
        if self.grouped is not None:
            out["grouped"] = self.grouped
        if self.after_silence is not None:
            out["after_silence"] = self.after_silence
        return out


def finding(
    kind: str,
    party: str,
    summary: str,
    requests: Sequence[RequestRow],
    evidence: list[EvidenceItem],
    ruled_out: list[RuledOut],
    confidence: str,
    *,
    settle: str | None = None,
    note: bool = False,
    t: float | None = None,
) -> Finding:
    """A finding about these requests (their ids and connections); its time is ``t``, or
    the first request's start."""
    return Finding(
        party=party,
        kind=kind,
        summary=summary,
        requests=[r.id for r in requests],
        connections=sorted({f"{r.tap}/{r.conn}" for r in requests}),
        evidence=evidence,
        ruled_out=ruled_out,
        confidence=confidence,
        settle=settle,
        note=note,
        t=t if t is not None else (requests[0].start if requests else None),
    )
