"""Record a scenario that the engine's own per-request records settle (issue 37, point 3).

    .venv/bin/python -m tests.scenarios.record_engine_records [NAME...]   (no NAME: all)

``hop_swallows_large_bodies_engine_records``: the recording of ``record.py``'s
``hop_swallows_large_bodies`` (tap front -> haproxy, which tarpits bodies over 60000 bytes
-> tap back -> engine), with the simulated engine writing its own records in both formats
(``--export-request-metrics``: SGLang's JSONL; ``--export-spans``: vLLM's spans as OTLP
JSON). Kept: tap front's capture and the engine's records. From the front capture alone
the two held requests are ``unknown`` (``hop_swallows_large_bodies_front_only``: the hop or
the serving stack); with the records, the engine has none for them while it recorded the
requests sent before and after them, and had time to record their abort when their
clients left (a last small request, after the give-ups, was recorded): they never
reached the engine — the hop after tap front.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio
import httpx

from tests.scenarios import record as base
from tests.scenarios.record import Case, Lab

SGLANG_FILE = "engine.sglang.jsonl"
SPANS_FILE = "engine.spans.json"


async def hop_swallows_large_bodies_engine_records(lab: Lab) -> None:
    """``hop_swallows_large_bodies``, the engine writing its per-request records."""
    plain = lab.engine

    async def engine(*args: str, name: str = "engine") -> str:
        sglang, spans = lab.work / SGLANG_FILE, lab.work / SPANS_FILE
        lab.found["records"] = [sglang, spans]
        extra = ["--export-request-metrics", str(sglang), "--export-spans", str(spans)]
        return await plain(*args, *extra, name=name)

    taps: dict[str, str] = {}
    plain_tap = lab.tap

    async def tap(name: str, upstream: str, *args: str) -> str:
        taps[name] = await plain_tap(name, upstream, *args)
        return taps[name]

    lab.engine = engine  # type: ignore[method-assign]
    lab.tap = tap  # type: ignore[method-assign]
    await base.hop_swallows_large_bodies(lab)
    # one more small request after the clients gave up on the held ones: the engine takes
    # new requests then (a request of theirs that had reached it would have its abort
    # recorded by now)
    async with httpx.AsyncClient(timeout=10) as client:
        body = base.chat_body(2_000, 8)
        got = await base.stream(
            client, taps["front"], max_tokens=8, headers={"x-request-id": "g1-after"}, content=body
        )
        lab.note(base.describe("httpx g1-after (fresh connection g, after the give-ups)", got))
    # the engine writes a record at the finish: wait (with a deadline) for that one's
    sglang = lab.work / SGLANG_FILE
    with anyio.fail_after(10):
        while not (sglang.exists() and b"g1-after" in sglang.read_bytes()):
            await anyio.sleep(0.05)  # (polls the file with a deadline)


def _records(lab: Lab, staged: Path) -> dict[str, Any]:
    """The engine's records beside the capture; the SGLang file is the case's evidence
    (``test_engine_requests`` reads the spans file too)."""
    for path in lab.found.get("records", []):
        if path.exists():
            shutil.copyfile(path, staged / path.name)
    return {"engine_requests": [SGLANG_FILE], "engine_spans": SPANS_FILE}


CASES: dict[str, Case] = {
    "hop_swallows_large_bodies_engine_records": Case(
        hop_swallows_large_bodies_engine_records,
        # (the front tap alone, as hop_swallows_large_bodies_front_only, which is unknown
        # from the counters; the engine's records say the two held requests never reached
        # it, while it recorded those sent before and after them)
        {"party": "proxy", "kind": "lost_before_engine"},
        forbidden=["proxy_hung_on_reuse", "engine_*", "client_*"],
        required=[{"party": "proxy", "kind": "lost_before_engine"}],
        more={"separating": ["request_bytes"]},
        taps=["front"],
        after=_records,
        about="Only the front capture and the engine's own records.",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """``tests.scenarios.record``'s command line over this module's ``CASES``."""
    return base.main(
        argv, cases=CASES, prog="python -m tests.scenarios.record_engine_records", doc=__doc__
    )


if __name__ == "__main__":
    raise SystemExit(main())
