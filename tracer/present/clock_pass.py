"""Whether an analysis's captures can be on clocks that disagree: where their headers do
not show one clock (several taps, not all of the same boot and wall offset), ``report``
measures the pairs' offsets (``analysis/findings/clocks.py``) on its fold and reads the
captures again on one clock if they disagree; one tap, or taps of one machine, cost
nothing more."""

from __future__ import annotations

from typing import Any

from ..analysis.findings.clocks import shared_clock
from ..capture.reader import file_kind


def one_clock(files: list[str], headers: list[dict[str, Any]]) -> bool:
    """Whether the captures' headers (``capture_headers``) show one clock for all their
    taps (or one tap)."""
    if any(file_kind(f) in ("pcap", "pcapng") for f in files):
        return len(files) < 2  # (a packet capture's taps: their headers come with it)
    taps: dict[str, dict[str, Any]] = {}
    for h in headers:
        t, m = h.get("t"), h.get("m")
        offset = t - m if isinstance(t, int | float) and isinstance(m, int | float) else None
        taps.setdefault(str(h.get("tap")), {"boot_id": h.get("boot_id"), "wall_offset": offset})
    return len(taps) < 2 or shared_clock(list(taps.values()))
