"""The attribution scenario matrix (issue 23): captures recorded once from real processes.

Each directory of ``tests/data/scenarios/`` holds the captures of one case (recorded by
``python -m tests.scenarios.record``: the simulated SGLang engine with SGLang's token
counting, taps, smg, nginx, haproxy, the openai SDK) and an ``expect.json``: the verdict
the analysis must reach (party, kind, optionally confidence), kinds that must not appear
(``fnmatch`` patterns), findings that must (notes included), and whether any fault at all
is allowed. The analysis runs in-process, as ``tracer analyze --format json`` runs it.
Only kinds and fields are asserted, never sentences.
"""

from __future__ import annotations

import json
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest

from tracer.analysis.summary import Summary
from tracer.capture.files import read_into
from tracer.evidence.engine_requests import read_engine_requests
from tracer.times import parse_time

SCENARIOS = Path(__file__).parent.parent / "data" / "scenarios"
CASES = sorted(p.parent.name for p in SCENARIOS.glob("*/expect.json"))


def analyze(
    case: Path,
    captures: list[str],
    hang_at: list[str] | None = None,
    engine_requests: list[str] | None = None,
) -> dict[str, Any]:
    """What ``tracer analyze CAPTURE... --format json [--hang-at T ...] [--engine-requests
    FILE ...]`` computes (tracer/present/analyze.py), in-process; ``engine_requests``
    defaults to the case's own (``expect.json``)."""
    if engine_requests is None and (case / "expect.json").exists():
        engine_requests = json.loads((case / "expect.json").read_text()).get("engine_requests")
    records = [
        x for name in engine_requests or [] for x in read_engine_requests(case / name).records
    ]
    with Summary() as summary:
        infos = [read_into(case / name, summary.feed).describe(name) for name in captures]
        marks = [parse_time(t, summary.first_t, summary.last_t) for t in hang_at or []]
        result = summary.result(captures=infos, hang_at=marks, engine_requests=records)
        return {
            "verdict": dict(result["verdict"]),
            "findings": [dict(f) for f in result["findings"]],
            "requests": len(result["requests"]),
            "chain": result["topology"].get("chain"),
            "mark_states": result["evidence"]["mark_states"],
        }


def brief(findings: list[dict[str, Any]]) -> list[tuple[str, str, str, bool]]:
    return [(f["party"], f["kind"], f["confidence"], bool(f.get("note"))) for f in findings]


@pytest.mark.parametrize("name", CASES)
def test_scenario(name: str) -> None:
    case = SCENARIOS / name
    expect = json.loads((case / "expect.json").read_text())
    result = analyze(case, expect["captures"], expect.get("hang_at"))
    verdict, findings = result["verdict"], result["findings"]
    assert result["requests"] > 0
    shown = (verdict, brief(findings))

    want = expect["verdict"]
    kinds = want["kind"] if isinstance(want["kind"], list) else [want["kind"]]
    assert verdict["party"] == want["party"], shown
    assert verdict["kind"] in kinds, shown
    if "confidence" in want:
        assert verdict["confidence"] == want["confidence"], shown
    if want["party"] != "none":  # the verdict names its finding, which says the same
        (chosen,) = [f for f in findings if f["id"] == verdict["finding"]]
        assert (chosen["party"], chosen["kind"]) == (verdict["party"], verdict["kind"])
        assert chosen["requests"] and chosen["evidence"]

    if "chain" in expect:  # the hops the analysis believes in
        assert result["chain"] == expect["chain"], result["chain"]
    for pattern in expect["forbidden"]:
        bad = [f for f in findings if fnmatch(f["kind"], pattern)]
        assert not bad, (pattern, shown)
    for need in expect["required"]:
        found = [
            f
            for f in findings
            if f["party"] == need["party"]
            and f["kind"] == need["kind"]
            and bool(f.get("note")) == bool(need.get("note"))
        ]
        assert found, (need, shown)
    if want["party"] != "none":
        (chosen,) = [f for f in findings if f["id"] == verdict["finding"]]
        # one story: no fault finding rules out the verdict's party for its requests
        assert "contradicted_by" not in verdict, shown
        for name in expect.get("idle_connections", []):  # the connections that went quiet
            assert name in chosen["connections"], (name, chosen["connections"])
        separating = {
            feature for e in chosen["evidence"] for feature in e["figures"].get("separating", [])
        }
        for feature in expect.get("separating", []):  # what set the failed requests apart
            assert feature in separating, (feature, shown)
    if expect.get("hang_at"):  # the mark answered: never healthy, every connection's state
        assert verdict["kind"] != "healthy", shown
        assert result["mark_states"] and all(m["connections"] for m in result["mark_states"])
    if expect["no_faults"]:
        assert [f for f in findings if not f.get("note")] == [], shown
    for f in findings:  # each a sentence of why, and evidence items with their fields
        assert f["summary"].strip(), f
        for e in f["evidence"]:
            assert set(e) == {"text", "t", "tap", "request", "figures"} and e["text"], e
            assert e["request"] is None or e["request"].startswith(f"{e['tap']}/"), e
