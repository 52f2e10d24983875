"""bench's figures: what bench_serving's ``calculate_metrics`` makes of a run's requests.

Pure arithmetic over samples (no sockets, no clocks), apart from the load generator so
that ``tracer compare`` reads the same headline figures and the tests check them alone.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from .streamclient import Sample

# (key in a figures dict, label, which direction is better): what compare reports
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("output_throughput", "output tok/s", "higher"),
    ("request_throughput", "req/s", "higher"),
    ("ttft_ms.mean", "TTFT mean", "lower"),
    ("ttft_ms.p99", "TTFT p99", "lower"),
    ("itl_ms.mean", "ITL mean", "lower"),
    ("tpot_ms.mean", "TPOT mean", "lower"),
    ("e2e_ms.mean", "E2E mean", "lower"),
)


def percentile(ordered: Sequence[float], q: float) -> float:
    """numpy's default (linear) percentile of sorted, non-empty ``ordered``; q in 0-100."""
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean, p50, p99, std (population) and max, scaled (seconds -> ms by default)."""
    if not values:
        return {"mean": None, "median": None, "p99": None, "std": None, "max": None}
    ordered = sorted(values)
    return {
        "mean": round(statistics.fmean(ordered) * scale, 4),
        "median": round(percentile(ordered, 50) * scale, 4),
        "p99": round(percentile(ordered, 99) * scale, 4),
        "std": round(statistics.pstdev(ordered) * scale, 4),
        "max": round(ordered[-1] * scale, 4),
    }


def figures(samples: Sequence[Sample], duration: float) -> dict[str, Any]:
    """bench_serving's ``calculate_metrics`` over these requests and this wall time."""
    ok = [s for s in samples if s.error is None]
    dur = max(duration, 1e-9)
    output = sum(s.output_tokens for s in ok)
    prompt = sum(s.prompt_tokens or 0 for s in ok)
    e2e = [s.latency for s in ok]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    tpot = [
        (s.latency - s.ttft) / (s.output_tokens - 1)
        for s in ok
        if s.ttft is not None and s.output_tokens > 1
    ]
    itl = [gap for s in ok for gap in s.itl]
    return {
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "duration_s": round(duration, 6),
        "input_tokens": prompt,
        "output_tokens": output,
        "output_chunks": sum(s.chunks for s in ok),
        "request_throughput": round(len(ok) / dur, 4),
        "input_throughput": round(prompt / dur, 4),
        "output_throughput": round(output / dur, 4),
        "total_throughput": round((prompt + output) / dur, 4),
        "observed_concurrency": round(sum(e2e) / dur, 4),  # Little's law
        "ttft_ms": distribution(ttft),
        "itl_ms": distribution(itl),
        "tpot_ms": distribution(tpot),
        "e2e_ms": distribution(e2e),
    }


def lookup(fig: dict[str, Any], key: str) -> float | None:
    """``"ttft_ms.mean"`` -> fig["ttft_ms"]["mean"]."""
    value: Any = fig
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return float(value) if isinstance(value, int | float) else None


def spread(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float] | None]:
    """For each headline figure: min, max, mean and stdev over the runs."""
    out: dict[str, dict[str, float] | None] = {}
    for key, _, _ in HEADLINE:
        values = [v for v in (lookup(r, key) for r in runs) if v is not None]
        if not values:
            out[key] = None
            continue
        out[key] = {
            "n": len(values),
            "min": round(min(values), 4),
            "max": round(max(values), 4),
            "mean": round(statistics.fmean(values), 4),
            "stdev": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
        }
    return out
