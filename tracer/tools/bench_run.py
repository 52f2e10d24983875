"""bench's load generator: closed-loop workers at one concurrency, warm-up then runs.

The measuring itself (what ``tracer bench`` and ``bench/loadgen_ceiling.py`` both run),
apart from the command's options and output; the method is in ``bench``'s docstring.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from .bench_figures import figures, spread
from .streamclient import Sample, StreamClient, Target
from .workload import Mix, RequestSpec

CLIENT_CPU_WARN = 0.8  # share of one core above which the client may be the bottleneck


@dataclass
class BenchConfig:
    target: Target
    concurrencies: list[int]
    mix: Mix
    duration: float | None = 20.0
    requests: int | None = None
    repeats: int = 3
    warmup: int = 1
    timeout: float = 300.0
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Live:
    """What the progress display reads while a run goes (written by the workers)."""

    label: str = ""
    started_at: float = 0.0
    goal: float = 0.0  # seconds (duration mode) or requests
    by_time: bool = True
    started: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    in_flight: int = 0


class Reporter:
    """A live rich progress bar on a terminal; plain lines otherwise (both on stderr)."""

    def __init__(self, *, tty: bool | None = None) -> None:
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.progress: Any = None
        self.task: Any = None

    def __enter__(self) -> Reporter:
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
                refresh_per_second=4,
            )
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(None, None, None)

    def line(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def show(self, live: Live) -> None:
        if self.progress is None:
            return
        elapsed = time.perf_counter() - live.started_at
        done = min(elapsed, live.goal) if live.by_time else min(live.started, live.goal)
        rate = live.tokens / elapsed if elapsed > 0 else 0.0
        info = (
            f"{live.done} done, {live.in_flight} in flight, {live.failed} failed, {rate:,.0f} tok/s"
        )
        if self.task is None:
            self.task = self.progress.add_task(live.label, total=live.goal, info=info)
        self.progress.update(
            self.task, description=live.label, total=live.goal, completed=done, info=info
        )

    def clear(self) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.remove_task(self.task)
            self.task = None


async def _ticker(reporter: Reporter, live: Live) -> None:
    while True:
        reporter.show(live)
        await anyio.sleep(0.25)


def _cpu() -> float:
    return time.process_time()


async def run_level(
    config: BenchConfig, concurrency: int, reporter: Reporter, cursor: list[int]
) -> dict[str, Any]:
    """Warm-up, then ``config.repeats`` measured runs at one concurrency."""
    clients = [
        StreamClient(config.target, timeout=config.timeout, headers=config.headers)
        for _ in range(concurrency)
    ]
    live = Live()

    def next_spec() -> RequestSpec:
        i = cursor[0]
        cursor[0] += 1
        return config.mix.specs(i)

    async def one(client: StreamClient) -> Sample:
        live.started += 1
        live.in_flight += 1
        sample = await client.exchange(next_spec())
        live.in_flight -= 1
        live.done += 1
        live.tokens += sample.output_tokens
        if sample.error is not None:
            live.failed += 1
            await anyio.sleep(0.1)  # a failing target must not spin the loop
        return sample

    warm: list[Sample] = []
    runs: list[dict[str, Any]] = []
    pooled: list[Sample] = []
    errors: Counter[str] = Counter()
    try:
        async with anyio.create_task_group() as ticker:
            ticker.start_soon(_ticker, reporter, live)
            if config.warmup:
                reporter.line(
                    f"tracer bench: C{concurrency} warm-up: {concurrency * config.warmup} "
                    "requests (excluded)"
                )
                live.label = f"C{concurrency} warm-up"
                live.by_time, live.goal = False, float(concurrency * config.warmup)
                live.started_at = time.perf_counter()

                async def warm_worker(client: StreamClient) -> None:
                    for _ in range(config.warmup):
                        warm.append(await one(client))

                async with anyio.create_task_group() as tg:
                    for client in clients:
                        tg.start_soon(warm_worker, client)
                if all(s.error is not None for s in warm):
                    first = Counter(s.error for s in warm).most_common(1)[0][0]
                    ticker.cancel_scope.cancel()
                    return {"concurrency": concurrency, "warmup_failed": len(warm), "error": first}
            for repeat in range(1, config.repeats + 1):
                live.label = f"C{concurrency} run {repeat}/{config.repeats}"
                live.by_time = config.duration is not None
                live.goal = float(config.duration or config.requests or 0)
                live.started = live.done = live.failed = live.tokens = 0
                cpu0 = _cpu()
                t0 = live.started_at = time.perf_counter()
                deadline = t0 + config.duration if config.duration is not None else math.inf
                budget = config.requests if config.requests is not None else math.inf
                samples = await _run_once(clients, one, live, deadline, budget)
                end = max((s.end for s in samples), default=time.perf_counter())
                cpu = _cpu() - cpu0
                fig = figures(samples, end - t0)
                fig["client_cpu"] = round(cpu / max(end - t0, 1e-9), 3)
                runs.append(fig)
                pooled += samples
                errors.update(s.error for s in samples if s.error is not None)
                reporter.line(_run_line(concurrency, repeat, config.repeats, fig))
            ticker.cancel_scope.cancel()
    finally:
        reporter.clear()
        for client in clients:
            await client.aclose()
    total = figures(pooled, sum(r["duration_s"] for r in runs))
    result: dict[str, Any] = {"concurrency": concurrency, **total}
    result["warmup_requests"] = len(warm)
    result["connections_opened"] = sum(c.connects for c in clients)
    result["client_cpu_max"] = max(r["client_cpu"] for r in runs)
    result["errors"] = dict(errors.most_common(20))
    result["spread"] = spread(runs)
    result["runs"] = runs
    return result


async def _run_once(
    clients: Sequence[StreamClient],
    one: Callable[[StreamClient], Awaitable[Sample]],
    live: Live,
    deadline: float,
    budget: float,
) -> list[Sample]:
    """Every client busy until the deadline (or the budget of requests started)."""
    samples: list[Sample] = []

    async def worker(client: StreamClient) -> None:
        while time.perf_counter() < deadline and live.started < budget:
            samples.append(await one(client))

    async with anyio.create_task_group() as tg:
        for client in clients:
            tg.start_soon(worker, client)
    return samples


def _run_line(concurrency: int, repeat: int, repeats: int, fig: dict[str, Any]) -> str:
    ttft = fig["ttft_ms"]["median"]
    tpot = fig["tpot_ms"]["median"]
    line = (
        f"tracer bench: C{concurrency} run {repeat}/{repeats}: {fig['completed']} requests "
        f"({fig['failed']} failed) in {fig['duration_s']:.2f} s, "
        f"{fig['output_throughput']:,.1f} output tok/s, "
        f"TTFT p50 {_ms(ttft)}, TPOT p50 {_ms(tpot)}, client CPU {fig['client_cpu']:.0%}"
    )
    if fig["client_cpu"] > CLIENT_CPU_WARN:
        line += " (WARNING: the load generator may be the bottleneck)"
    return line


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


async def run_bench(
    config: BenchConfig, reporter: Reporter, on_level: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    """Every concurrency in turn; ``on_level`` gets each result as it is done."""
    results: list[dict[str, Any]] = []
    cursor = [0]
    for concurrency in config.concurrencies:
        result = await run_level(config, concurrency, reporter, cursor)
        results.append(result)
        on_level(result)
        if "warmup_failed" in result:
            break
    return results
