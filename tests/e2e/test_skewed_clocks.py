"""Two taps whose wall clocks disagree by seconds — the tap behind runs under libfaketime
(Debian's ``faketime``), as a tap on another host with a clock 3 s behind — around an
engine that stalls one stream: the printed offset brackets the true one, and the verdict
is the one the same run gives with the clocks agreeing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.engine import engine_running
from tests.support.procs import tracer_proxy

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SKEW = -3  # seconds: the tap behind reads this against the front tap
REQUESTS = 6
STALLED = 3  # the request whose stream the engine stalls (x-sim-fault)


def _faked(offset: int) -> dict[str, str]:
    return {
        **os.environ,
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": f"{offset:+d}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # the wall clock only, as on another host
    }


async def _run(tmp_path: Path, skew: int) -> tuple[dict[str, Any], str]:
    front_cap, back_cap = tmp_path / f"front{skew}.jsonl", tmp_path / f"back{skew}.jsonl"
    common = ["--listen", "127.0.0.1:0", "--stall-after", "1"]
    async with engine_running(ttft=0.0, itl=0.01) as sim:
        assert sim.bound is not None
        engine = f"http://127.0.0.1:{sim.bound[1]}"
        async with (
            tracer_proxy(
                "proxy", *common, "--upstream", engine, "--tap", "back",
                "--capture", str(back_cap), "--engine-metrics", engine + "/metrics",
                env=_faked(skew) if skew else None,
            ) as back,
            tracer_proxy(
                "proxy", *common, "--upstream", back.url, "--tap", "front",
                "--capture", str(front_cap),
            ) as front,
        ):  # fmt: skip
            client = openai.AsyncOpenAI(
                base_url=front.url + "/v1", api_key="sk-x", max_retries=0, timeout=30
            )
            for i in range(REQUESTS):
                fault = {"x-sim-fault": "stall:after=2:for=2.5"} if i == STALLED else {}
                stream = await client.chat.completions.create(
                    model="sim-model",
                    messages=[{"role": "user", "content": f"turn {i}"}],
                    max_tokens=6,
                    stream=True,
                    extra_headers=fault,
                )
                async for _chunk in stream:
                    pass
            await client.close()
    argv = [sys.executable, "-m", "tracer", "analyze", str(front_cap), str(back_cap)]
    out = subprocess.run([*argv, "--format", "json"], capture_output=True, text=True, check=True)
    text = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.stdout)
    # the report reads the captures the same way: its verdict and clocks are analyze's
    md, js = tmp_path / f"incident{skew}.md", tmp_path / f"incident{skew}.json"
    report = [sys.executable, "-m", "tracer", "report", str(front_cap), str(back_cap)]
    subprocess.run([*report, "-o", str(md), "--json", str(js)], capture_output=True, check=True)
    doc = json.loads(js.read_text())
    assert (doc["verdict"]["kind"], doc["overview"]["clocks"]["applied"]) == (
        result["verdict"]["kind"],
        result["clocks"]["applied"],
    )
    return result, text


@pytest.mark.skipif(not LIBFAKETIME.exists(), reason="libfaketime not installed (.ci/run does)")
async def test_a_tap_with_its_clock_seconds_off_analyses_as_if_they_agreed(
    tmp_path: Path,
) -> None:
    same, _ = await _run(tmp_path, 0)
    skewed, text = await _run(tmp_path, SKEW)
    # the offset, bracketed by the requests both taps answered, printed, and applied
    [pair] = skewed["clocks"]["pairs"]
    assert (pair["from"], pair["to"]) == ("front", "back")
    assert pair["low"] <= SKEW <= pair["high"] and pair["high"] - pair["low"] < 0.5
    assert skewed["clocks"]["applied"] == {"back": pytest.approx(SKEW, abs=0.25)}
    assert "clocks: back reads -3.0" in text and "applied" in text
    assert same["clocks"]["applied"] == {}
    # the same verdict and findings as with the clocks agreeing
    for key in ("party", "kind"):
        assert skewed["verdict"][key] == same["verdict"][key]
    assert sorted(f["kind"] for f in skewed["findings"]) == sorted(
        f["kind"] for f in same["findings"]
    )
    assert {r["joined_by"] for r in skewed["requests"]} == {"content"}
