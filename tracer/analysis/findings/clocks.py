"""How far apart two taps' wall clocks are, from the requests both saw.

A request reaches the tap nearer the engine after the tap in front of it, and its
response reaches the tap in front after the tap behind (each tap's own durations say
which is in front: the one in front holds the request longer). In true time, with
``a`` in front of ``b``::

    start_a <= start_b   and   end_b <= end_a

so, with ``offset = clock_b - clock_a`` and each tap's times read on its own clock::

    end_b - end_a  <=  offset  <=  start_b - start_a

Over many requests the bounds close in (the tightest of each side); their midpoint is
the estimate, and their width is what the evidence cannot tell apart (about the fastest
round trip through what lies between the taps). Only requests answered completely at
both taps count: a cut or a hang at one tap breaks the second inequality.

A pair whose bounds exclude zero by more than ``SKEW`` has clocks that disagree; the
analysis then runs again with the taps' times shifted by the offsets, each tap's taken
against the front tap along the chain, so that the join and every cross-tap comparison
read as if the clocks agreed (``captures/ANALYSIS.md``, "Clocks").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ... import events as ev

SAME_HOLD = 1e-5  # seconds: held this close to as long at both taps, neither is in front
SKEW = 0.002  # seconds a pair's bounds must exclude zero by before its offset is applied


@dataclass
class PairClock:
    """The bounds on ``clock_b - clock_a`` for one pair (``a`` < ``b`` by name), under
    each of the two orders, and how many requests voted for each order."""

    a_front: int = 0
    b_front: int = 0
    ties: int = 0
    lo_a: float = -math.inf  # a in front: max(end_b - end_a)
    hi_a: float = math.inf  # ... min(start_b - start_a)
    lo_b: float = -math.inf  # b in front: max(start_b - start_a)
    hi_b: float = math.inf  # ... min(end_b - end_a)

    def add(self, start_a: float, end_a: float, start_b: float, end_b: float) -> None:
        d_start, d_end = start_b - start_a, end_b - end_a
        held_a, held_b = end_a - start_a, end_b - start_b
        if held_a > held_b + SAME_HOLD:
            self.a_front += 1
        elif held_b > held_a + SAME_HOLD:
            self.b_front += 1
        else:  # (as long at both: no vote for either; its bounds count under both orders)
            self.ties += 1
        self.lo_a, self.hi_a = max(self.lo_a, d_end), min(self.hi_a, d_start)
        self.lo_b, self.hi_b = max(self.lo_b, d_start), min(self.hi_b, d_end)

    def b_behind(self) -> bool | None:
        """Whether ``b`` is behind ``a`` (nearer the engine), where the requests say so
        clearly: at least 3, and 3 in 4 of them one way (None: not clear)."""
        n = self.a_front + self.b_front
        if n < 3:
            return None
        if self.a_front * 4 >= n * 3:
            return True
        if self.b_front * 4 >= n * 3:
            return False
        return None

    def estimate(self, a: str, b: str) -> dict[str, Any] | None:
        """The offset of ``b``'s clock against ``a``'s, with its bounds (None: no request
        both answered completely)."""
        n = self.a_front + self.b_front + self.ties
        if not n:
            return None
        front_a = self.a_front >= self.b_front
        lo, hi = (self.lo_a, self.hi_a) if front_a else (self.lo_b, self.hi_b)
        consistent = lo <= hi
        offset = (lo + hi) / 2
        return {
            "from": a if front_a else b,
            "to": b if front_a else a,
            "offset": round(offset if front_a else -offset, 6),
            "low": round(lo if front_a else -hi, 6),
            "high": round(hi if front_a else -lo, 6),
            "requests": n,
            "consistent": consistent,
            "skewed": consistent and (lo > SKEW or hi < -SKEW),
        }


def chain_offsets(pairs: list[dict[str, Any]], order: list[str]) -> dict[str, float]:
    """Each tap's clock against the front tap's (the first in ``order`` that a pair
    reaches), along the pairs whose clocks disagree; taps with no such pair: none."""
    if not any(p["skewed"] for p in pairs):
        return {}
    edges: dict[str, list[tuple[str, float]]] = {}
    for p in pairs:
        if p["consistent"]:
            # a pair whose bounds hold zero reads one clock as far as anyone can tell: its
            # taps are not moved against each other (a fraction of a millisecond is noise)
            offset = p["offset"] if p["skewed"] else 0.0
            edges.setdefault(p["from"], []).append((p["to"], offset))
            edges.setdefault(p["to"], []).append((p["from"], -offset))
    offsets: dict[str, float] = {}
    for root in order:
        if root in offsets or root not in edges:
            continue
        offsets[root] = 0.0
        todo = [root]
        while todo:
            tap = todo.pop()
            for other, delta in edges.get(tap, []):
                if other not in offsets:
                    offsets[other] = offsets[tap] + delta
                    todo.append(other)
    return {tap: round(off, 6) for tap, off in offsets.items() if off}


@dataclass
class Clocks:
    """What an analysis knows of its taps' clocks: the offsets it applies (seconds to
    take from each tap's times) and the pairs it measured them from (before applying)."""

    applied: dict[str, float] = field(default_factory=dict)
    measured: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self, residual: list[dict[str, Any]]) -> dict[str, Any]:
        """``pairs``: each pair's offset and bounds as the captures have them; ``applied``:
        the shift each tap's times got; ``residual``: the pairs measured after it."""
        if not self.applied:
            return {"pairs": residual, "applied": {}, "residual": []}
        return {"pairs": self.measured, "applied": dict(self.applied), "residual": residual}


def shift_clock(event: ev.Event, offset: float) -> None:
    """An event of a tap whose clock is ``offset`` ahead, onto the front tap's clock."""
    event.t -= offset
    if isinstance(event, ev.CaptureLoss):
        if event.first_t is not None:
            event.first_t -= offset
        if event.last_t is not None:
            event.last_t -= offset


def clocks_to_apply(result: dict[str, Any]) -> Clocks | None:
    """After a first pass: the offsets a second pass must apply (None: the taps' clocks
    agree, or nothing says by how much they do not). The front tap's clock is the one
    kept."""
    clocks = result.get("clocks") or {}
    if clocks.get("applied"):
        return None  # (a second pass already)
    pairs = clocks.get("pairs") or []
    # the front tap of each pair is known from durations, whatever the clocks say (the
    # join's own order reads the clocks, and a clock behind puts a tap in front)
    behind = {p["to"] for p in pairs}
    order = sorted({p["from"] for p in pairs} - behind) + sorted(behind)
    offsets = chain_offsets(pairs, order)
    # taps whose headers show one clock move together: each as the first of them in
    # order (a path through other taps would give them offsets a fraction of a ms apart)
    taps = {t["tap"]: t for t in result.get("taps", [])}
    for tap in order:
        group = [
            u for u in order if u in taps and tap in taps and shared_clock([taps[tap], taps[u]])
        ]
        for u in group[1:]:
            if u in offsets or group[0] in offsets:
                offsets[u] = offsets.get(group[0], 0.0)
    offsets = {tap: off for tap, off in offsets.items() if off}
    return Clocks(applied=offsets, measured=pairs) if offsets else None


def shared_clock(taps: list[dict[str, Any]]) -> bool:
    """Whether these taps read one wall clock: started in the same boot (``boot_id``) with
    the same wall offset (no clock step between their starts)."""
    boots = {t.get("boot_id") for t in taps}
    offsets = [o for t in taps if isinstance(o := t.get("wall_offset"), (int, float))]
    if len(boots) != 1 or None in boots or len(offsets) != len(taps):
        return False
    return max(offsets) - min(offsets) <= 0.001


def clock_caveats(pairs: list[dict[str, Any]], verdict: dict[str, Any]) -> list[dict[str, Any]]:
    """A pair whose bounds cross (a clock stepped mid-capture, or requests joined wrongly):
    no offset was applied, and what compares moments across those taps is unsure — said
    beside the verdict, which is then at most medium."""
    out = []
    for p in pairs:
        if p["consistent"]:
            continue
        out.append(
            {
                "kind": "clocks_disagree",
                "taps": [p["from"], p["to"]],
                "low": p["low"],
                "high": p["high"],
                "text": f"taps {p['from']} and {p['to']}: the requests both answered bound their "
                f"clocks' offset from {p['low']:+.3f} s and to {p['high']:+.3f} s, which cannot "
                "both hold (a clock stepped mid-capture, or requests joined wrongly): no offset "
                "applied, and what compares moments across them is unsure",
            }
        )
    if out and verdict.get("confidence") == "high":
        verdict["confidence"] = "medium"
    return out
