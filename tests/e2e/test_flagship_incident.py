"""The incident this project exists for, reproduced with real processes and attributed.

multi-round harness (openai SDK) -> tap "front" -> a proxy that hangs on the 3rd request
of a reused keep-alive connection (`tracer proxy --fault hang-on-reuse:3`) -> tap "back"
-> the real SGLang router (smg) -> two simulated engines.

One run, three views of it, as the issue asks:
* taps on both sides of the proxy: proxy, high confidence, engine and client ruled out;
* one tap behind the proxy only, with a hang mark: "client or proxy", engine ruled out;
* one tap in front of the proxy, with engine metrics and probes: proxy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.analyze import analyze_async
from tests.support.engine import SMG, engine_running, router
from tests.support.incident import taps_around_a_hanging_proxy
from tracer.sim.harness import HarnessConfig, run_harness

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]


@pytest.mark.skipif(not SMG.exists(), reason="smg (sglang-router) is not installed")
async def test_hang_on_reuse_behind_a_proxy_is_blamed_on_the_proxy(tmp_path: Path) -> None:
    front, back = tmp_path / "front.jsonl", tmp_path / "back.jsonl"
    async with (
        engine_running(ttft=0.0, itl=0.002) as w1,
        engine_running(ttft=0.0, itl=0.002) as w2,
        router(tmp_path, w1.url, w2.url) as (router_url, router_metrics),
    ):
        evidence = [
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
        ]
        async with taps_around_a_hanging_proxy(router_url, front, back, evidence) as (
            front_url,
            _,
        ):
            report = await run_harness(
                HarnessConfig(
                    base_url=front_url,
                    sessions=2,
                    rounds=4,
                    think=0.2,
                    max_tokens=6,
                    deadline=3.0,
                )
            )
    outcomes = sorted((r.session, r.round, r.outcome) for r in report.rounds)
    # rounds 1 and 2 complete; round 3 (the 3rd request on the reused connection) hangs
    expected = [(s, r, "complete") for s in (1, 2) for r in (1, 2)]
    assert outcomes == sorted([*expected, (1, 3, "hung"), (2, 3, "hung")]), outcomes

    # 1. taps on both sides of the proxy
    both = await analyze_async(str(front), str(back))
    v = both["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == ("proxy", "proxy_hung_on_reuse", "high")
    assert {r["party"] for r in v["ruled_out"]} == {"client", "engine"}
    # the hop between tap front and tap back: the hung requests never reached tap back
    (f,) = [f for f in both["findings"] if f["id"] == v["finding"]]
    assert f["requests"] and all(q.startswith("front/") for q in f["requests"])
    assert any(e["figures"].get("never_seen_at") == ["back"] for e in f["evidence"])

    # 2. one tap behind the proxy only, with a hang mark during the hang
    front_doc = await analyze_async(str(front))
    third = [r for r in front_doc["requests"] if r["seq"] == 3]
    assert third, front_doc["requests"]
    mark = str(third[0]["start"] + 1.5)
    behind = await analyze_async(str(back), "--hang-at", mark)
    vb = behind["verdict"]
    assert (vb["party"], vb["kind"]) == ("unknown", "idle_at_hang")
    assert [r["party"] for r in vb["ruled_out"]] == ["engine"]
    assert "client side of the proxy" in behind["findings"][0]["settle"]

    # 3. one tap in front of the proxy, with engine metrics and probes
    vf = front_doc["verdict"]
    assert (vf["party"], vf["kind"]) == ("proxy", "proxy_hung_on_reuse")
    top = front_doc["findings"][0]
    figures = [e["figures"] for e in top["evidence"]]
    assert any(f.get("probe_outcome") == "ok" for f in figures), figures  # a fresh connection
    assert any(f.get("running_max") == 0 for f in figures), figures  # the engine idle
