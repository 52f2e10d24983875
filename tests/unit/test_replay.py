"""`tracer replay --only`: which connections, requests and ids it selects."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.captures import slow_reader_capture
from tracer.tools.replay import plan
from tracer.tools.replay_compare import load, parse_only


def test_only_selects_connections_requests_and_ids(tmp_path: Path) -> None:
    original = tmp_path / "slow.jsonl"
    slow_reader_capture(original)
    capture = load(original)
    [job] = plan(capture, parse_only([]), fresh=False)
    assert [r.seq for r in job.requests] == [1, 2]
    assert job.gaps == [pytest.approx(0.001), pytest.approx(0.04)]
    # a later request alone: its connection opens when that request was sent
    [job] = plan(capture, parse_only(["req=1:2"]), fresh=False)
    assert [r.seq for r in job.requests] == [2]
    assert job.gaps == [0.0]
    [job] = plan(capture, parse_only(["req=orig/1/2"]), fresh=False)  # an analysis id
    assert [r.seq for r in job.requests] == [2]
    [job] = plan(capture, parse_only(["req=1:1-2"]), fresh=False)
    assert [r.seq for r in job.requests] == [1, 2]
    assert plan(capture, parse_only(["id=nothing-*"]), fresh=False) == []
    for bad, message in (
        ("conn", "expected KEY=VALUE"),
        ("req=3", "is not CONN:SEQ"),
        ("req=1:0", "is not a number >= 1"),
        ("req=1:3-2", "empty range"),
        ("path=/v1", "unknown key 'path'"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_only([bad])
    with pytest.raises(ValueError, match=r"no connection 7 \(it has 1-1\)"):
        parse_only(["conn=7"]).check(capture)
    with pytest.raises(ValueError, match="connection 1 has 2 requests"):
        parse_only(["req=1:5"]).check(capture)
    with pytest.raises(ValueError, match="no request has an x-request-id matching"):
        parse_only(["id=s9-*"]).check(capture)
