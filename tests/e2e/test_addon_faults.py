"""The mitmproxy fault addon (addons/faults.py) in a real mitmdump (and mitmweb) in front of
the sim engine. Hook by hook: tests/unit/test_addon_faults.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from tests.support.engine import chat_request, engine_running
from tests.support.net import free_port, nothing_for, recv_all, recv_until
from tests.support.procs import mitmdump
from tracer import events as ev
from tracer.capture.files import read_events, read_records

pytestmark = pytest.mark.e2e


# ---- mitmdump in front of the simulated engine ----------------------------------------


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
            mitmdump(
                engine.url, tmp_path, capture=capture, faults=(), web=(web_port, "s3cret")
            ) as (url, _),
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
        async with mitmdump(engine.url, tmp_path, capture=capture, faults=specs) as (url, _):
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
        async with mitmdump(engine.url, tmp_path, capture=capture, faults=specs) as (url, _):
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
            engine.url, tmp_path, "--set", "stream_large_bodies=1", capture=capture, faults=specs
        ) as (url, _):
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
