"""What an engine sample's figures may hold: the range of each, and the figures of a sample
that fall outside it.

An ``EngineSample`` holds what an endpoint said, normalised (``engines``): the poller
writes a NaN or an infinity as unknown (``None``), but a capture written by another tool,
edited by hand, or from a server that misreports can hold ``1e308`` requests running, a
negative queue or a KV-cache use of 40. Such a sample is not evidence: the analysis
(``analysis/summary.py``, where a sample is read in) drops it whole, counts it in the
``samples_out_of_range`` caveat by figure, and nothing downstream (the attribution's
engine view, the report's engine section, the timeline picture) ever sees it.

The ranges (a value is kept when ``low <= value <= high``; ``None`` is unknown, always
kept; anything else that is not a finite number is out of range):

* requests (``running``, ``queued``, ``in_flight``, ``workers_healthy``,
  ``workers_total``): 0 to ``MAX_REQUESTS`` (1e6);
* ``token_usage``: the KV-cache use as a fraction, 0 to 1 (every profile's source is a
  fraction, vLLM's ``kv_cache_usage_perc`` too);
* ``gen_throughput``: 0 to ``MAX_TOKEN_RATE`` (1e8 tokens/s);
* ``in_flight_older_than``: 0 to ``MAX_SECONDS`` (1e7 s, about 4 months);
* counters (a state key ending in ``_total``): 0 to ``MAX_COUNTER`` (2**53, the largest
  count a float64 counter holds exactly);
* another state key: any finite number;
* ``deltas`` (counter increases): 0 to ``MAX_COUNTER``, and a token counter's increase no
  more than ``MAX_TOKEN_RATE`` per second of ``interval``;
* ``interval``: 0 to ``MAX_SECONDS``.

A counter that went *down* is not out of range: it is an engine restart, which the poller
records as ``restarted`` with no deltas (``engines.CounterTracker``); the analysis reads
only the deltas, never differences of the counters itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_COUNTER",
    "MAX_REQUESTS",
    "MAX_SECONDS",
    "MAX_TOKEN_RATE",
    "out_of_range",
]

MAX_REQUESTS = 1e6
MAX_TOKEN_RATE = 1e8  # tokens/s: far above any one endpoint's
MAX_SECONDS = 1e7
MAX_COUNTER = float(2**53)

_REQUESTS = ("running", "queued", "in_flight", "workers_healthy", "workers_total")
_RANGES: dict[str, tuple[float, float]] = {
    **dict.fromkeys(_REQUESTS, (0.0, MAX_REQUESTS)),
    "token_usage": (0.0, 1.0),
    "gen_throughput": (0.0, MAX_TOKEN_RATE),
    "in_flight_older_than": (0.0, MAX_SECONDS),
}
_ANY = (-math.inf, math.inf)  # finite, else anything


def _range(key: str) -> tuple[float, float]:
    if key.endswith("_total"):
        return 0.0, MAX_COUNTER
    return _RANGES.get(key, _ANY)


def _inside(value: Any, low: float, high: float) -> bool:
    """``value`` is unknown (None) or a finite number within [low, high]."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and low <= value <= high


def out_of_range(
    state: Mapping[str, Any] | None,
    deltas: Mapping[str, Any] | None = None,
    interval: Any = None,
) -> list[str]:
    """The figures of one sample outside their range (see the module docstring), named
    as in the record: ``state.<key>``, ``deltas.<key>``, ``interval``; empty when the
    sample can be believed."""
    bad = [f"state.{k}" for k, v in (state or {}).items() if not _inside(v, *_range(k))]
    interval_ok = _inside(interval, 0.0, MAX_SECONDS)
    if not interval_ok:
        bad.append("interval")
    seconds = float(interval) if interval_ok and interval else 0.0
    for key, value in (deltas or {}).items():
        high = MAX_COUNTER
        if "tokens" in key and seconds > 0:
            high = min(high, MAX_TOKEN_RATE * seconds)
        if not _inside(value, 0.0, high):
            bad.append(f"deltas.{key}")
    return bad
