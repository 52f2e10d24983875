"""``python -m bench.run --scenarios addon``: what ``addons/trace.py`` costs mitmdump.

Three mitmdump processes run side by side on core 1, started anew every round (the
rounds are then independent pairs of processes, not one pair's luck repeated), all
started exactly like the bench's ``mitmdump`` target (reverse mode, ``stream_large_bodies=1``, the streaming script); one
also loads ``addons/trace.py`` writing a capture, one an addon with the same hooks doing
nothing (the floor: what mitmproxy's hook dispatch and a stream callable cost any addon). Same upstream, same load
generator and the same rig as ``bench.run`` (its ``_measure`` and ``_settle``);
``stream-c16``, ``agent-c16`` (the same stream, each request carrying an agent's 64 KiB
context: what the addon's work per request body byte costs) and ``plain-c16``
(saturating: mitmdump's core is the limit), and
``paced-c16`` (an event every 2 ms, as a decode step: mitmdump mostly idle), each round
measuring the three back to back, the order reversed every other round. Reported:
events/s, req/s, proxy CPU per event / request, the addon's capture process's CPU (it
runs beside mitmdump, off its core: ``addons/trace.py``), and the ratios with/without the
addon (medians of paired per-round ratios; the total one counts the capture process in); for ``paced-c16`` the time the addon adds to the
first event and to the gap between events. The target: the addon costs mitmdump at most
10 % of its throughput where mitmdump is the limit (throughput ratio ≥ 0.90); the paced
figures are reported, not checked (what a user at an engine's pace would see).
``--profile`` samples the two addon processes with py-spy in round 1.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import peers, profile
from .procs import Proc, free_port, spawn, wait_port
from .report import fmt_added, fmt_rate, fmt_time
from .run import REPO, Config, _measure, _profile_done, _say, _settle, start_upstream

SCENARIOS = ("stream-c16", "agent-c16", "plain-c16", "paced-c16")
PACED_TIMES = ("ttfe_p50", "gap_p99")  # reported for paced-c16, traced minus base
BASE, HOOKS, TRACED = "mitmdump", "mitmdump+hooks", "mitmdump+trace"
MAX_OVERHEAD = 0.10
CAPTURE = "addon-tap.jsonl"  # the traced mitmdump's, one round's (each round starts anew)

# The floor: an addon with the trace addon's hooks, doing nothing (a pass-through stream
# callable on every response). What is left above it is the addon's own work.
HOOKS_SCRIPT = """\
class Hooks:
    def load(self, loader):
        loader.add_option("tracer_capture", str, "", "unused")

    def client_connected(self, client): pass
    def server_connect(self, data): pass
    def server_connected(self, data): pass
    def server_connect_error(self, data): pass
    def client_disconnected(self, client): pass
    def requestheaders(self, flow): pass
    def request(self, flow): pass
    def response(self, flow): pass
    def error(self, flow): pass

    def responseheaders(self, flow):
        flow.response.stream = lambda data: data


addons = [Hooks()]
"""


def mitmdump_argv(upstream_port: int, port: int, out: Path) -> list[str]:
    """mitmdump as every addon comparison starts it (this one, ``bench.addon_hooks``,
    ``bench.addon_instructions``): reverse mode to the bench upstream on 127.0.0.1, quiet,
    bodies streamed (``stream_large_bodies=1`` and the streaming script); addons go after."""
    script = out / "mitm_stream.py"
    script.write_text(peers.MITM_SCRIPT)
    confdir = out / "mitmproxy"
    confdir.mkdir(exist_ok=True)
    argv = [str(Path(sys.executable).parent / "mitmdump")]
    argv += ["--mode", f"reverse:http://127.0.0.1:{upstream_port}"]
    argv += ["--listen-host", "127.0.0.1", "-p", str(port), "-q"]
    argv += ["--set", "stream_large_bodies=1", "--set", f"confdir={confdir}"]
    return [*argv, "-s", str(script)]


def _start(name: str, upstream_port: int, out: Path) -> peers.Target:
    port = free_port()
    argv = mitmdump_argv(upstream_port, port, out)
    if name == TRACED:
        capture = out / CAPTURE
        capture.unlink(missing_ok=True)
        argv += ["-s", str(REPO / "addons" / "trace.py"), "--set", f"tracer_capture={capture}"]
    elif name == HOOKS:
        hooks = out / "mitm_hooks.py"
        hooks.write_text(HOOKS_SCRIPT)
        argv += ["-s", str(hooks)]
    proc = spawn(name.replace("+", "-"), argv, core=peers.PROXY_CORE, log_dir=out, cwd=REPO)
    try:
        wait_port(port, proc.popen, timeout=30)
    except RuntimeError as exc:
        proc.stop()
        raise RuntimeError(f"{name}: {exc}\n{proc.log_tail()}") from exc
    return peers.Target(name, port, proc)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


async def _run(cfg: Config, procs: list[Proc]) -> dict[str, Any]:
    out = cfg.out
    upstream, upstream_port = start_upstream(out, procs)
    names = [BASE, HOOKS, TRACED]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {name: [] for name in names} for s in SCENARIOS
    }
    profiles: dict[str, Any] = {}
    captures: list[dict[str, Any]] = []
    for rnd in range(cfg.rounds):
        # Fresh processes every round: two mitmdumps running the same code differ by a
        # point or two for the whole of their lives (memory layout, hash seed), so the
        # rounds of one set of processes would all share its luck.
        targets = {name: _start(name, upstream_port, out) for name in names}
        round_procs = [t.proc for t in targets.values() if t.proc is not None]
        procs.extend(round_procs)
        order = names if rnd % 2 == 0 else names[::-1]
        _say(f"-- addon round {rnd + 1}/{cfg.rounds} (new processes): {', '.join(order)}")
        try:
            for scen in SCENARIOS:
                for name in order:
                    m = await _measure_one(cfg, scen, name, targets, upstream, rnd, profiles)
                    if "failed" not in m:
                        runs[scen][name].append(m)
        finally:
            for proc in round_procs:
                proc.stop()  # the traced one writes capture_end
                procs.remove(proc)
        captures.append(_capture_end(out / CAPTURE))
    return {"runs": runs, "capture": _captures_summary(captures), "profiles": profiles}


async def _measure_one(
    cfg: Config,
    scen: str,
    name: str,
    targets: dict[str, peers.Target],
    upstream: Proc,
    rnd: int,
    profiles: dict[str, Any],
) -> dict[str, Any]:
    """One target's run of one scenario in one round, printed as it ends."""
    target = targets[name]
    others = [t.proc for n, t in targets.items() if n != name and t.proc is not None]
    await _settle([upstream, *[t.proc for t in targets.values() if t.proc]])
    spy = None
    if cfg.profile and rnd == 0 and name != BASE and target.proc is not None:
        spy_out = cfg.out / f"profile-{name.replace('+', '-')}-{scen}.txt"
        spy = profile.start(target.proc.pid, spy_out, cfg.warmup + cfg.duration)
    try:
        m = await _measure(scen, target, upstream, others, cfg)
    except Exception as exc:
        m = {"failed": f"{type(exc).__name__}: {exc}"}
    if spy is not None:
        profiles[f"{name} {scen}"] = await _profile_done(spy, spy_out, scen)
    m["round"] = rnd + 1
    _say(_line(scen, name, m))
    if not target.alive():
        raise RuntimeError(f"{name} died:\n{target.proc.log_tail() if target.proc else ''}")
    await asyncio.sleep(0.1)
    return m


def _captures_summary(captures: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' captures together: bytes, records and drops summed (each round's file
    is replaced by the next; the last one stays on disk)."""
    ends = [c.get("capture_end") or {} for c in captures]
    return {
        "path": captures[-1]["path"] if captures else None,
        "rounds": len(captures),
        "bytes": sum(c.get("bytes", 0) for c in captures),
        "records": sum(e.get("records", 0) for e in ends),
        "dropped": sum(e.get("dropped", 0) for e in ends),
        "ended": sum(1 for e in ends if e),
    }


def _capture_end(path: Path) -> dict[str, Any]:
    info: dict[str, Any] = {"path": str(path)}
    try:
        info["bytes"] = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(max(0, info["bytes"] - 4096))
            tail = f.read().splitlines()
    except OSError:
        return info
    for raw in reversed(tail):
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if rec.get("type") == "capture_end":
            info["capture_end"] = rec
        break
    return info


def _line(scen: str, name: str, m: dict[str, Any]) -> str:
    if "failed" in m:
        return f"{scen:11} {name:15} FAILED: {m['failed']}"
    proxy = f"proxy {(m.get('proxy_util') or 0) * 100:.0f}%"
    if "eps" in m:
        return (
            f"{scen:11} {name:15} {fmt_rate(m['eps']):>7} ev/s  "
            f"{fmt_time(m['cpu_per_event'])}/event  {proxy}"
        )
    return (
        f"{scen:11} {name:15} {fmt_rate(m['rps']):>7} req/s  "
        f"{fmt_time(m['cpu_per_req'])}/req  {proxy}"
    )


def aggregate(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians per target, and medians of the paired per-round ratios traced/base."""
    agg: dict[str, Any] = {}
    for scen, by_target in runs.items():
        rate, cpu = ("rps", "cpu_per_req") if scen.startswith("plain") else ("eps", "cpu_per_event")
        by_round = {
            name: {m["round"]: m for m in by_target.get(name, [])} for name in (BASE, HOOKS, TRACED)
        }
        base, hooks, traced = by_round[BASE], by_round[HOOKS], by_round[TRACED]
        paired = sorted(set(base) & set(traced))
        floor = sorted(set(base) & set(hooks))
        helpers = "helpers_per_req" if rate == "rps" else "helpers_per_event"
        agg[scen] = {
            "rate": rate,
            "cpu_ratio": _median([_ratio(traced[r][cpu], base[r][cpu]) for r in paired]),
            # the addon's capture process (on another core) counted in: all it costs
            "total_cpu_ratio": _median(
                [
                    _ratio(traced[r][cpu] + (traced[r].get(helpers) or 0.0), base[r][cpu])
                    for r in paired
                    if traced[r][cpu] is not None
                ]
            ),
            "capture_process": _median([traced[r].get(helpers) or 0.0 for r in paired]),
            "rounds": len(paired),
        }
        for name, runs_of in by_round.items():
            agg[scen][name] = {
                rate: _median([m[rate] for m in runs_of.values()]),
                cpu: _median([m[cpu] for m in runs_of.values()]),
            }
        if scen.startswith("paced"):  # the rig sets the pace: what the addon adds in time
            for key in PACED_TIMES:
                for name, runs_of in by_round.items():
                    agg[scen][name][key] = _median([m[key] for m in runs_of.values()])
                agg[scen][f"{key}_added"] = _median([traced[r][key] - base[r][key] for r in paired])
            continue
        pairs = (_ratio(traced[r][rate], base[r][rate]) for r in paired)
        ratios = [x for x in pairs if x is not None]
        agg[scen] |= {
            "throughput_ratio": _median(ratios),
            "throughput_ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "hooks_throughput_ratio": _median(
                [_ratio(hooks[r][rate], base[r][rate]) for r in floor]
            ),
        }
    return agg


def render(agg: dict[str, Any]) -> str:
    lines = [
        f"{'scenario':11} {'metric':16} {BASE:>10} {HOOKS:>15} {TRACED:>15} {'ratio':>7}",
    ]
    for scen, a in agg.items():
        rate = a["rate"]
        cpu = "cpu_per_event" if rate == "eps" else "cpu_per_req"
        unit = "events/s" if rate == "eps" else "req/s"
        lines.append(
            f"{scen:11} {unit:16} {fmt_rate(a[BASE][rate]):>10} {fmt_rate(a[HOOKS][rate]):>15} "
            f"{fmt_rate(a[TRACED][rate]):>15} {_fmt_ratio(a.get('throughput_ratio')):>7}"
        )
        per = "CPU / event" if rate == "eps" else "CPU / request"
        lines.append(
            f"{'':11} {'proxy ' + per:16} {fmt_time(a[BASE][cpu]):>10} "
            f"{fmt_time(a[HOOKS][cpu]):>15} {fmt_time(a[TRACED][cpu]):>15} "
            f"{_fmt_ratio(a['cpu_ratio']):>7}"
        )
        lines.append(
            f"{'':11} {'capture process':16} {'-':>10} {'-':>15} "
            f"{fmt_time(a['capture_process']):>15} {_fmt_ratio(a['total_cpu_ratio']):>7}"
        )
        for key, label in zip(PACED_TIMES, ("first event p50", "gap p99"), strict=True):
            if f"{key}_added" in a:
                lines.append(
                    f"{'':11} {label:16} {fmt_time(a[BASE][key]):>10} "
                    f"{fmt_time(a[HOOKS][key]):>15} {fmt_time(a[TRACED][key]):>15} "
                    f"{fmt_added(a[f'{key}_added']):>7}"
                )
    return "\n".join(lines)


def _fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f} %"


def _fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def verdicts(agg: dict[str, Any]) -> list[str]:
    out = []
    for scen, a in agg.items():
        if "throughput_ratio" not in a:  # paced: reported, not checked
            first, gap = a.get("ttfe_p50_added"), a.get("gap_p99_added")
            out.append(
                f"INFO {scen} (an event every 2 ms): with the addon the first event (p50) "
                f"moves by {fmt_added(first)} and the gap p99 by {fmt_added(gap)}; "
                f"CPU per event x{_fmt_ratio(a['cpu_ratio'])}"
            )
            continue
        ratio = a["throughput_ratio"]
        if ratio is None:
            out.append(f"?    {scen}: no paired rounds")
            continue
        ok = ratio >= 1 - MAX_OVERHEAD
        low, high = a["throughput_ratio_range"]
        out.append(
            f"{'PASS' if ok else 'MISS'} {scen}: with the addon mitmdump keeps "
            f"{ratio * 100:.1f} % of its throughput (target ≥ {(1 - MAX_OVERHEAD) * 100:.0f} %; "
            f"rounds {low * 100:.1f} to {high * 100:.1f} %); "
            f"CPU per unit x{_fmt_ratio(a['cpu_ratio'])} (x{_fmt_ratio(a['total_cpu_ratio'])} "
            f"with the capture process, on another core); an addon with the same hooks "
            f"doing nothing keeps {_fmt_pct(a.get('hooks_throughput_ratio'))}"
        )
    return out


def main(cfg: Config) -> int:
    """Run the addon comparison with ``bench.run``'s rounds, windows and output directory."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    _say(
        f"bench addon: {BASE} vs {HOOKS} vs {TRACED}; {cfg.rounds} round(s), warm-up {cfg.warmup:g}s + "
        f"window {cfg.duration:g}s per run; output in {cfg.out}"
    )
    t0 = time.monotonic()
    try:
        result = asyncio.run(_run(cfg, procs))
    except KeyboardInterrupt:
        _say("interrupted; stopping what the bench started")
        return 130
    except RuntimeError as exc:
        _say(f"bench addon: {exc}")
        return 1
    finally:
        for p in procs:
            p.stop()
    agg = aggregate(result["runs"])
    table = render(agg)
    found = verdicts(agg)
    doc = {
        "config": {"rounds": cfg.rounds, "warmup": cfg.warmup, "duration": cfg.duration},
        "elapsed_s": round(time.monotonic() - t0, 1),
        "runs": result["runs"],
        "aggregate": agg,
        "checks": found,
        "capture": result["capture"],
        "table": table,
    }
    path = cfg.out / "addon-results.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print()
    print(f"Medians over {cfg.rounds} round(s); ratios: {TRACED} / {BASE}, paired per round.")
    print(table)
    print()
    for line in found:
        print("  " + line)
    cap = result["capture"]
    print(
        f"addon captures: {cap['bytes'] / 1e6:.0f} MB over {cap['rounds']} round(s) "
        f"({cap['ended']} with their capture_end), {cap['records']} records, "
        f"dropped {cap['dropped']}"
    )
    print(f"Written {path}")
    return 0
