"""The poller against a tiny HTTP server that serves fixtures and misbehaves on purpose."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

from tests.support.net import wait_until
from tracer import events as ev
from tracer.evidence.poller import EnginePoller, PollerConfig

pytestmark = pytest.mark.anyio

DATA = Path(__file__).parent.parent / "data" / "metrics"


DP2 = (DATA / "synthetic_sglang_pd_decode_dp2.prom").read_text()


OFFSET = 1_000_000.0

Route = tuple[int, bytes] | Literal["hang", "close"]


class Server:
    """One HTTP/1.1 response per connection, chosen by path from ``routes`` (mutable)."""

    def __init__(self, routes: dict[str, Route] | None = None) -> None:
        self.routes: dict[str, Route] = dict(routes or {})
        self.hits: list[str] = []
        self.port = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = int(listener.extra(SocketAttribute.local_port))
        task_status.started(self.port)
        async with listener:
            await listener.serve(self._handle)

    async def _handle(self, stream: SocketStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                try:
                    head += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    return
            path = head.split(b" ", 2)[1].decode()
            self.hits.append(path)
            route = self.routes.get(path, (404, b"not found"))
            if isinstance(route, str):
                if route == "hang":
                    await anyio.sleep_forever()
                return  # "close": no response at all
            status, body = route
            response = (
                f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + body
            with suppress(anyio.BrokenResourceError, OSError):
                await stream.send(response)


async def free_port() -> int:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = int(listener.extra(SocketAttribute.local_port))
    await listener.aclose()
    return port


@asynccontextmanager
async def polling(config: PollerConfig) -> AsyncIterator[tuple[EnginePoller, list[ev.Event]]]:
    """A running poller; yields it and the list of every event it emitted."""
    events: list[ev.Event] = []
    poller = EnginePoller(config, tap="t", emit=events.append, wall_offset=OFFSET)
    async with anyio.create_task_group() as tg:
        tg.start_soon(poller.run)
        yield poller, events
        tg.cancel_scope.cancel()


def cfg(*urls: str, **kw: Any) -> PollerConfig:
    kw.setdefault("interval", 0.05)
    kw.setdefault("timeout", 1.0)
    return PollerConfig(urls=list(urls), **kw)


async def wait_sample(events: list[ev.Event], timeout: float = 3.0, **match: Any) -> Any:
    """The first emitted sample whose fields match (``deltas__x=1`` matches deltas["x"])."""

    def find() -> Any:
        for e in events:
            ok = True
            for key, want in match.items():
                if "__" in key:
                    outer, inner = key.split("__")
                    value = (getattr(e, outer, None) or {}).get(inner)
                else:
                    value = getattr(e, key, None)
                if value != want:
                    ok = False
                    break
            if ok:
                return e
        return None

    await wait_until(lambda: find() is not None, timeout)
    return find()


def engine(events: list[ev.Event], url: str) -> list[ev.EngineSample]:
    return [e for e in events if isinstance(e, ev.EngineSample) and e.url == url]


# ---- metrics -------------------------------------------------------------------------


async def test_scrape_state_then_deltas_then_restart() -> None:
    server = Server({"/metrics": (200, DP2.encode())})
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        url = server.url("/metrics")
        async with polling(cfg(url)) as (poller, events):
            first = await wait_sample(events, url=url)
            assert first.ok and first.status == 200 and first.source == "metrics"
            assert first.profile == "sglang"
            assert first.state["running"] == 53 and first.state["queued"] == 4
            assert first.deltas is None and first.interval is None and not first.restarted
            assert first.t == pytest.approx(first.m + OFFSET)
            assert 0 < first.elapsed < 1.0
            assert first.series[0]["labels"] == {
                "dp_rank": "0",
                "engine_type": "decode",
                "model_name": "qwen",
            }
            assert first.freshness["running"].startswith("gauge: refreshed every 40 decode")
            json.dumps(first.to_record())

            more = DP2.replace(
                'sglang:generation_tokens_total{model_name="qwen"} 1.84321e+06',
                'sglang:generation_tokens_total{model_name="qwen"} 1843310',
            )
            assert more != DP2
            server.routes["/metrics"] = (200, more.encode())
            grew = await wait_sample(events, url=url, deltas__generation_tokens_total=100)
            assert grew.ok and not grew.restarted and grew.interval > 0
            assert grew.deltas["prompt_tokens_total"] == 0

            restarted = DP2.replace("1.84321e+06", "10")
            server.routes["/metrics"] = (200, restarted.encode())
            again = await wait_sample(events, url=url, restarted=True)
            assert again.ok and again.deltas == {}
            assert poller.latest[url].state["generation_tokens_total"] in (10, 1843310)
        tg.cancel_scope.cancel()
    # no /v1/loads or /get_load here: each was asked once, then never again
    assert server.hits.count("/v1/loads") == 1 and server.hits.count("/get_load") == 1
    assert not [e for e in events if isinstance(e, ev.EngineSample) and e.source == "loads"]


async def test_timeout_refused_503_garbage_and_close() -> None:
    server = Server(
        {
            "/hang": "hang",
            "/busy": (503, b"overloaded"),
            "/garbage": (200, (DATA / "synthetic_garbage.prom").read_bytes()),
            "/close": "close",
        }
    )
    dead = f"http://127.0.0.1:{await free_port()}/metrics"
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        urls = [server.url(p) for p in ("/hang", "/busy", "/garbage", "/close")] + [dead]
        async with polling(cfg(*urls, timeout=0.2)) as (poller, events):
            hang = await wait_sample(events, url=urls[0])
            busy = await wait_sample(events, url=urls[1])
            garbage = await wait_sample(events, url=urls[2])
            closed = await wait_sample(events, url=urls[3])
            refused = await wait_sample(events, url=dead)
        tg.cancel_scope.cancel()
    assert (hang.ok, hang.error, hang.status) == (False, "timeout after 0.2s", None)
    assert 0.15 < hang.elapsed < 1.0
    assert (busy.ok, busy.error, busy.status) == (False, "HTTP 503", 503)
    assert not garbage.ok and garbage.status == 200
    assert garbage.error.startswith("unparseable: line 1: '<html><head><title>502 Bad Gateway")
    assert not closed.ok and closed.error.startswith("protocol error")
    assert (refused.ok, refused.error, refused.status) == (False, "refused", None)
    for sample in (hang, busy, garbage, closed, refused):
        assert sample.state == {} and sample.profile is None
        assert sample.t == pytest.approx(sample.m + OFFSET)
        json.dumps(sample.to_record())
    assert poller.busy(1) is None  # failed scrapes say nothing about load


async def test_a_hung_engine_does_not_delay_the_others() -> None:
    server = Server({"/hang": "hang", "/metrics": (200, DP2.encode())})
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        hung, fine = server.url("/hang"), server.url("/metrics")
        async with polling(cfg(hung, fine, timeout=5.0, loads=False)) as (_, events):
            with anyio.fail_after(2.0):  # far less than the hung scrape's 5 s timeout
                await wait_until(lambda: len(engine(events, fine)) >= 4)
            assert engine(events, hung) == []
        tg.cancel_scope.cancel()


async def test_partly_unparseable_body_keeps_the_good_lines() -> None:
    body = (DATA / "vllm_docs_design_metrics.prom").read_bytes()
    server = Server({"/metrics": (200, body)})
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        async with polling(cfg(server.url("/metrics"))) as (_, events):
            sample = await wait_sample(events, url=server.url("/metrics"))
        tg.cancel_scope.cancel()
    assert sample.ok and sample.profile == "vllm" and sample.state["running"] == 8
    assert sample.error.startswith("unparseable lines skipped: 3 (first: line 5: '...'")
    assert server.hits == ["/metrics"] * len(server.hits)  # vLLM: no loads endpoint asked


async def test_profile_override_and_raw() -> None:
    body = (DATA / "vllm_v1_engine_label_thirdparty_trimmed.prom").read_bytes()
    server = Server({"/metrics": (200, body)})
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        config = cfg(server.url("/metrics"), profile="llamacpp", keep_raw=True)
        async with polling(config) as (_, events):
            sample = await wait_sample(events, url=server.url("/metrics"))
        tg.cancel_scope.cancel()
    assert sample.profile == "llamacpp" and sample.state["running"] is None
    assert "vllm:num_requests_running" in sample.raw
    with pytest.raises(ValueError, match="unknown engine profile"):
        EnginePoller(cfg("http://x/metrics", profile="tgi"), tap="t", emit=print, wall_offset=0)


# ---- SGLang /v1/loads ----------------------------------------------------------------

LOADS = {
    "loads": [
        {"dp_rank": 0, "num_running_reqs": 30, "num_waiting_reqs": 3, "token_usage": 0.7},
        {"dp_rank": 1, "num_running_reqs": 23, "num_waiting_reqs": 1, "token_usage": 0.6},
    ]
}


async def test_loads_found_read_every_tick_and_busy() -> None:
    server = Server(
        {"/metrics": (200, DP2.encode()), "/v1/loads": (200, json.dumps(LOADS).encode())}
    )
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        metrics_url, loads_url = server.url("/metrics"), server.url("/v1/loads")
        async with polling(cfg(metrics_url)) as (poller, events):
            await wait_until(lambda: len(engine(events, loads_url)) >= 2)
            loads = engine(events, loads_url)[0]
            assert loads.source == "loads" and loads.ok and loads.profile == "sglang"
            assert loads.state["running"] == 53 and loads.state["queued"] == 4
            assert loads.state["token_usage"] == 0.7
            assert loads.series is not None and loads.freshness is not None
            assert loads.series[1] == {
                "labels": {"dp_rank": "1"},
                "running": 23,
                "queued": 1,
                "token_usage": 0.6,
                "gen_throughput": None,
            }
            assert loads.freshness["running"].startswith("live")
            reason = poller.busy(32)
            assert reason is not None
            assert reason.startswith("engine busy: running=53 + queued=4 = 57 >= 32 at http://")
            assert poller.busy(58) is None

            server.routes["/v1/loads"] = (500, b"oops")  # once known, failures are samples
            failed = await wait_sample(events, url=loads_url, ok=False)
            assert failed.error == "HTTP 500" and failed.source == "loads"
        tg.cancel_scope.cancel()
    assert "/get_load" not in server.hits


async def test_loads_falls_back_to_get_load() -> None:
    old = [{"dp_rank": 0, "num_reqs": 7, "num_waiting_reqs": 2, "num_tokens": 100}]
    server = Server({"/metrics": (200, DP2.encode()), "/get_load": (200, json.dumps(old).encode())})
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        async with polling(cfg(server.url("/metrics"))) as (_, events):
            sample = await wait_sample(events, url=server.url("/get_load"))
            await wait_until(lambda: len(engine(events, server.url("/get_load"))) >= 2)
        tg.cancel_scope.cancel()
    assert sample.ok and sample.state["running"] == 5 and sample.state["queued"] == 2
    assert server.hits.count("/v1/loads") == 1  # found the fallback once, kept it


# ---- health --------------------------------------------------------------------------


async def test_health_samples() -> None:
    server = Server({"/health": (200, b""), "/readiness": (503, b'{"status":"not ready"}')})
    dead = f"http://127.0.0.1:{await free_port()}/health"
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        health, ready = server.url("/health"), server.url("/readiness")
        config = PollerConfig(urls=[], health_urls=[health, ready, dead], interval=0.05)
        async with polling(config) as (poller, events):
            ok = await wait_sample(events, url=health)
            not_ready = await wait_sample(events, url=ready)
            refused = await wait_sample(events, url=dead)
        tg.cancel_scope.cancel()
    assert all(isinstance(e, ev.HealthSample) for e in events)
    assert (ok.ok, ok.status, ok.error) == (True, 200, None)
    assert (not_ready.ok, not_ready.status, not_ready.error) == (False, 503, None)
    assert (refused.ok, refused.status, refused.error) == (False, None, "refused")
    assert ok.t == pytest.approx(ok.m + OFFSET)
    assert poller.latest_health[health].ok and poller.latest == {}
