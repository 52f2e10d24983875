"""The mitmproxy fault addon (addons/faults.py) hook by hook, with mitmproxy's test helpers.

With the trace addon's capture process: tests/integration/test_addon_faults.py; mitmdump in
front of the sim engine: tests/e2e/test_addon_faults.py."""

from __future__ import annotations

import time
import warnings
from typing import Any

import anyio
import pytest
from mitmproxy import exceptions, http

from tests.support.addon import fault_flow, faults
from tracer.faults.plan import parse_fault, status_body

with warnings.catch_warnings():  # mitmproxy.master imports ldap3, which warns on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from mitmproxy.test import taddons, tflow


def _sse(*events: bytes) -> bytes:
    return b"".join(events)


EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
    b": keepalive\n\n",
    b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]


# ---- hooks, in-process ----------------------------------------------------------------


def test_options_are_validated() -> None:
    addon = faults.TracerFaults()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tracer_faults=["hang-on-reuse:3", "status:503@every=2"])
        assert addon.plan is not None and len(addon.plan.faults) == 2
        tctx.configure(addon, tracer_faults=[])
        assert addon.plan.faults == ()
        for spec, message in [
            ("hang-on-resue:3", "did you mean hang-on-reuse?"),
            ("close-idle-after:1", "no hook on an idle connection"),
            ("stall-after-events:2:5", "stall-after-events:2:inf"),
            ("truncate-after-events:2:reset", "FIN only"),
        ]:
            with pytest.raises(exceptions.OptionsError) as caught:
                tctx.configure(addon, tracer_faults=[spec])
            assert message in str(caught.value), spec


def test_request_faults_count_positions_per_client_connection() -> None:
    addon = faults.TracerFaults()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tracer_faults=["hang-on-reuse:2", "status:429@method=GET"])
        one, two = tflow.tclient_conn(), tflow.tclient_conn()
        flows = [
            fault_flow(one),
            fault_flow(two),
            fault_flow(one),
            fault_flow(one, "GET", "/v1/models"),
        ]
        for flow in flows:
            addon.requestheaders(flow)
            addon.request(flow)
        assert [f.intercepted for f in flows] == [False, False, True, False]
        assert flows[2].metadata["tracer.faults"] == [
            {
                "fault": "hang-on-reuse",
                "spec": "hang-on-reuse:2",
                "seq": 2,
                "detail": "request read and not forwarded; the connection stays open and silent",
            }
        ]
        answer = flows[3].response
        assert answer is not None and answer.status_code == 429
        assert answer.content == status_body(parse_fault("status:429@method=GET"))
        assert answer.headers["x-tracer-fault"] == "status:429@method=GET"
        assert flows[0].response is None or flows[0].response.status_code == 200
        addon.client_disconnected(one)
        again = fault_flow(one)
        addon.requestheaders(again)
        addon.request(again)
        assert not again.intercepted  # a new connection counts from 1 again


def test_a_header_rule_in_mitmproxy() -> None:
    addon = faults.TracerFaults()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tracer_faults=["status:429@header=x-test-fault"])
        client = tflow.tclient_conn()
        plain, marked = fault_flow(client), fault_flow(client)
        marked.request.headers["X-Test-Fault"] = "1"
        for flow in (plain, marked):
            addon.requestheaders(flow)
            addon.request(flow)
        assert plain.response is None or plain.response.status_code == 200
        assert marked.response is not None and marked.response.status_code == 429


def test_half_open_holds_the_flow_before_its_body() -> None:
    addon = faults.TracerFaults()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tracer_faults=["half-open"])
        flow = fault_flow(tflow.tclient_conn())
        addon.requestheaders(flow)
        assert flow.intercepted and flow.metadata["tracer.faults"][0]["fault"] == "half-open"


def _streamed(addon: Any, specs: list[str], pieces: list[bytes]) -> tuple[Any, bytes, list[bytes]]:
    """Run one SSE response through the hooks; returns the flow, the body sent, the pieces."""
    flow = fault_flow(tflow.tclient_conn())
    flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    addon.requestheaders(flow)
    anyio.run(addon.responseheaders, flow)
    stream = flow.response.stream
    assert callable(stream)
    out: list[bytes] = []
    for piece in [*pieces, b""]:
        got = stream(piece)
        out += [got] if isinstance(got, bytes) else list(got)
    addon.response(flow)
    return flow, b"".join(out), out


def test_drop_done_in_the_stream() -> None:
    addon = faults.TracerFaults()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tracer_faults=["drop-done"])
        body = _sse(*EVENTS)
        pieces = [body[i : i + 7] for i in range(0, len(body), 7)]
        flow, sent, out = _streamed(addon, ["drop-done"], pieces)
    assert sent == _sse(*EVENTS[:-1])
    assert b"" not in out  # an empty piece would end mitmproxy's chunked body early
    assert not flow.intercepted and flow.error is None


@pytest.mark.parametrize("spec", ["stall-after-events:3:inf", "truncate-after-events:3"])
def test_event_faults_stop_after_k_events(spec: str) -> None:
    addon = faults.TracerFaults()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tracer_faults=[spec])
        flow, sent, _ = _streamed(addon, [spec], [_sse(*EVENTS[:2]), _sse(*EVENTS[2:])])
    assert sent == _sse(*EVENTS[:4])  # role, a, (a heartbeat is no event), b
    if spec.startswith("stall"):
        assert flow.intercepted  # the end of the body never comes
    else:
        assert flow.error is not None and flow.error.msg == "Connection killed."
    [note] = flow.metadata["tracer.faults"]
    assert note["spec"] == spec and note["detail"].endswith("after 3 events")


@pytest.mark.anyio
async def test_delay_first_byte_and_buffer_stream_in_responseheaders() -> None:
    addon = faults.TracerFaults()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tracer_faults=["delay-first-byte:0.2", "buffer-stream"])
        flow = fault_flow(tflow.tclient_conn())
        flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
        flow.response.stream = True
        addon.requestheaders(flow)
        start = time.monotonic()
        await addon.responseheaders(flow)
        assert time.monotonic() - start >= 0.19
        assert flow.response.stream is False  # mitmproxy holds the whole response
        names = [n["fault"] for n in flow.metadata["tracer.faults"]]
        assert names == ["buffer-stream", "delay-first-byte"]
