"""``make bench``: the cost of the tap inline, next to a direct connection and peer proxies.

One run starts the bench upstream (core 0), every selected proxy (core 1), then measures
each scenario on each target back to back, direct among them, for a number of rounds
(the order reversed every other round, so drift hits every target alike). The loads are
closed-loop keep-alive connections from this process, also pinned to core 0, and wrk for
plain requests. It prints a table of medians over rounds with paired ratios and checks
the targets; everything goes to ``bench-out/results.json``. See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import peers, profile
from .loadgen import IdleConns, Probe, run_load, run_wrk, self_cpu
from .procs import (
    Proc,
    children,
    cpu_seconds,
    foreign_cpu,
    free_port,
    spawn,
    steal_seconds,
    wait_port,
)
from .report import (
    EVENTS_PER_STREAM,
    aggregate,
    checks,
    fmt_pct,
    fmt_rate,
    fmt_time,
    load_metrics,
    pct,
    render_table,
    wrk_metrics,
)

REPO = Path(__file__).resolve().parent.parent
RIG_CORE = 0

SCENARIOS = [
    "plain-c1",
    "plain-c16",
    "plain-c64",
    "plain-c256",
    "wrk-c64",
    "stream-c1",
    "stream-c16",
    "stream-c64",
    "stream-c256",
    "paced-c16",
    "paced-c256",
    "idle",
]
IDLE_CONNS = 1000
IDLE_CPU_WINDOW = 5.0  # seconds the idle connections are left alone while the CPU is read


@dataclass
class Config:
    rounds: int
    warmup: float
    duration: float
    targets: list[str]
    scenarios: list[str]
    out: Path
    profile: bool = False
    idle_conns: int = IDLE_CONNS
    tracer_path: Path | None = None  # --tracer-path: the tap from another checkout


def _parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Measure the tracer tap inline against direct, mitmdump and nginx.",
    )
    p.add_argument("--quick", action="store_true", help="one round, short windows (smoke check)")
    p.add_argument(
        "--only",
        default=",".join(peers.TARGETS),
        metavar="T1,T2",
        help=f"targets to run, from {','.join(peers.TARGETS)} (default: all)",
    )
    p.add_argument(
        "--scenarios",
        default="all",
        metavar="S1,S2",
        help="scenario ids or families (plain, wrk, stream, paced, idle); "
        f"default all: {','.join(SCENARIOS)}; or 'addon' alone: mitmdump with and without "
        "addons/trace.py (bench/addon.py)",
    )
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 2, quick 1)")
    p.add_argument("--duration", type=float, default=None, help="measurement window, seconds")
    p.add_argument("--warmup", type=float, default=None, help="warm-up per run, seconds")
    p.add_argument("--out", default=str(REPO / "bench-out"), metavar="DIR")
    p.add_argument(
        "--profile",
        action="store_true",
        help="sample the tracer with py-spy during its first-round runs (bench-out/profile-*.txt)",
    )
    p.add_argument(
        "--tracer-path",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the tracer tap from this checkout (e.g. a `git worktree` of an older "
        "commit), to measure before and after on one machine; default: this one",
    )
    a = p.parse_args(argv)
    if a.tracer_path is not None and not (a.tracer_path / "tracer" / "__main__.py").exists():
        p.error(f"--tracer-path {a.tracer_path}: no tracer package there")
    targets = [t.strip() for t in a.only.split(",") if t.strip()]
    bad = [t for t in targets if t not in peers.TARGETS]
    if bad or not targets:
        p.error(f"unknown target(s) {bad}; choose from {','.join(peers.TARGETS)}")
    targets = [t for t in peers.TARGETS if t in targets]  # canonical order
    if a.scenarios == "all":
        scenarios = list(SCENARIOS)
    elif a.scenarios.strip() == "addon":
        scenarios = ["addon"]  # bench/addon.py: runs on its own
    else:
        wanted = [s.strip() for s in a.scenarios.split(",") if s.strip()]
        scenarios = [s for s in SCENARIOS if s in wanted or s.split("-")[0] in wanted]
        unknown = [w for w in wanted if not any(s == w or s.split("-")[0] == w for s in SCENARIOS)]
        if unknown or not scenarios:
            p.error(f"unknown scenario(s) {unknown}; choose from {','.join(SCENARIOS)}")
    rounds = a.rounds if a.rounds is not None else (1 if a.quick else 2)
    duration = a.duration if a.duration is not None else (0.8 if a.quick else 2.0)
    warmup = a.warmup if a.warmup is not None else (0.25 if a.quick else 0.5)
    if not 1 <= rounds <= 10 or not 0.1 <= duration <= 30 or not 0 <= warmup <= 10:
        p.error("rounds must be 1..10, duration 0.1..30 s, warmup 0..10 s")
    return Config(
        rounds,
        warmup,
        duration,
        targets,
        scenarios,
        Path(a.out).resolve(),
        a.profile,
        tracer_path=a.tracer_path,
    )


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _helpers_cpu(target: peers.Target) -> float:
    """CPU of the proxy's child processes that are not counted as the proxy itself: the
    trace addon's capture process (nginx's workers are the proxy: ``extra_children``)."""
    if target.proc is None or target.proc.extra_children:
        return 0.0
    return sum(cpu_seconds(pid) for pid in children(target.proc.pid))


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _measure(
    scen: str, target: peers.Target, upstream: Proc, others: list[Proc], cfg: Config
) -> dict[str, Any]:
    mode, _, c = scen.partition("-c")
    conc = int(c)
    ours = {os.getpid(), upstream.pid, *target.pids(), *(p for o in others for p in o.pids())}
    probes: dict[str, Probe] = {
        "proxy": target.cpu,
        "upstream": upstream.cpu,
        "loadgen": self_cpu,
        "others": lambda: sum(p.cpu() for p in others),  # idle proxies: must stay ~0
        "foreign": lambda: foreign_cpu(ours),  # everything else on the VM: should be ~0
        # the host's other guests on our cores (steal): should be ~0 too
        "steal_proxy": lambda: steal_seconds(peers.PROXY_CORE),
        "steal_rig": lambda: steal_seconds(RIG_CORE),
        "helpers": lambda: _helpers_cpu(target),
    }
    if mode == "wrk":
        probes["loadgen"] = _children_cpu  # wrk's own CPU, counted when it exits
        res = await run_wrk(
            target.port,
            conc,
            warmup=0.0,
            duration=cfg.duration,
            probes=probes,
            core=RIG_CORE,
        )
        m = wrk_metrics(res)
        m["wrk_output"] = res.get("raw", "")
        return m
    timeout = cfg.warmup + cfg.duration + 40
    load = await asyncio.wait_for(
        run_load(
            target.port,
            mode,
            conc,
            warmup=cfg.warmup,
            duration=cfg.duration,
            expect_events=EVENTS_PER_STREAM,
            probes=probes,
        ),
        timeout,
    )
    return load_metrics(load)


async def _settle(procs: list[Proc], limit: float = 10.0) -> float:
    """Wait (bounded) until the processes are nearly idle: leftovers of the previous run done.

    Dirty pages (the tracer's capture) are flushed first, so that the kernel's writeback
    does not land in the next measurement window.
    """
    t0 = time.monotonic()
    await asyncio.get_running_loop().run_in_executor(None, os.sync)
    while time.monotonic() - t0 < limit:
        before = [p.cpu() for p in procs]
        await asyncio.sleep(0.1)
        busy = max((p.cpu() - b for p, b in zip(procs, before, strict=True)), default=0.0)
        if busy <= 0.1 * 0.1:  # under 10 % of a core (the clock ticks are 10 ms)
            break
    return time.monotonic() - t0


async def _idle(target: peers.Target, n: int) -> dict[str, Any]:
    """RSS of the proxy with 0, n and 2n idle keep-alive connections (each after a request)."""
    await asyncio.sleep(0.5)
    base = target.rss()
    first, second = IdleConns(), IdleConns()
    try:
        errors = await asyncio.wait_for(first.open(target.port, n), 60)
        await asyncio.sleep(1.0)
        r1 = target.rss()
        errors += await asyncio.wait_for(second.open(target.port, n), 60)
        await asyncio.sleep(1.0)
        r2 = target.rss()
        # what the 2n idle connections cost in CPU: the proxy's CPU over a quiet window
        cpu0, t0 = target.cpu(), time.monotonic()
        await asyncio.sleep(IDLE_CPU_WINDOW)
        idle_cpu = (target.cpu() - cpu0) / (time.monotonic() - t0)  # cores busy
    finally:
        first.close()
        second.close()
    await asyncio.sleep(0.5)
    firsts = first.first_request + second.first_request
    return {
        "new_conn_p50": pct(firsts, 50),
        "new_conn_p99": pct(firsts, 99),
        "rss_base_kib": base,
        f"rss_{n}_kib": r1,
        f"rss_{2 * n}_kib": r2,
        "rss_per_conn_first": (r1 - base) / n,
        "rss_per_conn_next": (r2 - r1) / n,
        "idle_cpu_util": idle_cpu,
        "idle_open": 2 * n,
        "cpu_per_idle_conn": idle_cpu / (2 * n),  # CPU-seconds per second per connection
        "errors": errors,
    }


async def _profile_done(spy: subprocess.Popen[bytes], path: Path, scen: str) -> dict[str, Any]:
    """Wait for py-spy (bounded), then the top functions by self time."""
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loop.run_in_executor(None, spy.wait), 30)
    except TimeoutError:
        spy.kill()
        spy.wait()
    err = spy.stderr.read().decode(errors="replace") if spy.stderr else ""
    if spy.stderr:
        spy.stderr.close()
    if not path.exists():
        return {"error": err.strip()[-500:] or f"py-spy exited {spy.returncode}"}
    samples, rows = profile.top(path)
    text = profile.render(scen, samples, rows)
    _say(text)
    return {"file": str(path), "samples": samples, "top": rows, "text": text}


def _stolen(m: dict[str, Any]) -> float:
    """The larger share of a core the host took from one of ours in a window (steal)."""
    return max(m.get("steal_proxy_util") or 0.0, m.get("steal_rig_util") or 0.0)


def _worst(
    result: dict[str, Any], figure: Callable[[dict[str, Any]], float]
) -> tuple[float, str, str] | None:
    """The window with the largest ``figure``: (it, scenario, target); None without runs."""
    return max(
        (
            (figure(m), scen, name)
            for scen, by_target in result["runs"].items()
            for name, rounds in by_target.items()
            for m in rounds
        ),
        default=None,
    )


def _line(scen: str, name: str, m: dict[str, Any]) -> str:
    if "failed" in m:
        return f"{scen:12} {name:9} FAILED: {m['failed']}"
    if scen == "idle":
        return (
            f"{scen:12} {name:9} {m['rss_per_conn_first']:.1f} KiB/conn (first), "
            f"{m['rss_per_conn_next']:.1f} KiB/conn (next); new conn + request p50 "
            f"{fmt_time(m['new_conn_p50'])} p99 {fmt_time(m['new_conn_p99'])}; "
            f"CPU {m['idle_cpu_util'] * 100:.2f}% with {m['idle_open']} open"
        )
    rig = f"rig {m['rig_util'] * 100:.0f}%"
    proxy = "" if name == "direct" else f" proxy {(m['proxy_util'] or 0) * 100:.0f}%"
    err = f" errors {m['errors']}" if m.get("errors") else ""
    if m.get("undrained"):
        err += f" undrained {m['undrained']}"
    if (m.get("foreign_util") or 0) > 0.05:
        err += f" (other processes on the VM busy {m['foreign_util'] * 100:.0f}%)"
    stolen = _stolen(m)
    if stolen > 0.05:
        err += f" (the host took up to {stolen * 100:.0f}% of a core: steal)"
    if (m.get("others_util") or 0) > 0.05:
        err += f" (idle proxies busy {m['others_util'] * 100:.0f}%)"
    if m.get("settle_s", 0) > 1:
        err += f" (waited {m['settle_s']:.1f}s for idle before)"
    if "eps" in m:
        return (
            f"{scen:12} {name:9} {fmt_rate(m['eps']):>7} ev/s  first {fmt_time(m['ttfe_p50'])}"
            f"  gap p99 {fmt_time(m['gap_p99'])} zero {fmt_pct(m['zero_gap'])}  {rig}{proxy}{err}"
        )
    return (
        f"{scen:12} {name:9} {fmt_rate(m['rps']):>7} req/s  p50 {fmt_time(m['lat_p50'])}"
        f"  p99 {fmt_time(m['lat_p99'])}  {rig}{proxy}{err}"
    )


def _versions() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
    }
    for pkg in ("tracer", "mitmproxy", "anyio", "h11"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[pkg] = importlib.metadata.version(pkg)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["/usr/sbin/nginx", "-v"], capture_output=True, text=True, timeout=5
        ).stderr
        info["nginx"] = out.strip().rpartition("/")[2]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["wrk", "-v"], capture_output=True, text=True, timeout=5).stdout
        info["wrk"] = out.split()[1] if out.split() else None
    return info


def _tracer_health(out: Path) -> dict[str, Any]:
    """What the tap said about itself: warnings/errors in its log, capture_end record."""
    health: dict[str, Any] = {}
    log = out / "tracer.log"
    with contextlib.suppress(OSError):
        lines = log.read_text(errors="replace").splitlines()
        health["log_warnings"] = sum(1 for x in lines if "[warning" in x)
        health["log_errors"] = sum(1 for x in lines if "[error" in x or "Traceback" in x)
        health["log_first_problem"] = next(
            (x for x in lines if "[error" in x or "[warning" in x or "Traceback" in x), None
        )
    cap = out / "tap.jsonl"
    with contextlib.suppress(OSError):
        health["capture_bytes"] = cap.stat().st_size
        with open(cap, "rb") as f:
            f.seek(max(0, cap.stat().st_size - 4096))
            tail = f.read().splitlines()
        for raw in reversed(tail):
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if rec.get("type") == "capture_end":
                health["capture_end"] = rec
            break
    return health


def start_upstream(out: Path, procs: list[Proc]) -> tuple[Proc, int]:
    """The bench upstream on the rig's core, listening (appended to ``procs`` at once)."""
    port = free_port()
    upstream = spawn(
        "upstream",
        [sys.executable, "-m", "bench.upstream", "--port", str(port)],
        core=RIG_CORE,
        log_dir=out,
        cwd=REPO,
    )
    procs.append(upstream)
    wait_port(port, upstream.popen, timeout=15)
    return upstream, port


async def _run(cfg: Config, procs: list[Proc], started: list[peers.Target]) -> dict[str, Any]:
    out = cfg.out
    upstream, upstream_port = start_upstream(out, procs)

    targets: dict[str, peers.Target] = {}
    skipped: dict[str, str] = {}
    for name in cfg.targets:
        why = peers.available(name)
        if why:
            skipped[name] = why
            _say(f"skipping {name}: {why}")
            continue
        try:
            t = peers.start(name, upstream_port, out, REPO, tracer_path=cfg.tracer_path)
        except RuntimeError as exc:
            skipped[name] = str(exc)
            _say(f"skipping {name}: {exc}")
            continue
        targets[name] = t
        if t.proc is not None:
            started.append(t)
    names = [n for n in cfg.targets if n in targets]
    if not names:
        raise RuntimeError("no target could be started")
    scenarios = [s for s in cfg.scenarios if s != "idle"]
    if "wrk-c64" in scenarios and shutil.which("wrk") is None:
        scenarios.remove("wrk-c64")
        skipped["wrk-c64"] = "wrk not installed"

    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in cfg.scenarios}
    profiles: dict[str, Any] = {}
    failures: list[dict[str, Any]] = []
    t_start = time.monotonic()
    for rnd in range(cfg.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        _say(f"-- round {rnd + 1}/{cfg.rounds}: {', '.join(order)}")
        for scen in scenarios:
            for name in order:
                target = targets[name]
                if not target.alive():
                    continue
                proxies = [t.proc for t in targets.values() if t.proc is not None]
                others = [p for p in proxies if p is not target.proc]
                settle = await _settle([upstream, *proxies])
                spy = None
                if cfg.profile and rnd == 0 and name == "tracer" and target.proc is not None:
                    spy_out = out / f"profile-{scen}.txt"
                    try:
                        spy = profile.start(target.proc.pid, spy_out, cfg.warmup + cfg.duration)
                    except (OSError, RuntimeError) as exc:
                        _say(f"no profile: {exc}")
                try:
                    m = await _measure(scen, target, upstream, others, cfg)
                except Exception as exc:
                    m = {"failed": f"{type(exc).__name__}: {exc}"}
                    failures.append({"round": rnd + 1, "scenario": scen, "target": name, **m})
                if spy is not None:
                    profiles[scen] = await _profile_done(spy, spy_out, scen)
                m["round"] = rnd + 1
                m["settle_s"] = round(settle, 2)
                _say(_line(scen, name, m))
                if "failed" not in m:
                    runs[scen].setdefault(name, []).append(m)
                if not target.alive():
                    failures.append(
                        {"round": rnd + 1, "scenario": scen, "target": name, "failed": "died"}
                    )
                    _say(f"{name} died:\n{target.proc.log_tail() if target.proc else ''}")
                if not upstream.alive():
                    raise RuntimeError(f"the bench upstream died:\n{upstream.log_tail()}")
                await asyncio.sleep(0.1)
    if "idle" in cfg.scenarios:
        for name in names:
            target = targets[name]
            if name == "direct" or not target.alive():
                continue
            await _settle([upstream, *[t.proc for t in targets.values() if t.proc is not None]])
            try:
                m = await _idle(target, cfg.idle_conns)
            except Exception as exc:
                m = {"failed": f"{type(exc).__name__}: {exc}"}
                failures.append({"scenario": "idle", "target": name, **m})
            _say(_line("idle", name, m))
            if "failed" not in m:
                runs["idle"].setdefault(name, []).append(m)
    elapsed = time.monotonic() - t_start
    return {
        "runs": runs,
        "names": names,
        "skipped": skipped,
        "failures": failures,
        "elapsed_s": round(elapsed, 1),
        "profiles": profiles,
        "upstream_port": upstream_port,
        "ports": {n: t.port for n, t in targets.items()},
    }


def _pin_self() -> bool:
    if (os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, {RIG_CORE})
    except OSError:
        return False
    return True


def _raise_nofile(want: int = 16384) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    cfg = _parse_args(argv)
    if cfg.scenarios == ["addon"]:
        from . import addon

        _pin_self()
        _raise_nofile()
        signal.signal(signal.SIGTERM, _on_sigterm)
        return addon.main(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    pinned = _pin_self()
    if not pinned:
        _say("warning: fewer than 2 cores or no affinity: proxy and rig share the CPU")
    _raise_nofile()
    signal.signal(signal.SIGTERM, _on_sigterm)
    procs: list[Proc] = []
    started: list[peers.Target] = []
    _say(
        f"bench: targets {','.join(cfg.targets)}; {cfg.rounds} round(s), "
        f"warm-up {cfg.warmup:g}s + window {cfg.duration:g}s per run; output in {cfg.out}"
    )
    try:
        result = asyncio.run(_run(cfg, procs, started))
    except KeyboardInterrupt:
        _say("interrupted; stopping what the bench started")
        return 130
    except RuntimeError as exc:
        _say(f"bench: {exc}")
        return 1
    finally:
        for t in started:
            t.stop()
        for p in procs:
            p.stop()
    names = result["names"]
    agg = aggregate(result["runs"], names)
    table = render_table(agg, names, cfg.scenarios)
    found = checks(agg)
    health = _tracer_health(cfg.out) if "tracer" in names else {}
    doc = {
        "config": {**asdict(cfg), "out": str(cfg.out), "pinned": pinned},
        "environment": _versions(),
        "elapsed_s": result["elapsed_s"],
        "skipped": result["skipped"],
        "failures": result["failures"],
        "runs": result["runs"],
        "aggregate": agg,
        "checks": [asdict(c) for c in found],
        "tracer_health": health,
        "profiles": result["profiles"],
        "table": table,
    }
    (cfg.out / "results.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print()
    print(
        f"Medians over {cfg.rounds} round(s); ratios are medians of paired per-round ratios. "
        "Rig (core 0) = upstream + load generator."
    )
    print(table)
    print()
    print("Targets (tracer):")
    for c in found:
        print("  " + c.line())
    for prof in result["profiles"].values():
        if "text" in prof:
            print()
            print(prof["text"])
    busiest = _worst(result, lambda m: m.get("foreign_util") or 0.0)
    if busiest is not None:
        print(
            f"Other processes on the VM: at most {busiest[0] * 100:.0f}% of a core in a window "
            f"({busiest[1]}, {busiest[2]}); above ~5% the run was disturbed."
        )
    stolen = _worst(result, _stolen)
    if stolen is not None:
        print(
            f"Steal (the host running other guests on this VM's cores): at most "
            f"{stolen[0] * 100:.0f}% of a core in a window ({stolen[1]}, {stolen[2]}); above "
            "~5% timings on that core are the host's, not the proxy's."
        )
    if result["skipped"]:
        print("Skipped: " + "; ".join(f"{k}: {v}" for k, v in result["skipped"].items()))
    if result["failures"]:
        print(f"Failed runs: {len(result['failures'])} (see results.json)")
    if health:
        end = health.get("capture_end") or {}
        print(
            f"tracer: {health.get('log_warnings', 0)} warnings, {health.get('log_errors', 0)} "
            f"errors in its log; capture {health.get('capture_bytes', 0) / 1e6:.0f} MB"
            + (f", dropped {end.get('dropped')}" if "dropped" in end else "")
        )
    print(f"Elapsed {result['elapsed_s']:.0f} s. Written {cfg.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
