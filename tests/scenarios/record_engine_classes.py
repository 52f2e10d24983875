"""Record three engine-side incident classes from real processes on 127.0.0.1.

    .venv/bin/python -m tests.scenarios.record_engine_classes [NAME...]   (no NAME: all)
    .venv/bin/python -m tests.scenarios.record_engine_classes --list

The cases of ``tests/scenarios/record.py`` (its ``Lab``, ``Case`` and ``record``), for
incidents where what the engine itself does decides the answer:

* ``engine_generates_after_client_left``: the client aborts a long stream; the engine goes
  on generating for nobody (``ignore-disconnect``: vLLM #9428, "Running: 1 reqs" minutes
  after the disconnect), and the requests after it queue behind that zombie.
* ``health_ok_while_wedged``: the engine's scheduler wedges while streams run; its
  ``/health`` goes on answering 200 (vllm #2731, sglang #6624).
* ``router_retries_on_5xx``: the real SGLang router (``smg``) in front of two engines, one
  of which answers 500 to every other request; smg retries each on the other engine and
  the client gets 200 every time.

Each writes ``tests/data/scenarios/<case>/`` (captures and ``expect.json``, which says the
right answer), as ``record.py`` does.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import httpx

from tests.scenarios import record as base
from tests.scenarios.record import FAST, PROXY_KINDS, SMG, STALLS, Case, Lab, describe, stream

# ---- engine_generates_after_client_left ----------------------------------------------------


async def _engine_running(client: httpx.AsyncClient, engine: str) -> int | None:
    """The engine's live running count (``/v1/loads``, asked of it directly, not via the tap)."""
    try:
        doc = (await client.get(engine + "/v1/loads", timeout=1)).json()
        return int(doc["aggregate"]["total_running_reqs"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def engine_generates_after_client_left(lab: Lab) -> None:
    """A healthy stream, then one of 600 tokens (25 ms apart) that the client (httpx)
    abandons after 1 s; the engine (``ignore-disconnect``, --max-running 1) goes on
    generating it for ~14 s for nobody, while nothing is in flight at the tap; two requests
    sent 5 s in queue behind that zombie until it ends, and are then answered."""
    fault = "ignore-disconnect@nth=2"
    engine = await lab.engine(
        "--max-running", "1", "--ttft", "0.05", "--itl", "0.025", "--fault", fault
    )
    url = await lab.tap("tap", engine, "--engine-metrics", f"{engine}/metrics", *FAST)
    async with httpx.AsyncClient(timeout=30) as client:
        got = await stream(client, url, max_tokens=20, headers={"x-request-id": "before"})
        lab.note(describe("httpx before (20 tokens)", got))
        t0 = time.monotonic()
        got = await stream(
            client, url, max_tokens=600, headers={"x-request-id": "abandoned"}, timeout=1
        )
        left = time.monotonic()
        lab.note(describe("httpx abandoned (600 tokens, the client closes after 1 s)", got))

        running: list[tuple[float, int | None]] = []

        async def watch() -> None:  # the engine's own live count, for the record
            while True:
                running.append((time.monotonic() - left, await _engine_running(client, engine)))
                await anyio.sleep(0.5)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await anyio.sleep(max(0.0, t0 + 5 - time.monotonic()))
            busy = [t for t, n in running if n]
            lab.note(
                f"after the abort, with nothing in flight at the tap: the engine's /v1/loads "
                f"said running {sorted({str(n) for _, n in running})} at {len(running)} polls over "
                f"{running[-1][0] if running else 0:.1f} s ({len(busy)} of them running >= 1)"
            )
            results: dict[str, dict[str, Any]] = {}

            async def later(rid: str) -> None:
                results[rid] = await stream(
                    client, url, max_tokens=20, headers={"x-request-id": rid}, timeout=30
                )

            async with anyio.create_task_group() as sent:
                for rid in ("later-1", "later-2"):
                    sent.start_soon(later, rid)
            tg.cancel_scope.cancel()
        for rid in ("later-1", "later-2"):
            lab.note(describe(f"httpx {rid} (20 tokens, sent 5 s in, queued)", results[rid]))
        text = (await client.get(engine + "/metrics")).text
        counted = [
            line
            for line in text.splitlines()
            if line.startswith(("sglang:num_requests_total", "sglang:num_aborted_requests_total"))
            or line.startswith("sglang:generation_tokens_total")
        ]
        lab.note("the engine's counters at the end: " + "; ".join(counted))
    await anyio.sleep(1.5)  # a few more scrapes after the end


# ---- health_ok_while_wedged ------------------------------------------------------------------


async def health_ok_while_wedged(lab: Lab) -> None:
    """The scheduler wedges (``wedge``: no tokens, gauges frozen) while 3 streams run and
    a 4th arrives; the tap polls the engine's /health (200 throughout) and its /metrics
    every 0.5 s; the clients give up after 7 s; the wedge ends 15 s in, and a last
    request is answered."""
    fault = "wedge:after=5:for=15@nth=2"
    engine = await lab.engine("--ttft", "0.05", "--itl", "0.05", "--fault", fault)
    evidence = ["--engine-metrics", f"{engine}/metrics", "--health", f"{engine}/health"]
    url = await lab.tap("tap", engine, *evidence, *FAST)
    health: list[int | None] = []

    async def poll() -> None:  # what an orchestrator's liveness probe saw, for the record
        async with httpx.AsyncClient(timeout=2) as c:
            while True:
                try:
                    health.append((await c.get(engine + "/health")).status_code)
                except httpx.HTTPError:
                    health.append(None)
                await anyio.sleep(0.5)

    begun = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(poll)
        async with anyio.create_task_group() as clients:
            clients.start_soon(
                lambda: lab.harness(url, sessions=3, rounds=1, max_tokens=40, deadline=7)
            )

            async def late() -> None:
                await anyio.sleep(1.5)
                async with httpx.AsyncClient(timeout=30) as client:
                    got = await stream(client, url, max_tokens=10, timeout=7)
                lab.note(describe("httpx request sent 1.5 s in (during the wedge)", got))

            clients.start_soon(late)
        await anyio.sleep(max(0.0, begun + 16.5 - time.monotonic()))  # the wedge is over
        tg.cancel_scope.cancel()
    codes = sorted({str(c) for c in health})
    lab.note(f"the engine's /health, polled every 0.5 s meanwhile: {len(health)} polls, {codes}")
    async with httpx.AsyncClient(timeout=30) as client:
        got = await stream(client, url, max_tokens=10, headers={"x-request-id": "after"})
    lab.note(describe("httpx after (10 tokens, after the wedge)", got))
    await anyio.sleep(1.0)


# ---- router_retries_on_5xx -------------------------------------------------------------------


async def _smg_retrying(lab: Lab, *workers: str) -> tuple[str, str]:
    """``Lab.smg`` with the retry flags said: up to 3 retries, 50 ms backoff."""
    if not SMG.exists():
        raise RuntimeError(f"{SMG} is not installed")
    port, prom = base.free_port(), base.free_port()
    argv = [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--worker-urls", *workers, "--policy", "round_robin", "--log-level", "warn"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
    retry = ["--retry-max-retries", "3", "--retry-initial-backoff-ms", "50"]
    argv += [*retry, "--retry-jitter-factor", "0"]
    url = await lab.start_http("smg", argv, f"http://127.0.0.1:{port}", "/readiness")
    lab.note(f"smg round_robin {' '.join(retry)} -> {' '.join(workers)}")
    return url, f"http://127.0.0.1:{prom}/metrics"


async def router_retries_on_5xx(lab: Lab) -> None:
    """tap front (smg's metrics and /readiness) -> smg (round robin, up to 3 retries) ->
    tap e1 -> engine 1 (HTTP 500 to every other completion) and tap e2 -> engine 2; smg
    sends each request that got a 500 again (to engine 2, or to engine 1 again), and every
    client (httpx streams, then the openai SDK harness) gets 200."""
    engine1 = await lab.engine("--ttft", "0.02", "--itl", "0.01", "--fault", "500@every=2")
    engine2 = await lab.engine("--ttft", "0.02", "--itl", "0.01", name="engine2")
    e1 = await lab.tap("e1", engine1, "--engine-metrics", f"{engine1}/metrics", *FAST)
    e2 = await lab.tap("e2", engine2, "--engine-metrics", f"{engine2}/metrics", *FAST)
    router, prom = await _smg_retrying(lab, e1, e2)
    evidence = ["--engine-metrics", prom, "--health", f"{router}/readiness"]
    url = await lab.tap("front", router, *evidence, *FAST)
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(1, 7):
            got = await stream(client, url, max_tokens=12, headers={"x-request-id": f"r{i}"})
            lab.note(describe(f"httpx r{i} (12 tokens)", got))
        await lab.harness(url, sessions=2, rounds=3, think=0.2, max_tokens=12, deadline=10)
        try:
            text = (await client.get(prom, timeout=2)).text
            retries = [
                line
                for line in text.splitlines()
                if line.startswith(("smg_worker_retries", "smg_router_upstream_send_retries"))
                or (line.startswith("smg_http_responses_total") and "chat" in line)
            ]
            lab.note("smg's own metrics at the end: " + "; ".join(retries[:8]))
        except httpx.HTTPError as exc:
            lab.note(f"smg's metrics could not be read: {exc}")
    await anyio.sleep(1.0)


# ---- the cases -------------------------------------------------------------------------------


CASES: dict[str, Case] = {
    "engine_generates_after_client_left": Case(
        engine_generates_after_client_left,
        # the right answer: the abort was the client's, and the engine going on generating
        # for it (running >= 1, decode progress moving, nothing in flight at the tap) is
        # the engine's own fault — zombie load that made the later requests queue (the
        # abort is told inside it, as what set it off: one story)
        {"party": "engine", "kind": "engine_kept_generating"},
        forbidden=[*STALLS, *PROXY_KINDS, "engine_lost_request", "upstream_silent"],
        required=[{"party": "engine", "kind": "engine_kept_generating"}],
        limit=60.0,
    ),
    "health_ok_while_wedged": Case(
        health_ok_while_wedged,
        {"party": "engine", "kind": STALLS},
        forbidden=[*PROXY_KINDS, "engine_lost_request", "client_*"],
        limit=60.0,
    ),
    "router_retries_on_5xx": Case(
        router_retries_on_5xx,
        {"party": "none", "kind": "healthy"},
        forbidden=[*STALLS, *PROXY_KINDS, "client_*", "engine_lost_request"],
        required=[{"party": "engine", "kind": "engine_error_status", "note": True}],
        no_faults=True,
        limit=60.0,
    ),
}


def main(argv: list[str] | None = None) -> int:
    """``tests.scenarios.record``'s command line over this module's ``CASES``."""
    return base.main(
        argv, cases=CASES, prog="python -m tests.scenarios.record_engine_classes", doc=__doc__
    )


if __name__ == "__main__":
    raise SystemExit(main())
