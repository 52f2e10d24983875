"""The simulated engine at the traffic layer: bytes, endpoints, load, gauge lag, faults, router."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from prometheus_client.parser import text_string_to_metric_families

from tests.support.engine import (
    SMG,
    chat_request,
    complete,
    connect,
    engine_running,
    events_of,
    smg_router,
    split_response,
)
from tests.support.net import recv_all, recv_until, wait_until
from tracer.sim.engine import SimEngine, parse_fault

pytestmark = pytest.mark.anyio


async def scrape(client: httpx.AsyncClient, engine: SimEngine) -> dict[str, float]:
    """``/metrics`` as {name: value}, summing nothing (one series per name, labels checked)."""
    text = (await client.get(engine.url + "/metrics")).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            key = s.name if "mode" not in s.labels else f"{s.name}:{s.labels['mode']}"
            values[key] = s.value
    return values


async def loads(client: httpx.AsyncClient, engine: SimEngine) -> dict[str, Any]:
    doc = (await client.get(engine.url + "/v1/loads")).json()
    return dict(doc["loads"][0])


# ---- bytes -----------------------------------------------------------------------------


async def test_stream_bytes_are_sglang_shaped() -> None:
    async with engine_running(ttft=0.0, itl=0.001) as engine:
        async with await anyio.connect_tcp("127.0.0.1", engine.bound[1]) as s:  # type: ignore[index]
            await s.send(chat_request(4))
            data = await recv_until(s, complete)
            status, headers, chunks, terminated, rest = split_response(data)
            assert status == 200 and terminated and rest == b""
            assert headers["content-type"] == "text/event-stream; charset=utf-8"
            assert headers["transfer-encoding"] == "chunked" and "content-length" not in headers
            assert headers["server"] == "uvicorn" and "date" in headers
            events = events_of(chunks)
            assert len(events) == 1 + 4 + 1 + 1 + 1
            role, *content, finish, usage, done = events
            ids = {e["id"] for e in events[:-1]}
            assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
            assert role["object"] == "chat.completion.chunk"
            assert role["choices"][0]["delta"]["role"] == "assistant"
            assert role["choices"][0]["delta"]["content"] == ""
            assert role["choices"][0]["finish_reason"] is None
            assert [c["choices"][0]["delta"]["content"] for c in content] == [
                f"tok{i} " for i in range(4)
            ]
            assert all(c["choices"][0]["finish_reason"] is None for c in content)
            assert finish["choices"][0]["finish_reason"] == "length"
            assert finish["choices"][0]["delta"]["content"] is None
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
            assert done == "[DONE]"
            # compact JSON, as pydantic writes it
            assert b'"choices":[{"index":0,' in chunks[0]

            # the same connection serves the next request (keep-alive), non-streaming
            await s.send(chat_request(3, stream=False))
            data = await recv_until(s, lambda b: b"\r\n\r\n" in b and b.endswith(b"}"))
            head, _, body = data.partition(b"\r\n\r\n")
            assert b"content-length: %d" % len(body) in head
            doc = json.loads(body)
            assert doc["object"] == "chat.completion"
            assert doc["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
            assert doc["usage"]["completion_tokens"] == 3

            # without include_usage: no usage chunk; /v1/completions: no role chunk,
            # finish_reason on the last text chunk
            await s.send(chat_request(2, usage=False, path="/v1/completions"))
            data = await recv_until(s, complete)
            events = events_of(split_response(data)[2])
            assert [e if e == "[DONE]" else e["object"] for e in events] == [
                "text_completion",
                "text_completion",
                "[DONE]",
            ]
            assert [e["choices"][0]["finish_reason"] for e in events[:2]] == [None, "length"]
        assert engine.connections == 1 and engine.requests == 3


async def test_head_goes_out_with_the_first_token_unless_early_headers() -> None:
    for early in (False, True):
        async with engine_running(ttft=0.3, itl=0.001, early_headers=early) as engine:
            async with await anyio.connect_tcp("127.0.0.1", engine.bound[1]) as s:  # type: ignore[index]
                start = time.monotonic()
                await s.send(chat_request(2))
                await recv_until(s, lambda b: b"\r\n\r\n" in b)
                ttfb = time.monotonic() - start
                await recv_until(s, complete)
        assert (ttfb < 0.2) if early else (ttfb >= 0.25), (early, ttfb)


async def test_per_request_headers_shape_one_request() -> None:
    async with engine_running(ttft=0.0, itl=0.001) as engine:
        async with await connect(engine) as s:
            start = time.monotonic()
            headers = {"x-sim-tokens": "3", "x-sim-ttft": "0.25", "x-sim-itl": "0.1"}
            await s.send(chat_request(8, headers=headers))
            times: list[float] = []
            data = b""
            with anyio.fail_after(5):
                while not complete(data):
                    data += await s.receive()
                    times += [time.monotonic() - start] * (
                        data.count(b'"content":"tok') - len(times)
                    )
            events = events_of(split_response(data)[2])
    assert len(times) == 3 and times[0] >= 0.25
    assert times[1] - times[0] >= 0.09 and times[2] - times[1] >= 0.09
    assert events[-3]["choices"][0]["finish_reason"] == "stop"  # 3 of max_tokens 8


async def test_http2_preface_gets_400_like_uvicorn() -> None:
    async with engine_running() as engine:
        async with await connect(engine) as s:
            await s.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            data, how = await recv_all(s)
    assert data.startswith(b"HTTP/1.1 400 ") and data.endswith(b"Invalid HTTP request received.")
    assert how == "fin"


async def test_endpoints_a_router_probes() -> None:
    async with engine_running(model="m1", engine_type="decode") as engine:
        async with httpx.AsyncClient(base_url=engine.url) as c:
            r = await c.get("/health")
            assert r.status_code == 200 and r.content == b""
            assert (await c.get("/health_generate")).status_code == 200
            models = (await c.get("/v1/models")).json()
            assert models["object"] == "list" and models["data"][0]["id"] == "m1"
            for path in ("/model_info", "/get_model_info"):
                info = (await c.get(path)).json()
                assert info["is_generation"] is True
                assert "model_path" not in info and "tokenizer_path" not in info
            for path in ("/server_info", "/get_server_info"):
                info = (await c.get(path)).json()
                assert info["served_model_name"] == "m1"
                assert info["disaggregation_mode"] == "decode"
                assert "model_path" not in info and "tokenizer_path" not in info
            doc = (await c.get("/v1/loads")).json()
            assert doc["dp_rank_count"] == 1 and "aggregate" in doc
            load = doc["loads"][0]
            for key in (
                "dp_rank",
                "num_running_reqs",
                "num_waiting_reqs",
                "token_usage",
                "gen_throughput",
                "max_running_requests",
            ):
                assert key in load
            assert (await c.get("/get_load")).json()[0]["num_reqs"] == 0
            text = (await c.get("/metrics")).text
            assert (await c.get("/nope")).status_code == 404
            assert (await c.post("/v1/chat/completions", content=b"{")).status_code == 400
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = families["sglang:num_running_reqs"].samples[0]
    assert running.labels["engine_type"] == "decode" and running.labels["tp_rank"] == "0"
    assert running.labels["model_name"] == "m1"
    for name in (
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:gen_throughput",
        "sglang:generation_tokens",
        "sglang:prompt_tokens",
        "sglang:num_requests",
        "sglang:time_to_first_token_seconds",
        "sglang:engine_startup_time",
    ):
        assert name in families, name
    assert families["sglang:time_to_first_token_seconds"].type == "histogram"
    assert families["sglang:generation_tokens"].type == "counter"


# ---- load ------------------------------------------------------------------------------


async def _stream_client(
    client: httpx.AsyncClient, url: str, max_tokens: int, ttfts: list[float], counts: list[int]
) -> None:
    body = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "load"}],
    }
    start = time.monotonic()
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                if tokens == 0:
                    ttfts.append(time.monotonic() - start)
                tokens += 1
    counts.append(tokens)


async def test_load_behaves_like_load() -> None:
    async with engine_running(
        max_running=2, ttft=0.0, itl=0.01, batch_alpha=0.2, decode_log_interval=5
    ) as engine:
        limits = httpx.Limits(max_connections=20)
        async with httpx.AsyncClient(limits=limits, timeout=10) as client:
            before = await scrape(client, engine)
            ttfts: list[float] = []
            counts: list[int] = []
            seen_live: set[tuple[int, int]] = set()
            seen_gauge: set[tuple[float, float]] = set()
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(_stream_client, client, engine.url, 25, ttfts, counts)

                async def sample() -> None:
                    while len(counts) < 6:
                        load = await loads(client, engine)
                        seen_live.add((load["num_running_reqs"], load["num_waiting_reqs"]))
                        m = await scrape(client, engine)
                        seen_gauge.add((m["sglang:num_running_reqs"], m["sglang:num_queue_reqs"]))
                        await anyio.sleep(0.01)

                tg.start_soon(sample)
            after = await scrape(client, engine)
    assert (2, 4) in seen_live, seen_live
    assert (2.0, 4.0) in seen_gauge, seen_gauge
    assert max(r for r, _ in seen_live) == 2  # never more than max_running
    assert counts == [25] * 6
    ttfts.sort()
    # three waves: the queue shows in the time to first token
    assert ttfts[2] > ttfts[1] + 0.15 and ttfts[4] > ttfts[3] + 0.15, ttfts
    gen = after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"]
    assert gen == sum(counts)
    assert after["sglang:num_requests_total"] - before["sglang:num_requests_total"] == 6
    assert after["sglang:time_to_first_token_seconds_count"] == 6


async def _tokens_per_step_at(concurrency: int) -> float:
    """The gen_throughput gauge in steady state with ``concurrency`` streams, times the
    step the engine delivered (its ITL histogram): the requests decoded per step. A
    starved process (a loaded machine) stretches both alike, so this holds under load."""
    async with engine_running(
        max_running=2, ttft=0.0, itl=0.01, batch_alpha=0.5, decode_log_interval=6
    ) as engine:
        hist = engine.scheduler.itl_hist
        async with httpx.AsyncClient(timeout=10) as client:
            samples: list[float] = []
            counts: list[int] = []
            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(_stream_client, client, engine.url, 30, [], counts)
                with anyio.fail_after(30):
                    while len(counts) < concurrency:
                        m = await scrape(client, engine)
                        if m["sglang:gen_throughput"] > 0:
                            samples.append(m["sglang:gen_throughput"])
                        await anyio.sleep(0.02)
        step = hist.sum / hist.count
    distinct = sorted(set(samples))
    return distinct[len(distinct) // 2] * step


async def test_gen_throughput_saturates_at_the_batch_limit() -> None:
    one, two, six = [await _tokens_per_step_at(n) for n in (1, 2, 6)]
    # a token per running request per step, and never more than 2 running
    assert one == pytest.approx(1, rel=0.25), (one, two, six)
    assert two == pytest.approx(2, rel=0.25), (one, two, six)
    assert six == pytest.approx(2, rel=0.25), (one, two, six)


# ---- gauge refresh ---------------------------------------------------------------------


async def test_gauges_lag_like_sglang() -> None:
    async with engine_running(
        ttft=0.0, itl=0.004, decode_log_interval=40, idle_refresh=0.6
    ) as engine:
        async with httpx.AsyncClient(timeout=10) as client:
            counts: list[int] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(_stream_client, client, engine.url, 150, [], counts)
                await wait_until(lambda: engine.scheduler.running and engine.scheduler.steps > 2)
                # B joins: the prefill log writes running=2
                await _stream_client(client, engine.url, 5, [], counts)
                live = await loads(client, engine)
                gauge = await scrape(client, engine)
                assert live["num_running_reqs"] == 1  # B is done, A runs
                assert gauge["sglang:num_running_reqs"] == 2.0  # not rewritten yet
                # the next decode log (every 40 steps) catches up while A still runs
                with anyio.fail_after(10):
                    while (await scrape(client, engine))["sglang:num_running_reqs"] != 1.0:
                        assert not counts or len(counts) < 2, "A finished before a decode log"
                        await anyio.sleep(0.01)
                assert len(counts) == 1
            finished = time.monotonic()
            live = await loads(client, engine)
            gauge = await scrape(client, engine)
            assert live["num_running_reqs"] == 0
            assert gauge["sglang:num_running_reqs"] == 1.0  # stale until the idle refresh
            with anyio.fail_after(10):
                while (await scrape(client, engine))["sglang:num_running_reqs"] != 0.0:
                    await anyio.sleep(0.02)
            lag = time.monotonic() - finished
    assert 0.2 < lag < 1.5, lag


async def test_fault_stall_keeps_running_with_flat_counters() -> None:
    async with engine_running(ttft=0.0, itl=0.002) as engine:
        async with httpx.AsyncClient() as client:
            async with await anyio.connect_tcp("127.0.0.1", engine.bound[1]) as s:  # type: ignore[index]
                await s.send(chat_request(5, headers={"x-sim-fault": "stall:after=2:for=0.8"}))
                data = await recv_until(s, lambda b: b.count(b'"content":"tok') >= 2)
                stalled_at = time.monotonic()
                base = await scrape(client, engine)
                while time.monotonic() - stalled_at < 0.5:
                    m = await scrape(client, engine)
                    assert m["sglang:num_running_reqs"] >= 1
                    assert (await loads(client, engine))["num_running_reqs"] == 1
                    assert (
                        m["sglang:generation_tokens_total"]
                        == base["sglang:generation_tokens_total"]
                    )
                    await anyio.sleep(0.05)
                data += await recv_until(s, complete)
                resumed = time.monotonic() - stalled_at
            events = events_of(split_response(data)[2])
    assert len(events) == 1 + 5 + 1 + 1 + 1
    assert 0.6 < resumed < 2.0, resumed


async def test_fault_lost_is_neither_running_nor_queued() -> None:
    async with engine_running(faults=[parse_fault("lost@nth=1")]) as engine:
        async with httpx.AsyncClient() as client:
            async with await anyio.connect_tcp("127.0.0.1", engine.bound[1]) as s:  # type: ignore[index]
                await s.send(chat_request(3))
                await wait_until(lambda: engine.lost == 1)
                load = await loads(client, engine)
                gauge = await scrape(client, engine)
                assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
                assert gauge["sglang:num_running_reqs"] == 0
                assert gauge["sglang:num_queue_reqs"] == 0
                got = b""
                with anyio.move_on_after(0.3):
                    got = await s.receive()
                assert got == b""  # nothing came back
            await wait_until(lambda: engine.lost == 0)  # the client gave up
            # the next request (the rule was for the first) is served
            r = await client.post(
                engine.url + "/v1/chat/completions",
                json={
                    "model": "m",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
            assert r.status_code == 200


@pytest.mark.parametrize("kind", ["close", "reset"])
async def test_fault_cut_mid_stream(kind: str) -> None:
    async with engine_running(ttft=0.0, itl=0.002) as engine:
        async with httpx.AsyncClient() as client:
            async with await anyio.connect_tcp("127.0.0.1", engine.bound[1]) as s:  # type: ignore[index]
                await s.send(chat_request(6, headers={"x-sim-fault": f"{kind}:after=2"}))
                data, how = await recv_all(s)
            status, _, chunks, terminated, _ = split_response(data)
            assert status == 200 and not terminated
            assert how == ("fin" if kind == "close" else "reset")
            events = events_of(chunks)
            assert len(events) == 3 and b"[DONE]" not in data  # role + 2 tokens
            await wait_until(lambda: not engine.scheduler.running)
            m = await scrape(client, engine)
            assert m["sglang:num_aborted_requests_total"] == 1
            assert (await loads(client, engine))["num_running_reqs"] == 0


async def test_fault_500_and_error_event() -> None:
    async with engine_running(ttft=0.0, itl=0.001, faults=[parse_fault("500@nth=1")]) as engine:
        async with await anyio.connect_tcp("127.0.0.1", engine.bound[1]) as s:  # type: ignore[index]
            await s.send(chat_request(3))
            data = await recv_until(s, lambda b: b.endswith(b"}"))
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 500 ")
            assert json.loads(body)["code"] == 500
            # the connection is still good; the header picks the next fault
            await s.send(chat_request(3, headers={"x-sim-fault": "error:after=1"}))
            data = await recv_until(s, complete)
            status, _, chunks, terminated, _ = split_response(data)
            assert status == 200 and terminated
            events = events_of(chunks)
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert events[1]["choices"][0]["delta"]["content"] == "tok0 "
            assert events[2]["error"]["code"] == 500
            assert events[3] == "[DONE]" and len(events) == 4
        assert engine.scheduler.num_aborted_requests_total == 1


async def test_fault_wedge_freezes_the_whole_engine() -> None:
    async with engine_running(ttft=0.0, itl=0.002, health_timeout=0.3) as engine:
        async with httpx.AsyncClient(timeout=5) as client:
            async with await anyio.connect_tcp("127.0.0.1", engine.bound[1]) as s:  # type: ignore[index]
                await s.send(chat_request(4, headers={"x-sim-fault": "wedge:after=1:for=1.0"}))
                await recv_until(s, lambda b: b'"content":"tok0' in b)
                await wait_until(lambda: engine.scheduler.wedged)
                base = await scrape(client, engine)
                with anyio.move_on_after(0.3) as scope:
                    await client.get(engine.url + "/v1/loads")  # asks the (stuck) scheduler
                assert scope.cancelled_caught
                assert (await client.get(engine.url + "/health_generate")).status_code == 503
                m = await scrape(client, engine)
                assert m["sglang:generation_tokens_total"] == base["sglang:generation_tokens_total"]
                await recv_until(s, complete, timeout=3)
            assert (await loads(client, engine))["num_running_reqs"] == 0


async def test_client_abort_leaves_the_batch() -> None:
    async with engine_running(ttft=0.0, itl=0.01) as engine:
        async with httpx.AsyncClient() as client:
            async with await anyio.connect_tcp("127.0.0.1", engine.bound[1]) as s:  # type: ignore[index]
                await s.send(chat_request(500))
                await recv_until(s, lambda b: b'"content":"tok0' in b)
                assert (await loads(client, engine))["num_running_reqs"] == 1
            await wait_until(lambda: not engine.scheduler.running)
            assert (await scrape(client, engine))["sglang:num_aborted_requests_total"] == 1


# ---- keep-alive ------------------------------------------------------------------------


async def test_idle_keepalive_connection_closed_after_configured_seconds() -> None:
    async with engine_running(keepalive=0.4) as engine:
        async with await anyio.connect_tcp("127.0.0.1", engine.bound[1]) as s:  # type: ignore[index]
            await s.send(b"GET /health HTTP/1.1\r\nhost: sim\r\n\r\n")
            await recv_until(s, lambda b: b"\r\n\r\n" in b)
            idle_from = time.monotonic()
            rest, how = await recv_all(s, timeout=3)
            idle = time.monotonic() - idle_from
    assert rest == b"" and how == "fin"
    assert 0.35 < idle < 1.2, idle


# ---- the command line ------------------------------------------------------------------


async def test_engine_command_line_ready_line_and_sigterm() -> None:
    cmd = [sys.executable, "-m", "tracer.sim.cli", "engine", "--listen", "127.0.0.1:0"]
    cmd += ["--tokens", "3", "--ttft", "0", "--itl", "0.001", "--fault", "500@nth=2"]
    process = await anyio.open_process(cmd)
    try:
        assert process.stderr is not None
        reader = BufferedByteReceiveStream(process.stderr)
        with anyio.fail_after(10):
            line = (await reader.receive_until(b"\n", 4096)).decode()
        found = re.fullmatch(r"sim engine listening on (http://127\.0\.0\.1:\d+)", line)
        assert found, line
        async with httpx.AsyncClient(base_url=found.group(1)) as c:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            first = await c.post("/v1/chat/completions", json=body)
            second = await c.post("/v1/chat/completions", json=body)
        assert first.status_code == 200 and second.status_code == 500
        assert first.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
        process.send_signal(signal.SIGTERM)
        with anyio.fail_after(5):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
        await process.aclose()


# ---- the real SGLang router in front ---------------------------------------------------


async def _chat_through(url: str, n: int) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-x", max_retries=0, timeout=10)
    finishes: list[str] = []
    try:
        for i in range(n):
            stream = await client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": f"request {i}"}],
                max_tokens=4,
                stream=True,
                extra_headers={"x-request-id": f"router-{i}"},
            )
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.finish_reason:
                        finishes.append(choice.finish_reason)
    finally:
        await client.close()
    return finishes


@pytest.mark.skipif(not SMG.exists(), reason="smg (sglang-router) is not installed")
async def test_sglang_router_in_front_of_two_engines(tmp_path: Path) -> None:
    async with engine_running(ttft=0.0, itl=0.001) as w1, engine_running(ttft=0.0, itl=0.001) as w2:
        args = ("--worker-urls", w1.url, w2.url, "--policy", "round_robin")
        async with smg_router(tmp_path, *args) as smg:
            assert smg.ready, smg.log.read_text(errors="replace")
            finishes = await _chat_through(smg.url, 6)
    assert finishes == ["length"] * 6
    for w in (w1, w2):
        assert w.hits["POST /v1/chat/completions"] >= 1, w.hits
        # what the router asked of a worker at start
        assert w.hits["GET /health"] >= 1
        assert w.hits["GET /server_info"] + w.hits["GET /get_server_info"] >= 1
        assert w.hits["GET /model_info"] + w.hits["GET /get_model_info"] >= 1
    assert w1.completions + w2.completions == 6


@pytest.mark.skipif(not SMG.exists(), reason="smg (sglang-router) is not installed")
async def test_sglang_router_pd_chain(tmp_path: Path) -> None:
    async with (
        engine_running(ttft=0.0, itl=0.001, engine_type="prefill") as prefill,
        engine_running(ttft=0.0, itl=0.001, engine_type="decode") as decode,
    ):
        args = ("--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url)
        async with smg_router(tmp_path, *args) as smg:
            if not smg.ready:
                pytest.skip("smg refused simulated PD workers: " + smg.log.read_text()[-2000:])
            finishes = await _chat_through(smg.url, 3)
        async with httpx.AsyncClient() as c:
            labels = {
                f.samples[0].labels["engine_type"]
                for e in (prefill, decode)
                for f in text_string_to_metric_families((await c.get(e.url + "/metrics")).text)
                if f.name == "sglang:num_running_reqs"
            }
    assert finishes == ["length"] * 3
    # the router sends each request to both legs and streams the decode leg
    assert prefill.completions == 3 and decode.completions == 3
    assert prefill.scheduler.generation_tokens_total == 3  # one token each
    assert decode.scheduler.generation_tokens_total == 12
    assert labels == {"prefill", "decode"}
