"""The mitmproxy addon (addons/trace.py): hook by hook, and in parity with the native tap.

The parity test drives one scenario — a multi-round openai-SDK harness on keep-alive
connections, a stall, a truncation and a client abort — through the native tap and
through ``mitmdump -s addons/trace.py --mode reverse:...`` (a real process), and asserts
that ``tracer analyze --format json`` gives the same per-request table once timing
fields (and the two things mitmproxy cannot show: FIN vs reset, its own error wording)
are dropped.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from mitmproxy import http
from mitmproxy.io import FlowReader

from tests.support.analyze import analyze_json
from tests.support.engine import chat_request, engine_running
from tests.support.net import recv_all, recv_until, wait_until
from tests.support.procs import count_records, mitmdump
from tests.support.tap import running_tap, wait_closed
from tracer import events as ev
from tracer.capture.files import read_records
from tracer.faults.plan import parse_fault
from tracer.sim.harness import HarnessConfig, run_harness

pytestmark = pytest.mark.e2e


# ---- parity with the native tap: real processes on 127.0.0.1 --------------------------------


CONNECTIONS = 5  # two harness sessions, one keep-alive client, a truncation, an abort


async def stream_chat(
    client: httpx.AsyncClient, body: dict[str, Any], rid: str, fault: str
) -> tuple[int, bytes]:
    """One streamed chat completion, with the simulated engine's fault switch; its status
    and body."""
    headers = {"x-request-id": rid, "x-sim-fault": fault}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        data = b"".join([chunk async for chunk in resp.aiter_bytes()])
    return resp.status_code, data


async def scenario(url: str, all_closed: Callable[[], Awaitable[None]]) -> None:
    """The same traffic for each tap; returns when the tap has seen every connection end."""
    report = await run_harness(
        HarnessConfig(base_url=url, sessions=2, rounds=3, think=0.05, max_tokens=6, deadline=10)
    )
    assert not report.failed and not report.not_run, report
    body = {
        "model": "sim-model",
        "max_tokens": 6,
        "stream": True,
        "messages": [{"role": "user", "content": "one connection, three requests"}],
    }
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        for rid, fault in (
            ("keep-1", "none"),
            ("keep-2", "stall:after=2:for=1.2"),
            ("keep-3", "none"),
        ):
            status, data = await stream_chat(client, body, rid, fault)
            assert status == 200 and data.endswith(b"data: [DONE]\n\n")
    port = int(url.rsplit(":", 1)[1])
    async with await anyio.connect_tcp("127.0.0.1", port) as s:  # the upstream cuts it
        await s.send(
            chat_request(6, headers={"x-request-id": "cut", "x-sim-fault": "close:after=2"})
        )
        data, _ = await recv_all(s, timeout=10)
    assert b"[DONE]" not in data and b"tok1" in data
    async with await anyio.connect_tcp("127.0.0.1", port) as s:  # the client gives up
        await s.send(chat_request(50, headers={"x-request-id": "abort", "x-sim-itl": "0.01"}))
        await recv_until(s, lambda b: b.count(b'"content":"tok') >= 2, timeout=10)
    await all_closed()


IDENTITY = {"id", "tap", "conn", "request_id"}


# counts that come from timing: how many gaps between events were under a threshold
TIMING_COUNTS = {"zero_gaps", "bunch_gaps"}


# the client that gives up closes after its second token: how many more each tap saw
# before the close is a race (3 or 4 events under load), not a difference of the taps
ABORT_COUNTS = {"events", "response_bytes", "event_gaps", "max_event_bytes"}

# what mitmproxy cannot show (FIN vs reset) and each tap's own wording of an end
NOT_COMPARABLE = {"close", "detail"}


def untimed(row: dict[str, Any]) -> dict[str, Any]:
    """A request row without timing (every float is a time or a duration), identities and
    tap-specific wording; stalls keep only their direction."""
    out = {
        k: v
        for k, v in row.items()
        if k not in IDENTITY | TIMING_COUNTS | NOT_COMPARABLE and not isinstance(v, float)
    }
    out["stalls"] = [s["direction"] for s in row["stalls"]]
    return out


def label(request_id: str) -> str:
    """``s1-r2-1a2b3c4d`` (the harness adds a random suffix) -> ``s1-r2``."""
    return request_id.rsplit("-", 1)[0] if request_id.startswith("s") else request_id


Tables = tuple[dict[str, Any], dict[tuple[str, ...], dict[str, Any]], list[tuple[Any, ...]]]


def tables(capture: Path) -> Tables:
    """Per-request rows by label, per-connection rows by the labels they carried, and the
    findings (kind, party, confidence, the labels they name), the verdict's first."""
    doc = analyze_json(capture)
    requests: dict[str, Any] = {}
    on_conn: dict[int, list[tuple[int, str]]] = defaultdict(list)
    labels: dict[str, str] = {}
    for row in doc["requests"]:
        key = label(row["request_id"])
        assert key not in requests
        requests[key] = untimed(row)
        on_conn[row["conn"]].append((row["seq"], key))
        labels[row["id"]] = key
    conns = {}
    for c in doc["connections"]:
        keys = tuple(k for _, k in sorted(on_conn[c["conn"]]))
        conns[keys] = {
            "requests": c["requests"],
            "closed_by": c["closed_by"],
            "in_flight_at_close": c["in_flight_at_close"],
        }
    findings = [
        (f["kind"], f["party"], f["confidence"], tuple(labels[i] for i in f["requests"]))
        for f in doc["findings"]
    ]
    return requests, conns, findings


@pytest.mark.anyio
async def test_parity_with_the_native_tap(tmp_path: Path) -> None:
    async with engine_running(ttft=0.01, itl=0.004) as engine:
        async with running_tap(engine.bound[1], tmp_path, name="native", stall_after=0.5) as tap:
            await scenario(tap.url, lambda: wait_closed(tap, CONNECTIONS, timeout=10))
        native_capture = tap.capture
        async with mitmdump(
            engine.url, tmp_path, "--set", "tracer_tap=mitm", "--set", "tracer_stall_after=0.5"
        ) as (url, mitm_capture):

            async def closed() -> None:
                await wait_until(
                    lambda: count_records(mitm_capture, "conn_close") >= CONNECTIONS, 10
                )

            await scenario(url, closed)
    native, native_conns, native_findings = tables(native_capture)
    mitm, mitm_conns, mitm_findings = tables(mitm_capture)
    assert mitm_findings == native_findings
    assert {f[0] for f in native_findings} >= {"upstream_silent", "stream_cut", "client_abort"}
    assert sorted(native) == sorted(mitm)
    for key in native:
        if key == "abort":  # how many events reached each tap before the close: timing
            for row in (mitm[key], native[key]):
                for count in ABORT_COUNTS:
                    row.pop(count, None)
        assert mitm[key] == native[key], key
    assert mitm_conns == native_conns
    # the scenario did what it says, in both
    assert [native[f"s1-r{n}"]["seq"] for n in (1, 2, 3)] == [1, 2, 3]
    assert native["keep-2"]["stalls"] == ["upstream_silent"] and native["keep-2"]["seq"] == 2
    assert native["keep-3"]["termination"] == "complete" and native["keep-3"]["seq"] == 3
    assert native["cut"]["termination"] == "truncated" and native["cut"]["events"] == 3
    assert native["abort"]["termination"] == "client_abort"
    assert all(r["done"] for k, r in native.items() if k not in ("cut", "abort"))
    header = next(read_records(mitm_capture))
    assert header["kind"] == "mitmproxy" and header["tap"] == "mitm"
    assert header["options"]["stall_after"] == 0.5
    assert count_records(mitm_capture, "capture_end") == 1
    assert os.path.getsize(mitm_capture) > 0


@pytest.mark.anyio
async def test_a_killed_mitmdump_still_leaves_a_whole_capture(tmp_path: Path) -> None:
    """mitmproxy killed (SIGKILL: no ``done`` hook): its capture process reads the end
    of the pipe, ends what was open ``in_flight`` and writes ``capture_end``."""
    async with engine_running(ttft=0.01, itl=0.05) as engine:
        async with mitmdump(engine.url, tmp_path, stop=signal.SIGKILL) as (url, capture):
            client = await anyio.connect_tcp("127.0.0.1", int(url.rsplit(":", 1)[1]))
            await client.send(chat_request(200, headers={"x-request-id": "open"}))
            await recv_until(client, lambda b: b.count(b'"content":"tok') >= 2, timeout=10)
            await wait_until(lambda: count_records(capture, "body") >= 1, 10)
        try:
            await wait_until(lambda: count_records(capture, "capture_end") == 1, 10)
        finally:
            await client.aclose()
    (end,) = [r for r in read_records(capture) if r["type"] == "response_end"]
    assert end["termination"] == "in_flight" and end["events"] >= 2
    last = list(read_records(capture))[-1]
    assert last["type"] == "capture_end" and last["reason"] == "mitmproxy went away"


@pytest.mark.anyio
async def test_an_upstream_close_under_an_open_client_connection(tmp_path: Path) -> None:
    """mitmproxy keeps its own upstream connections: when the upstream closes an idle one
    (here a tap behind it with ``close-idle-after``) the client's stays open, and the
    next request gets a new upstream connection. The capture says so
    (``server_disconnected``: ``upstream_close``), and a client that closes its own
    connection gives no such record."""
    async with engine_running(ttft=0.005, itl=0.002) as engine:
        idle = [parse_fault("close-idle-after:0.5")]
        async with running_tap(engine.bound[1], tmp_path, name="back", faults=idle) as back:
            async with mitmdump(f"http://127.0.0.1:{back.port}", tmp_path) as (url, capture):
                port = int(url.rsplit(":", 1)[1])
                async with await anyio.connect_tcp("127.0.0.1", port) as s:
                    for n in (1, 2):
                        await s.send(chat_request(4, headers={"x-request-id": f"turn-{n}"}))
                        await recv_until(s, lambda b: b"data: [DONE]" in b, 10)
                        if n == 1:  # the back tap closes mitmproxy's idle upstream
                            await wait_until(
                                lambda: count_records(capture, "upstream_close") >= 1, 10
                            )
                await wait_until(lambda: count_records(capture, "conn_close") >= 1, 10)
    (closed,) = [r for r in read_records(capture) if r["type"] == "upstream_close"]
    assert closed["conn"] == 1 and closed["requests"] == 1 and closed["in_flight"] is False
    assert closed["idle"] >= 0.45 and closed["addr"] == f"127.0.0.1:{back.port}"
    phases = [r["phase"] for r in read_records(capture) if r["type"] == "upstream_connect"]
    assert phases == ["start", "done", "start", "done"]  # the second request's own
    (close,) = [r for r in read_records(capture) if r["type"] == "conn_close"]
    assert close["closed_by"] == "client" and close["requests"] == 2
    rows = analyze_json(capture)["requests"]
    assert [(r["seq"], r["termination"]) for r in rows] == [(1, "complete"), (2, "complete")]


@pytest.mark.anyio
async def test_flow_files_keep_streamed_bodies_when_asked(tmp_path: Path) -> None:
    """The addon streams event-stream responses, and mitmproxy keeps no streamed body
    (its web UI and flow files show them empty) unless ``store_streamed_bodies`` is set;
    then the flow holds what the client got, and the capture is the same."""
    flows = tmp_path / "flows"
    options = ("-w", str(flows), "--set", "store_streamed_bodies=true")
    async with engine_running(ttft=0.01, itl=0.004) as engine:
        async with mitmdump(engine.url, tmp_path, *options) as (url, capture):
            async with await anyio.connect_tcp("127.0.0.1", int(url.rsplit(":", 1)[1])) as s:
                await s.send(
                    chat_request(6, headers={"x-request-id": "kept", "connection": "close"})
                )
                data, _ = await recv_all(s, timeout=10)
            await wait_until(lambda: count_records(capture, "conn_close") >= 1, 10)
    with open(flows, "rb") as f:
        (flow,) = list(FlowReader(f).stream())
    assert isinstance(flow, http.HTTPFlow) and flow.response is not None
    body = flow.response.raw_content or b""
    assert body.endswith(b"data: [DONE]\n\n") and data.count(b"data:") == body.count(b"data:")
    (row,) = analyze_json(capture)["requests"]
    assert (row["termination"], row["done"]) == ("complete", True)
    assert row["events"] == body.count(b"data:")


@pytest.mark.anyio
async def test_the_addon_in_front_of_the_native_tap_tells_each_failure_once(tmp_path: Path) -> None:
    """mitmproxy with the addon in front of a native tap, in front of the engine: the two
    captures join request by request, and a stall and a cut by the engine, seen the same
    at both taps, are one finding each, the native tap's, naming both requests."""
    body = {
        "model": "sim-model",
        "max_tokens": 6,
        "stream": True,
        "messages": [{"role": "user", "content": "two taps"}],
    }
    async with engine_running(ttft=0.01, itl=0.004) as engine:
        async with running_tap(engine.bound[1], tmp_path, name="back", stall_after=0.5) as tap:
            options = ("--set", "tracer_tap=front", "--set", "tracer_stall_after=0.5")
            async with mitmdump(tap.url, tmp_path, *options) as (url, front):
                async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                    for rid, fault in (
                        ("ok", "none"),
                        ("stalled", "stall:after=2:for=1.2"),
                        ("cut", "close:after=2"),
                    ):
                        with contextlib.suppress(httpx.HTTPError):
                            await stream_chat(client, body, rid, fault)
                await wait_until(lambda: count_records(front, "response_end") >= 3, 10)
            await wait_until(lambda: len(tap.of(ev.ResponseEnd)) >= 3, 10)
    doc = analyze_json(front, tap.capture)
    (pair,) = doc["evidence"]["tap_pairs"]
    assert (pair["from"], pair["to"], pair["shared"]) == ("front", "back", 3)
    rows = {(r["tap"], r["request_id"]): r for r in doc["requests"]}
    faults = [f for f in doc["findings"] if not f["note"]]
    by_id = {r["id"]: key for key, r in rows.items()}
    told = sorted(sorted(by_id[i] for i in f["requests"]) for f in faults)
    assert told == [
        [("back", "cut"), ("front", "cut")],
        [("back", "stalled"), ("front", "stalled")],
    ]
    for f in faults:
        assert f["requests"][0].startswith("back/")  # the tap nearest the engine tells it
        assert any(e["tap"] == "front" and e["figures"].get("same_failure") for e in f["evidence"])
