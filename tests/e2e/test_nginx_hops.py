"""nginx from Debian as a real third-party proxy: the stale-connection race.

A short ``keepalive_timeout`` and latency between nginx and the tap in front of it (a
delay line, since this kernel has no netem qdisc): nginx closes an idle keep-alive
connection while a request is already on its way to it — the proxy's fault, not the
client's (which would be writing after the close reached it; tests/e2e/test_attribution_e2e.py).

(``tcp_nodelay off`` was tried for delivery coalescing: on loopback Linux leaves the
delayed-ACK "pingpong" mode after the first delayed ACK, so Nagle holds almost nothing
and nginx does not bunch the events; that kind is tested from recorded timings.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.support.analyze import analyze_async
from tests.support.delayline import delay_line
from tests.support.engine import engine_running
from tests.support.nginx import nginx
from tests.support.procs import tracer_proxy

pytestmark = [pytest.mark.e2e, pytest.mark.anyio, pytest.mark.nginx]

BODY: dict[str, Any] = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}


async def test_nginx_closing_an_idle_connection_under_a_request_is_the_proxy(
    tmp_path: Path,
) -> None:
    """nginx keeps idle client connections 2 s (keepalive_timeout 2s); 0.3 s of latency
    lies between it and the tap in front, so nginx's idle clock starts 0.3 s before the
    client has its answer and nginx closes 1.7 s after the client has it; its FIN reaches
    the tap 0.3 s later still. The client's second request leaves in between (1.85 s):
    the tap forwards it onto a connection nginx no longer has."""
    front = tmp_path / "front.jsonl"
    async with engine_running(ttft=0.0, itl=0.001) as sim:
        async with nginx(tmp_path, sim.url, server="keepalive_timeout 2s;") as hop:
            async with delay_line(hop, 0.3) as far_hop:
                async with tracer_proxy(
                    "proxy", "--listen", "127.0.0.1:0", "--upstream", far_hop,
                    "--tap", "front", "--capture", str(front), "--stall-after", "5",
                ) as front_tap:  # fmt: skip
                    async with await anyio.connect_tcp("127.0.0.1", front_tap.port) as s:
                        payload = json.dumps({**BODY, "stream": False}).encode()
                        request = (
                            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                            % (len(payload), payload)
                        )
                        await s.send(request)
                        got = b""
                        with anyio.fail_after(5):
                            while b"}" not in got.partition(b"\r\n\r\n")[2]:
                                got += await s.receive()
                        assert got.startswith(b"HTTP/1.1 200"), got
                        answered = anyio.current_time()
                        await anyio.sleep_until(answered + 1.85)  # the client's think time
                        await s.send(request)
                        rest = b""
                        with anyio.fail_after(5):
                            try:
                                while True:
                                    rest += await s.receive()
                            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                                pass
                    assert not rest.startswith(b"HTTP/1.1 200"), rest
    result = await analyze_async(str(front))
    second = [r for r in result["requests"] if r["seq"] == 2]
    assert second and second[0]["termination"] == "truncated", result["requests"]
    kinds = {(f["party"], f["kind"]) for f in result["findings"]}
    assert ("proxy", "stale_connection_race") in kinds, result["findings"]
    assert result["verdict"]["party"] == "proxy"


async def test_nginx_timing_out_on_a_silent_engine_between_two_taps(tmp_path: Path) -> None:
    """nginx with ``proxy_read_timeout 1s`` between two taps, the engine silent for 2 s:
    before the first token nginx answers 504 itself, mid-stream it cuts the stream. The
    tap behind shows the engine's silence and nginx giving up on it; so the 504 is the
    hop's own and the cut the hop's timeout, and the engine's stall is still told."""
    front, back = tmp_path / "front.jsonl", tmp_path / "back.jsonl"
    async with engine_running(ttft=0.0, itl=0.01) as sim:
        metrics = ["--engine-metrics", f"{sim.url}/metrics", "--metrics-interval", "0.1"]
        async with tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", sim.url,
            "--tap", "back", "--capture", str(back), "--stall-after", "0.5", *metrics,
        ) as back_tap:  # fmt: skip
            async with nginx(tmp_path, back_tap.url, server="proxy_read_timeout 1s;") as hop:
                async with tracer_proxy(
                    "proxy", "--listen", "127.0.0.1:0", "--upstream", hop,
                    "--tap", "front", "--capture", str(front), "--stall-after", "0.5",
                ) as front_tap:  # fmt: skip
                    async with httpx.AsyncClient(timeout=10) as client:
                        for rid, fault in (
                            ("early", "stall:after=0:for=2"),
                            ("mid", "stall:after=2:for=2"),
                        ):
                            headers = {"x-request-id": rid, "x-sim-fault": fault}
                            try:
                                async with client.stream(
                                    "POST", front_tap.url + "/v1/chat/completions",
                                    json={**BODY, "max_tokens": 6}, headers=headers,
                                ) as r:  # fmt: skip
                                    status = r.status_code
                                    async for _ in r.aiter_bytes():
                                        pass
                            except httpx.HTTPError:
                                status = -1  # the cut, at the client
                            assert status == (504 if rid == "early" else -1), rid
    result = await analyze_async(str(front), str(back))
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for f in result["findings"]:
        by_kind.setdefault(f["kind"], []).append(f)
    rows = {r["id"]: r["request_id"] for r in result["requests"]}
    (answered,) = by_kind["proxy_error_status"]
    # the hop answered 504 itself: tap front got it, tap back did not
    assert {rows[i] for i in answered["requests"]} == {"early"}
    statuses = {
        e["tap"]: e["figures"].get("status")
        for e in answered["evidence"]
        if "termination" in e["figures"]
    }
    assert statuses["front"] == 504 and statuses["back"] != 504, answered["evidence"]
    (cut,) = by_kind["proxy_cut_stream"]
    # nginx's read timeout met the engine's silence at tap back, which came first
    assert {rows[i] for i in cut["requests"]} == {"mid"}
    assert cut["after_silence"] is not None and rows[cut["after_silence"]] == "mid"
    # the engine's silence, at the tap in front of it (no hop between): mid-stream a
    # stall; before the first token, 1 s of flat progress (nginx gave up then) is too
    # short to call a stall: what tap back saw is the 504's context (issue 35: one story,
    # not a second fault), with how long it waited and what it alone would have said
    stalls = [
        f
        for kind in ("engine_stall", "engine_stall_mid_stream", "upstream_silent")
        for f in by_kind.get(kind, [])
    ]
    assert sorted(rows[f["requests"][0]] for f in stalls) == ["mid"]
    context = [e["figures"] for e in answered["evidence"] if e["tap"] == "back"]
    assert any("waited" in f for f in context), answered["evidence"]
    assert {"context_of": "upstream_silent"} in context, answered["evidence"]
    assert all(f["requests"][0].startswith("back/") and f["party"] == "engine" for f in stalls)
    assert [rows[f["requests"][0]] for f in by_kind["engine_stall_mid_stream"]] == ["mid"]
    assert "engine_error_status" not in by_kind  # the 504 was not the engine's
    # 1 s of silence cannot be told from a slow first token: the verdict is the status
    # the hop produced itself, its settle pointing at the silence behind
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_error_status"), v
