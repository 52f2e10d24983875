"""Replay fidelity: how close ``tracer replay`` puts each request to its captured start.

Captures a multi-connection, multi-round session (the openai-SDK harness -> an in-process
tap -> the simulated engine), replays it against the same engine with the real CLI
(``tracer replay --format json``, a subprocess) a few times, and prints the distribution
of |replay start offset - original start offset| over the requests (offsets from each
run's first request, which is left out: it is 0 by definition), and whether the
connection/reuse structure was the same in every run. Bounded: about 10 s.

Each request is sent its captured idle gap after the previous response on its
connection ends, so a target slower than the original (a loaded machine) moves later
requests later: the errors grow with the load average, which is printed with them.

    .venv/bin/python -m bench.replay_fidelity [--runs 3] [--sessions 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from tracer.capture.files import CaptureWriter
from tracer.proxy.relay import Tap, TapConfig
from tracer.sim.engine import EngineConfig, SimEngine
from tracer.sim.harness import HarnessConfig, run_harness

REPLAY_DEADLINE = 60.0  # seconds for one replay subprocess, at most


async def capture_session(workdir: Path, engine: SimEngine, args: argparse.Namespace) -> Path:
    assert engine.bound is not None
    path = workdir / "original.jsonl"
    writer = CaptureWriter(path)
    tap = Tap(TapConfig("127.0.0.1", 0, "127.0.0.1", engine.bound[1], name="orig"), capture=writer)
    writer.write(tap.header())
    try:
        async with anyio.create_task_group() as tg:
            bound = await tg.start(tap.serve)
            report = await run_harness(
                HarnessConfig(
                    base_url=f"http://127.0.0.1:{bound[0][1]}",
                    sessions=args.sessions,
                    rounds=args.rounds,
                    think=args.think,
                    max_tokens=8,
                    deadline=10.0,
                )
            )
            tap.stop()
            tg.cancel_scope.cancel()
    finally:
        writer.finish("orig", "bench done")
    failed = [r for r in report.rounds if not r.ok]
    if failed:
        raise SystemExit(f"the captured session failed: {failed[0].outcome} {failed[0].error}")
    return path


async def replay_once(original: Path, out: Path, target: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tracer", "replay", str(original), "--target", target]
    cmd += ["--capture", str(out), "--format", "json"]
    with anyio.fail_after(REPLAY_DEADLINE):
        result = await anyio.run_process(cmd, check=False)
    if result.returncode != 0:
        raise SystemExit(f"tracer replay failed ({result.returncode}): {result.stderr.decode()}")
    return dict(json.loads(result.stdout))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    engine = SimEngine(EngineConfig(ttft=0.0, itl=0.005))
    errors_ms: list[float] = []
    same = 0
    reproduced = 0
    with tempfile.TemporaryDirectory(prefix="replay-fidelity-") as tmp:
        workdir = Path(tmp)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.serve)
            original = await capture_session(workdir, engine, args)
            for run in range(args.runs):
                doc = await replay_once(original, workdir / f"replay-{run}.jsonl", engine.url)
                rows = doc["requests"]
                first = min(rows, key=lambda r: r["original"]["start_offset"])
                for row in rows:
                    if row is not first and row["start_offset_error"] is not None:
                        errors_ms.append(abs(row["start_offset_error"]) * 1000)
                same += bool(doc["structure"]["same"])
                reproduced += bool(doc["verdict"]["reproduced"])
            tg.cancel_scope.cancel()
    requests = args.sessions * args.rounds
    print(
        f"replay fidelity: {requests} requests on {args.sessions} keep-alive connections "
        f"({args.rounds} rounds, {args.think:g} s think), replayed {args.runs}x against the "
        "simulated engine"
    )
    if errors_ms:
        print(
            f"  |start offset error| over {len(errors_ms)} requests: "
            f"p50 {pct(errors_ms, 0.5):.2f} ms  p90 {pct(errors_ms, 0.9):.2f} ms  "
            f"max {max(errors_ms):.2f} ms  (mean {statistics.fmean(errors_ms):.2f} ms)"
        )
    print(f"  connection/reuse structure identical: {same}/{args.runs} runs")
    print(f"  verdict reproduced: {reproduced}/{args.runs} runs")
    load1 = os.getloadavg()[0]
    print(
        f"  took {time.monotonic() - started:.1f} s; load average {load1:.1f} on {os.cpu_count()} cores"
    )
    return 0 if same == args.runs else 1


def cli() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="replays of the one capture (default 3)")
    p.add_argument("--sessions", type=int, default=4, help="harness sessions = connections")
    p.add_argument("--rounds", type=int, default=5, help="requests per session")
    p.add_argument("--think", type=float, default=0.1, help="idle gap between rounds (s)")
    args = p.parse_args()
    if args.runs < 1 or args.sessions < 1 or args.rounds < 1:
        p.error("--runs, --sessions and --rounds must be >= 1")
    return anyio.run(main, args)


if __name__ == "__main__":
    raise SystemExit(cli())
