"""`tracer top`: the view rendered from a recorded ``/status``, deterministic."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from tests.support.text import line_with
from tracer.present.top import render, render_text, status_url

# ---- rendering is a pure function of /status ------------------------------------------

RECORDED = json.loads(
    """{
 "tap": "front", "upstream": "http://127.0.0.1:30000", "uptime": 3725.5,
 "connections": [
  {"conn": 7, "peer": "[::1]:51234", "age": 12.5, "requests": 4, "idle": 0.0,
   "in_flight": [{"seq": 4, "method": "POST", "status": 200, "events": 12,
     "response_bytes": 5120, "stalled": "upstream_silent", "age": 9.25,
     "last_byte_age": 8.0, "request": "POST /v1/chat/completions",
     "request_id": "[rid-9]"}],
   "bytes_from_client": 4096, "bytes_from_upstream": 20480},
  {"conn": 3, "peer": "127.0.0.1:40000", "age": 65.0, "requests": 1, "idle": 30.5,
   "in_flight": [], "bytes_from_client": 900, "bytes_from_upstream": 3000},
  {"conn": 9, "peer": "127.0.0.1:40002", "age": 2.0, "requests": 1, "idle": 0.0,
   "in_flight": [{"seq": 1, "method": "POST", "status": null, "events": 0,
     "response_bytes": 0, "stalled": null, "age": 0.4, "last_byte_age": 0.4,
     "request": "POST /v1/completions", "request_id": null}],
   "bytes_from_client": 300, "bytes_from_upstream": 0}
 ],
 "stall_after": 5.0,
 "totals": {"connections": 9, "connections_open": 3, "requests": 20, "in_flight": 2,
   "stalls_active": 1, "terminations": {"complete": 17, "truncated": 1},
   "stalls": {"upstream_silent": 2}, "anomalies": 0, "upstream_connect_failures": 0},
 "engines": [{"url": "http://10.0.0.5:30000/metrics", "profile": "sglang", "ok": true,
   "age": 0.3, "error": null, "running": 53, "queued": 4, "token_usage": 0.81,
   "gen_throughput": 1900.0, "in_flight": null, "tokens_per_s": 2012.5}],
 "recent": [
  {"age": 4.0, "kind": "stall", "conn": 7, "seq": 4,
   "detail": "upstream_silent, no bytes for 5.0s"},
  {"age": 50.0, "kind": "truncated", "conn": 2, "seq": 3,
   "detail": "HTTP 200, 812 bytes after 1.2s (reset)"},
  {"age": 70.0, "kind": "mark", "conn": null, "seq": null, "detail": "[harness stuck]"}
 ]
}"""
)


def test_render_from_a_recorded_status_is_deterministic() -> None:
    text = render_text(RECORDED, width=140)
    assert render_text(json.loads(json.dumps(RECORDED)), width=140) == text
    assert text.splitlines()[0] == (
        "tracer top · tap front -> http://127.0.0.1:30000 · up 1h02m · stall after 5.0s"
    )
    assert "connections 3 open / 9 total · requests 20 · in flight 2 · STALLED 1" in text
    # brackets are text, not markup: the peer, the request id, the mark's note
    assert "[::1]:51234" in text and "[rid-9]" in text and "[harness stuck]" in text
    stalled = line_with(text, "[rid-9]").split()
    assert stalled[:2] == ["7", "4"] and stalled[6:9] == ["9.2s", "8.0s", "ago"]
    assert "STALLED" in stalled
    assert line_with(text, "/v1/completions").split()[-3:] == ["waiting", "for", "head"]
    engine = line_with(text, "10.0.0.5").split()
    assert engine[2:6] == ["53", "4", "81%", "2012.5"]
    idle = line_with(text, "127.0.0.1:40000").split()
    assert idle[3:7] == ["1", "0x", "idle", "30.5s"]
    # the busiest first: stalled before waiting; active connections before idle ones
    assert text.index("[rid-9]") < text.index("/v1/completions")
    assert text.index("[::1]:51234") < text.index("127.0.0.1:40000")
    assert re.search(r"4\.0s ago\s+stall\s+conn 7 #4", text)
    assert re.search(r"50\.0s ago\s+truncated\s+conn 2 #3", text)

    # in colour too, the same document draws the same view
    def coloured() -> str:
        out = io.StringIO()
        Console(file=out, width=140, force_terminal=True, color_system="truecolor").print(
            render(RECORDED)
        )
        return out.getvalue()

    assert coloured() == coloured() and "\x1b[" in coloured()


def test_render_caps_long_tables_and_copes_with_an_empty_tap() -> None:
    text = render_text(RECORDED, limit=1)
    assert "... and 2 more" in text  # connections: 3, one shown
    assert "... and 1 more" in text  # in flight: 2, one shown
    empty = render_text({"tap": "t", "upstream": "http://u:1", "uptime": 1, "connections": []})
    assert "requests in flight: none" in empty and "connections: none open" in empty
    assert "recent findings: none" in empty


def test_a_tap_injecting_faults_says_so_on_top() -> None:
    faults = {"faults": ["status:503@every=2"], "control": True, "injected": {"status": 3}}
    status = {"tap": "t", "upstream": "http://u:1", "uptime": 1, "connections": []}
    recent = [{"age": 2.0, "kind": "fault_plan", "detail": "replace: status:503@every=2"}]
    text = render_text({**status, "faults": faults, "recent": recent}, width=140)
    assert text.splitlines()[0].endswith("· injecting status:503@every=2")
    assert re.search(r"2\.0s ago\s+fault_plan\s+replace: status:503@every=2", text)
    assert "injecting" not in render_text({**status, "faults": {"faults": []}}, width=140)


def test_status_url() -> None:
    assert status_url("127.0.0.1:9100") == "http://127.0.0.1:9100/status"
    assert status_url("http://localhost:9100/") == "http://localhost:9100/status"
    assert status_url("[::1]:9100") == "http://[::1]:9100/status"
    with pytest.raises(ValueError):
        status_url("9100")
