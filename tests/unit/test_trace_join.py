"""Trace context from the traffic: every row carries the client's trace, and its copies
at the other taps with what joined them — the trace id first, where it is one request's."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_findings import Cap, analyze
from tracer.protocol.trace_context import TraceContext, parse_traceparent

A = "4bf92f3577b34da6a3ce929d0e0e4736"
B = "0af7651916cd43dd8448eb211c80319c"


def parent(trace: str, span: str = "00f067aa0ba902b7") -> list[list[str]]:
    return [["traceparent", f"00-{trace}-{span}-01"], ["tracestate", "vendor=x"]]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("00-" + A + "-00f067aa0ba902b7-01", None),
        ("01-" + A + "-00f067aa0ba902b7-01-later-fields", None),  # a later version's extra
        ("00-" + A.upper() + "-00f067aa0ba902b7-01", "malformed traceparent"),
        ("ff-" + A + "-00f067aa0ba902b7-01", "traceparent version ff is invalid"),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", "traceparent trace-id is all zeros"),
        ("00-" + A + "-" + "0" * 16 + "-01", "traceparent parent-id is all zeros"),
        ("00-" + A + "-00f067aa0ba902b7-01-x", "traceparent version 00 with extra fields"),
        ("00-" + A[:-1] + "-00f067aa0ba902b7-01", "malformed traceparent"),
        ("", "malformed traceparent"),
    ],
)
def test_traceparent_is_read_by_the_recommendations_grammar(value: str, why: str | None) -> None:
    got = parse_traceparent(value, "congo=t61rcWkgMzE")
    if why is None:
        assert isinstance(got, TraceContext) and got.trace_id == A and got.sampled
        assert got.parent_span_id == "00f067aa0ba902b7" and got.tracestate == "congo=t61rcWkgMzE"
    else:
        assert got == why


def _rows(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in result["requests"]}


def test_two_taps_join_by_the_clients_trace_id_where_content_would_cross_them() -> None:
    """Two requests with the same body reach the tap behind in the other order: by
    occurrence they would cross; by trace id each finds its own copy."""
    front, back = Cap("front"), Cap("back")
    front.exchange(1, 1, 1.000, headers=parent(A))
    front.exchange(2, 1, 1.001, headers=parent(B))
    back.exchange(1, 1, 1.002, headers=parent(B))
    back.exchange(2, 1, 1.003, headers=parent(A))
    result = analyze(front, back)
    rows = _rows(result)
    assert rows["front/1/1"]["trace_id"] == A and rows["front/1/1"]["parent_span_id"]
    assert rows["front/1/1"]["copies"] == ["back/2/1"]
    assert rows["front/2/1"]["copies"] == ["back/1/1"]
    assert rows["back/1/1"]["copies"] == ["front/2/1"]
    assert {r["joined_by"] for r in rows.values()} == {"trace_id"}
    [pair] = result["evidence"]["tap_pairs"]
    assert pair["joined_by"] == {"trace_id": 2}


def test_a_trace_id_a_tap_saw_twice_joins_by_what_comes_next() -> None:
    """One trace for a whole session: it is no request's own, so the request id joins."""
    front, back = Cap("front"), Cap("back")
    for seq, rid in ((1, "r1"), (2, "r2")):
        front.exchange(1, seq, float(seq), rid=rid, headers=parent(A, f"{seq:016x}"))
        back.exchange(1, seq, seq + 0.002, rid=rid, headers=parent(A, f"{seq:016x}"))
    rows = _rows(analyze(front, back))
    assert rows["front/1/2"]["copies"] == ["back/1/2"]
    assert {r["joined_by"] for r in rows.values()} == {"request_id"}
    assert {r["trace_id"] for r in rows.values()} == {A}  # still carried by every row


def test_a_malformed_traceparent_is_an_anomaly_never_a_trace() -> None:
    cap = Cap("front")
    cap.exchange(1, 1, 1.0, headers=[["traceparent", "00-" + "0" * 32 + "-00f067aa0ba902b7-01"]])
    result = analyze(cap)
    [row] = result["requests"]
    assert row["trace_id"] is None and row["trace_error"] == "traceparent trace-id is all zeros"
    [conn] = result["connections"]
    assert any("trace-id is all zeros" in a for a in conn["anomalies"])
    assert row["copies"] == [] and row["joined_by"] is None
