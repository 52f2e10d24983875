"""Engine metrics, sans-I/O: Prometheus text (or SGLang's load JSON) in, one normalised state out.

Theory of operation
-------------------
The poller (``tracer/evidence/poller.py``) fetches ``/metrics`` from engines (SGLang, vLLM,
llama.cpp) and from the SGLang router's metrics port; this module turns the text into
the same small set of figures whatever the server, so that analysis never needs to know
which server it was. No sockets, no clocks: times come in as arguments. The text is read in
``metrics_text``; the servers' names and timings are the profiles of ``metric_profiles``;
the normalisation, the load JSON and the counters' deltas are here.

* ``parse`` reads the text with ``prometheus_client``'s parser; a text it cannot read
  raises ``MetricsError`` naming the first bad line. ``parse_lenient`` drops the lines
  that do not parse (and says which) and reads the rest.
* Metric names are matched on *sample* names in one canonical spelling: ``sglang_``,
  ``vllm_`` and ``llamacpp_`` are read as ``sglang:``, ``vllm:`` and ``llamacpp:`` (the
  router's ``/engine_metrics`` rewrites ``:`` to ``_``; newer prometheus_client writes
  HELP/TYPE in one spelling and samples in the other).
* ``detect_profile`` picks the profile from what the endpoint exposes: ``smg`` (router,
  ``smg_*``), ``sgl_router`` (older router, ``sgl_router_*``), else whichever of
  ``sglang``, ``vllm``, ``llamacpp`` has the most samples, else ``unknown``. It can be
  overridden.
* ``normalise`` maps a profile's names to ``STATE_KEYS`` (plus ``ROUTER_KEYS`` for the
  router profiles); a figure the endpoint does not expose is ``None``. The labelled
  series behind the figures are kept in ``series`` (one entry per distinct label set:
  ``engine_type``, ``dp_rank``, ``model_name``, ``engine``, ``worker`` ...).

Summing rules (reference §1.2, §3.1):

1. *Replica ranks are never summed.* Series that differ only in ``tp_rank``, ``pp_rank``,
   ``moe_ep_rank`` (``REPLICA_LABELS``) report the same batch of one DP group: the one
   with the lowest rank is used (``tp_rank="0"`` when present; with DP attention a DP
   group's lowest rank is not 0, which is why it is per group and not "tp_rank 0").
2. *Priorities are never counted twice.* Where a ``priority=""`` aggregate series sits
   next to per-priority series, the aggregate is used; without it, the per-priority
   series are summed.
3. Everything else is summed: ``dp_rank``, vLLM's ``engine``, router workers, and the
   per-metric dimensions a figure declares (vLLM's ``finished_reason``, the router's
   ``status_code``). Ratios (``token_usage``) take the maximum instead.
4. NaN and infinities are ``None``; a sum with an unknown part is unknown (``None``), not
   a smaller number.

Freshness (``Reading.freshness``) says, per figure, how old it may be, and each source's
``timing`` says when it moves (``figure_timing``): SGLang's scheduler gauges are
*sampled* (written every 40 decode steps and about every 30 s while idle, so a gauge can
be 30 s old); its tokenizer counters (``generation_tokens_total``, ``prompt_tokens_total``,
``num_requests_total``) are added when a request *finishes*, so they stay flat on a busy,
healthy engine while long streams decode. Progress is ``decode_tokens_total``
(``PROGRESS_KEY``): SGLang's ``realtime_tokens_total{mode="decode"}`` (sampled, every log
interval), vLLM's ``generation_tokens_total`` (live, every engine step), llama.cpp's
``n_decode_total`` (live). Check progress deltas (``CounterTracker``) before believing a
frozen gauge, and never read "no tokens" from a finish-time counter. llama.cpp resets its throughput averages on *every* /metrics
scrape, so another scraper (Prometheus) and the tracer disturb each other's figure.

``parse_loads`` reads SGLang's ``/v1/loads`` (live values, computed on request) and the
older ``/get_load`` list into the same keys, summed over DP ranks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.metrics_core import Metric

from .metric_profiles import (
    COUNTER_KEYS,
    PROFILES,
    PROGRESS_KEY,
    ROUTER_KEYS,
    STATE_KEYS,
    Profile,
    Source,
    detect_profile,
    figure_timing,
)
from .metrics_text import MetricsError, _clip, canonical_name, parse, parse_lenient

__all__ = [
    "COUNTER_KEYS",
    "PROFILES",
    "PROGRESS_KEY",
    "REPLICA_LABELS",
    "ROUTER_KEYS",
    "STATE_KEYS",
    "CounterTracker",
    "MetricsError",
    "Profile",
    "Reading",
    "canonical_name",
    "detect_profile",
    "figure_timing",
    "normalise",
    "parse",
    "parse_lenient",
    "parse_loads",
    "progress_delta",
    "read_metrics",
]

_INT_KEYS = frozenset(
    {
        "running",
        "queued",
        "decode_tokens_total",
        "generation_tokens_total",
        "prompt_tokens_total",
        "requests_total",
        "in_flight",
        "in_flight_older_than",
        "workers_healthy",
        "workers_total",
        "health",
    }
)
REPLICA_LABELS: tuple[str, ...] = (
    "tp_rank",
    "pp_rank",
    "moe_ep_rank",
    "attn_tp_rank",
    "attn_cp_rank",
)
PRIORITY_LABEL = "priority"
MAX_SERIES = 256  # series kept per reading (bounded memory per sample)

Number = int | float


def progress_delta(deltas: Mapping[str, Any] | None, profile: str | None) -> float | None:
    """Tokens the engine produced between two samples, from a figure that moves while
    streams decode (``PROGRESS_KEY``, or a token counter whose timing is live); None when
    the sample has no such figure (a finish-time counter's delta is not progress)."""
    if not deltas:
        return None
    for key in (PROGRESS_KEY, "generation_tokens_total"):
        value = _number(deltas.get(key))
        if value is not None and (key == PROGRESS_KEY or figure_timing(profile, key) == "live"):
            return value
    return None


# ---- normalisation --------------------------------------------------------------------

LabelKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Reading:
    """One endpoint's figures, normalised (the payload of an ``EngineSample``)."""

    profile: str
    state: dict[str, Number | None]
    series: list[dict[str, Any]] = field(default_factory=list)
    freshness: dict[str, str] = field(default_factory=dict)
    raw: dict[str, list[dict[str, Any]]] | None = None


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _num(key: str, value: float | None) -> Number | None:
    if value is None or not math.isfinite(value):
        return None
    if key in _INT_KEYS and float(value).is_integer():
        return int(value)
    return float(value)


def _rank(value: str | None) -> float:
    if not value:
        return -1.0
    try:
        return float(value)
    except ValueError:
        return math.inf


def _key(labels: Mapping[str, str], drop: Iterable[str]) -> LabelKey:
    dropped = set(drop)
    return tuple(sorted((k, v) for k, v in labels.items() if k not in dropped))


Pair = tuple[dict[str, str], float]


def _select(samples: Sequence[Pair]) -> list[Pair]:
    """Apply summing rules 1 (one replica rank per group) and 2 (priority aggregate)."""
    best: dict[LabelKey, tuple[tuple[float, ...], Pair]] = {}
    for labels, value in samples:
        group = _key(labels, REPLICA_LABELS)
        rank = tuple(_rank(labels.get(k)) for k in REPLICA_LABELS)
        current = best.get(group)
        if current is None or rank < current[0]:
            best[group] = (rank, (labels, value))
    chosen = [pair for _, pair in best.values()]
    if not any(PRIORITY_LABEL in labels for labels, _ in chosen):
        return chosen
    groups: dict[LabelKey, list[Pair]] = {}
    for labels, value in chosen:
        groups.setdefault(_key(labels, (PRIORITY_LABEL,)), []).append((labels, value))
    out: list[Pair] = []
    for members in groups.values():
        aggregate = [p for p in members if p[0].get(PRIORITY_LABEL, "") == ""]
        out.extend(aggregate or members)
    return out


def _sum(values: Iterable[float | None]) -> float | None:
    total = 0.0
    seen = False
    for value in values:
        if value is None:
            return None
        total += value
        seen = True
    return total if seen else None


def _figure(
    source: Source, samples: Sequence[Pair]
) -> tuple[float | None, dict[LabelKey, float | None]]:
    """The figure's total, and its value per series (identity labels -> value)."""
    selected = _select(samples)
    if source.agg == "oldest":
        finite = [(labels, v) for labels, v in selected if _finite(v)]
        if not finite:
            return None, {}
        ages = [_rank(labels.get("gt")) for labels, v in finite if v > 0]
        ages = [a for a in ages if math.isfinite(a)]
        return (max(ages) if ages else 0.0), {}
    drop = (*REPLICA_LABELS, PRIORITY_LABEL, *source.dims, *(k for k, _ in source.match))
    grouped: dict[LabelKey, list[float | None]] = {}
    for labels, value in selected:
        grouped.setdefault(_key(labels, drop), []).append(value if _finite(value) else None)
    per_series = {ident: _sum(values) for ident, values in grouped.items()}
    values = list(per_series.values())
    total: float | None
    if source.agg == "sum":
        total = _sum(values)
    elif source.agg == "max":
        known = [v for v in values if v is not None]
        total = max(known) if known else None
    elif source.agg == "healthy":
        total = float(sum(1 for v in values if v == 1))
    else:  # live
        total = float(sum(1 for v in values if v is not None and v >= 0))
    return total, per_series


def normalise(
    families: Iterable[Metric], *, profile: str | None = None, keep_raw: bool = False
) -> Reading:
    """Map parsed families to the normalised state of ``profile`` (detected when None).

    ``keep_raw``: also keep every sample the profile does not use, as
    ``name -> [{"labels": ..., "value": ...}]`` (non-finite values as None).
    """
    fams = list(families)
    name = profile if profile is not None else detect_profile(fams)
    if name != "unknown" and name not in PROFILES:
        raise ValueError(f"unknown engine profile {name!r} (known: {', '.join(PROFILES)})")
    prof = PROFILES.get(name)
    by_name: dict[str, list[Pair]] = {}
    for family in fams:
        for sample in family.samples:
            by_name.setdefault(canonical_name(sample.name), []).append(
                (dict(sample.labels), float(sample.value))
            )
    keys = prof.keys if prof is not None else STATE_KEYS
    state: dict[str, Number | None] = dict.fromkeys(keys)
    freshness: dict[str, str] = {}
    series: dict[LabelKey, dict[str, Number | None]] = {}
    for figure in prof.figures if prof is not None else ():
        for source in figure.sources:
            samples = [
                pair
                for pair in by_name.get(source.name, ())
                if all(pair[0].get(k) == v for k, v in source.match)
            ]
            if samples:
                break
        else:
            continue
        total, per_series = _figure(source, samples)
        state[figure.key] = _num(figure.key, total)
        if state[figure.key] is not None:
            freshness[figure.key] = source.note
        if source.series_key is not None:
            skey = source.series_key or figure.key
            for ident, value in per_series.items():
                if ident:  # an unlabelled series is the state itself
                    series.setdefault(ident, {})[skey] = _num(skey, value)
    raw: dict[str, list[dict[str, Any]]] | None = None
    if keep_raw:
        known = prof.known_names() if prof is not None else frozenset()
        raw = {}
        for family in fams:
            for sample in family.samples:
                if canonical_name(sample.name) in known:
                    continue
                value = float(sample.value)
                raw.setdefault(sample.name, []).append(
                    {"labels": dict(sample.labels), "value": value if _finite(value) else None}
                )
    ordered = sorted(series.items())[:MAX_SERIES]
    return Reading(
        profile=name,
        state=state,
        series=[{"labels": dict(ident), **figures} for ident, figures in ordered],
        freshness=freshness,
        raw=raw,
    )


def read_metrics(text: str, *, profile: str | None = None, keep_raw: bool = False) -> Reading:
    """``normalise(parse(text))``: raises ``MetricsError`` on text that does not parse."""
    return normalise(parse(text), profile=profile, keep_raw=keep_raw)


# ---- SGLang /v1/loads and /get_load ---------------------------------------------------

_LOADS_NOTE = "live: computed by the engine when asked (/v1/loads)"
_GET_LOAD_NOTE = "live: computed by the engine when asked (/get_load, deprecated)"
_LOAD_KEYS = ("running", "queued", "token_usage", "gen_throughput")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def parse_loads(data: Any) -> Reading:
    """SGLang's ``/v1/loads`` (``{"loads": [...]}``) or ``/get_load`` (a list) -> a Reading.

    ``data`` is the decoded JSON, or its text/bytes. Figures are summed over DP ranks
    (``token_usage``: the maximum); ``series`` has one entry per ``dp_rank``. The old
    ``/get_load`` gives ``num_reqs`` (running + waiting) and ``num_waiting_reqs``.
    """
    if isinstance(data, str | bytes | bytearray):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise MetricsError(f"loads: not JSON: {_clip(str(exc), 120)}") from None
    note = _LOADS_NOTE
    if isinstance(data, dict) and "loads" in data:
        entries = data["loads"]
    elif isinstance(data, list):
        entries, note = data, _GET_LOAD_NOTE
    elif isinstance(data, dict) and ("num_reqs" in data or "num_running_reqs" in data):
        entries, note = [data], _GET_LOAD_NOTE
    else:
        raise MetricsError('loads: unrecognised JSON (expected {"loads": [...]} or a list)')
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise MetricsError("loads: the entries are not a list of objects")
    per_rank: list[tuple[LabelKey, dict[str, float | None]]] = []
    recognised = False
    for entry in entries:
        running = _number(entry.get("num_running_reqs"))
        queued = _number(entry.get("num_waiting_reqs"))
        if running is None and "num_running_reqs" not in entry:
            total = _number(entry.get("num_reqs"))
            if total is not None and queued is not None:
                running = total - queued
        figures = {
            "running": running,
            "queued": queued,
            "token_usage": _number(entry.get("token_usage")),
            "gen_throughput": _number(entry.get("gen_throughput")),
        }
        recognised = recognised or any(v is not None for v in figures.values())
        rank = entry.get("dp_rank")
        ident: LabelKey = (("dp_rank", str(rank)),) if rank is not None else ()
        per_rank.append((ident, figures))
    if entries and not recognised:
        raise MetricsError("loads: no load figures in the JSON")
    state: dict[str, Number | None] = dict.fromkeys(STATE_KEYS)
    freshness: dict[str, str] = {}
    for key in _LOAD_KEYS:
        values = [figures[key] for _, figures in per_rank]
        if key == "token_usage":
            known = [v for v in values if v is not None]
            total_value = max(known) if known else None
        else:
            total_value = _sum(values)
        state[key] = _num(key, total_value)
        if state[key] is not None:
            freshness[key] = note
    series = [
        {"labels": dict(ident), **{k: _num(k, v) for k, v in figures.items()}}
        for ident, figures in per_rank
        if ident
    ][:MAX_SERIES]
    return Reading(profile="sglang", state=state, series=series, freshness=freshness)


# ---- counters between scrapes ---------------------------------------------------------


class CounterTracker:
    """Per URL, the previous counters and their monotonic time: deltas between samples.

    ``update`` returns ``(deltas, interval, restarted)``. The first sample of a URL gives
    ``({}, None, False)``. A counter that went down means the engine (or router)
    restarted: ``restarted`` is True and no deltas are given at all for that sample (a
    restart resets every counter, so an increase seen beside a decrease is not one).
    Counters are the state's keys ending in ``_total`` with a finite value.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, dict[str, float]]] = {}

    def update(
        self, url: str, state: Mapping[str, Any], m: float
    ) -> tuple[dict[str, Number], float | None, bool]:
        counters = {
            k: float(v) for k, v in state.items() if k.endswith("_total") and _number(v) is not None
        }
        if not counters:
            return {}, None, False
        previous = self._last.get(url)
        self._last[url] = (m, counters)
        if previous is None:
            return {}, None, False
        prev_m, prev = previous
        interval = m - prev_m
        common = [k for k in counters if k in prev]
        if any(counters[k] < prev[k] for k in common):
            return {}, interval, True
        deltas: dict[str, Number] = {}
        for k in common:
            delta = counters[k] - prev[k]
            deltas[k] = int(delta) if delta.is_integer() else delta
        return deltas, interval, False

    def forget(self, url: str) -> None:
        self._last.pop(url, None)
