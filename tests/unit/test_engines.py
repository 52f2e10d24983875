"""Prometheus text -> normalised engine state, on real and hand-written fixtures.

Every expected figure below was checked by hand against the fixture file (the synthetic
ones say their expected figures in their SOURCE line).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tracer.evidence import engines
from tracer.evidence.engines import CounterTracker, MetricsError

DATA = Path(__file__).parent.parent / "data" / "metrics"


def text(name: str) -> str:
    return (DATA / name).read_text()


def reading(name: str, **kw: Any) -> engines.Reading:
    return engines.read_metrics(text(name), **kw)


N = None
ENGINE_KEYS = list(engines.STATE_KEYS)
ROUTER_KEYS = ENGINE_KEYS + list(engines.ROUTER_KEYS)


def state(keys: list[str], *values: Any) -> dict[str, Any]:
    assert len(keys) == len(values)
    return dict(zip(keys, values, strict=True))


# running, queued, token_usage, gen_throughput, decode_tokens_total, generation_tokens_total,
# prompt_tokens_total, requests_total [, in_flight, in_flight_older_than, workers_healthy,
# workers_total]
EXPECTED: list[tuple[str, str, dict[str, Any]]] = [
    (
        "sglang_docs_production_metrics.prom",
        "sglang",
        state(ENGINE_KEYS, 162, 2826, 0.28, 86.50814177726902, N, 7557572, 8128902, N),
    ),
    (
        "llamacpp_pr11512_commit_message.prom",
        "llamacpp",
        state(ENGINE_KEYS, 0, 0, N, N, N, N, N, N),
    ),
    (
        "vllm_v1_engine_label_thirdparty_trimmed.prom",
        "vllm",
        state(ENGINE_KEYS, 1, 0, 0.0798685, N, 89950, 89950, N, 160 + 4),
    ),
    (
        "captured_smg_0.3.2_engine_metrics.prom",
        "sglang",
        state(ENGINE_KEYS, 3 + 3, 1 + 1, 0.25, 321.5 + 321.5, N, N, N, N),
    ),
    (
        "captured_smg_0.3.2_router_metrics.prom",
        "smg",
        state(ROUTER_KEYS, N, N, N, N, N, N, N, 4, N, N, 2, 2),
    ),
    (
        "synthetic_sglang_pd_decode_dp2.prom",
        "sglang",
        state(ENGINE_KEYS, 53, 4, 0.71, 2140.5, 901234 + 880001, 1843210, 9921040, 5120),
    ),
    (
        "synthetic_sglang_priority.prom",
        "sglang",
        state(ENGINE_KEYS, 12, 4, 0.33, N, N, 4000, N, N),
    ),
    (
        "synthetic_sglang_underscore.prom",
        "sglang",
        state(ENGINE_KEYS, 42, 6, 0.5, 900.0, N, 5100, 70200, 178),
    ),
    (
        "synthetic_smg_router.prom",
        "smg",
        state(ROUTER_KEYS, 60, 4, 0.7, 2440.0, N, 81234, 123456, 5015, 12, 300, 2, 3),
    ),
    (
        "synthetic_sgl_router_legacy.prom",
        "sgl_router",
        state(ROUTER_KEYS, N, N, N, N, N, N, N, 1350, 4, N, 2, 2),
    ),
    (
        "synthetic_vllm_dp2.prom",
        "vllm",
        state(ENGINE_KEYS, 8, 2, 0.42, N, 52453, 52453, 190000, 164),
    ),
    (
        "synthetic_llamacpp.prom",
        "llamacpp",
        state(ENGINE_KEYS, 2, 1, 0.25, 41.5, 2100, 2048, 8192, N),
    ),
    (
        "synthetic_sglang_nan.prom",
        "sglang",
        state(ENGINE_KEYS, N, 4, 0.5, N, N, N, 1000, N),
    ),
    (
        "synthetic_sglang_missing.prom",
        "sglang",
        state(ENGINE_KEYS, N, N, N, N, N, 77, 999, 3),
    ),
    ("synthetic_empty.prom", "unknown", state(ENGINE_KEYS, N, N, N, N, N, N, N, N)),
]


@pytest.mark.parametrize(("name", "profile", "expected"), EXPECTED, ids=[e[0] for e in EXPECTED])
def test_fixture_profile_and_state(name: str, profile: str, expected: dict[str, Any]) -> None:
    families = engines.parse(text(name))
    assert engines.detect_profile(families) == profile
    got = engines.normalise(families)
    assert got.profile == profile
    assert got.state == expected
    for key, value in got.state.items():  # counts are ints, like the capture example
        if key in ("running", "queued") or key.endswith("_total"):
            assert value is None or isinstance(value, int), key
    json.dumps(got.state)  # JSON-clean: no NaN, no infinities


def test_every_fixture_is_covered() -> None:
    covered = {e[0] for e in EXPECTED} | {
        "vllm_docs_design_metrics.prom",  # see test_vllm_docs_elisions_*
        "synthetic_garbage.prom",  # see test_garbage_*
    }
    assert {p.name for p in DATA.glob("*.prom")} == covered


# ---- summing rules -------------------------------------------------------------------


def test_dp_summed_tp_never_and_series_kept() -> None:
    got = reading("synthetic_sglang_pd_decode_dp2.prom")
    # tp_rank 0..3 all report; naive sums would give 106 running, and "tp_rank 0 only"
    # would lose dp_rank 1 (whose lowest rank is tp_rank 2).
    assert got.state["running"] == 30 + 23
    assert got.series == [
        {
            "labels": {"dp_rank": "0", "engine_type": "decode", "model_name": "qwen"},
            "running": 30,
            "queued": 3,
            "token_usage": 0.71,
            "gen_throughput": 1100.25,
            "decode_tokens_total": 901234,
        },
        {
            "labels": {"dp_rank": "1", "engine_type": "decode", "model_name": "qwen"},
            "running": 23,
            "queued": 1,
            "token_usage": 0.64,
            "gen_throughput": 1040.25,
            "decode_tokens_total": 880001,
        },
        {
            "labels": {"model_name": "qwen"},
            "generation_tokens_total": 1843210,
            "prompt_tokens_total": 9921040,
            "requests_total": 5120,
        },
    ]


def test_tp_rank_zero_preferred_when_values_differ() -> None:
    body = (
        'sglang:num_running_reqs{dp_rank="0",tp_rank="1"} 99\n'
        'sglang:num_running_reqs{dp_rank="0",tp_rank="0"} 5\n'
        'sglang:num_running_reqs{dp_rank="1",tp_rank="3"} 7\n'
        'sglang:num_running_reqs{dp_rank="1",tp_rank="2"} 6\n'
    )
    assert engines.read_metrics(body).state["running"] == 5 + 6


def test_priority_aggregate_not_double_counted() -> None:
    got = reading("synthetic_sglang_priority.prom")
    assert got.state["running"] == 12  # the priority="" aggregate, not 12 + 5 + 7
    assert got.state["queued"] == 3 + 1  # no aggregate: the per-priority series summed
    assert got.series[0] == {
        "labels": {"engine_type": "unified", "model_name": "llama"},
        "running": 12,
        "queued": 4,
        "token_usage": 0.33,
    }


def test_vllm_engines_summed_finish_reasons_summed_current_kv_name_wins() -> None:
    got = reading("synthetic_vllm_dp2.prom")
    assert got.state["token_usage"] == 0.42  # not the deprecated gpu_cache_usage_perc 0.99
    assert got.state["queued"] == 2  # num_requests_waiting_by_reason not added in
    assert [(s["labels"]["engine"], s["running"], s["requests_total"]) for s in got.series] == [
        ("0", 5, 1 + 131 + 0),
        ("1", 3, 10 + 20 + 2),
    ]


def test_both_spellings_give_the_same_reading() -> None:
    underscore = text("synthetic_sglang_underscore.prom")
    colon = underscore.replace("sglang_", "sglang:")
    assert "sglang_" not in colon
    a, b = engines.read_metrics(underscore), engines.read_metrics(colon)
    assert a == b
    assert engines.canonical_name("sglang_num_running_reqs") == "sglang:num_running_reqs"
    assert engines.canonical_name("vllm_num_requests_running") == "vllm:num_requests_running"
    assert engines.canonical_name("smg_worker_health") == "smg_worker_health"


def test_router_engine_metrics_keep_worker_labels() -> None:
    got = reading("captured_smg_0.3.2_engine_metrics.prom")
    assert [s["labels"]["worker_addr"] for s in got.series] == [
        "http://127.0.0.1:38111",
        "http://127.0.0.1:38114",
    ]
    assert all(s["running"] == 3 and s["labels"]["engine_type"] == "unified" for s in got.series)


def test_smg_router_figures_and_series() -> None:
    got = reading("synthetic_smg_router.prom")
    # in_flight from the HTTP in-flight age gauge (9 + 2 + 1), not the per-worker
    # requests (6 + 5 + 0); the oldest request is in the (300, 600] bucket.
    assert got.state["in_flight"] == 12
    assert got.state["in_flight_older_than"] == 300
    health = {s["labels"]["worker"]: s["health"] for s in got.series if "health" in s}
    assert health == {
        "grpc://10.0.0.1:30000": 1,
        "grpc://10.0.0.2:30000": 1,
        "grpc://10.0.0.3:30000": 0,
        "grpc://10.0.0.9:30000": -1,
    }
    engine_series = [s for s in got.series if "dp_rank" in s["labels"]]
    assert sum(s["running"] for s in engine_series) == 60
    assert got.freshness["in_flight"].startswith("gauge: the router's in-flight sampler")


def test_smg_in_flight_falls_back_to_worker_requests() -> None:
    body = "\n".join(
        line
        for line in text("synthetic_smg_router.prom").splitlines()
        if "inflight_request_age" not in line
    )
    got = engines.read_metrics(body)
    assert got.state["in_flight"] == 6 + 5 + 0
    assert got.state["in_flight_older_than"] is None


def test_sgl_router_legacy() -> None:
    got = reading("synthetic_sgl_router_legacy.prom")
    assert got.series == [
        {"labels": {"worker": "http://10.0.0.1:30000"}, "requests_total": 700, "in_flight": 4},
        {"labels": {"worker": "http://10.0.0.2:30000"}, "requests_total": 650, "in_flight": 0},
    ]
    assert "sent to workers" in got.freshness["requests_total"]


def test_a_router_port_that_also_reexports_engine_names_is_the_router() -> None:
    body = text("synthetic_smg_router.prom") + text("synthetic_sglang_pd_decode_dp2.prom")
    assert engines.detect_profile(engines.parse(body)) == "smg"


# ---- NaN, missing, empty, garbage ----------------------------------------------------


def test_nan_and_inf_are_none_and_a_partly_unknown_sum_is_unknown() -> None:
    got = reading("synthetic_sglang_nan.prom")
    assert got.state["running"] is None  # 30 + NaN is unknown, not 30
    assert got.state["token_usage"] == 0.5  # the max of what is known
    assert got.state["gen_throughput"] is None  # +Inf
    assert got.state["generation_tokens_total"] is None  # NaN counter
    assert got.series[1] == {
        "labels": {"dp_rank": "1", "engine_type": "unified", "model_name": "m"},
        "running": None,
        "queued": 0,
        "token_usage": None,
    }
    assert "running" not in got.freshness and "queued" in got.freshness
    json.dumps(got.series)


def test_missing_metrics_are_none() -> None:
    got = reading("synthetic_sglang_missing.prom")
    assert got.profile == "sglang"
    assert [k for k, v in got.state.items() if v is None] == [
        "running",
        "queued",
        "token_usage",
        "gen_throughput",
        "decode_tokens_total",
    ]
    assert set(got.freshness) == {
        "generation_tokens_total",
        "prompt_tokens_total",
        "requests_total",
    }


def test_empty_body() -> None:
    assert engines.parse("") == []
    got = engines.read_metrics("")
    assert got.profile == "unknown" and got.series == [] and got.freshness == {}
    assert set(got.state) == set(engines.STATE_KEYS)


def test_garbage_raises_a_clear_error() -> None:
    with pytest.raises(MetricsError, match=r"^line 1: '<html><head><title>502"):
        engines.parse(text("synthetic_garbage.prom"))
    families, skipped = engines.parse_lenient(text("synthetic_garbage.prom"))
    assert families == [] and len(skipped) == 2
    with pytest.raises(MetricsError):
        engines.parse("{}")
    with pytest.raises(MetricsError, match=r"line 2: 'foo 1 2 x'"):
        engines.parse("# comment\nfoo 1 2 x\n")


def test_vllm_docs_elisions_strict_fails_lenient_recovers() -> None:
    body = text("vllm_docs_design_metrics.prom")
    with pytest.raises(MetricsError, match=r"^line 5: '\.\.\.'"):
        engines.parse(body)
    families, skipped = engines.parse_lenient(body)
    assert [s.split(":")[0] for s in skipped] == ["line 5", "line 9", "line 15"]
    got = engines.normalise(families)
    assert got.profile == "vllm"
    assert got.state == state(ENGINE_KEYS, 8, N, N, N, 27453, 27453, N, 1 + 131 + 0)


# ---- profile override, raw, freshness ------------------------------------------------


def test_profile_override() -> None:
    families = engines.parse(text("synthetic_vllm_dp2.prom"))
    forced = engines.normalise(families, profile="sglang")
    assert forced.profile == "sglang"
    assert all(v is None for v in forced.state.values())
    with pytest.raises(ValueError, match="unknown engine profile 'tgi'"):
        engines.normalise(families, profile="tgi")


def test_raw_only_on_request_and_only_unknown_metrics() -> None:
    assert reading("vllm_v1_engine_label_thirdparty_trimmed.prom").raw is None
    raw = reading("vllm_v1_engine_label_thirdparty_trimmed.prom", keep_raw=True).raw
    assert raw is not None
    assert raw["python_gc_objects_collected_total"] == [
        {"labels": {"generation": "0"}, "value": 12345.0}
    ]
    assert "vllm:num_requests_running" not in raw  # used by the profile
    assert len(raw["vllm:time_to_first_token_seconds_bucket"]) == 1
    nan_raw = engines.read_metrics('odd{a="b"} NaN\n', keep_raw=True).raw
    assert nan_raw == {"odd": [{"labels": {"a": "b"}, "value": None}]}


def test_freshness_says_sglang_gauges_are_sampled_and_token_counters_finish_time() -> None:
    got = reading("synthetic_sglang_pd_decode_dp2.prom")
    assert got.freshness["running"] == "gauge: refreshed every 40 decode steps, ~30 s when idle"
    assert got.freshness["gen_throughput"] == got.freshness["running"]
    assert "when a request finishes" in got.freshness["generation_tokens_total"]
    assert engines.figure_timing("sglang", "running") == "sampled"
    assert engines.figure_timing("sglang", "generation_tokens_total") == "finish"
    assert engines.figure_timing("sglang", "requests_total") == "finish"
    assert engines.figure_timing("sglang", engines.PROGRESS_KEY) == "sampled"
    assert engines.figure_timing("vllm", "generation_tokens_total") == "live"
    assert engines.figure_timing("vllm", engines.PROGRESS_KEY) == "live"
    assert engines.figure_timing("llamacpp", "generation_tokens_total") == "finish"
    assert engines.figure_timing("llamacpp", engines.PROGRESS_KEY) == "live"
    assert engines.figure_timing("smg", engines.PROGRESS_KEY) is None
    assert engines.figure_timing("nope", "running") is None
    lc = reading("synthetic_llamacpp.prom").freshness
    assert "resets it on every scrape" in lc["gen_throughput"]


def test_series_are_bounded() -> None:
    body = "".join(f'sglang:num_running_reqs{{dp_rank="{i}"}} 1\n' for i in range(400))
    got = engines.read_metrics(body)
    assert got.state["running"] == 400
    assert len(got.series) == engines.MAX_SERIES


# ---- counters between scrapes --------------------------------------------------------


def test_counter_tracker_deltas_and_restart() -> None:
    tracker = CounterTracker()
    s1 = {"running": 3, "generation_tokens_total": 100, "prompt_tokens_total": 50}
    assert tracker.update("u", s1, 10.0) == ({}, None, False)
    s2 = {"running": 9, "generation_tokens_total": 160, "prompt_tokens_total": 50}
    assert tracker.update("u", s2, 11.5) == (
        {"generation_tokens_total": 60, "prompt_tokens_total": 0},
        1.5,
        False,
    )
    # one counter went down: the engine restarted, so no deltas at all this time
    s3 = {"generation_tokens_total": 5, "prompt_tokens_total": 70}
    assert tracker.update("u", s3, 12.5) == ({}, 1.0, True)
    s4 = {"generation_tokens_total": 25, "prompt_tokens_total": 70}
    assert tracker.update("u", s4, 13.0) == (
        {"generation_tokens_total": 20, "prompt_tokens_total": 0},
        0.5,
        False,
    )
    # URLs are independent; unknown (None / NaN) counters give no delta
    assert tracker.update("v", s1, 13.0) == ({}, None, False)
    s5 = {"generation_tokens_total": None, "prompt_tokens_total": 80.5}
    deltas, interval, restarted = tracker.update("u", s5, 14.0)
    assert deltas == {"prompt_tokens_total": 10.5} and interval == 1.0 and not restarted
    assert tracker.update("u", {"prompt_tokens_total": math.nan}, 15.0) == ({}, None, False)


def test_counter_tracker_on_readings() -> None:
    tracker = CounterTracker()
    before = reading("synthetic_sglang_pd_decode_dp2.prom")
    after = engines.read_metrics(
        text("synthetic_sglang_pd_decode_dp2.prom").replace(
            'sglang:num_requests_total{model_name="qwen"} 5120.0',
            'sglang:num_requests_total{model_name="qwen"} 5133.0',
        )
    )
    tracker.update("u", before.state, 1.0)
    deltas, _, _ = tracker.update("u", after.state, 2.0)
    assert deltas == {
        "decode_tokens_total": 0,
        "generation_tokens_total": 0,
        "prompt_tokens_total": 0,
        "requests_total": 13,
    }


# ---- SGLang /v1/loads and /get_load --------------------------------------------------

V1_LOADS = {
    "loads": [
        {
            "dp_rank": 0,
            "timestamp": 1796003000.1,
            "num_running_reqs": 30,
            "num_waiting_reqs": 3,
            "num_used_tokens": 90000,
            "num_total_tokens": 120000,
            "max_total_num_tokens": 128000,
            "token_usage": 0.71,
            "gen_throughput": 1100.25,
            "cache_hit_rate": 0.4,
            "utilization": 0.8,
            "max_running_requests": 64,
            "queues": {"waiting": 3, "grammar": 0, "paused": 0, "retracted": 0},
        },
        {
            "dp_rank": 1,
            "timestamp": 1796003000.1,
            "num_running_reqs": 23,
            "num_waiting_reqs": 1,
            "token_usage": 0.64,
            "gen_throughput": 1040.25,
        },
    ]
}


def test_parse_v1_loads() -> None:
    got = engines.parse_loads(V1_LOADS)
    assert got.profile == "sglang"
    assert got.state == state(ENGINE_KEYS, 53, 4, 0.71, 2140.5, N, N, N, N)
    assert got.series == [
        {
            "labels": {"dp_rank": "0"},
            "running": 30,
            "queued": 3,
            "token_usage": 0.71,
            "gen_throughput": 1100.25,
        },
        {
            "labels": {"dp_rank": "1"},
            "running": 23,
            "queued": 1,
            "token_usage": 0.64,
            "gen_throughput": 1040.25,
        },
    ]
    assert got.freshness["running"].startswith("live")
    assert engines.parse_loads(json.dumps(V1_LOADS).encode()) == got


def test_parse_old_get_load_list() -> None:
    old = [
        {"dp_rank": 0, "num_reqs": 33, "num_waiting_reqs": 3, "num_tokens": 9000, "ts_tic": 1.0},
        {"dp_rank": 1, "num_reqs": 24, "num_waiting_reqs": 1, "num_tokens": 8000, "ts_tic": 1.0},
    ]
    got = engines.parse_loads(json.dumps(old))
    assert got.state == state(ENGINE_KEYS, 30 + 23, 3 + 1, N, N, N, N, N, N)
    assert "get_load" in got.freshness["running"]
    single = engines.parse_loads({"num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 10})
    assert single.state["running"] == 3 and single.series == []


def test_parse_loads_rejects_other_shapes() -> None:
    with pytest.raises(MetricsError, match="not JSON"):
        engines.parse_loads(b"<html>")
    with pytest.raises(MetricsError, match="unrecognised"):  # the router's /get_loads
        engines.parse_loads({"workers": [{"worker": "http://w:1", "load": 3}]})
    with pytest.raises(MetricsError, match="not a list of objects"):
        engines.parse_loads({"loads": [1, 2]})
    with pytest.raises(MetricsError, match="no load figures"):
        engines.parse_loads([{"dp_rank": 0, "something": "else"}])
    empty = engines.parse_loads({"loads": []})
    assert all(v is None for v in empty.state.values())
