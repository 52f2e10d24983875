"""`tracer analyze` for people: compact tables that fit, --brief, filters, relative times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracer.cli import commands as cli

SCENARIOS = Path(__file__).parent.parent / "data" / "scenarios"
NGINX = sorted(str(p) for p in (SCENARIOS / "nginx_buffered_http10").glob("*.jsonl"))


def analyze(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli.main(["analyze", *args]) == 0
    return capsys.readouterr().out


def test_piped_text_fits_120_columns_and_quotes_no_epoch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = analyze(capsys, *NGINX)
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 120
    assert "t=17" not in out and out.startswith("captures 20")  # the absolute time once
    wide = analyze(capsys, *NGINX, "--wide")
    assert "bytes c->u" in wide and "bytes c->u" not in out


def test_brief_is_the_verdict_and_findings(capsys: pytest.CaptureFixture[str]) -> None:
    out = analyze(capsys, *NGINX, "--brief")
    assert "VERDICT: proxy" in out and "F1 [proxy, high] buffered_response" in out
    assert "━" not in out and "terminations:" not in out  # no totals, no tables


def test_filters_choose_rows_and_findings_not_the_verdict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = json.loads(analyze(capsys, *NGINX, "--format", "json", "--id", "n2"))
    assert {r["request_id"] for r in doc["requests"]} == {"n2"}
    assert {c["id"] for c in doc["connections"]} == {"front/1", "back/5"}
    assert doc["verdict"]["kind"] == "buffered_response" and doc["totals"]["requests"] == 11
    assert doc["filter"]["ids"] == ["n2"]
    doc = json.loads(analyze(capsys, *NGINX, "--format", "json", "--tap", "back"))
    assert doc["requests"] and all(r["tap"] == "back" for r in doc["requests"])
    late = json.loads(analyze(capsys, *NGINX, "--format", "json", "--since", "+6.5"))
    assert late["requests"] and all(r["start"] + r["duration"] >= late["filter"]["since"]
                                    for r in late["requests"])  # fmt: skip
    assert len(late["requests"]) < len(doc["requests"]) + 4
    none = json.loads(analyze(capsys, *NGINX, "--format", "json", "--conn", "front/9"))
    assert none["requests"] == [] and none["findings"] == []
    assert "filter: id n2: 2 requests, 2 connections" in analyze(capsys, *NGINX, "--id", "n2")


def test_json_gives_iso_times_beside_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(analyze(capsys, *NGINX, "--format", "json"))
    assert doc["time_range"]["start_iso"].endswith("Z")
    assert all(f["t_iso"].startswith("20") for f in doc["findings"] if f["t"] is not None)
