"""The first pass of an analysis whose taps' wall clocks may disagree: it measures each
pair's offset (``analysis/findings/clocks.py``) so that the real pass can apply it.

Run only where the captures' headers do not show one clock (several taps, not all of the
same boot and wall offset): one tap, or taps of one machine, cost nothing more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..analysis.findings.clocks import Clocks, clocks_to_apply
from ..analysis.findings.join import shared_clock
from ..analysis.summary import Summary
from ..capture.reader import capture_headers, file_kind
from ..protocol.probe_mark import KnownTaps


def one_clock(files: list[str]) -> bool:
    """Whether the captures' headers show one clock for all their taps (or one tap)."""
    if any(file_kind(f) in ("pcap", "pcapng") for f in files):
        return len(files) < 2  # (a packet capture's taps: their headers come with it)
    taps: dict[str, dict[str, Any]] = {}
    for h in capture_headers(files):
        t, m = h.get("t"), h.get("m")
        offset = t - m if isinstance(t, int | float) and isinstance(m, int | float) else None
        taps.setdefault(str(h.get("tap")), {"boot_id": h.get("boot_id"), "wall_offset": offset})
    return len(taps) < 2 or shared_clock(list(taps.values()))


def measure_clocks(
    files: list[str], known: KnownTaps, read_all: Callable[[Callable[[Any], None]], object]
) -> Clocks | None:
    """The offsets the real pass must apply (None: one clock, or the clocks agree).
    ``read_all(feed)`` reads the captures into ``feed`` as the real pass will."""
    if one_clock(files):
        return None
    with Summary(known_taps=known) as first:
        read_all(first.feed)
        return clocks_to_apply(first.result())
