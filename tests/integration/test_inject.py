"""--inject-request-id on two real taps: the captures join exactly by the injected ids."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.engine import engine_running
from tests.support.procs import tracer_proxy
from tracer.capture.files import read_records


@pytest.mark.anyio
async def test_two_taps_join_exactly_with_injected_ids(tmp_path: Path) -> None:
    """front tap (--inject-request-id) -> back tap -> sim engine, a client sending no ids."""
    front, back = tmp_path / "front.jsonl", tmp_path / "back.jsonl"
    async with engine_running(ttft=0.0, itl=0.001) as sim:
        async with (
            tracer_proxy(
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                sim.url,
                "--tap",
                "back",
                "--capture",
                str(back),
            ) as back_tap,
            tracer_proxy(
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                back_tap.url,
                "--tap",
                "front",
                "--capture",
                str(front),
                "--inject-request-id",
            ) as front_tap,
        ):
            async with httpx.AsyncClient(timeout=5) as client:
                for _ in range(3):
                    r = await client.post(
                        front_tap.url + "/v1/chat/completions",
                        json={
                            "model": "m",
                            "max_tokens": 2,
                            "messages": [{"role": "user", "content": "x"}],
                        },
                    )
                    assert r.status_code == 200
    ids = {
        name: [
            r["request_id"]
            for r in read_records(path)
            if r["type"] == "request"  # the front tap's own fingerprint passes tap back
            and not any(k.lower() == "x-tracer-probe" for k, _ in r["headers"])
        ]
        for name, path in (("front", front), ("back", back))
    }
    assert ids["front"] == ids["back"] == [f"tracer-front-1-{n}" for n in (1, 2, 3)]
    header = next(read_records(front))
    assert header["options"]["inject_request_id"] is True
