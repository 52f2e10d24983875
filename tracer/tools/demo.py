"""``tracer demo``: the incident this project exists for, reproduced on one machine.

Every part is a real process, as in production: simulated engines (``tracer sim
engine``), the SGLang router (``smg``) in front of them when it is installed, taps and
the suspect proxy (``tracer proxy``), and the multi-round keep-alive harness (openai
SDK) driving it. The demo prints the verdict ``tracer analyze`` reaches from the
captures, writes the captures and the incident report to the output directory, and for
the default scenario runs the differential replay (same connections, then fresh ones).
Each scenario knows the verdict it should reach: the exit code says whether it did.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.abc import Process
from rich.console import Console

from ..analysis.summary import Summary
from ..capture.files import read_into
from ..present.render import to_text
from ..sim.harness import HarnessConfig, HarnessReport, run_harness

DEFAULT = "hang-on-reuse"
TRACER = [sys.executable, "-m", "tracer"]
READY = re.compile(r"listening on (?:http://)?(127\.0\.0\.1:\d+)")
CHAT = {"model": "sim-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Scenario:
    name: str
    summary: str
    expect: tuple[str, str | None]  # the verdict's (party, kind); kind None: any kind
    run: Callable[[Demo], Awaitable[list[Path]]]


@dataclass
class Running:
    url: str
    proc: Process


@dataclass
class Demo:
    """The processes of one run, where it writes, and what it has said."""

    out: Path
    console: Console
    stack: AsyncExitStack
    started: float = field(default_factory=time.monotonic)
    notes: list[str] = field(default_factory=list)

    def step(self, text: str) -> None:
        self.console.print(f"[dim]{time.monotonic() - self.started:5.1f}s[/dim]  {text}")

    def _log(self, name: str) -> tuple[Path, Any]:
        path = self.out / "logs" / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        log = path.open("wb")
        self.stack.callback(log.close)
        return path, log

    async def start(self, name: str, argv: list[str]) -> Running:
        """Start a process that prints ``listening on HOST:PORT`` on stderr when ready."""
        log_path, log = self._log(name)
        proc = await anyio.open_process(argv, stdin=None, stdout=subprocess.DEVNULL, stderr=log)
        self.stack.push_async_callback(_stop, proc)
        with anyio.fail_after(30):
            while not (found := READY.search(log_path.read_text(errors="replace"))):
                if proc.returncode is not None:
                    raise RuntimeError(f"{name} exited before it was ready (see {log_path})")
                await anyio.sleep(0.05)  # (polls its log with a deadline)
        return Running(f"http://{found.group(1)}", proc)

    async def engines(self, count: int, *args: str) -> list[Running]:
        """Start ``count`` engines at once (each takes a second or two to import)."""
        started: dict[int, Running] = {}

        async def one(i: int) -> None:
            started[i] = await self.engine(f"engine-{i + 1}", *args)

        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one, i)
        engines = [started[i] for i in range(count)]
        self.step(f"engines {' '.join(e.url for e in engines)}")
        return engines

    async def engine(self, name: str, *args: str) -> Running:
        argv = [*TRACER, "sim", "engine", "--listen", "127.0.0.1:0", *args]
        return await self.start(name, argv)

    async def proxy(self, name: str, upstream: str, *args: str) -> Running:
        argv = [*TRACER, "proxy", "--listen", "127.0.0.1:0", "--upstream", upstream]
        return await self.start(name, [*argv, "--tap", name, *args])

    async def router(self, workers: list[Running]) -> tuple[str, list[str]]:
        """smg in front of the workers; without smg, the first worker alone (said so).

        Returns the URL to send to, and the evidence options for a tap behind it.
        """
        metrics = [a for w in workers for a in ("--engine-metrics", f"{w.url}/metrics")]
        smg = smg_path()
        if smg is None:
            note = "smg (pip install sglang-router) is not installed: no router, engine 1 direct"
            self.notes.append(note)
            self.step(f"[yellow]{note}[/yellow]")
            return workers[0].url, metrics[:2]
        # a port found free can be taken before smg binds it (other processes on a busy
        # machine): then smg exits with "Address already in use", and gets two others
        for attempt in range(PORT_TRIES):
            port, prom = _free_port(), _free_port()
            argv = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls"]
            argv += [w.url for w in workers]
            argv += ["--policy", "round_robin", "--log-level", "warn"]
            argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
            log_path, log = self._log("smg" if attempt == 0 else f"smg.{attempt}")
            proc = await anyio.open_process(argv, stdin=None, stdout=log, stderr=log)
            self.stack.push_async_callback(_stop, proc)
            url = f"http://127.0.0.1:{port}"
            if await _until_ready(proc, url):
                break
            taken = "Address already in use" in log_path.read_text(errors="replace")
            if not taken or attempt == PORT_TRIES - 1:
                raise RuntimeError(f"smg exited (see {log_path})")
        self.step(f"router smg {url} in front of {len(workers)} engines")
        router_metrics = f"http://127.0.0.1:{prom}/metrics"
        evidence = [*metrics, "--engine-metrics", router_metrics]
        return url, [*evidence, "--health", f"{url}/readiness"]

    async def harness(self, url: str, **cfg: Any) -> HarnessReport:
        config = HarnessConfig(base_url=url, **cfg)
        self.step(
            f"harness: {config.sessions} sessions x {config.rounds} rounds "
            f"(openai SDK, keep-alive; a round not answered in {config.deadline:g} s is hung)"
        )
        report = await run_harness(config)
        self.step(f"harness done: {_tally(r.outcome for r in report.rounds)}")
        return report


async def stop(running: Running) -> None:
    """Stop a process now (SIGTERM: a tap finishes its capture)."""
    await _stop(running.proc)


async def _stop(proc: Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(10):
            await proc.wait()
    if proc.returncode is None:
        proc.kill()
    with anyio.CancelScope(shield=True):
        await proc.aclose()


def _tally(outcomes: Iterable[str]) -> str:
    """``4 complete, 2 hung``: how many of each, in name order."""
    return ", ".join(f"{n} {k}" for k, n in sorted(Counter(outcomes).items()))


def smg_path() -> str | None:
    local = Path(sys.executable).parent / "smg"
    return str(local) if local.exists() else shutil.which("smg")


async def _until_ready(proc: Process, url: str) -> bool:
    """Poll the router's readiness with a deadline; False if it exited first."""
    async with httpx.AsyncClient(timeout=2) as client:
        with anyio.fail_after(30):
            while True:
                if proc.returncode is not None:
                    return False
                try:
                    if (await client.get(url + "/readiness")).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                await anyio.sleep(0.1)  # (polls readiness with a deadline)


PORT_TRIES = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TAP_OPTIONS = ["--stall-after", "0.5", "--metrics-interval", "0.2"]


# ---- scenarios ---------------------------------------------------------------------------


async def hang_on_reuse(d: Demo) -> list[Path]:
    """harness -> tap front -> proxy (hangs on the 3rd request of a reused connection)
    -> tap back -> smg -> two engines. Then the differential replay through the proxy."""
    e1, e2 = await d.engines(2, "--ttft", "0.02", "--itl", "0.004")
    router_url, evidence = await d.router([e1, e2])
    front, back = d.out / "front.jsonl", d.out / "back.jsonl"
    back_tap = await d.proxy("back", router_url, "--capture", str(back), *TAP_OPTIONS, *evidence)
    faulty = await d.proxy("proxy", back_tap.url, "--fault", "hang-on-reuse:3")
    d.step(f"the proxy in between: {faulty.url} (--fault hang-on-reuse:3), tap back behind it")
    probes = ["--probe-on-stall", "--probe-interval", "0.5"]
    front_tap = await d.proxy(
        "front", faulty.url, "--capture", str(front), "--client-facing", *TAP_OPTIONS,
        *probes, *evidence,
    )  # fmt: skip
    d.step(f"tap front {front_tap.url} (client-facing), with engine metrics and probes")
    await d.harness(front_tap.url, sessions=2, rounds=4, think=0.2, max_tokens=6, deadline=3.0)
    await stop(front_tap)
    await stop(back_tap)
    # The replays go through the same kind of proxy straight to the router, so that the
    # taps' captures hold the incident alone (the replays reuse its x-request-ids).
    again = await d.proxy("proxy-again", router_url, "--fault", "hang-on-reuse:3")
    await replay_differential(d, front, again.url)
    return [front, back]


async def replay_differential(d: Demo, capture: Path, target: str) -> None:
    """Replay the capture through the proxy: same connections (hangs), then fresh ones."""
    for mode in ("same", "fresh"):
        out = d.out / f"replay-{mode}.jsonl"
        argv = [*TRACER, "replay", str(capture), "--target", target, "--capture", str(out)]
        argv += ["--stall-timeout", "1.5", "--format", "json"]
        if mode == "fresh":
            argv += ["--connections", "fresh"]
        d.step(f"replay ({'same connections' if mode == 'same' else 'fresh connections'})")
        result = await anyio.run_process(argv, check=False)
        try:
            doc = json.loads(result.stdout)
        except ValueError:
            err = result.stderr.decode(errors="replace").strip()[-300:]
            d.step(f"[red]replay failed[/red] (exit {result.returncode}): {err}")
            d.notes.append(f"replay ({mode}) failed: {err}")
            continue
        shown = _tally(
            str(r.get("replay", {}).get("outcome", "?")) for r in doc.get("requests", [])
        )
        verdict = doc.get("verdict", {})
        line = verdict.get("summary") if isinstance(verdict, dict) else verdict
        d.step(f"  {shown} - {line}")
        d.notes.append(f"replay, {mode} connections: {shown}: {line}")


async def engine_stall(d: Demo) -> list[Path]:
    """The engine holds a request running and stops producing its tokens mid-stream."""
    fault = "stall:after=3:for=8@nth=3"
    e1 = await d.engine("engine-1", "--ttft", "0.02", "--itl", "0.004", "--fault", fault)
    d.step(f"engine {e1.url} (--fault {fault}: the 3rd request stops after 3 tokens for 8 s)")
    cap = d.out / "tap.jsonl"
    probes = ["--probe-on-stall", "--probe-interval", "0.5"]
    metrics = ["--engine-metrics", f"{e1.url}/metrics"]
    tap = await d.proxy("tap", e1.url, "--capture", str(cap), *TAP_OPTIONS, *probes, *metrics)
    await d.harness(tap.url, sessions=1, rounds=4, think=0.2, max_tokens=12, deadline=4.0)
    await stop(tap)
    return [cap]


async def engine_queueing(d: Demo) -> list[Path]:
    """More sessions than the engine runs at once: slow first tokens, because busy."""
    e1 = await d.engine("engine-1", "--ttft", "0.05", "--itl", "0.02", "--max-running", "2")
    d.step(f"engine {e1.url} (runs 2 requests at a time)")
    cap = d.out / "tap.jsonl"
    tap = await d.proxy(
        "tap", e1.url, "--capture", str(cap), *TAP_OPTIONS, "--engine-metrics", f"{e1.url}/metrics"
    )
    await d.harness(tap.url, sessions=12, rounds=2, think=0.1, max_tokens=40, deadline=30.0)
    await stop(tap)
    return [cap]


async def buffering_proxy(d: Demo) -> list[Path]:
    """A hop that holds the whole stream and releases it at the end (proxy_buffering on)."""
    e1 = await d.engine("engine-1", "--ttft", "0.02", "--itl", "0.05")
    hop = await d.proxy("buffering-proxy", e1.url, "--fault", "buffer-stream")
    d.step(f"engine {e1.url} <- buffering proxy {hop.url} (--fault buffer-stream)")
    cap = d.out / "tap.jsonl"
    # (a stall threshold above the stream's length: the burst, not the silence, is the sign)
    options = ["--stall-after", "5", "--metrics-interval", "0.1"]
    tap = await d.proxy(
        "tap", hop.url, "--capture", str(cap), *options, "--engine-metrics", f"{e1.url}/metrics"
    )
    await d.harness(tap.url, sessions=2, rounds=2, think=0.1, max_tokens=30, deadline=10.0)
    await stop(tap)
    return [cap]


async def client_not_reading(d: Demo) -> list[Path]:
    """A client that sends a streaming request, then stops reading its answer."""
    e1 = await d.engine("engine-1", "--ttft", "0.0", "--itl", "0.0001")
    cap = d.out / "tap.jsonl"
    tap = await d.proxy("tap", e1.url, "--capture", str(cap), "--stall-after", "0.3")
    port = int(tap.url.rsplit(":", 1)[1])
    payload = json.dumps({**CHAT, "max_tokens": 20000}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: demo\r\ncontent-type: application/json"
        b"\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    d.step("a client with a 4 KiB receive buffer sends a long streaming request, never reads")
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        slow.connect(("127.0.0.1", port))
        slow.sendall(request)
        with anyio.fail_after(20):
            while not (cap.exists() and b"client_not_reading" in cap.read_bytes()):
                await anyio.sleep(0.1)  # (polls the capture with a deadline)
        d.step("the tap recorded the stall: client_not_reading")
    finally:
        slow.close()
    await stop(tap)
    return [cap]


async def healthy(d: Demo) -> list[Path]:
    """The same chain with nothing wrong: the analysis must find nothing."""
    e1, e2 = await d.engines(2, "--ttft", "0.02", "--itl", "0.004")
    router_url, evidence = await d.router([e1, e2])
    cap = d.out / "tap.jsonl"
    tap = await d.proxy("tap", router_url, "--capture", str(cap), *TAP_OPTIONS, *evidence)
    await d.harness(tap.url, sessions=3, rounds=4, think=0.2, max_tokens=8, deadline=10.0)
    await stop(tap)
    return [cap]


SCENARIOS = {
    s.name: s
    for s in [
        Scenario(
            DEFAULT,
            "a proxy hangs on the 3rd request of a reused keep-alive connection (the incident)",
            ("proxy", "proxy_hung_on_reuse"),
            hang_on_reuse,
        ),
        Scenario(
            "engine-stall",
            "the engine stops producing tokens mid-stream",
            ("engine", None),
            engine_stall,
        ),
        Scenario(
            "engine-queueing",
            "slow because busy, not a cold start: more sessions than the engine runs",
            ("none", None),
            engine_queueing,
        ),
        Scenario(
            "buffering-proxy",
            "a hop holds the stream and releases it at the end",
            ("proxy", "buffered_response"),
            buffering_proxy,
        ),
        Scenario(
            "client-not-reading",
            "the client stops reading its answer",
            ("client", "client_not_reading"),
            client_not_reading,
        ),
        Scenario("healthy", "nothing wrong", ("none", None), healthy),
    ]
}


# ---- the run -------------------------------------------------------------------------------


def analyze(captures: list[Path]) -> dict[str, Any]:
    summary = Summary()
    infos = [read_into(path, summary.feed).describe(str(path)) for path in captures]
    return summary.result(captures=infos)


async def run_demo(name: str, out: Path, console: Console) -> int:
    scenario = SCENARIOS[name]
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.jsonl"):
        old.unlink()
    console.print(f"[bold]tracer demo[/bold] {name}: {scenario.summary}")
    async with AsyncExitStack() as stack:
        demo = Demo(out=out, console=console, stack=stack)
        captures = await scenario.run(demo)
    result = analyze(captures)
    verdict = result["verdict"]
    console.print()
    text = re.split(r"\nconnections\s*\n", to_text(result), maxsplit=1)[0]
    console.print(text, markup=False, highlight=False)
    report = out / "incident.md"
    argv = [
        *TRACER,
        "report",
        *map(str, captures),
        "-o",
        str(report),
        "--json",
        str(out / "incident.json"),
    ]
    done = await anyio.run_process(argv, check=False)
    if done.returncode == 0:
        demo.step(f"report: {report}")
    else:
        err = done.stderr.decode(errors="replace").strip()[-300:]
        demo.notes.append(f"report failed: {err}")
        demo.step(f"[red]report failed[/red]: {err}")
    console.print()
    console.print(f"captures: {', '.join(map(str, captures))}")
    console.print(f"again: tracer analyze {' '.join(map(str, captures))}")
    for note in demo.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    party, kind = scenario.expect
    got = (verdict.get("party"), verdict.get("kind"))
    if got[0] == party and (kind is None or got[1] == kind):
        console.print(f"[green]verdict as expected[/green]: {got[0]} {got[1] or ''}".rstrip())
        return 0
    console.print(f"[red]verdict not as expected[/red]: got {got}, expected {scenario.expect}")
    return 1


def main(out_dir: str = "demo-out", scenario: str = DEFAULT) -> int:
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; one of: {', '.join(SCENARIOS)}")
    out = Path(out_dir) if scenario == DEFAULT else Path(out_dir) / scenario
    console = Console(highlight=False, soft_wrap=True)
    try:
        return anyio.run(run_demo, scenario, out, console)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"tracer demo: {exc}", file=sys.stderr)
        return 1
