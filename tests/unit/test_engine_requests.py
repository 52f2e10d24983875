"""The engines' own per-request records (issue 37, point 3): the two formats read from
files written with the engines' real field names (``tests/data/engine_requests/``), the
join to the rows by request id and by trace id, the findings that quote and decide, and
the scenario the records settle. Kinds and fields are asserted, never sentences."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_findings import ROUTER, Cap, analyze
from tests.unit.test_scenarios import SCENARIOS
from tests.unit.test_scenarios import analyze as analyze_case
from tracer.capture.files import CaptureError
from tracer.evidence.engine_requests import (
    EngineRequest,
    EngineRequestsError,
    read_engine_requests,
)

DATA = Path(__file__).parent.parent / "data" / "engine_requests"
SGLANG = DATA / "sglang-request-metrics-20260101_00.log"
OTLP = DATA / "vllm.otlp.json"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_sglang_request_metrics_are_read_with_their_fields() -> None:
    got = read_engine_requests(SGLANG)
    assert (got.format, len(got.records), got.bad_lines) == ("sglang", 3, 1)
    assert got.first_bad is not None and got.first_bad.startswith("line 2")
    first, queued, aborted = got.records
    assert first.request_id == "req-1" and first.finish == "stop" and first.answered()
    assert first.queued == pytest.approx(0.002)
    assert first.ttft == pytest.approx(0.05, abs=1e-3)  # prefill_finished_time - received
    assert first.e2e == pytest.approx(0.3, abs=1e-3)
    assert (first.prompt_tokens, first.output_tokens) == (12, 8)
    assert queued.queued == pytest.approx(30.5) and queued.finish == "length"
    assert aborted.finish == "abort" and not aborted.answered() and aborted.ttft is None


def test_the_export_folder_reads_its_hourly_files() -> None:
    got = read_engine_requests(DATA)  # SGLang's --export-metrics-to-file-dir
    assert got.format == "sglang" and len(got.records) == 3


def test_vllm_spans_in_otlp_json_are_read_with_their_fields() -> None:
    got = read_engine_requests(OTLP)
    assert (got.format, len(got.records), got.bad_lines, got.spans_skipped) == ("vllm", 3, 1, 1)
    span, queued, aborted = got.records
    assert span.request_id == "chatcmpl-req-7" and "req-7" in span.ids()
    assert span.trace_id == TRACE and span.service == "vllm"
    assert span.finish == "stop"  # gen_ai.response.finish_reasons: '["stop"]'
    assert span.e2e == pytest.approx(2.1, abs=1e-3)
    assert span.ttft == pytest.approx(0.04, abs=1e-3)
    assert queued.queued == pytest.approx(29.5) and queued.finish == "length"
    assert aborted.status == "error" and not aborted.answered()


def test_a_file_of_neither_format_is_an_input_error_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(EngineRequestsError) as caught:
        read_engine_requests(DATA / "neither.jsonl")
    assert isinstance(caught.value, CaptureError)  # exit 3, as a file that is no capture
    assert "\n" not in str(caught.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert read_engine_requests(empty).records == []
    with pytest.raises(EngineRequestsError):
        read_engine_requests(tmp_path / "missing.jsonl")


def test_garbage_and_odd_values_are_counted_never_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "odd.jsonl"
    lines = [
        {"id": "a", "request_received_ts": "nan", "e2e_latency": -3, "finish_reason": None},
        {"id": "b", "request_received_ts": 1767225600.5, "queue_time": "x", "finish_reason": 7},
        [1, 2],
        {"resourceSpans": []},  # the other format in an SGLang file
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\x00\xff\n")
    got = read_engine_requests(path)
    assert got.format == "sglang" and [r.request_id for r in got.records] == ["a", "b"]
    assert got.records[0].received is None and got.records[0].e2e is None
    assert got.records[1].queued is None and got.bad_lines == 3


# -- joined to the rows: the engine's account, and what it decides --------------------------


def _record(rid: str | None, **kw: Any) -> EngineRequest:
    base: dict[str, Any] = {"engine": "vllm", "source": "spans.json:1", "request_id": rid}
    return EngineRequest(**(base | kw))


def _by_kind(result: dict[str, Any], kind: str) -> dict[str, Any]:
    (f,) = [f for f in result["findings"] if f["kind"] == kind]
    return f


def _account(f: dict[str, Any]) -> dict[str, Any]:
    (item,) = [e for e in f["evidence"] if "joined_by" in e["figures"]][:1]
    return item["figures"]


def test_the_engine_finished_it_while_nothing_came_back_is_after_the_engine() -> None:
    cap = Cap()  # front -> a proxy
    cap.exchange(1, 1, 0.0, rid="ok-1")
    cap.exchange(2, 1, 1.0, rid="held", end=None)
    cap.stall(2, 1, 1.0, None)
    cap.exchange(3, 1, 2.0, rid="ok-2")
    records = [
        _record(
            "chatcmpl-held",
            received=1001.0,
            queued=0.01,
            first_token=1001.05,
            finished=1003.1,
            e2e=2.1,
            finish="stop",
            output_tokens=64,
        ),
    ]
    before = analyze(cap)
    assert before["verdict"]["party"] == "unknown"
    result = analyze(cap, engine_requests=records)
    f = _by_kind(result, "lost_after_engine")
    assert (f["party"], f["requests"]) == ("proxy", ["front/2/1"])
    assert result["verdict"]["kind"] == "lost_after_engine"
    account = _account(f)
    assert account["finish"] == "stop" and account["e2e_s"] == pytest.approx(2.1)
    assert account["joined_by"] == "request_id"  # x-request-id held = chatcmpl-held
    assert account["queue_s"] == pytest.approx(0.01) and account["ttft_s"] == pytest.approx(0.05)
    assert {r["party"] for r in f["ruled_out"]} == {"engine"}
    assert result["evidence"]["engine_requests"] == {"records": 1, "joined": 1}


def test_a_request_the_engine_queued_is_load_joined_by_trace_id() -> None:
    cap = Cap(upstream=ROUTER)
    parent = [["traceparent", f"00-{TRACE}-b7ad6b7169203331-01"]]
    cap.exchange(1, 1, 0.0, end=None, headers=parent)  # no x-request-id: the trace joins it
    cap.stall(1, 1, 0.0, None)
    records = [_record(None, trace_id=TRACE, received=1000.0, queued=30.0)]  # still queued
    result = analyze(cap, engine_requests=records)
    f = _by_kind(result, "engine_queued")
    assert f["note"] and f["party"] == "engine" and f["requests"] == ["front/1/1"]
    account = _account(f)
    assert account["joined_by"] == "trace_id" and account["queue_s"] == 30.0
    assert result["verdict"]["party"] == "none"  # busy is not broken


def test_no_record_while_the_requests_around_it_have_one_is_before_the_engine() -> None:
    cap = Cap()
    cap.exchange(1, 1, 0.0, rid="r1")
    cap.exchange(2, 1, 1.0, rid="lost", end="client_abort", ttfb=None, duration=8.0)
    cap.stall(2, 1, 1.0, 9.0)
    cap.exchange(3, 1, 2.0, rid="r3")
    cap.exchange(4, 1, 12.0, rid="r4")  # after its client left: the engine took it
    records = [
        _record(f"chatcmpl-{rid}", received=1000.0 + t, finished=1000.3 + t, finish="stop")
        for rid, t in (("r1", 0.0), ("r3", 2.0), ("r4", 12.0))
    ]
    result = analyze(cap, engine_requests=records)
    f = _by_kind(result, "lost_before_engine")
    assert (f["party"], f["confidence"], f["requests"]) == ("proxy", "high", ["front/2/1"])
    (item,) = [e for e in f["evidence"] if e["figures"].get("engine_record") is False]
    assert item["figures"]["recorded_before"] == 1 and item["figures"]["overtaken"] >= 1
    assert item["figures"]["client_left"] is True
    # without the request after the give-up, an engine that still held it unfinished
    # would have no record either: low, and the engine not ruled out
    result = analyze(cap, engine_requests=records[:2])
    f = _by_kind(result, "lost_before_engine")
    assert f["confidence"] == "low" and not f["ruled_out"]
    # ... unless the engine's live figures say it held nothing then: medium
    for t in range(2, 10):
        cap.engine(float(t), running=0, url="http://127.0.0.1:8000/metrics", profile="vllm")
    result = analyze(cap, engine_requests=records[:2])
    f = _by_kind(result, "lost_before_engine")
    assert f["confidence"] == "medium" and [r["party"] for r in f["ruled_out"]] == ["engine"]
    assert [e for e in f["evidence"] if e["figures"].get("engine_counted") == 0]


def test_records_that_decide_nothing_are_quoted_in_the_finding() -> None:
    cap = Cap()
    cap.exchange(1, 1, 0.0, rid="cut", end="truncated", events=3)
    records = [_record("cut", received=1000.0, finish="abort", queued=0.0, e2e=0.1)]
    result = analyze(cap, engine_requests=records)
    quoted = [
        f for f in result["findings"] if any("joined_by" in e["figures"] for e in f["evidence"])
    ]
    assert quoted and all(
        f["kind"] not in ("lost_after_engine", "lost_before_engine") for f in quoted
    )
    assert _account(quoted[0])["finish"] == "abort"


def test_without_records_nothing_changes() -> None:
    cap = Cap()
    cap.exchange(1, 1, 0.0, rid="a", end=None)
    cap.stall(1, 1, 0.0, None)
    assert analyze(cap) == analyze(cap, engine_requests=[])


# -- the scenario the records settle ----------------------------------------------------------


CASE = SCENARIOS / "hop_swallows_large_bodies_engine_records"


@pytest.mark.parametrize("records", [["engine.sglang.jsonl"], ["engine.spans.json"]])
def test_the_records_settle_what_the_counters_left_unknown(records: list[str]) -> None:
    before = analyze_case(CASE, ["front.jsonl"], engine_requests=[])
    assert (before["verdict"]["party"], before["verdict"]["kind"]) == ("unknown", "upstream_silent")
    after = analyze_case(CASE, ["front.jsonl"], engine_requests=records)
    v = after["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "lost_before_engine")
    (f,) = [f for f in after["findings"] if f["id"] == v["finding"]]
    assert sorted(f["requests"]) == ["front/1/5", "front/4/1"]  # the two 64 KB bodies
    assert not [x for x in after["findings"] if x["kind"].startswith("engine_") and not x["note"]]
