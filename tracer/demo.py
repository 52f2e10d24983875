"""``tracer demo``: a real end-to-end run on one machine with nothing to configure.

A simulated streaming engine, the tap in front of it writing a capture, and the
multi-round keep-alive harness (openai SDK) through the tap; then the per-connection
and per-request tables of what the tap recorded, read back from the capture file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio

from .analysis import Summary
from .capture import CaptureWriter, ReadStats, read_events
from .relay import Tap, TapConfig
from .render import to_text
from .sim.engine import EngineConfig, SimEngine
from .sim.harness import HarnessConfig, run_harness


async def run_demo(out_dir: Path, *, sessions: int = 3, rounds: int = 4) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    capture_path = out_dir / "demo-tap.jsonl"
    capture_path.unlink(missing_ok=True)
    engine = SimEngine(EngineConfig(tokens=12, ttft=0.03, itl=0.004))
    writer = CaptureWriter(capture_path)
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(engine.serve)
        tap = Tap(
            TapConfig("127.0.0.1", 0, host, port, name="demo-tap", stall_after=2.0), capture=writer
        )
        writer.write(tap.header())
        bound = await tg.start(tap.serve)
        tap_url = f"http://{bound[0][0]}:{bound[0][1]}"
        print(
            f"engine {engine.url}  <-  tap {tap_url}  <-  harness: {sessions} sessions x {rounds} rounds"
        )
        report = await run_harness(
            HarnessConfig(base_url=tap_url, sessions=sessions, rounds=rounds, think=0.3)
        )
        for r in report.rounds:
            ttft = f"{r.ttft * 1000:.1f} ms" if r.ttft is not None else "-"
            print(
                f"  session {r.session} round {r.round}: {r.outcome:9s} ttft {ttft:>9s}  "
                f"total {r.duration * 1000:.1f} ms"
            )
        tap.stop()
        tg.cancel_scope.cancel()
    writer.finish("demo-tap", "demo finished")
    stats = ReadStats()
    summary = Summary()
    for event in read_events(capture_path, stats):
        summary.feed(event)
    print()
    print(to_text(summary.result(captures=[{"path": str(capture_path), "records": stats.records}])))
    print(f"capture: {capture_path} ({stats.records} records)")
    print(f"analyse it again with: tracer analyze {capture_path}")
    return 1 if report.failed else 0


def main(out_dir: str = "demo-out") -> int:
    try:
        return anyio.run(run_demo, Path(out_dir))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
