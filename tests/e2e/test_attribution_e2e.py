"""End to end: real faults made by real processes, attributed from the capture alone.

The simulated engine's fault switches make the engine-side faults; the tap (a real
`tracer proxy` process) records them with engine metrics; `tracer analyze` (a real
process) must name the party and the kind — and a healthy control must stay clean.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from tests.support.analyze import analyze_async
from tests.support.engine import engine_running
from tests.support.incident import taps_around
from tests.support.net import wait_until
from tests.support.nginx import nginx
from tests.support.procs import tracer_proxy

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

BODY = {
    "model": "sim-model",
    "stream": True,
    "max_tokens": 6,
    "messages": [{"role": "user", "content": "hi"}],
}


async def _stream(
    client: httpx.AsyncClient, url: str, fault: str | None, body: dict[str, Any] = BODY
) -> None:
    headers = {"x-sim-fault": fault} if fault else {}
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers
        ) as r:
            async for _ in r.aiter_bytes():
                pass
    except httpx.HTTPError:
        pass  # the fault's symptom at the client; the capture is what is judged


async def run_case(
    tmp_path: Path, fault: str | None, *, client_timeout: float = 5.0, **engine: Any
) -> dict[str, Any]:
    capture = tmp_path / "cap.jsonl"
    async with engine_running(ttft=0.0, itl=0.005, **engine) as sim:
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            sim.url,
            "--capture",
            str(capture),
            "--engine-metrics",
            f"{sim.url}/metrics",
            "--metrics-interval",
            "0.1",
            "--stall-after",
            "0.5",
        ) as proc:
            async with httpx.AsyncClient(timeout=client_timeout) as client:
                await _stream(client, proc.url, None)  # a healthy request first
                await _stream(client, proc.url, fault)
                await _stream(client, proc.url, None)  # and after
    return await analyze_async(capture)


async def test_healthy_control_stays_clean(tmp_path: Path) -> None:
    result = await run_case(tmp_path, None)
    assert result["verdict"]["kind"] == "healthy"
    assert [f for f in result["findings"] if not f["note"]] == []


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        ("stall:after=2:for=3", "engine_stall_mid_stream"),
        ("lost", "engine_lost_request"),
        ("error:after=2", "engine_error_event"),
        ("500", "engine_error_status"),
        ("close:after=2", "engine_truncated"),
    ],
)
async def test_engine_faults_are_the_engine(fault: str, kind: str, tmp_path: Path) -> None:
    result = await run_case(tmp_path, fault, client_timeout=2.5)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("engine", kind), result["findings"]
    finding = result["findings"][0]
    assert finding["requests"] and finding["evidence"]
    assert any(r["party"] == "client" for r in finding["ruled_out"])


@pytest.mark.nginx
async def test_nginx_in_front_of_a_slow_stream_stays_clean(tmp_path: Path) -> None:
    """nginx from Debian (proxy_buffering on) in front of a slow stream: a healthy control.

    nginx 1.22 forwards each chunk of a chunked SSE response as it arrives even with
    proxy_buffering on (the events keep their 50 ms spacing), so nothing is held and
    the analysis must find no fault. The buffered-stream signature is tested with
    `tracer proxy --fault buffer-stream` as the buffering hop.
    """
    capture = tmp_path / "cap.jsonl"
    buffering = "proxy_buffering on;\n      proxy_buffers 64 16k;"
    async with (
        engine_running(ttft=0.0, itl=0.05) as sim,
        nginx(tmp_path, sim.url, location=buffering) as hop,
    ):
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            hop,
            "--capture",
            str(capture),
            "--engine-metrics",
            f"{sim.url}/metrics",
            "--metrics-interval",
            "0.1",
        ) as proc:
            async with httpx.AsyncClient(timeout=10) as client:
                body = {**BODY, "max_tokens": 30}
                async with client.stream("POST", proc.url + "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_bytes():
                        pass
    result = await analyze_async(capture)
    assert result["verdict"]["kind"] == "healthy", result["findings"]
    request = result["requests"][0]
    assert request["termination"] == "complete" and request["events"] >= 30
    # the engine's 50 ms pacing survived nginx: few events bunched, most gaps near 50 ms
    # (bounds that hold on a loaded machine, where some gaps stretch past 60 ms)
    assert request["zero_gaps"] <= request["event_gaps"] // 3
    assert request["bunch_gaps"] >= request["event_gaps"] // 2


async def test_client_not_reading_and_abort_are_the_client(tmp_path: Path) -> None:
    import socket

    capture = tmp_path / "cap.jsonl"
    # the engine writes fast (0.2 ms a token), so that the kernel's buffers towards the
    # client that does not read fill within seconds even on a loaded machine
    async with engine_running(ttft=0.0, itl=0.0002) as sim:
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            sim.url,
            "--capture",
            str(capture),
            "--stall-after",
            "0.3",
        ) as proc:
            payload = json.dumps({**BODY, "max_tokens": 100000}).encode()
            request = (
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                b"\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            # a client that stops reading: a tiny receive buffer, never read
            with socket.socket() as slow:
                slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                slow.connect(("127.0.0.1", proc.port))
                slow.sendall(request)

                def stalled() -> bool:
                    return capture.exists() and b"client_not_reading" in capture.read_bytes()

                await wait_until(stalled, timeout=30)
            # a client that reads a little, then hangs up
            async with await anyio.connect_tcp("127.0.0.1", proc.port) as s:
                await s.send(request.replace(b"20000", b"400  "))
                await s.receive()
    result = await analyze_async(capture)
    found = {(f["party"], f["kind"]) for f in result["findings"]}
    assert ("client", "client_not_reading") in found, result["findings"]
    assert ("client", "client_abort") in found, result["findings"]
    assert result["verdict"]["party"] == "client"


async def test_a_buffering_hop_is_the_proxy(tmp_path: Path) -> None:
    """A hop that holds the whole stream (`--fault buffer-stream`, as nginx with buffering
    does for some responses): the tap in front sees one burst at the end while the
    engine's decode progress (written every 40 decode steps, as SGLang's
    realtime_tokens_total) rose meanwhile: 120 tokens, three writes inside the stream."""
    capture = tmp_path / "cap.jsonl"
    async with engine_running(ttft=0.0, itl=0.02) as sim:
        async with (
            tracer_proxy(
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                sim.url,
                "--tap",
                "buffering",
                "--fault",
                "buffer-stream",
            ) as hop,
            tracer_proxy(
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                hop.url,
                "--capture",
                str(capture),
                "--engine-metrics",
                f"{sim.url}/metrics",
                "--metrics-interval",
                "0.1",
            ) as proc,
        ):
            async with httpx.AsyncClient(timeout=10) as client:
                body = {**BODY, "max_tokens": 120}
                async with client.stream("POST", proc.url + "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_bytes():
                        pass
    result = await analyze_async(capture)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "buffered_response"), result["findings"]


async def test_a_hop_that_cuts_the_stream_between_two_taps(tmp_path: Path) -> None:
    async def drive(url: str) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            for i in range(2):
                await _stream(client, url, None)
                del i

    front, back = tmp_path / "front.jsonl", tmp_path / "back.jsonl"
    async with engine_running(ttft=0.0, itl=0.01) as sim:
        async with taps_around(sim.url, "truncate-after-events:3@pos=2", front, back) as (url, _):
            await drive(url)
    result = await analyze_async(front, back)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_cut_stream"), result["findings"]
    assert [r["party"] for r in v["ruled_out"]] == ["engine"]


async def _one_stream_through_a_hop(
    tmp_path: Path, fault: str, itl: float, tokens: int
) -> dict[str, Any]:
    """One stream through tap front, a hop with ``--fault FAULT``, tap back, the engine;
    the analysis of both captures (no engine metrics)."""
    front, back = tmp_path / "front.jsonl", tmp_path / "back.jsonl"
    async with engine_running(ttft=0.0, itl=itl) as sim:
        async with taps_around(
            sim.url, fault, front, back, front_args=["--stall-after", "0.5"]
        ) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                await _stream_body(client, url, {**BODY, "max_tokens": tokens})
    return await analyze_async(front, back)


async def test_a_hop_that_holds_a_stream_between_two_taps(tmp_path: Path) -> None:
    """The hop stops relaying after 3 events for 2 s; the tap behind it got the whole
    stream without a gap, the tap in front nothing for 2 s: the hop, with no engine
    metrics needed."""
    result = await _one_stream_through_a_hop(tmp_path, "stall-after-events:3:2", 0.01, 6)
    v = result["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == ("proxy", "proxy_held_stream", "high"), (
        result["findings"]
    )
    assert {r["party"] for r in v["ruled_out"]} == {"engine", "client"}
    (finding,) = [f for f in result["findings"] if not f["note"]]
    assert sorted(finding["requests"]) == ["back/1/1", "front/1/1"]


async def test_a_buffering_hop_between_two_taps(tmp_path: Path) -> None:
    """The hop holds the whole stream (`buffer-stream`): one burst at the end at the tap in
    front, the stream as it came at the tap behind; no engine metrics needed."""
    result = await _one_stream_through_a_hop(tmp_path, "buffer-stream", 0.05, 30)
    v = result["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == ("proxy", "buffered_response", "high"), (
        result["findings"]
    )
    # the hop between the two taps: the stream as it came at tap back
    (f,) = [f for f in result["findings"] if f["id"] == v["finding"]]
    assert sorted(f["requests"]) == ["back/1/1", "front/1/1"]
    assert {r["party"] for r in f["ruled_out"]} == {"client", "engine"}


async def test_a_hop_answering_503_without_forwarding_between_two_taps(tmp_path: Path) -> None:
    """The hop answers every second request 503 itself (`status:503@every=2`): the tap
    behind never sees those, so the 503 is the hop's, not the engine's."""
    front, back = tmp_path / "front.jsonl", tmp_path / "back.jsonl"
    async with engine_running(ttft=0.0, itl=0.005) as sim:
        async with taps_around(sim.url, "status:503@every=2", front, back) as (url, _):
            async with httpx.AsyncClient(timeout=5) as client:
                for _ in range(2):
                    await _stream(client, url, None)
    result = await analyze_async(front, back)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_error_status"), result["findings"]
    # answered 503 itself: the request never reached tap back
    (f,) = [f for f in result["findings"] if f["id"] == v["finding"]]
    assert [e["figures"]["status"] for e in f["evidence"] if "termination" in e["figures"]] == [503]
    assert [
        e["figures"]["never_seen_at"] for e in f["evidence"] if "never_seen_at" in e["figures"]
    ] == [["back"]]
    assert not any(f["kind"] == "engine_error_status" for f in result["findings"])


async def test_an_sdk_retry_after_a_hang_on_reuse_without_request_ids(tmp_path: Path) -> None:
    """The openai SDK, no x-request-id: the hop holds the second request of a keep-alive
    connection; the SDK times out and sends it again (the same body) on a fresh one,
    which goes through. The first attempt is the one tap back never saw: the hop."""
    front, back = tmp_path / "front.jsonl", tmp_path / "back.jsonl"
    async with engine_running(ttft=0.0, itl=0.005) as sim:
        async with taps_around(
            sim.url, "hang-on-reuse:2", front, back, front_args=["--stall-after", "0.5"]
        ) as (url, _):
            client = openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="x", timeout=1.5, max_retries=1
            )
            async with client:
                for turn in ("first", "second"):
                    stream = await client.chat.completions.create(
                        model="sim-model",
                        messages=[{"role": "user", "content": turn}],
                        max_tokens=4,
                        stream=True,
                    )
                    async for _ in stream:
                        pass
    result = await analyze_async(front, back)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_hung_on_reuse"), result["findings"]
    rows = {r["id"]: r for r in result["requests"]}
    assert (rows["front/1/2"]["retry_count"], rows["front/2/1"]["retry_count"]) == (0, 1)
    # the hop between tap front and tap back: the first attempt never reached tap back
    (f,) = [f for f in result["findings"] if f["id"] == v["finding"]]
    assert f["requests"] == ["front/1/2"]
    assert any(e["figures"].get("never_seen_at") == ["back"] for e in f["evidence"])


async def test_a_hop_that_swallows_a_fresh_request(tmp_path: Path) -> None:
    front, back = tmp_path / "front.jsonl", tmp_path / "back.jsonl"
    async with engine_running(ttft=0.0, itl=0.01) as sim:
        evidence = ["--engine-metrics", f"{sim.url}/metrics", "--metrics-interval", "0.1"]
        async with taps_around(
            sim.url,
            "drop-request@times=1,pos=1",
            front,
            back,
            back_args=evidence,
            front_args=["--stall-after", "0.5", *evidence],
        ) as (front_url, _):
            async with httpx.AsyncClient(timeout=1.5) as first:
                await _stream(first, front_url, None)  # dropped: hangs until timeout
            async with httpx.AsyncClient(timeout=5) as second:
                await _stream(second, front_url, None)  # a fresh one goes through
    result = await analyze_async(front, back)
    v = result["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == (
        "proxy",
        "proxy_swallowed_request",
        "high",
    ), result["findings"]
    # the taps share this machine's clock, so the second request's copy at tap back is
    # joined to it by time, not to the swallowed first (counted per tap, that pair was
    # 1.5 s apart: the client's timeout)
    swallowed = next(f for f in result["findings"] if f["kind"] == "proxy_swallowed_request")
    assert swallowed["requests"] == ["front/1/1"]
    (pair,) = result["evidence"]["tap_pairs"]
    assert pair["shared"] == 1 and 0 < pair["median_delay"] < 0.5, pair


async def test_client_idle_hang_at_a_client_facing_tap(tmp_path: Path) -> None:
    capture = tmp_path / "cap.jsonl"
    async with engine_running(ttft=0.0, itl=0.001) as sim:
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            sim.url,
            "--capture",
            str(capture),
            "--tap",
            "front",
            "--engine-metrics",
            f"{sim.url}/metrics",
            "--metrics-interval",
            "0.1",
        ) as proc:
            async with httpx.AsyncClient(timeout=5) as client:
                await _stream(client, proc.url, None)
                await _stream(client, proc.url, None)
    # the harness says it hung 0.3 s after the last answer ended (a loaded machine may
    # take longer than a second to get there)
    records = [json.loads(line) for line in capture.read_text().splitlines()]
    last_end = max(r["t"] for r in records if r["type"] == "response_end")
    hang_at = f"+{last_end - records[0]['t'] + 0.3:.3f}"
    result = await analyze_async(capture, "--hang-at", hang_at, "--client-facing", "front")
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("client", "client_idle_hang"), result["findings"]
    assert [r["party"] for r in v["ruled_out"]] == ["engine"]


async def test_request_on_a_connection_the_upstream_closed_is_the_client(tmp_path: Path) -> None:
    """The upstream closes an idle keep-alive connection (uvicorn's 5 s, here 0.3 s); the
    client ignores the FIN it was passed and writes its next request anyway."""
    capture = tmp_path / "cap.jsonl"
    async with engine_running(ttft=0.0, itl=0.001, keepalive=0.3) as sim:
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            sim.url,
            "--capture",
            str(capture),
        ) as proc:
            payload = json.dumps({**BODY, "stream": False}).encode()
            request = (
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            async with await anyio.connect_tcp("127.0.0.1", proc.port) as s:
                await s.send(request)
                got = b""
                with anyio.fail_after(5):
                    try:
                        while True:  # the answer, then the FIN the upstream's close became
                            got += await s.receive()
                    except anyio.EndOfStream:
                        pass
                assert got.startswith(b"HTTP/1.1 200")
                await s.send(request)  # on a connection whose far side is gone
    result = await analyze_async(capture)
    found = {(f["party"], f["kind"]) for f in result["findings"]}
    assert ("client", "client_reused_closed_connection") in found, result["findings"]
    (f,) = [f for f in result["findings"] if f["kind"] == "client_reused_closed_connection"]
    # written at once after the FIN came: on one machine that cannot be told from the race
    (gone,) = [
        e["figures"]["upstream_closed_before"]
        for e in f["evidence"]
        if "upstream_closed_before" in e["figures"]
    ]
    assert 0 < gone < 1.0
    assert f["confidence"] == ("medium" if gone < 0.01 else "high")


async def test_a_hop_that_bunches_events_is_where_delivery_coalesces(tmp_path: Path) -> None:
    """A hop that sends each event late and in bunches ~40 ms apart (`--fault
    coalesce:0.04`: Nagle meeting delayed ACKs): steady at the tap behind it, bunched at
    the tap in front; the finding names the hop between the two taps."""
    front, back = tmp_path / "front.jsonl", tmp_path / "back.jsonl"
    async with engine_running(ttft=0.0, itl=0.005) as sim:
        async with taps_around(sim.url, "coalesce:0.04", front, back) as (front_url, _):
            async with httpx.AsyncClient(timeout=20) as client:
                body = {**BODY, "max_tokens": 100}
                async with client.stream(
                    "POST", front_url + "/v1/chat/completions", json=body
                ) as r:
                    chunks = [c async for c in r.aiter_bytes()]
    assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    result = await analyze_async(front, back)
    by_tap = {r["tap"]: r for r in result["requests"]}
    assert by_tap["back"]["bunch_gaps"] < 5 < by_tap["front"]["bunch_gaps"], by_tap
    found = [f for f in result["findings"] if f["kind"] == "delivery_coalesced"]
    assert found and found[0]["party"] == "proxy", result["findings"]
    # bunched at tap front, steady at tap back: the hop between them — unless a tap was
    # itself starved then (a loaded machine): its timings cannot testify, a note by design
    starved = [e for e in found[0]["evidence"] if "max_lag" in e["figures"]]
    assert found[0]["confidence"] == ("low" if starved else "high"), found[0]
    assert sorted(found[0]["requests"]) == ["back/1/1", "front/1/1"], found[0]
    assert {e["tap"] for e in found[0]["evidence"]} == {"front", "back"}


async def test_queueing_under_load_is_a_load_note_not_a_fault(tmp_path: Path) -> None:
    """More streams than the engine runs at once: the later ones wait seconds for their
    first token while running/queued are high and the counters rise — load, no fault."""
    capture = tmp_path / "cap.jsonl"
    async with engine_running(ttft=0.0, itl=0.02, max_running=1) as sim:
        async with tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", sim.url,
            "--capture", str(capture), "--engine-metrics", f"{sim.url}/metrics",
            "--metrics-interval", "0.1", "--stall-after", "0.5",
        ) as proc:  # fmt: skip
            async with httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as tg:
                body = {**BODY, "max_tokens": 40}  # ~0.8 s each, one at a time
                for _ in range(5):
                    tg.start_soon(_stream_body, client, proc.url, body)
    result = await analyze_async(capture)
    assert result["verdict"]["kind"] == "healthy", result["findings"]
    notes = [f for f in result["findings"] if f["note"]]
    assert [f["kind"] for f in notes] == ["engine_queueing"], result["findings"]
    assert len(notes[0]["requests"]) >= 2
    # load, with the engine's figures: requests queued while they waited
    assert any((e["figures"].get("queued_max") or 0) > 0 for e in notes[0]["evidence"])


async def _stream_body(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for _ in r.aiter_bytes():
            pass


async def test_an_engine_that_is_gone_is_unreachable(tmp_path: Path, refused_port: int) -> None:
    """The engine process is gone (nothing listens on its port): the tap answers 502 and
    the finding says the upstream was unreachable, with the connect error quoted."""
    capture = tmp_path / "cap.jsonl"
    port = refused_port  # nothing listens there
    async with tracer_proxy(
        "proxy", "--listen", "127.0.0.1:0", "--upstream", f"http://127.0.0.1:{port}",
        "--capture", str(capture),
    ) as proc:  # fmt: skip
        async with httpx.AsyncClient(timeout=5) as client:
            r = await client.post(proc.url + "/v1/chat/completions", json=BODY)
            assert r.status_code == 502
    result = await analyze_async(capture)
    v = result["verdict"]
    assert v["kind"] == "upstream_unreachable" and v["party"] in ("engine", "unknown"), v
    finding = result["findings"][0]
    (connect,) = [e for e in finding["evidence"] if "connect_failed" in e["figures"]]
    assert "refused" in connect["figures"]["connect_failed"].lower(), connect
    assert connect["figures"]["tls"] is False


async def _through_a_faulty_hop(
    tmp_path: Path, hop_fault: str, *, metrics: bool, max_tokens: int = 6
) -> dict[str, Any]:
    """client -> tap (capture) -> `tracer proxy --fault HOP_FAULT` -> sim engine: one tap,
    in front of a proxy that misbehaves; engine metrics only when ``metrics``."""
    capture = tmp_path / "cap.jsonl"
    async with engine_running(ttft=0.0, itl=0.02) as sim:
        evidence = ["--engine-metrics", f"{sim.url}/metrics", "--metrics-interval", "0.1"]
        async with tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", sim.url,
            "--tap", "hop", "--fault", hop_fault,
        ) as hop:  # fmt: skip
            async with tracer_proxy(
                "proxy", "--listen", "127.0.0.1:0", "--upstream", hop.url,
                "--capture", str(capture), "--stall-after", "0.5",
                *(evidence if metrics else []),
            ) as proc:  # fmt: skip
                async with httpx.AsyncClient(timeout=3.0) as client:
                    await _stream(client, proc.url, None, {**BODY, "max_tokens": max_tokens})
    return await analyze_async(capture)


async def test_a_hop_holding_a_stream_while_the_engine_generates_is_the_proxy(
    tmp_path: Path,
) -> None:
    """The hop stops relaying after 3 events for 2 s while the engine goes on generating
    (its counters rise): tokens were made that did not reach the tap — the hop held them.
    60 tokens (1.2 s of decode) keep the engine generating through most of the hold, so
    the poller's samples (every 0.1 s, later on a loaded machine) see it inside it."""
    result = await _through_a_faulty_hop(
        tmp_path, "stall-after-events:3:2", metrics=True, max_tokens=60
    )
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("proxy", "proxy_held_stream"), result["findings"]


async def test_a_hop_cutting_a_stream_with_no_second_tap_is_a_cut_of_unknown_origin(
    tmp_path: Path,
) -> None:
    """The hop closes after 3 events; one tap in front of it, upstream not the serving
    stack: the stream was cut, and which hop cut it is left open with how to settle it."""
    result = await _through_a_faulty_hop(tmp_path, "truncate-after-events:3", metrics=False)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("unknown", "stream_cut"), result["findings"]
    assert result["findings"][0]["settle"]


async def test_silence_with_no_engine_evidence_is_upstream_silent_unknown(tmp_path: Path) -> None:
    """The hop swallows the request; one tap in front and no engine metrics: nothing came
    back, and the analysis says so without guessing, naming what would settle it."""
    result = await _through_a_faulty_hop(tmp_path, "drop-request", metrics=False)
    v = result["verdict"]
    assert (v["party"], v["kind"]) == ("unknown", "upstream_silent"), result["findings"]
    assert "--engine-metrics" in result["findings"][0]["settle"]
