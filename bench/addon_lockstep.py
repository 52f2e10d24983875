"""``python -m bench.addon_lockstep``: mitmdump's CPU per SSE event with and without an
addon, over fresh processes and a fixed workload, for one-off comparisons.

Each round starts every variant anew on the proxy's core (a process keeps its own luck
for its whole life: see bench/README.md), warms it up, then drives the same lockstep
workload (``--requests`` streaming requests of 64 SSE events over 16 keep-alive
connections, the next batch sent when all have ended) and reads the process's CPU time
around it; the order of the variants is reversed every other round. Reported: CPU per
event, and per round the ratio to the first variant (paired: the same round).

Variants: ``alone`` (mitmdump as ``bench.addon`` starts it), ``hooks`` (the do-nothing
addon of the trace addon's hooks), ``burn:US`` (that addon spending US µs of CPU in its
``response`` hook, in a loop that touches no memory: what the same time costs without the
addon's data and code), ``touch:KB`` (that addon reading KB of memory it keeps, in C, in
its ``response`` hook: what filling the caches costs mitmproxy), ``trace`` (``addons/trace.py`` writing a capture) and
``trace=PATH`` (a variant of it). Not part of ``make bench``: ``bench.addon`` is the
check; this is for telling where a cost comes from.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from .addon import HOOKS_SCRIPT, mitmdump_argv
from .addon_instructions import REQUEST, agent_request, cpu_per_event
from .procs import Proc, free_port
from .run import REPO, start_upstream

BURN_HOOK = """\
    def response(self, flow):
        until = time.perf_counter() + {seconds!r}
        while time.perf_counter() < until:
            pass
"""
# reads the next KB of an 8 MiB buffer (C speed, nothing kept): caches filled with memory
# mitmproxy does not use, in little time
TOUCH_HOOK = """\
    buf = bytearray(8 << 20)
    at = 0

    def response(self, flow):
        n = {size!r}
        if self.at + n > len(self.buf):
            self.at = 0
        self.buf.count(b"x", self.at, self.at + n)
        self.at += n
"""


def _script(variant: str, out: Path) -> list[str]:
    """The ``-s``/``--set`` arguments a variant adds to mitmdump's."""
    if variant == "alone":
        return []
    if variant == "hooks" or variant.startswith(("burn:", "touch:")):
        text = HOOKS_SCRIPT
        kind, _, amount = variant.partition(":")
        if kind != "hooks":
            hook = (
                BURN_HOOK.format(seconds=float(amount) / 1e6)
                if kind == "burn"
                else TOUCH_HOOK.format(size=int(amount) * 1024)
            )
            text = "import time\n\n" + text.replace("    def response(self, flow): pass\n", hook)
        path = out / f"lockstep-{variant.replace(':', '-')}.py"
        path.write_text(text)
        return ["-s", str(path)]
    if variant == "trace" or variant.startswith("trace="):
        addon = variant.partition("=")[2] or str(REPO / "addons" / "trace.py")
        capture = out / "lockstep-tap.jsonl"
        capture.unlink(missing_ok=True)
        return ["-s", addon, "--set", f"tracer_capture={capture}"]
    raise SystemExit(
        f"unknown variant {variant!r} (alone, hooks, burn:US, touch:KB, trace, trace=PATH)"
    )


def _one(variant: str, upstream: int, out: Path, requests: int, request: bytes) -> float:
    """CPU µs per SSE event of a fresh mitmdump running ``variant``."""
    port = free_port()
    argv = [*mitmdump_argv(upstream, port, out), *_script(variant, out)]
    per_event, done = cpu_per_event(
        "lockstep-mitmdump", argv, port, out, requests, warmup=160, request=request
    )
    if done < requests:
        raise RuntimeError(f"{variant}: {done} of {requests} requests before the deadline")
    return per_event


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="*", default=["alone", "hooks", "burn:140", "trace"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=1600)
    p.add_argument("--agent", action="store_true", help="each request with a 64 KiB body")
    p.add_argument("--out", default="bench-out")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    request = agent_request() if a.agent else REQUEST
    procs: list[Proc] = []
    per_event: dict[str, list[float]] = {v: [] for v in a.variants}
    try:
        _, upstream = start_upstream(out, procs)
        for r in range(a.rounds):
            for variant in a.variants if r % 2 == 0 else a.variants[::-1]:
                value = _one(variant, upstream, out, a.requests, request)
                per_event[variant].append(value)
                print(f"round {r + 1}: {variant:12} {value:6.2f} µs/event", flush=True)
    finally:
        for proc in procs:
            proc.stop()
    base = per_event[a.variants[0]]
    print(f"\nmitmdump CPU per SSE event, {a.requests} requests a round, fresh processes:")
    for variant, values in per_event.items():
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        rounds = " ".join(f"{x:.3f}" for x in ratios)
        print(
            f"  {variant:12} {statistics.median(values):6.2f} µs   "
            f"x{statistics.median(ratios):.3f} of {a.variants[0]} (rounds: {rounds})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
