"""The mitmproxy fault addon (addons/faults.py): hook by hook, then mitmdump in front of the sim engine."""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import openai
import pytest
from mitmproxy import exceptions, http

from tracer import events as ev
from tracer.capture.files import read_events, read_records
from tracer.faults.plan import parse_fault, status_body

from .conftest import recv_all, recv_until
from .test_fault_injection import nothing_for
from .test_sim_engine import chat_request, engine_running

with warnings.catch_warnings():  # mitmproxy.master imports ldap3, which warns on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from mitmproxy.test import taddons, tflow

REPO = Path(__file__).resolve().parent.parent
ADDON = REPO / "addons" / "faults.py"
MITMDUMP = Path(sys.executable).parent / "mitmdump"


def _load_addon() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tracer_addon_faults", ADDON)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


faults = _load_addon()


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


def _flow(client: Any, method: str = "POST", path: str = "/v1/chat/completions") -> Any:
    flow = tflow.tflow(client_conn=client)
    flow.request.method = method
    flow.request.path = path
    return flow


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
        flows = [_flow(one), _flow(two), _flow(one), _flow(one, "GET", "/v1/models")]
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
        again = _flow(one)
        addon.requestheaders(again)
        addon.request(again)
        assert not again.intercepted  # a new connection counts from 1 again


def test_faults_set_anew_while_mitmproxy_runs(tmp_path: Path) -> None:
    """``tracer_faults`` set again (mitmproxy's ``set`` command, mitmweb's options): the
    plan changes from the next request on, flows already decided keep their faults,
    positions on open connections go on counting, and the capture gets ``fault_plan``."""
    from .test_addon_trace import trace

    tracer = trace.TraceAddon()
    addon = faults.TracerFaults()
    capture = tmp_path / "cap.jsonl"
    with taddons.context(tracer, addon) as tctx:
        tctx.configure(tracer, tracer_capture=str(capture))
        tctx.configure(addon, tracer_faults=["status:503@pos=1"])
        one = tflow.tclient_conn()
        first, held = _flow(one), _flow(one)
        addon.requestheaders(first)
        addon.requestheaders(held)  # decided under the first plan: not faulted
        tctx.configure(addon, tracer_faults=["hang-on-reuse:2", "hang-on-reuse:3"])
        addon.request(first)
        addon.request(held)
        assert first.response is not None and first.response.status_code == 503
        assert not held.intercepted
        third = _flow(one)  # request 3 on the connection: the new plan's
        addon.requestheaders(third)
        addon.request(third)
        assert third.intercepted
        tctx.configure(addon, tracer_faults=[])
        fourth = _flow(one)
        addon.requestheaders(fourth)
        addon.request(fourth)
        assert not fourth.intercepted
        tracer.done()
    plans = [(r["change"], r["faults"]) for r in read_records(capture) if r["type"] == "fault_plan"]
    assert plans == [
        ("replace", ["status:503@pos=1"]),
        ("replace", ["hang-on-reuse:2", "hang-on-reuse:3"]),
        ("clear", []),
    ]


def test_a_header_rule_in_mitmproxy() -> None:
    addon = faults.TracerFaults()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tracer_faults=["status:429@header=x-test-fault"])
        client = tflow.tclient_conn()
        plain, marked = _flow(client), _flow(client)
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
        flow = _flow(tflow.tclient_conn())
        addon.requestheaders(flow)
        assert flow.intercepted and flow.metadata["tracer.faults"][0]["fault"] == "half-open"


def _streamed(addon: Any, specs: list[str], pieces: list[bytes]) -> tuple[Any, bytes, list[bytes]]:
    """Run one SSE response through the hooks; returns the flow, the body sent, the pieces."""
    flow = _flow(tflow.tclient_conn())
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
        flow = _flow(tflow.tclient_conn())
        flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
        flow.response.stream = True
        addon.requestheaders(flow)
        start = time.monotonic()
        await addon.responseheaders(flow)
        assert time.monotonic() - start >= 0.19
        assert flow.response.stream is False  # mitmproxy holds the whole response
        names = [n["fault"] for n in flow.metadata["tracer.faults"]]
        assert names == ["buffer-stream", "delay-first-byte"]


# ---- mitmdump in front of the simulated engine ----------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def mitmdump(
    upstream: str,
    tmp_path: Path,
    *specs: str,
    capture: Path | None = None,
    web: tuple[int, str] | None = None,
    options: tuple[str, ...] = (),
) -> AsyncIterator[str]:
    """mitmdump with the addons in reverse mode; with ``web`` (port, password): mitmweb,
    whose REST API changes options while it runs."""
    port = free_port()
    log_path = tmp_path / f"mitmdump-{port}.log"
    cmd = [str(MITMDUMP), "--set", "flow_detail=0"]
    if web is not None:
        cmd = [str(MITMDUMP.parent / "mitmweb"), "--web-port", str(web[0])]
        cmd += ["--set", "web_open_browser=false", "--set", f"web_password={web[1]}"]
    if capture is not None:  # the trace addon first, as addons/faults.py asks
        cmd += ["-s", str(REPO / "addons" / "trace.py"), "--set", f"tracer_capture={capture}"]
    cmd += ["-s", str(ADDON)]
    cmd += ["--mode", f"reverse:{upstream}", "--listen-host", "127.0.0.1", "-p", str(port)]
    cmd += ["--set", f"confdir={tmp_path / 'mitmproxy'}"]
    for spec in specs:
        cmd += ["--set", f"tracer_faults={spec}"]
    for option in options:
        cmd += ["--set", option]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        with anyio.fail_after(30):
            while f"listening at 127.0.0.1:{port}" not in log_path.read_text(errors="replace"):
                assert proc.poll() is None, log_path.read_text()
                await anyio.sleep(0.05)  # (polls a file with a deadline)
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.mark.anyio
async def test_faults_set_through_mitmwebs_api_while_it_runs(tmp_path: Path) -> None:
    """Real mitmproxy: ``tracer_faults`` changed through mitmweb's REST API (what its
    options editor sends) takes effect on the next request and is in the capture; a bad
    spec is refused and changes nothing."""
    import httpx

    capture = tmp_path / "mitm.jsonl"
    web_port = free_port()
    # mitmweb checks tornado's XSRF pair: a cookie and the same value in a header
    xsrf = {"_mitmproxy_xsrf": "tracer-test"}
    async with engine_running(ttft=0.0, itl=0.001) as engine:
        async with (
            mitmdump(engine.url, tmp_path, capture=capture, web=(web_port, "s3cret")) as url,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{web_port}", cookies=xsrf) as web,
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client,
        ):
            assert (await web.get("/?token=s3cret")).status_code == 200  # the auth cookie

            async def set_faults(specs: list[str]) -> httpx.Response:
                return await web.put(
                    "/options",
                    json={"tracer_faults": specs},
                    headers={"X-XSRFToken": xsrf["_mitmproxy_xsrf"]},
                )

            await client.models.list()
            assert (await set_faults(["status:503@path=/v1/models"])).status_code == 200
            with pytest.raises(openai.InternalServerError):
                await client.models.list()
            refused = await set_faults(["hang-on-reuse:1"])
            assert refused.status_code == 400 and "integer >= 2" in refused.text
            with pytest.raises(openai.InternalServerError):  # still the plan before
                await client.models.list()
            assert (await set_faults([])).status_code == 200
            await client.models.list()
    records = list(read_records(capture))
    plans = [(r["change"], r["faults"]) for r in records if r["type"] == "fault_plan"]
    assert plans == [("replace", ["status:503@path=/v1/models"]), ("clear", [])]
    assert [r["fault"] for r in records if r["type"] == "fault"] == ["status", "status"]


def _models() -> bytes:
    return b"GET /v1/models HTTP/1.1\r\nhost: sim\r\n\r\n"


def _response_end(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return len(body) >= length


@pytest.mark.anyio
async def test_mitmdump_hang_status_stall_against_the_sim_engine(tmp_path: Path) -> None:
    specs = (
        "hang-on-reuse:3@method=GET",
        "status:503@path=/v1/completions",
        "stall-after-events:2:inf@path=/v1/chat/*",
    )
    capture = tmp_path / "mitm.jsonl"
    async with engine_running(ttft=0.0, itl=0.001) as engine:
        async with mitmdump(engine.url, tmp_path, *specs, capture=capture) as url:
            port = int(url.rsplit(":", 1)[1])
            # hang-on-reuse: the third request on a keep-alive connection gets nothing
            async with await anyio.connect_tcp("127.0.0.1", port) as s:
                for _ in range(2):
                    await s.send(_models())
                    got = await recv_until(s, _response_end)
                    assert got.startswith(b"HTTP/1.1 200") and b"sim-model" in got
                await s.send(_models())
                await nothing_for(s, 0.5)
            async with await anyio.connect_tcp("127.0.0.1", port) as s:  # a fresh one works
                await s.send(_models())
                assert (await recv_until(s, _response_end)).startswith(b"HTTP/1.1 200")

            # stall-after-events:2:inf, raw: the head and two events, then silence
            async with await anyio.connect_tcp("127.0.0.1", port) as s:
                await s.send(chat_request(6))
                got = await recv_until(s, lambda b: b.count(b"data: ") >= 2)
                await nothing_for(s, 0.5)
            assert got.count(b"data: ") == 2 and b'"tok0 "' in got and b"tok1" not in got

            client = openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="sk-x", max_retries=0, timeout=1.0
            )
            async with client:
                # status: the engine is never asked
                with pytest.raises(openai.InternalServerError) as caught:
                    await client.completions.create(model="sim-model", prompt="hi", max_tokens=3)
                assert caught.value.status_code == 503
                assert "injected by tracer" in str(caught.value)
                # the stall, at the SDK: two chunks, then a read timeout
                texts: list[str] = []
                with pytest.raises(openai.APITimeoutError):
                    stream = await client.chat.completions.create(
                        model="sim-model",
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=6,
                        stream=True,
                    )
                    async for part in stream:
                        texts.append(part.choices[0].delta.content or "")
                assert texts == ["", "tok0 "]
    assert engine.hits["POST /v1/completions"] == 0
    assert engine.hits["GET /v1/models"] == 3
    # with addons/trace.py loaded too, each injection is a fault record on its request
    events = list(read_events(capture))
    requests = {(e.conn, e.seq): e for e in events if isinstance(e, ev.RequestHead)}
    faults = [e for e in events if isinstance(e, ev.FaultInjected)]
    assert [f.fault for f in faults] == [
        "hang-on-reuse",
        "stall-after-events",
        "status",
        "stall-after-events",
    ]
    hang = faults[0]
    assert hang.seq == 3 and requests[(hang.conn, 3)].method == "GET"
    assert hang.spec == "hang-on-reuse:3@method=GET"
    for fault in faults[1:]:
        assert requests[(fault.conn, fault.seq)].method == "POST"


@pytest.mark.anyio
async def test_mitmdump_drop_done_and_truncate_against_the_sim_engine(tmp_path: Path) -> None:
    specs = ("drop-done@pos=1", "truncate-after-events:3@pos=2")
    capture = tmp_path / "mitm.jsonl"
    async with engine_running(ttft=0.0, itl=0.001) as engine:
        async with mitmdump(engine.url, tmp_path, *specs, capture=capture) as url:
            port = int(url.rsplit(":", 1)[1])
            async with await anyio.connect_tcp("127.0.0.1", port) as s:
                await s.send(chat_request(3, usage=False))
                first = await recv_until(s, lambda b: b.endswith(b"\r\n0\r\n\r\n"))
                await s.send(chat_request(6, usage=False))
                second, how = await recv_all(s)
    # drop-done: every event but [DONE], and a clean end of the chunked body
    assert b"[DONE]" not in first and first.count(b"data: ") == 1 + 3 + 1
    # truncation: three events, then the connection closes without the last chunk
    assert second.count(b"data: ") == 3 and not second.endswith(b"0\r\n\r\n") and how == "fin"
    third = json.loads(second.split(b"data: ")[3].split(b"\n\n")[0])
    assert third["choices"][0]["delta"]["content"] == "tok1 "
    assert engine.completions == 2
    # the trace addon records what the client got, as the tap does with its own faults
    events = list(read_events(capture))
    ends = [e for e in events if isinstance(e, ev.ResponseEnd)]
    assert [(e.seq, e.termination, e.events, e.done) for e in ends] == [
        (1, "complete", 1 + 3 + 1, False),
        (2, "truncated", 3, False),
    ]
    assert [e.closed_by for e in events if isinstance(e, ev.ConnClose)] == ["tracer"]
    faults = [(e.seq, e.fault) for e in events if isinstance(e, ev.FaultInjected)]
    assert faults == [(1, "drop-done"), (2, "truncate-after-events")]


@pytest.mark.anyio
async def test_request_faults_when_mitmproxy_streams_request_bodies(tmp_path: Path) -> None:
    """With ``stream_large_bodies`` mitmproxy sends a request body upstream as it comes
    (and turns streaming back on if an addon turns it off), so ``request`` comes too late
    to hold the request: ``hang-on-reuse`` holds it at its head instead, and the engine
    never sees it. A response cannot be set for a streamed request at all: ``status`` is
    not applied (logged, no ``fault`` record), where before the engine's answer went
    through under a record of a 503."""
    capture = tmp_path / "mitm.jsonl"
    specs = ("status:503@path=/v1/completions", "hang-on-reuse:2@path=/v1/chat/*")
    async with engine_running(ttft=0.0, itl=0.001) as engine:
        async with mitmdump(
            engine.url, tmp_path, *specs, capture=capture, options=("stream_large_bodies=1",)
        ) as url:
            args: dict[str, Any] = {"base_url": url + "/v1", "api_key": "sk-x", "max_retries": 0}
            async with openai.AsyncOpenAI(**args, timeout=5.0) as client:
                answered = await client.completions.create(
                    model="sim-model", prompt="hi", max_tokens=3
                )
                assert answered.choices[0].finish_reason == "length"
            messages: Any = [{"role": "user", "content": "hi"}]
            async with openai.AsyncOpenAI(**args, timeout=1.0) as client:
                done = await client.chat.completions.create(
                    model="sim-model", messages=messages, max_tokens=3
                )
                assert done.choices[0].finish_reason == "length"
                with pytest.raises(openai.APITimeoutError):
                    await client.chat.completions.create(
                        model="sim-model", messages=messages, max_tokens=3
                    )
    assert engine.hits["POST /v1/completions"] == 1
    assert engine.hits["POST /v1/chat/completions"] == 1
    events = list(read_events(capture))
    faults = [(f.fault, f.seq, f.detail) for f in events if isinstance(f, ev.FaultInjected)]
    held = "held before its body, which mitmproxy streams: never forwarded"
    assert faults == [("hang-on-reuse", 2, held)]
    log = next(tmp_path.glob("mitmdump-*.log")).read_text()
    assert "status does not apply to a request whose body mitmproxy streams" in log
    assert "tracer fault status:503@path=/v1/completions not applied to request 1" in log
