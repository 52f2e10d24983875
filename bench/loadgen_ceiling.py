"""The load generator's ceiling: ``tracer bench``'s client against a zero-cost engine.

``python -m bench.loadgen_ceiling`` starts ``tracer sim engine --ttft 0 --itl 0
--batch-alpha 0`` pinned to core 1, pins itself to core 0, and runs ``tracer bench``'s
own code (``tracer.tools.bench.run_level``: warm-up, then measured runs) at one concurrency with
long outputs, so that almost every event is a content chunk. Then, for reference, the same
load through ``httpx.AsyncClient`` (the same SSE reader), the other client considered.

It reports, per client: SSE content events/s and output tokens/s achieved (one token per
event here), the client's CPU per event, and ``events/s per client core`` = 1 / CPU per
event, the rate at which the client itself would saturate one core. When the engine's
core is near 100 % the achieved rate is the engine's limit and the per-core figure is the
client's ceiling. Results go to ``bench-out/loadgen-ceiling.json``. About 20 s; bounded
by ``--duration`` (each run) and the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from bench.procs import cpu_seconds, free_port, spawn, wait_port
from tracer.proxy.relay import loop_options
from tracer.tools.bench import BenchConfig, Reporter, run_level
from tracer.tools.streamclient import Sample, SSEReader, Target
from tracer.tools.workload import RequestSpec, synthetic_mix

CLIENT_CORE, ENGINE_CORE = 0, 1


def _pin_self() -> bool:
    if (os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, {CLIENT_CORE})
    except OSError:
        return False
    return True


async def _tracer_client(
    target: Target, concurrency: int, duration: float, output_len: int, engine_pid: int
) -> dict[str, Any]:
    mix = synthetic_mix(64, output_len, model="sim-model", endpoint="chat", ignore_eos=True)
    config = BenchConfig(
        target=target,
        concurrencies=[concurrency],
        mix=mix,
        duration=duration,
        repeats=2,
        warmup=1,
        timeout=30.0,
    )
    engine0, t0 = cpu_seconds(engine_pid), time.perf_counter()
    with Reporter(tty=False) as reporter:
        result = await run_level(config, concurrency, reporter, [0])
    engine_share = (cpu_seconds(engine_pid) - engine0) / (time.perf_counter() - t0)
    runs = result["runs"]
    events = sum(r["output_chunks"] for r in runs)
    wall = sum(r["duration_s"] for r in runs)
    cpu = sum(r["client_cpu"] * r["duration_s"] for r in runs)
    return _figures(
        "tracer bench (anyio + h11)",
        events,
        sum(r["output_tokens"] for r in runs),
        wall,
        cpu,
        engine_share,
        result["failed"],
    )


async def _httpx_client(
    target: Target, concurrency: int, duration: float, output_len: int, engine_pid: int
) -> dict[str, Any]:
    mix = synthetic_mix(64, output_len, model="sim-model", endpoint="chat", ignore_eos=True)
    url = f"{target.base}/v1/chat/completions"
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(client: httpx.AsyncClient, spec: RequestSpec) -> None:
        sample = Sample(start=time.perf_counter())
        reader = SSEReader(sample)
        headers = {"content-type": "application/json"}
        async with client.stream("POST", url, content=spec.body, headers=headers) as response:
            async for data in response.aiter_raw():
                reader.feed(data, time.perf_counter())
        sample.output_tokens = int((reader.usage or {}).get("completion_tokens", sample.chunks))
        samples.append(sample)

    async with httpx.AsyncClient(limits=limits, timeout=30.0, trust_env=False) as client:
        for i in range(concurrency):  # warm-up: open the connections
            await one(client, mix.specs(i))
        samples.clear()
        engine0, cpu0, t0 = cpu_seconds(engine_pid), time.process_time(), time.perf_counter()
        deadline = t0 + duration

        async def worker(k: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                await one(client, mix.specs(k * 100_000 + n))
                n += 1

        async with anyio.create_task_group() as tg:
            for k in range(concurrency):
                tg.start_soon(worker, k)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        engine_share = (cpu_seconds(engine_pid) - engine0) / wall
    return _figures(
        "httpx.AsyncClient (reference)",
        sum(s.chunks for s in samples),
        sum(s.output_tokens for s in samples),
        wall,
        cpu,
        engine_share,
        0,
    )


def _figures(
    client: str, events: int, tokens: int, wall: float, cpu: float, engine: float, failed: int
) -> dict[str, Any]:
    per_event = cpu / max(events, 1)
    return {
        "client": client,
        "events_per_s": round(events / wall, 1),
        "output_tokens_per_s": round(tokens / wall, 1),
        "client_cpu_share": round(cpu / wall, 3),
        "client_cpu_us_per_event": round(per_event * 1e6, 2),
        "events_per_s_per_client_core": round(1 / per_event, 1) if events else None,
        "engine_cpu_share": round(engine, 3),
        "failed": failed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen_ceiling", description=__doc__)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=4.0, help="seconds per measured run")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--out", default="bench-out", metavar="DIR")
    p.add_argument("--no-httpx", action="store_true", help="skip the httpx reference")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pinned = _pin_self()
    port = free_port()
    sim = [sys.executable, "-m", "tracer", "sim", "engine", "--listen", f"127.0.0.1:{port}"]
    zero_cost = ["--ttft", "0", "--itl", "0", "--batch-alpha", "0"]
    engine = spawn(
        "ceiling-engine",
        [*sim, *zero_cost, "--max-running", str(max(256, args.concurrency))],
        core=ENGINE_CORE,
        log_dir=out,
    )
    try:
        wait_port(port, engine.popen, 15.0)
        target = Target.parse(f"http://127.0.0.1:{port}")
        rows = [
            anyio.run(
                _tracer_client,
                target,
                args.concurrency,
                args.duration,
                args.output_len,
                engine.pid,
                backend_options=loop_options(),
            )
        ]
        if not args.no_httpx:
            rows.append(
                anyio.run(
                    _httpx_client,
                    target,
                    args.concurrency,
                    args.duration,
                    args.output_len,
                    engine.pid,
                    backend_options=loop_options(),
                )
            )
    finally:
        engine.stop()
    print(
        f"load generator ceiling: C{args.concurrency}, {args.output_len}-token streams, "
        f"sim engine with zero decode time (client core {CLIENT_CORE}, engine core "
        f"{ENGINE_CORE}{'' if pinned else ', not pinned'})"
    )
    print(
        f"{'client':<30} {'events/s':>10} {'tok/s':>10} {'client CPU':>10} "
        f"{'µs/event':>9} {'events/s per client core':>25} {'engine CPU':>10}"
    )
    for r in rows:
        print(
            f"{r['client']:<30} {r['events_per_s']:>10,.0f} {r['output_tokens_per_s']:>10,.0f} "
            f"{r['client_cpu_share']:>10.0%} {r['client_cpu_us_per_event']:>9.1f} "
            f"{r['events_per_s_per_client_core'] or 0:>25,.0f} {r['engine_cpu_share']:>10.0%}"
        )
    print(
        "an engine CPU near 100 % means the achieved rate is the simulated engine's limit; "
        "'events/s per client core' is then the client's own ceiling"
    )
    doc = {
        "concurrency": args.concurrency,
        "output_len": args.output_len,
        "duration_per_run": args.duration,
        "pinned": pinned,
        "clients": rows,
    }
    (out / "loadgen-ceiling.json").write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
