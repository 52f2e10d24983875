"""The report's engine section: each engine's (and router's) own figures around a finding.

Its own module because it reads engine samples, not rows: the same rules as the
attribution's engine view, applied to the span before a finding and the span it covers.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from ..evidence.engines import progress_delta

AROUND = 1.5  # seconds of engine samples taken on either side of a finding's window
ENGINE_PROFILES = {"sglang", "vllm", "llamacpp"}
ROUTER_PROFILES = {"smg", "sgl_router"}


def _host(url: str) -> str:
    return urlsplit(url).netloc or url


def engine_around(
    f: dict[str, Any], samples: list[dict[str, Any]], window: tuple[float, float]
) -> dict[str, Any]:
    """Each engine's (and router's) own figures before a finding's window and during it.

    The rules are those of the attribution (``findings.Context.engine_view``): running and
    queued from the samples inside the phase (live ``/v1/loads`` ones where the engine has
    them), tokens from the counter deltas whose interval lies inside the phase.
    """
    start, stop = window
    phases = {"before": (start - AROUND, start), "during": (start, stop)}
    live = {_host(s["url"]) for s in samples if s["ok"] and s.get("source") == "loads"}
    engines: list[dict[str, Any]] = []
    routers: list[dict[str, Any]] = []
    for phase, (low, high) in phases.items():
        inside = sorted(
            (s for s in samples if low <= s["t"] <= high), key=lambda s: (s["t"], s["url"])
        )
        engines += _engine_rows(phase, low, high, inside, live)
        routers += _router_rows(phase, inside)
    return {
        "finding": f["id"],
        "kind": f["kind"],
        "window": {"start": start, "end": stop, "before": AROUND},
        "engines": engines,
        "routers": routers,
    }


def _engine_rows(
    phase: str, low: float, high: float, samples: list[dict[str, Any]], live: set[str]
) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for s in samples:
        host, profile, state = _host(s["url"]), s.get("profile"), s.get("state") or {}
        if profile in ROUTER_PROFILES or (s["ok"] and profile not in ENGINE_PROFILES):
            continue
        e = rows.setdefault(
            host,
            {
                "engine": host,
                "phase": phase,
                "start": low,
                "end": high,
                "profile": profile,
                "source": "loads" if host in live else "metrics",
                "samples": 0,
                "failed_scrapes": 0,
                "running": None,
                "queued_max": None,
                "generation_tokens": None,
                "token_rate": None,
                "_seconds": 0.0,
            },
        )
        if not s["ok"]:
            e["failed_scrapes"] += 1
            continue
        e["samples"] += 1
        e["profile"] = e["profile"] or profile
        if (s.get("source") == "loads") == (host in live):
            if state.get("running") is not None:
                value = int(state["running"])
                old = e["running"] or [value, value]
                e["running"] = [min(old[0], value), max(old[1], value)]
            if state.get("queued") is not None:
                e["queued_max"] = max(e["queued_max"] or 0, int(state["queued"]))
        deltas, interval = s.get("deltas") or {}, s.get("interval") or 0.0
        tokens = progress_delta(deltas, profile)
        if interval > 0 and tokens is not None and s["t"] - interval >= low - 1e-9:
            e["generation_tokens"] = (e["generation_tokens"] or 0) + tokens
            e["_seconds"] += interval
    for e in rows.values():
        seconds = e.pop("_seconds")
        if seconds > 0:
            e["token_rate"] = round(e["generation_tokens"] / seconds, 3)
    return [rows[k] for k in sorted(rows)]


def _router_rows(phase: str, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for s in samples:
        if s.get("profile") not in ROUTER_PROFILES:
            continue
        host, state = _host(s["url"]), s.get("state") or {}
        r = rows.setdefault(
            host, {"router": host, "phase": phase, "samples": 0, "in_flight_max": None}
        )
        r["samples"] += 1
        if s["ok"] and state.get("in_flight") is not None:
            r["in_flight_max"] = max(r["in_flight_max"] or 0, int(state["in_flight"]))
    return [rows[k] for k in sorted(rows)]
