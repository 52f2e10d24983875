"""The real chain: harness -> tap -> the real SGLang router (smg) -> two simulated engines.

The tap scrapes both engines and the router's own metrics port; the capture must hold
all three, and the engines' token counters must account for every token the harness
received. A second test puts the poller against one engine under load: running and
queued rise and fall as they should.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.analyze import analyze_async
from tests.support.engine import SMG, engine_running, router, smg_router
from tests.support.net import wait_until
from tests.support.procs import mitmdump, tracer_proxy
from tracer.capture.files import read_records
from tracer.sim.engine import parse_fault
from tracer.sim.harness import HarnessConfig, run_harness

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]


@pytest.mark.skipif(not SMG.exists(), reason="smg (sglang-router) is not installed")
async def test_harness_through_tap_and_router_with_engine_evidence(tmp_path: Path) -> None:
    capture = tmp_path / "front.jsonl"
    sessions, rounds, max_tokens = 2, 3, 8
    async with (
        engine_running(ttft=0.0, itl=0.002) as w1,
        engine_running(ttft=0.0, itl=0.002) as w2,
        router(tmp_path, w1.url, w2.url) as (router_url, router_metrics),
        tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            router_url,
            "--capture",
            str(capture),
            "--tap",
            "front",
            "--engine-metrics",
            f"{w1.url}/metrics",
            "--engine-metrics",
            f"{w2.url}/metrics",
            "--engine-metrics",
            router_metrics,
            "--health",
            f"{router_url}/readiness",
            "--metrics-interval",
            "0.2",
        ) as proc,
    ):
        report = await run_harness(
            HarnessConfig(
                base_url=proc.url,
                sessions=sessions,
                rounds=rounds,
                think=0.1,
                max_tokens=max_tokens,
                deadline=20,
            )
        )
        total = sessions * rounds * max_tokens
        assert w1.scheduler.generation_tokens_total + w2.scheduler.generation_tokens_total == total

        def engines_caught_up() -> bool:
            latest: dict[str, int] = {}
            for r in read_records(capture):
                if (
                    r["type"] == "engine"
                    and r["ok"]
                    and r["source"] == "metrics"
                    and r["profile"] == "sglang"
                ):
                    latest[r["url"]] = r["state"]["generation_tokens_total"] or 0
            return len(latest) == 2 and sum(latest.values()) == total

        await wait_until(engines_caught_up, timeout=10)
    assert [r.outcome for r in report.rounds] == ["complete"] * (sessions * rounds)
    records = list(read_records(capture))
    samples = [r for r in records if r["type"] == "engine" and r["source"] == "metrics"]
    assert any(r["type"] == "engine" and r["source"] == "loads" for r in records)
    by_url: dict[str, list[dict[str, object]]] = {}
    for s in samples:
        by_url.setdefault(str(s["url"]), []).append(s)
    assert set(by_url) == {f"{w1.url}/metrics", f"{w2.url}/metrics", router_metrics}
    router_ok = [s for s in by_url[router_metrics] if s["ok"]]
    assert router_ok and router_ok[-1]["profile"] in ("smg", "sgl_router")
    # counters: first value + the deltas = the tokens the harness received
    accounted = 0
    for url in (f"{w1.url}/metrics", f"{w2.url}/metrics"):
        ok = [s for s in by_url[url] if s["ok"]]
        first = ok[0]["state"]["generation_tokens_total"]  # type: ignore[index]
        deltas = sum(
            int(s["deltas"].get("generation_tokens_total") or 0)  # type: ignore[union-attr]
            for s in ok[1:]
            if s.get("deltas")
        )
        assert first + deltas == ok[-1]["state"]["generation_tokens_total"]  # type: ignore[index]
        accounted += first + deltas
    assert accounted == total
    health = [r for r in records if r["type"] == "health"]
    assert health and health[-1]["ok"] and health[-1]["status"] == 200
    requests = [r for r in records if r["type"] == "request"]
    assert len(requests) == sessions * rounds
    assert sorted(r["seq"] for r in requests) == [1, 1, 2, 2, 3, 3]  # keep-alive reuse kept


async def test_poller_sees_load_rise_and_fall(tmp_path: Path) -> None:
    """max_running=2 and 6 concurrent streams: running 2, queued up to 4, then both 0."""
    capture = tmp_path / "watch.jsonl"
    async with engine_running(
        ttft=0.0, itl=0.02, max_running=2, decode_log_interval=1, idle_refresh=0.2
    ) as engine:
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            engine.url,
            "--capture",
            str(capture),
            "--engine-metrics",
            f"{engine.url}/metrics",
            "--metrics-interval",
            "0.05",
        ) as proc:
            report = await run_harness(
                HarnessConfig(base_url=proc.url, sessions=6, rounds=1, max_tokens=20, deadline=20)
            )

            def idle_again() -> bool:
                states = [
                    r["state"]
                    for r in read_records(capture)
                    if r["type"] == "engine" and r["ok"] and r["source"] == "metrics"
                ]
                return bool(states) and states[-1]["running"] == 0 and states[-1]["queued"] == 0

            await wait_until(idle_again, timeout=10)
    assert all(r.outcome == "complete" for r in report.rounds)
    states = [
        r["state"]
        for r in read_records(capture)
        if r["type"] == "engine" and r["ok"] and r["source"] == "metrics"
    ]
    assert max(s["running"] for s in states) == 2
    assert max(s["queued"] for s in states) >= 2
    loads = [
        r["state"]
        for r in read_records(capture)
        if r["type"] == "engine" and r["source"] == "loads" and r["ok"]
    ]
    assert loads and max(s["running"] for s in loads) == 2


def _tap(name: str, upstream: str, capture: Path, *extra: str) -> Any:
    """`tracer proxy` as tap ``name`` in front of ``upstream``, writing ``capture``."""
    args = ("--listen", "127.0.0.1:0", "--upstream", upstream, "--tap", name)
    return tracer_proxy("proxy", *args, "--capture", str(capture), *extra)


@asynccontextmanager
async def taps_around_the_router(
    tmp_path: Path, *, e1_faults: Sequence[str] = (), hop_fault: str | None = None
) -> AsyncIterator[tuple[str, list[Path]]]:
    """Two simulated engines, a tap in front of each (e1, e2), the real router in front of
    both taps, optionally a `tracer proxy --fault` hop, and a tap in front of it all
    (front); yields the front tap's URL and the captures (front, e1, e2)."""
    front, e1, e2 = (tmp_path / f"{name}.jsonl" for name in ("front", "e1", "e2"))
    async with (
        engine_running(ttft=0.0, itl=0.002, faults=[parse_fault(f) for f in e1_faults]) as w1,
        engine_running(ttft=0.0, itl=0.002) as w2,
        _tap("e1", w1.url, e1) as tap1,
        _tap("e2", w2.url, e2) as tap2,
        router(tmp_path, tap1.url, tap2.url) as (router_url, _),
        tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", router_url,
            "--tap", "hop", *(["--fault", hop_fault] if hop_fault else []),
        ) as hop,
        _tap("front", hop.url, front, "--stall-after", "0.5") as front_tap,
    ):  # fmt: skip
        yield front_tap.url, [front, e1, e2]


async def _questions(url: str, n: int, *, timeout: float = 5.0) -> list[int | None]:
    """``n`` streamed chat requests on one keep-alive client, each its own question, with
    the openai SDK's retry count header; the status of each (None: timed out)."""
    body = {"model": "sim-model", "stream": True, "max_tokens": 4}
    statuses: list[int | None] = []
    async with httpx.AsyncClient(timeout=timeout) as client:
        for i in range(n):
            question = {"messages": [{"role": "user", "content": f"question {i}"}]}
            try:
                async with client.stream(
                    "POST",
                    url + "/v1/chat/completions",
                    json=body | question,
                    headers={"x-stainless-retry-count": "0"},  # the router drops it
                ) as r:
                    async for _ in r.aiter_bytes():
                        pass
                    statuses.append(r.status_code)
            except httpx.ReadTimeout:
                statuses.append(None)
    return statuses


@pytest.mark.skipif(not SMG.exists(), reason="smg (sglang-router) is not installed")
async def test_taps_in_front_of_each_engine_behind_the_router(tmp_path: Path) -> None:
    """A tap in front of the router and one in front of each of its two engines: the
    router sends each request to one of them, so the taps behind it see none of each
    other's requests. Each is one hop behind the front tap (not a chain of three), and
    a request the hop in front of the router swallows never reached either of them.
    The requests join although the router re-writes their bodies and drops the SDK's
    retry count header; and the router, which does not set TCP_NODELAY, holds the first
    event of streams on a reused connection ~40 ms (the front tap's delayed ACK)."""
    async with taps_around_the_router(tmp_path, hop_fault="drop-request@times=1,pos=5") as (
        url,
        captures,
    ):
        statuses = await _questions(url, 10, timeout=1.5)
    assert [i for i, s in enumerate(statuses) if s is None] == [4]  # the one swallowed
    front = captures[0]
    result = await analyze_async(*captures)
    pairs = {(p["from"], p["to"]): p["shared"] for p in result["evidence"]["tap_pairs"]}
    assert pairs.keys() == {("front", "e1"), ("front", "e2")}, pairs
    assert all(shared >= 2 for shared in pairs.values()), pairs
    assert all(p["one_clock"] for p in result["evidence"]["tap_pairs"])  # one machine
    v = result["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == ("proxy", "proxy_hung_on_reuse", "high")
    finding = result["findings"][0]
    assert finding["id"] == v["finding"] and finding["requests"] == ["front/1/5"]
    # the hop between tap front and the taps of the engines: seen at neither
    assert any(e["figures"].get("never_seen_at") == ["e1", "e2"] for e in finding["evidence"])
    held = [f for f in result["findings"] if f["kind"] == "first_event_held"]
    assert held, result["findings"]
    for f in held:
        assert f["party"] == "proxy" and f["note"] is True, f
        # late at tap front, at once at an engine's tap: the hop between them
        assert f["evidence"][0]["tap"] == "front", f
        assert f["evidence"][0]["figures"]["behind"] in ("e1", "e2"), f
        assert all(r.startswith(("front/", "e1/", "e2/")) for r in f["requests"])
    # the front tap alone: held on reused connections, at once on fresh ones
    alone = await analyze_async(front)
    (note,) = [f for f in alone["findings"] if f["kind"] == "first_event_held"]
    assert (note["party"], note["confidence"], note["note"]) == ("proxy", "medium", True), note
    reused, fresh = note["evidence"][:2]  # held on reused connections, not on fresh ones
    assert reused["tap"] == "front" and reused["figures"]["reused_held"] >= 3, note
    assert fresh["figures"]["fresh_prompt"] >= 1, note


@pytest.mark.skipif(not SMG.exists(), reason="smg (sglang-router) is not installed")
async def test_a_5xx_the_router_retries_on_another_engine_is_a_note(tmp_path: Path) -> None:
    """Engine 1 answers 500 to everything; the router sends each such request again to
    engine 2, and the client gets its answer. Engine 1's 500s are told, as notes: the
    client never saw them. The taps in front of the engines saw the same requests, one
    after the other: they are not a chain (each is one hop behind the front tap)."""
    async with taps_around_the_router(tmp_path, e1_faults=["500"]) as (url, captures):
        statuses = await _questions(url, 4)
    assert statuses == [200] * 4
    result = await analyze_async(*captures)
    assert result["verdict"]["kind"] == "healthy", result["findings"]
    pairs = {(p["from"], p["to"]): p["shared"] for p in result["evidence"]["tap_pairs"]}
    assert pairs.keys() == {("front", "e1"), ("front", "e2")}, pairs
    errors = [f for f in result["findings"] if f["kind"] == "engine_error_status"]
    # round robin: half of them went to e1 (identical findings are one, naming them all)
    assert sum(f.get("grouped", 1) for f in errors) >= 2, result["findings"]
    for f in errors:
        assert f["note"] is True and f["requests"][0].startswith("e1/"), f
        # the client did not see it: the router sent it again to engine 2, which answered
        answered = f["evidence"][-1]["figures"]
        assert (answered["sent_to"], answered["sent"]) == ("e2", "again"), f["evidence"]
        assert answered["termination"] == "complete", f["evidence"]


@pytest.mark.skipif(not SMG.exists(), reason="smg (sglang-router) is not installed")
async def test_taps_on_the_legs_of_pd_disaggregation(tmp_path: Path) -> None:
    """The router in PD mode sends each request to a prefill and a decode engine at once,
    with a tap in front of each and one in front of the router. The legs' taps are each
    one hop behind the front tap, side by side (not a chain: they see the same requests
    at the same time, neither inside the other's). The prefill engine cuts its answer to
    the second request; the client gets its stream from the decode leg all the same, so
    the cut is a note."""
    front, p, d = (tmp_path / f"{name}.jsonl" for name in ("front", "p", "d"))
    async with (
        engine_running(  # its cut comes well after the decode leg began, even on a busy
            # machine: the legs are sent together, and this one answers 0.3 s later
            ttft=0.3, itl=0.02, engine_type="prefill", faults=[parse_fault("close:after=2@nth=2")]
        ) as prefill,
        engine_running(ttft=0.0, itl=0.002, engine_type="decode") as decode,
        _tap("p", prefill.url, p) as p_tap,
        _tap("d", decode.url, d) as d_tap,
        smg_router(
            tmp_path, "--pd-disaggregation", "--prefill", p_tap.url, "--decode", d_tap.url
        ) as smg,
        _tap("front", smg.url, front) as front_tap,
    ):  # fmt: skip
        if not smg.ready:
            pytest.skip("smg refused simulated PD workers: " + smg.log.read_text()[-2000:])
        assert await _questions(front_tap.url, 4) == [200] * 4
    result = await analyze_async(front, p, d)
    pairs = {(p["from"], p["to"]): p["shared"] for p in result["evidence"]["tap_pairs"]}
    assert pairs == {("front", "p"): 4, ("front", "d"): 4}, pairs
    assert result["verdict"]["kind"] == "healthy", result["findings"]
    (cut,) = [f for f in result["findings"] if f["kind"] in ("stream_cut", "engine_truncated")]
    assert cut["note"] is True and [r[:2] for r in cut["requests"]] == ["p/"], cut
    answered = cut["evidence"][-1]["figures"]  # sent at the same time to tap d, which answered
    assert (answered["sent_to"], answered["sent"]) == ("d", "at_once"), cut


@pytest.mark.skipif(not SMG.exists(), reason="smg (sglang-router) is not installed")
async def test_the_mitmproxy_addon_in_front_of_the_router(tmp_path: Path) -> None:
    """mitmdump with addons/trace.py as the front tap, the native tap in front of each
    engine: the captures join across the router (one boot, one clock), the engine taps
    are side by side, and the router's held first events are found from mitmproxy's
    side as from the native tap's."""
    e1, e2 = tmp_path / "e1.jsonl", tmp_path / "e2.jsonl"
    async with (
        engine_running(ttft=0.0, itl=0.002) as w1,
        engine_running(ttft=0.0, itl=0.002) as w2,
        _tap("e1", w1.url, e1) as tap1,
        _tap("e2", w2.url, e2) as tap2,
        router(tmp_path, tap1.url, tap2.url) as (router_url, _),
        mitmdump(router_url, tmp_path, "--set", "tracer_tap=front") as (url, front),
    ):
        assert await _questions(url, 8) == [200] * 8
    result = await analyze_async(front, e1, e2)
    pairs = result["evidence"]["tap_pairs"]
    assert {(p["from"], p["to"]) for p in pairs} == {("front", "e1"), ("front", "e2")}, pairs
    assert all(p["one_clock"] and p["shared"] >= 2 for p in pairs), pairs
    assert result["verdict"]["kind"] == "healthy", result["findings"]
    held = [f for f in result["findings"] if f["kind"] == "first_event_held"]
    assert held, result["findings"]
    assert held[0]["evidence"][0]["tap"] == "front", held  # the hop between front and e1/e2
    assert held[0]["evidence"][0]["figures"]["behind"] in ("e1", "e2"), held
