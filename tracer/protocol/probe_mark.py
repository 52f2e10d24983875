"""A tap's own requests (metric scrapes, probes on stall, the topology fingerprint), and
how a tap behind it tells them from a client's.

Each request a tap makes itself carries ``x-tracer-probe: KIND; tap=NAME; nonce=N``,
where ``N`` is a random per-run nonce that the tap also writes in its ``capture_start``
(``probe_nonce``). The header alone proves nothing — any client can send it — so the
analysis leaves a request out of the tables only when its nonce is that of a capture
in the same analysis: the tap that sent it is known, and said so. A request that
carries the header with no such nonce stays a client request, with a note.

Captures written before the nonce (no ``probe_nonce`` in their ``capture_start``) keep
the old rule for their own tap's name only: ``tap=NAME`` is accepted when a capture of
that tap, itself without a nonce, is in the analysis.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

PROBE_HEADER = "x-tracer-probe"
# this process's run: each tap it runs signs its own requests with a nonce made from it
RUN_NONCE = secrets.token_hex(12)
MAX_VALUE = 200  # a header value longer than this is no tap's


def nonce_for(tap: str) -> str:
    """The run's nonce for one tap (taps in one process — tests, a sniff's taps by port —
    each get their own, so that a tap can tell its own nonce from another's)."""
    return hashlib.sha256(f"{RUN_NONCE}:{tap}".encode()).hexdigest()[:24]


def probe_value(kind: str, tap: str, nonce: str | None = None) -> str:
    """The header's value on a request this tap makes itself."""
    return f"{kind}; tap={tap}; nonce={nonce if nonce is not None else nonce_for(tap)}"


@dataclass(frozen=True, slots=True)
class ProbeClaim:
    """What a request's ``x-tracer-probe`` says of itself (nothing checked yet)."""

    kind: str
    tap: str | None
    nonce: str | None


def parse_probe(value: str) -> ProbeClaim:
    """``KIND; tap=NAME; nonce=N`` read leniently: missing parts are None."""
    parts = [p.strip() for p in value[:MAX_VALUE].split(";")]
    fields = dict(p.partition("=")[::2] for p in parts[1:] if "=" in p)
    return ProbeClaim(
        kind=parts[0] if parts else "",
        tap=fields.get("tap") or None,
        nonce=fields.get("nonce") or None,
    )


LEGACY_KINDS = ("proxy", "watch", "sniff")  # taps that made requests of their own


@dataclass
class KnownTaps:
    """The taps whose own requests an analysis can recognise: each capture's nonce with
    the taps it names (``nonces``), the nonces of passive taps (``passive``: a sniff sees
    its own scrapes on the wire), and the names of captures written before nonces
    (``legacy``)."""

    nonces: dict[str, set[str]] = field(default_factory=dict)
    passive: set[str] = field(default_factory=set)
    legacy: set[str] = field(default_factory=set)

    def add(self, tap: str, kind: str, nonce: str | None) -> None:
        """A capture in the analysis (its ``capture_start``'s tap, kind and nonce)."""
        if nonce:
            self.nonces.setdefault(nonce, set()).add(tap)
            if kind == "sniff":
                self.passive.add(nonce)
        elif kind in LEGACY_KINDS and tap:
            self.legacy.add(tap)

    @classmethod
    def of(cls, headers: Iterable[dict[str, Any]]) -> KnownTaps:
        """From the captures' ``capture_start`` records (read before the analysis, so
        that a tap's capture vouches for its requests wherever they come in the order)."""
        known = cls()
        for h in headers:
            nonce = h.get("probe_nonce")
            known.add(
                str(h.get("tap") or ""),
                str(h.get("kind")),
                nonce if isinstance(nonce, str) else None,
            )
        return known

    def own(self, value: str, at: str | None = None) -> bool:
        """The header names a tap of this analysis, in a way a client cannot forge: the
        run's nonce, with the name of a tap whose capture holds it, seen at another tap
        (an inline tap's own requests never come in through its own listener; a sniff's
        do) — or the old way, for a capture that predates nonces."""
        if len(value) > MAX_VALUE:
            return False
        claim = parse_probe(value)
        if claim.nonce is not None:
            names = self.nonces.get(claim.nonce, set())
            if claim.tap not in names:
                return False
            return at is None or at not in names or claim.nonce in self.passive
        return claim.tap is not None and claim.tap in self.legacy
