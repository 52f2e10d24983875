"""Two chained taps, no ``--inject-request-id``, and an openai SDK client that sends a W3C
``traceparent`` of its own on every request (the same prompt each time, on two keep-alive
connections at once, so that content alone could not tell the copies apart): every row
has the client's trace id and its copy at the other tap, joined by it."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import anyio
import openai
import pytest

from tests.support.engine import engine_running
from tests.support.tap import running_tap
from tracer import events as ev

pytestmark = pytest.mark.anyio

PER_CLIENT = 4


async def _agent(url: str, sent: dict[str, str]) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-x", max_retries=0, timeout=10)
    try:
        for _ in range(PER_CLIENT):
            trace, span = secrets.token_hex(16), secrets.token_hex(8)
            value = f"00-{trace}-{span}-01"
            stream = await client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "the same prompt every time"}],
                max_tokens=3,
                stream=True,
                extra_headers={"traceparent": value, "tracestate": "harness=1"},
            )
            async for _chunk in stream:
                pass
            sent[trace] = span
    finally:
        await client.close()


async def test_every_row_has_the_clients_trace_and_its_copy(tmp_path: Path) -> None:
    sent: dict[str, str] = {}
    async with (
        engine_running(ttft=0.0, itl=0.002) as engine,
        running_tap(engine.bound[1], tmp_path, name="back") as back,
        running_tap(back.port, tmp_path, name="front") as front,
    ):
        url = f"http://127.0.0.1:{front.port}"
        async with anyio.create_task_group() as tg:
            tg.start_soon(_agent, url, sent)
            tg.start_soon(_agent, url, sent)
        await back.wait_for(ev.ResponseEnd, count=2 * PER_CLIENT)
    # the tap forwarded both headers unchanged: the tap behind saw them as sent
    heads = [e for e in back.events() if isinstance(e, ev.RequestHead)]
    assert {dict(e.headers)["traceparent"] for e in heads} == {
        f"00-{t}-{s}-01" for t, s in sent.items()
    }
    assert {dict(e.headers)["tracestate"] for e in heads} == {"harness=1"}

    argv = ["analyze", str(front.capture), str(back.capture), "--format", "json"]
    out = subprocess.run(
        [sys.executable, "-m", "tracer", *argv], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout)
    rows = {r["id"]: r for r in result["requests"]}
    assert len(rows) == 4 * PER_CLIENT
    for r in rows.values():
        assert sent[r["trace_id"]] == r["parent_span_id"]
        [copy] = r["copies"]
        assert rows[copy]["trace_id"] == r["trace_id"] and rows[copy]["tap"] != r["tap"]
        assert r["joined_by"] == "trace_id"
    [pair] = result["evidence"]["tap_pairs"]
    assert (pair["from"], pair["to"], pair["joined_by"]) == (
        "front",
        "back",
        {"trace_id": 2 * PER_CLIENT},
    )
