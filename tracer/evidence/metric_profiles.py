"""What each server calls its figures, and when each figure moves: the profiles.

One table per server (SGLang, vLLM, llama.cpp, the SGLang routers) from its metric names
to the normalised state's keys, with a note on how fresh each figure is (``Timing``).
Apart from the normalisation (``engines``) because it is data to keep up with the
servers, not rules; the references are in ``engines``' docstring.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client.metrics_core import Metric

from .metrics_text import canonical_name

STATE_KEYS: tuple[str, ...] = (
    "running",  # requests in the running batch(es)
    "queued",  # requests waiting
    "token_usage",  # KV-cache use, 0-1 (max over DP ranks / engines)
    "gen_throughput",  # tokens/s (the engine's own gauge)
    "decode_tokens_total",  # counter of decode progress, moving while streams decode
    "generation_tokens_total",  # counter (SGLang, llama.cpp: added when a request finishes)
    "prompt_tokens_total",  # counter
    "requests_total",  # counter: finished requests (routers: responses)
)
ROUTER_KEYS: tuple[str, ...] = (
    "in_flight",  # requests the router has outstanding
    "in_flight_older_than",  # seconds: the oldest in-flight request is older than this
    "workers_healthy",
    "workers_total",
)
COUNTER_KEYS: tuple[str, ...] = (
    "decode_tokens_total",
    "generation_tokens_total",
    "prompt_tokens_total",
    "requests_total",
)

Agg = Literal["sum", "max", "healthy", "live", "oldest"]
# When a figure moves (reference §1.4): ``live`` as the engine works (read at the scrape),
# ``sampled`` written by the engine now and then (SGLang's scheduler every 40 decode steps,
# ~30 s idle), ``finish`` added when a request finishes (SGLang's tokenizer counters):
# a finish-time counter that stays flat says nothing about tokens being produced.
Timing = Literal["live", "sampled", "finish"]


@dataclass(frozen=True, slots=True)
class Source:
    """One metric that can give a figure.

    ``agg``: ``sum`` / ``max`` over series; ``healthy`` counts series equal to 1; ``live``
    counts series >= 0 (the router writes -1 for a removed worker); ``oldest`` is the
    largest ``gt`` label of a non-empty bucket of a non-cumulative age gauge-histogram.
    ``match``: required label values. ``dims``: labels summed within a series.
    ``series_key``: the name of this figure in ``series`` ("" = the figure's key; None =
    not shown per series). ``timing``: when the figure moves (``Timing``).
    """

    name: str
    note: str
    agg: Agg = "sum"
    match: tuple[tuple[str, str], ...] = ()
    dims: tuple[str, ...] = ()
    series_key: str | None = ""
    timing: Timing = "live"


@dataclass(frozen=True, slots=True)
class Figure:
    key: str
    sources: tuple[Source, ...]  # the first one the endpoint exposes is used


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    prefixes: tuple[str, ...]  # canonical-name prefixes that identify the server
    figures: tuple[Figure, ...]
    router: bool = False

    @property
    def keys(self) -> tuple[str, ...]:
        return STATE_KEYS + ROUTER_KEYS if self.router else STATE_KEYS

    def known_names(self) -> frozenset[str]:
        return frozenset(s.name for f in self.figures for s in f.sources)


def _fig(key: str, *sources: Source) -> Figure:
    return Figure(key, sources)


_SG_GAUGE = "gauge: refreshed every 40 decode steps, ~30 s when idle"
_SG_REALTIME = (
    "counter: scheduler-side decode tokens, advanced every decode log interval (40 steps)"
)
_SG_FINISH = "counter: added by the tokenizer when a request finishes (flat while streams decode)"
_VLLM_TOKENS = "counter: live (added every engine step)"
_VLLM_GAUGE = "gauge: set every engine step (about live)"
_LC_GAUGE = "gauge: live at scrape"
_LC_AVG = "gauge: average since the previous /metrics scrape by anyone (llama.cpp resets it on every scrape)"
_LC_TOKENS = "counter: moves when a request completes, not per token"
_SMG_ENGINE = "gauge: the router's load monitor relays the engine's own figure (polled every ~10 s; SGLang's are sampled)"
PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "sglang",
            ("sglang:",),
            (
                _fig("running", Source("sglang:num_running_reqs", _SG_GAUGE, timing="sampled")),
                _fig("queued", Source("sglang:num_queue_reqs", _SG_GAUGE, timing="sampled")),
                _fig(
                    "token_usage",
                    Source("sglang:token_usage", _SG_GAUGE, "max", timing="sampled"),
                ),
                _fig(
                    "gen_throughput", Source("sglang:gen_throughput", _SG_GAUGE, timing="sampled")
                ),
                _fig(
                    "decode_tokens_total",
                    Source(
                        "sglang:realtime_tokens_total",
                        _SG_REALTIME,
                        match=(("mode", "decode"),),
                        timing="sampled",
                    ),
                ),
                _fig(
                    "generation_tokens_total",
                    Source("sglang:generation_tokens_total", _SG_FINISH, timing="finish"),
                ),
                _fig(
                    "prompt_tokens_total",
                    Source("sglang:prompt_tokens_total", _SG_FINISH, timing="finish"),
                ),
                _fig(
                    "requests_total",
                    Source(
                        "sglang:num_requests_total",
                        "counter: added when a request finishes",
                        timing="finish",
                    ),
                ),
            ),
        ),
        Profile(
            "vllm",
            ("vllm:",),
            (
                _fig("running", Source("vllm:num_requests_running", _VLLM_GAUGE)),
                _fig("queued", Source("vllm:num_requests_waiting", _VLLM_GAUGE)),
                _fig(
                    "token_usage",
                    Source("vllm:kv_cache_usage_perc", _VLLM_GAUGE, "max"),
                    Source("vllm:gpu_cache_usage_perc", _VLLM_GAUGE + " (deprecated name)", "max"),
                ),
                _fig(
                    "gen_throughput",
                    Source(
                        "vllm:avg_generation_throughput_toks_per_s",
                        "gauge: v0 engine's average over its log interval",
                    ),
                ),
                _fig(
                    "decode_tokens_total",
                    Source("vllm:generation_tokens_total", _VLLM_TOKENS, series_key=None),
                ),
                _fig(
                    "generation_tokens_total", Source("vllm:generation_tokens_total", _VLLM_TOKENS)
                ),
                _fig("prompt_tokens_total", Source("vllm:prompt_tokens_total", _VLLM_TOKENS)),
                _fig(
                    "requests_total",
                    Source(
                        "vllm:request_success_total",
                        "counter: live (finished requests, every finished_reason)",
                        dims=("finished_reason",),
                    ),
                ),
            ),
        ),
        Profile(
            "llamacpp",
            ("llamacpp:",),
            (
                _fig("running", Source("llamacpp:requests_processing", _LC_GAUGE)),
                _fig("queued", Source("llamacpp:requests_deferred", _LC_GAUGE)),
                _fig("token_usage", Source("llamacpp:kv_cache_usage_ratio", _LC_GAUGE, "max")),
                _fig(
                    "gen_throughput",
                    Source("llamacpp:predicted_tokens_seconds", _LC_AVG, timing="sampled"),
                ),
                _fig(
                    "decode_tokens_total",
                    Source("llamacpp:n_decode_total", "counter: live (decode passes, every pass)"),
                ),
                _fig(
                    "generation_tokens_total",
                    Source("llamacpp:tokens_predicted_total", _LC_TOKENS, timing="finish"),
                ),
                _fig(
                    "prompt_tokens_total",
                    Source("llamacpp:prompt_tokens_total", _LC_TOKENS, timing="finish"),
                ),
            ),
        ),
        Profile(
            "smg",
            ("smg_",),
            (
                _fig(
                    "running", Source("smg_engine_running_requests", _SMG_ENGINE, timing="sampled")
                ),
                _fig(
                    "queued", Source("smg_engine_waiting_requests", _SMG_ENGINE, timing="sampled")
                ),
                _fig(
                    "token_usage",
                    Source("smg_engine_token_usage", _SMG_ENGINE, "max", timing="sampled"),
                ),
                _fig(
                    "gen_throughput",
                    Source("smg_engine_gen_throughput", _SMG_ENGINE, timing="sampled"),
                ),
                _fig(
                    "generation_tokens_total",
                    Source(
                        "smg_router_tokens_total",
                        "counter: live (counted by the router, gRPC workers only)",
                        match=(("token_type", "output"),),
                        dims=("router_type", "backend_type", "endpoint"),
                    ),
                ),
                _fig(
                    "prompt_tokens_total",
                    Source(
                        "smg_router_tokens_total",
                        "counter: live (counted by the router, gRPC workers only)",
                        match=(("token_type", "input"),),
                        dims=("router_type", "backend_type", "endpoint"),
                    ),
                ),
                _fig(
                    "requests_total",
                    Source(
                        "smg_http_responses_total",
                        "counter: live (responses the router sent, every status)",
                        dims=("status_code", "error_code"),
                    ),
                ),
                _fig(
                    "in_flight",
                    Source(
                        "smg_http_inflight_request_age_count",
                        "gauge: the router's in-flight sampler (HTTP requests it holds)",
                        dims=("gt", "le"),
                    ),
                    Source(
                        "smg_worker_requests_active",
                        "gauge: live (the router's count of requests sent to each worker)",
                    ),
                ),
                _fig(
                    "in_flight_older_than",
                    Source(
                        "smg_http_inflight_request_age_count",
                        "gauge: the router's in-flight sampler (age buckets, seconds)",
                        "oldest",
                        series_key=None,
                    ),
                ),
                _fig(
                    "workers_healthy",
                    Source(
                        "smg_worker_health",
                        "gauge: the router's health checks (every 60 s by default)",
                        "healthy",
                        series_key="health",
                    ),
                ),
                _fig(
                    "workers_total",
                    Source(
                        "smg_worker_health",
                        "gauge: workers registered with the router",
                        "live",
                        series_key=None,
                    ),
                ),
            ),
            router=True,
        ),
        Profile(
            "sgl_router",
            ("sgl_router_", "sgl_tokenizer_"),
            (
                _fig(
                    "requests_total",
                    Source(
                        "sgl_router_http_responses_total",
                        "counter: live (responses the router sent)",
                        dims=("status_code", "error_code"),
                    ),
                    Source(
                        "sgl_router_processed_requests_total",
                        "counter: live (requests the router sent to workers, counted when sent)",
                    ),
                    Source(
                        "sgl_router_requests_total",
                        "counter: live (requests the router received, counted on arrival)",
                        dims=("route", "method"),
                    ),
                ),
                _fig(
                    "in_flight",
                    Source(
                        "sgl_router_running_requests",
                        "gauge: live (the router's count of requests sent to each worker)",
                    ),
                ),
                _fig(
                    "workers_healthy",
                    Source(
                        "sgl_router_active_workers",
                        "gauge: the router's healthy workers",
                        series_key=None,
                    ),
                    Source(
                        "sgl_router_worker_health",
                        "gauge: the router's health checks",
                        "healthy",
                        series_key="health",
                    ),
                ),
                _fig(
                    "workers_total",
                    Source(
                        "sgl_router_worker_health",
                        "gauge: workers registered with the router",
                        "live",
                        series_key=None,
                    ),
                ),
            ),
            router=True,
        ),
    )
}
_ENGINE_PROFILES = ("sglang", "vllm", "llamacpp")
PROGRESS_KEY = "decode_tokens_total"


def figure_timing(profile: str | None, key: str) -> Timing | None:
    """When ``key`` moves for ``profile`` (its first source's ``timing``); None when the
    profile has no such figure. ``/v1/loads`` figures are live whatever this says."""
    prof = PROFILES.get(profile or "")
    if prof is None:
        return None
    for figure in prof.figures:
        if figure.key == key:
            return figure.sources[0].timing
    return None


def detect_profile(families: Iterable[Metric]) -> str:
    """The profile whose names the endpoint exposes; ``unknown`` when none."""
    counts = dict.fromkeys(PROFILES, 0)
    for family in families:
        for sample in family.samples:
            name = canonical_name(sample.name)
            for profile in PROFILES.values():
                if name.startswith(profile.prefixes):
                    counts[profile.name] += 1
    for router in ("smg", "sgl_router"):  # a router's own port may re-export engine names
        if counts[router]:
            return router
    best = max(_ENGINE_PROFILES, key=lambda name: counts[name])
    return best if counts[best] else "unknown"
