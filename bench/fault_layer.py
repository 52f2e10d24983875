"""``python -m bench.fault_layer``: what the fault layer costs ``tracer proxy`` on traffic
it does not fault.

With ``--fault`` or ``--fault-control`` every connection goes through
``tracer.faults.plan.ConnectionFaults`` (both directions cut into messages, chunks and, where
a fault needs them, SSE events), even for requests no fault matches and while the plan
is empty; without, the relay's data path has no check at all. Three ``tracer proxy``
processes, one after the other on the proxy's core, each writing a capture: plain, with
``--fault-control`` (an empty plan) and with a ``--fault`` no request matches. Each gets
a warm-up, then the same lockstep workload (``--requests`` streaming requests of 64 SSE
events over 16 keep-alive connections, from ``bench.upstream``); the proxy's CPU time per
SSE event is read from /proc. Rounds alternate the order; medians are reported, with
the ratio to the plain relay. Informational: the fault layer is for tests, not for a
tap left inline for good.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from .addon_instructions import cpu_per_event
from .procs import Proc, free_port, spawn, wait_port
from .run import REPO, RIG_CORE

VARIANTS: dict[str, list[str]] = {
    "plain": [],
    "fault-control": ["--fault-control", "--admin", "127.0.0.1:{admin}"],
    "fault-unmatched": ["--fault", "status:503@path=/never"],
}


def measure(name: str, upstream: int, out: Path, requests: int) -> float:
    """Microseconds of the proxy's CPU per SSE event for one variant, one fresh process."""
    port = free_port()
    capture = out / f"fault-layer-{name}.jsonl"
    capture.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "tracer", "--log-level", "warning", "proxy"]
    argv += ["--listen", f"127.0.0.1:{port}", "--upstream", f"http://127.0.0.1:{upstream}"]
    argv += ["--capture", str(capture)]
    argv += [a.format(admin=free_port()) for a in VARIANTS[name]]
    per_event, _ = cpu_per_event(f"fault-layer-{name}", argv, port, out, requests, warmup=64)
    return per_event


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fault_layer", description=__doc__)
    p.add_argument("--requests", type=int, default=2400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "bench-out")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    upstream: Proc = spawn(
        "fault-layer-upstream",
        [sys.executable, "-m", "bench.upstream", "--port", str(port)],
        core=RIG_CORE,
        log_dir=args.out,
        cwd=REPO,
    )
    per_event: dict[str, list[float]] = {name: [] for name in VARIANTS}
    try:
        wait_port(port, upstream.popen, timeout=15)
        for rnd in range(args.rounds):
            names = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
            for name in names:
                per_event[name].append(measure(name, port, args.out, args.requests))
                print(f"round {rnd + 1}: {name:16} {per_event[name][-1]:6.2f} µs/event", flush=True)
    finally:
        upstream.stop()
    medians = {name: statistics.median(v) for name, v in per_event.items()}
    base = medians["plain"]
    for name, value in medians.items():
        print(f"{name:16} {value:6.2f} µs of CPU per SSE event, x{value / base:.3f} of plain")
    doc = {"per_event_us": per_event, "median_us": medians, "requests": args.requests}
    (args.out / "fault-layer.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
