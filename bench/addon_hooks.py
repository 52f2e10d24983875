"""``python -m bench.addon_hooks``: where ``addons/trace.py`` spends its time inside mitmdump.

The throughput ratio of ``bench.run --scenarios addon`` says how much the addon costs;
this says where. One mitmdump, started as ``bench/addon.py`` starts the traced one
(reverse mode, ``stream_large_bodies=1``, the streaming script, a capture), but loading
the addon through a wrapper that puts a ``perf_counter`` pair around each hook, the ticker
and each call of the two stream callables. A warm-up, then the timers are zeroed
(SIGUSR1), then ``--requests`` streaming requests of 64 SSE events and ``[DONE]`` over 16
keep-alive connections, then the timers are written out (SIGUSR2). Reported per hook:
calls per request, time per call, per request and per SSE event, and the sum against
the whole process's CPU time per event over the same requests.

Read it as a breakdown, not as the cost: the timers cost something themselves (the
calibration line says how much, measured in this process, and it is not subtracted),
and they do not see what the addon costs mitmproxy's own code (caches, the allocator),
which the throughput ratio does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from . import peers
from .addon import mitmdump_argv
from .addon_instructions import EVENTS_PER_REQUEST, REQUEST, _drive, agent_request
from .hook_timers import timed
from .loadgen import agent_body
from .procs import Proc, children, cpu_seconds, free_port, spawn, wait_port
from .run import REPO, _pin_self, start_upstream

# The script mitmdump loads instead of addons/trace.py: the same addon, hooks timed.
WRAPPER = """\
import os
import sys

sys.path.insert(0, {repo!r})
from bench.hook_timers import install

addons = install(os.environ["TRACE_ADDON"], {hooks!r}, os.environ["HOOK_STATS"])
"""

HOOKS = (
    "client_connected",
    "server_connect",
    "server_connected",
    "requestheaders",
    "request",
    "responseheaders",
    "response",
    "error",
    "client_disconnected",
    "tick",
    "_ship",  # the batch of facts for the capture process (every 5 ms, and in tick)
)
CONNECTIONS = 16


def _timer_cost() -> float:
    """Seconds one timed call adds (``hook_timers.timed`` around a function doing nothing)."""

    def bare() -> None:
        return None

    n = 200_000
    best = []
    for fn in (timed("calibration", bare), bare):
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append(time.perf_counter() - t)
        best.append(min(runs) / n)
    return max(0.0, best[0] - best[1])


def _wait_for(path: Path, timeout: float) -> dict[str, list[float]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data: dict[str, list[float]] = json.loads(path.read_text())
            return data
        except (OSError, ValueError):
            time.sleep(0.05)
    raise RuntimeError(f"mitmdump wrote no timers to {path}")


def measure(
    out: Path, requests: int, addon: Path, hooks: tuple[str, ...], request: bytes = REQUEST
) -> tuple[dict[str, list[float]], int, float]:
    """(timers by name, requests done, mitmdump CPU seconds) over the measured requests."""
    procs: list[Proc] = []
    try:
        _, upstream_port = start_upstream(out, procs)
        port = free_port()
        wrapper = out / "mitm_trace_timed.py"
        wrapper.write_text(WRAPPER.format(repo=str(REPO), hooks=hooks))
        stats_path = out / "addon-hooks.json"
        stats_path.unlink(missing_ok=True)
        capture = out / "addon-hooks-tap.jsonl"
        capture.unlink(missing_ok=True)
        argv = mitmdump_argv(upstream_port, port, out)
        argv += ["-s", str(wrapper), "--set", f"tracer_capture={capture}"]
        env = {
            **os.environ,
            "TRACE_ADDON": str(addon),
            "HOOK_STATS": str(stats_path),
        }
        mitm = spawn("mitmdump-timed", argv, core=peers.PROXY_CORE, log_dir=out, cwd=REPO, env=env)
        procs.append(mitm)
        wait_port(port, mitm.popen, timeout=30)
        deadline = time.monotonic() + 300
        _drive(port, 64, deadline, conns=CONNECTIONS, request=request)  # warm-up
        mitm.popen.send_signal(signal.SIGUSR1)  # zero the timers (mitmdump is idle now)
        helpers = children(mitm.pid)  # the addon's capture process
        cpu0 = cpu_seconds(mitm.pid)
        aside0 = sum(map(cpu_seconds, helpers))
        done = _drive(port, requests, deadline, conns=CONNECTIONS, request=request)
        cpu1 = cpu_seconds(mitm.pid)
        aside = sum(map(cpu_seconds, helpers)) - aside0
        mitm.popen.send_signal(signal.SIGUSR2)
        stats = _wait_for(stats_path, 30)
        stats["capture process CPU"] = [aside, done]
        return stats, done, cpu1 - cpu0
    finally:
        for proc in reversed(procs):
            proc.stop()


def report(
    stats: dict[str, list[float]], done: int, cpu: float, timer: float, body_note: str = ""
) -> list[str]:
    events = done * EVENTS_PER_REQUEST
    lines = [
        f"where addons/trace.py spends its time inside mitmdump ({done} streaming requests, "
        f"{EVENTS_PER_REQUEST} SSE events each, {CONNECTIONS} connections{body_note})",
        f"  {'hook':26} {'calls/req':>9} {'per call':>9} {'per req':>9} {'per event':>9}",
    ]
    total = 0.0
    for name, (spent, calls) in sorted(stats.items(), key=lambda kv: -kv[1][0]):
        if name in HOOKS or name.endswith("stream callable"):
            total += spent  # the --also methods run inside these
        lines.append(
            f"  {name:26} {calls / done:9.2f} {spent / calls * 1e6:8.2f}µ "
            f"{spent / done * 1e6:8.1f}µ {spent / events * 1e6:8.3f}µ"
        )
    lines.append(
        f"  {'all hooks and callables':26} {'':9} {'':9} {total / done * 1e6:8.1f}µ {total / events * 1e6:8.3f}µ"
    )
    lines.append(
        f"  mitmdump CPU over the same requests: {cpu / events * 1e6:.2f}µ per event; "
        f"the addon's timed code {total / cpu * 100 if cpu else 0:.1f} % of it"
    )
    collected = sum(spent for name, (spent, _) in stats.items() if name.startswith("gc, "))
    lines.append(
        f"  garbage collections (mitmproxy's and the addon's): {collected / done * 1e6:.1f}µ "
        "per request, counted again in the hook they landed in"
    )
    lines.append(f"  each timer adds about {timer * 1e9:.0f} ns per call (not subtracted)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1600)
    p.add_argument("--out", default="bench-out")
    p.add_argument(
        "--addon", default=str(REPO / "addons" / "trace.py"), help="a variant of the addon to time"
    )
    p.add_argument(
        "--also",
        default="",
        help="more TraceAddon methods to time, comma-separated (their time is in their "
        "callers' too), e.g. _flush_body,_end,_emit",
    )
    p.add_argument(
        "--agent",
        action="store_true",
        help="send each request with an agent's 64 KiB context as its body (bench.run's "
        "agent-c16) instead of an empty one",
    )
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _pin_self()
    also = tuple(name for name in a.also.split(",") if name)
    request = agent_request() if a.agent else REQUEST
    body_note = f", request bodies of {len(agent_body())} B" if a.agent else ""
    stats, done, cpu = measure(out, a.requests, Path(a.addon).resolve(), HOOKS + also, request)
    for line in report(stats, done, cpu, _timer_cost(), body_note):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
