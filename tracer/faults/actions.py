"""What the fault layer asks of the relay: each ``ConnectionFaults`` call returns a list
of these ``Action`` values, which the relay carries out in order (the mitmproxy addon
has its own means and uses none of them)."""

from __future__ import annotations

from dataclasses import dataclass

from .kinds import Close, Fault


@dataclass(frozen=True, slots=True)
class Forward:
    """Write these bytes to the upstream."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Deliver:
    """Write these bytes to the client."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Hold:
    """Deliver nothing more to the client for this long (inf: for good).

    ``merge``: a coalescing hold; when it ends, what queued behind it goes out at once, up
    to the last merging hold queued meanwhile (the holds in between are dropped).
    """

    seconds: float
    merge: bool = False


@dataclass(frozen=True, slots=True)
class Cut:
    """Close the client connection (FIN or RST) and the upstream one."""

    how: Close


@dataclass(frozen=True, slots=True)
class Freeze:
    """Stop reading and writing both sides, without closing (half-open)."""


@dataclass(frozen=True, slots=True)
class ArmIdle:
    """The connection is idle after a response: close it if it stays idle that long."""

    fault: Fault
    seq: int


@dataclass(frozen=True, slots=True)
class Injected:
    """A fault was injected: write a ``fault`` record. ``now``: at once, not in delivery order."""

    fault: Fault
    seq: int | None
    detail: str
    now: bool = False


Action = Forward | Deliver | Hold | Cut | Freeze | ArmIdle | Injected
