"""``make kill-soak``: ``kill -9`` of a loaded tap at random moments; every capture must read.

One simulated engine for the whole run, then ``--kills`` rounds (20 by default), each: a
fresh ``tracer proxy`` with a fresh capture, ``--concurrency`` client loops (32) of chat
completions through it (three in four streamed, the rest plain), each request with an
``x-request-id`` of our own, its completion time taken once its whole response was read;
``kill -9`` of the tap at a random moment (seeded) between ``--kill-min`` and ``--kill-max``
seconds into the load. Then the capture is checked:

- ``tracer info`` and ``tracer analyze --format json`` both exit 0, without a traceback,
  and the analysis parses;
- every request the client saw complete at least FLUSH_INTERVAL + ``--margin`` seconds
  before the kill is an analysis row (found by its request id) with a complete 200
  response. The writer puts records on disk once per flush interval (50 ms), so a request
  completed in the last moments before the kill can honestly be missing: those are
  counted and their ages shown, never a failure.

A table per round, a summary, exit 1 on any failure:
``python -m bench.kill_soak [--kills 20] [--seed 36] [--concurrency 32]``. Everything runs
on 127.0.0.1; every process is started here and signalled by its own pid only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.abc import Process, TaskGroup
from anyio.streams.buffered import BufferedByteReceiveStream

from tracer.capture.files import FLUSH_INTERVAL, read_records

TRACER = [sys.executable, "-m", "tracer"]
READY = re.compile(r"listening on (?:http://)?127\.0\.0\.1:(\d+)")
START_TIMEOUT = 40.0  # a process starting on a loaded 2-core machine (imports, the probe)
READ_TIMEOUT = 120.0  # info or analyze of one capture


@dataclass
class Done:
    """A request the client saw complete: its id, when (monotonic and wall clock)."""

    rid: str
    m: float
    t: float
    stream: bool


@dataclass
class Round:
    n: int
    kill_after: float  # seconds into the load
    completed: list[Done] = field(default_factory=list)  # before the kill
    client_errors: list[str] = field(default_factory=list)  # before the kill
    kill_m: float = 0.0
    after_kill: int = 0  # completions the client read after the kill (not checked)
    exit_code: int | None = None
    capture_bytes: int = 0
    info_ok: bool = False
    analyze_ok: bool = False
    rows: int = 0
    torn_tail: bool = False
    bad_lines: int = 0
    tail_lag: float | None = None  # kill time minus the newest record's ``m`` on disk
    checked: int = 0  # completed at least the threshold before the kill
    found: int = 0  # of those, in the capture complete
    late_found: int = 0  # completed within the threshold, found anyway
    # (request id, seconds before the kill it completed, its request record on disk)
    missing: list[tuple[str, float, bool]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def age(self, done: Done) -> float:
        return self.kill_m - done.m


@dataclass
class Started:
    name: str
    process: Process
    port: int
    lines: list[str]


async def _drain(reader: BufferedByteReceiveStream, lines: list[str]) -> None:
    """A process's stderr read to its end (so the pipe never fills), kept for a report."""
    try:
        while True:
            lines.append((await reader.receive_until(b"\n", 1 << 20)).decode(errors="replace"))
            del lines[:-50]
    except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
        return


async def launch(tg: TaskGroup, name: str, argv: Sequence[str]) -> Started:
    """Start ``argv`` and wait for its ``listening on 127.0.0.1:PORT`` line on stderr (it
    listens on port 0: the kernel picks, nothing races for it, no probe connection)."""
    process = await anyio.open_process(list(argv), stdin=subprocess.DEVNULL)
    assert process.stderr is not None
    reader = BufferedByteReceiveStream(process.stderr)
    lines: list[str] = []
    try:
        with anyio.fail_after(START_TIMEOUT):
            while True:
                try:
                    line = (await reader.receive_until(b"\n", 1 << 20)).decode(errors="replace")
                except (anyio.EndOfStream, anyio.IncompleteRead) as exc:
                    tail = "".join(lines[-8:])
                    raise RuntimeError(f"{name} ended before it listened:\n{tail}") from exc
                lines.append(line)
                if found := READY.search(line):
                    break
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stop(process)
        raise
    tg.start_soon(_drain, reader, lines)
    return Started(name, process, int(found.group(1)), lines)


async def stop(process: Process) -> None:
    """SIGTERM to this process's own pid, SIGKILL to it after 10 s; then reaped."""
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            os.kill(process.pid, signal.SIGTERM)
            with anyio.move_on_after(10):
                await process.wait()
        if process.returncode is None:
            os.kill(process.pid, signal.SIGKILL)
        await process.aclose()


# ---- the load -------------------------------------------------------------------------------


async def worker(
    client: httpx.AsyncClient, tag: str, w: int, rnd: random.Random, rnd_round: Round
) -> None:
    k = 0
    while True:
        k += 1
        rid = f"{tag}-w{w:02d}-{k:05d}"
        stream = rnd.random() < 0.75
        body: dict[str, Any] = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": f"kill soak {rid}"}],
            "max_tokens": rnd.randint(4, 48),
            "stream": stream,
        }
        headers = {"x-request-id": rid}
        try:
            if stream:
                async with client.stream(
                    "POST", "/v1/chat/completions", json=body, headers=headers
                ) as response:
                    saw_done = False
                    async for line in response.aiter_lines():
                        saw_done = saw_done or line == "data: [DONE]"
                # the whole body read, its last chunk too
                ok = response.status_code == 200 and saw_done
            else:
                response = await client.post("/v1/chat/completions", json=body, headers=headers)
                ok = response.status_code == 200 and bool(response.json().get("choices"))
        except httpx.HTTPError as exc:  # before the kill (the kill cancels at once)
            rnd_round.client_errors.append(f"{rid}: {type(exc).__name__}: {exc}")
            continue
        if ok:
            rnd_round.completed.append(Done(rid, time.monotonic(), time.time(), stream))
        else:
            rnd_round.client_errors.append(f"{rid}: status {response.status_code}")


async def load_then_kill(tap: Started, rnd_round: Round, concurrency: int, seed: int) -> None:
    """The client loops through the tap; ``kill -9`` of the tap at the round's moment, and
    the loops cancelled in the same step (nothing they read after the kill is counted)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(30.0)
    url = f"http://127.0.0.1:{tap.port}"
    tag = f"ks{rnd_round.n:02d}"
    async with (
        httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, trust_env=False) as client,
        anyio.create_task_group() as tg,
    ):
        for w in range(concurrency):
            rnd = random.Random(seed * 1_000_000 + rnd_round.n * 1000 + w)
            tg.start_soon(worker, client, tag, w, rnd, rnd_round)
        await anyio.sleep(rnd_round.kill_after)  # the random moment: what the round is about
        rnd_round.kill_m = time.monotonic()
        os.kill(tap.process.pid, signal.SIGKILL)
        tg.cancel_scope.cancel()
    # a loop already woken with the last bytes (read before the kill) runs one more step
    # before its cancellation: that request completed after the kill, not before it
    done = rnd_round.completed
    rnd_round.completed = [d for d in done if d.m <= rnd_round.kill_m]
    rnd_round.after_kill = len(done) - len(rnd_round.completed)


# ---- the check ------------------------------------------------------------------------------


async def run_tracer(*args: str) -> tuple[int, str, str]:
    """``tracer ARGS`` as a user runs it: exit code, stdout, stderr."""
    with anyio.fail_after(READ_TIMEOUT):
        done = await anyio.run_process([*TRACER, *args], check=False, stdin=subprocess.DEVNULL)
    return (
        done.returncode,
        done.stdout.decode(errors="replace"),
        done.stderr.decode(errors="replace"),
    )


async def check(capture: Path, rnd_round: Round, threshold: float) -> None:
    r = rnd_round
    r.capture_bytes = capture.stat().st_size if capture.exists() else 0
    code, _, err = await run_tracer("info", str(capture))
    r.info_ok = code == 0 and "Traceback" not in err
    if not r.info_ok:
        r.problems.append(f"tracer info exit {code}: {err.strip()[-600:]}")
    code, out, err = await run_tracer("analyze", str(capture), "--format", "json")
    analysis: dict[str, Any] | None = None
    if code == 0 and "Traceback" not in err:
        try:
            analysis = json.loads(out)
        except ValueError as exc:
            r.problems.append(f"tracer analyze --format json: not JSON ({exc})")
    else:
        r.problems.append(f"tracer analyze exit {code}: {err.strip()[-600:]}")
    r.analyze_ok = analysis is not None
    rows: dict[str, dict[str, Any]] = {}
    if analysis is not None:
        for cap in analysis.get("captures", []):
            r.torn_tail = r.torn_tail or bool(cap.get("torn_tail"))
            r.bad_lines += int(cap.get("bad_lines") or 0)
        for row in analysis.get("requests", []):
            if row.get("request_id"):
                rows[row["request_id"]] = row
        r.rows = len(rows)
    # the capture's own records: the newest one on disk, and which request heads are there
    heads: set[str] = set()
    newest: float | None = None
    try:
        for record in read_records(capture):
            m = record.get("m")
            if isinstance(m, int | float) and record.get("type") != "capture_start":
                newest = m if newest is None else max(newest, m)
            if record.get("type") == "request" and record.get("request_id"):
                heads.add(record["request_id"])
    except Exception as exc:  # the check reports whatever the reader raises
        r.problems.append(f"read_records: {type(exc).__name__}: {exc}")
    r.tail_lag = None if newest is None else r.kill_m - newest

    def complete(rid: str, done: Done) -> bool:
        row = rows.get(rid)
        if row is None or row.get("termination") != "complete" or row.get("status") != 200:
            return False
        return not done.stream or bool(row.get("done"))

    for done in r.completed:
        age = r.age(done)
        ok = complete(done.rid, done)
        if age >= threshold:
            r.checked += 1
            r.found += ok
        elif ok:
            r.late_found += 1
        if not ok:
            r.missing.append((done.rid, age, done.rid in heads))
    for rid, age, head in r.missing:
        if age >= threshold:
            where = "its request record is there" if head else "not even its request record"
            r.problems.append(f"{rid} completed {age * 1000:.0f} ms before the kill, {where}")
    if r.client_errors:
        r.problems.append(
            f"{len(r.client_errors)} requests failed before the kill: {r.client_errors[:3]}"
        )
    if r.exit_code != -signal.SIGKILL:
        r.problems.append(f"the tap exited {r.exit_code}, not by SIGKILL")


# ---- a run ----------------------------------------------------------------------------------


@dataclass
class Options:
    kills: int = 20
    seed: int = 36
    concurrency: int = 32
    kill_min: float = 0.3
    kill_max: float = 3.0
    margin: float = 0.5

    @property
    def threshold(self) -> float:
        return FLUSH_INTERVAL + self.margin


async def soak(opts: Options, out: Path) -> list[Round]:
    rng = random.Random(opts.seed)
    rounds: list[Round] = []
    async with anyio.create_task_group() as tg:
        engine = await launch(
            tg,
            "engine",
            [*TRACER, "--log-level", "warning", "sim", "engine", "--listen", "127.0.0.1:0",
             "--itl", "0.002", "--max-running", "1024"],
        )  # fmt: skip
        try:
            for n in range(1, opts.kills + 1):
                r = Round(n=n, kill_after=round(rng.uniform(opts.kill_min, opts.kill_max), 3))
                capture = out / f"kill-{n:02d}.jsonl"
                tap = await launch(
                    tg,
                    f"tap {n}",
                    [*TRACER, "--log-level", "warning", "proxy", "--listen", "127.0.0.1:0",
                     "--upstream", f"http://127.0.0.1:{engine.port}", "--capture", str(capture),
                     "--upstream-role", "engine", "--tap", f"kill{n:02d}"],
                )  # fmt: skip
                try:
                    await load_then_kill(tap, r, opts.concurrency, opts.seed)
                    with anyio.fail_after(10):
                        r.exit_code = await tap.process.wait()
                finally:
                    await stop(tap.process)
                await check(capture, r, opts.threshold)
                rounds.append(r)
                print_round(r, opts)
        finally:
            await stop(engine.process)
    return rounds


def print_round(r: Round, opts: Options) -> None:
    if r.n == 1:
        print(
            f"{'round':>5} {'kill s':>7} {'done':>5} {'checked':>7} {'found':>5} {'missing':>7}"
            f" {'late found':>10} {'tail ms':>7} {'torn':>4} {'reads':>5}  missing: ms before kill"
        )
    ages = sorted(age for _, age, _ in r.missing)
    shown = ", ".join(f"{a * 1000:.0f}" for a in ages[:12]) + (" ..." if len(ages) > 12 else "")
    tail = "-" if r.tail_lag is None else f"{r.tail_lag * 1000:.0f}"
    reads = "ok" if r.info_ok and r.analyze_ok else "FAIL"
    late = r.late_found + sum(1 for _, a, _ in r.missing if a < opts.threshold)
    print(
        f"{r.n:>5} {r.kill_after:>7.3f} {len(r.completed):>5} {r.checked:>7} {r.found:>5}"
        f" {len(r.missing):>7} {f'{r.late_found}/{late}':>10} {tail:>7}"
        f" {'yes' if r.torn_tail else 'no':>4} {reads:>5}  {shown}",
        flush=True,
    )
    for problem in r.problems:
        print(f"      FAIL: {problem}", flush=True)


def summary(rounds: list[Round], opts: Options, wall: float) -> bool:
    """Print the run's figures; True when every round passed."""
    failed = [r for r in rounds if r.problems]
    missing_ages = [age for r in rounds for _, age, _ in r.missing]
    tails = [r.tail_lag for r in rounds if r.tail_lag is not None]
    completed = sum(len(r.completed) for r in rounds)
    print(
        f"\nkill soak: {len(rounds)} kills (seed {opts.seed}, C={opts.concurrency}, kill "
        f"{opts.kill_min:g}-{opts.kill_max:g} s into the load), {wall:.0f} s"
    )
    print(
        f"requests completed before a kill {completed}; checked (completed >= "
        f"{opts.threshold * 1000:.0f} ms = FLUSH_INTERVAL {FLUSH_INTERVAL * 1000:.0f} ms + "
        f"margin {opts.margin * 1000:.0f} ms before it) {sum(r.checked for r in rounds)}, "
        f"found {sum(r.found for r in rounds)} (completions read after the kill, not "
        f"counted: {sum(r.after_kill for r in rounds)})"
    )
    if missing_ages:
        print(
            f"missing {len(missing_ages)}, all completed within "
            f"{max(missing_ages) * 1000:.0f} ms of the kill (the margin this run needed: "
            f"{max(0.0, max(missing_ages) - FLUSH_INTERVAL) * 1000:.0f} ms over FLUSH_INTERVAL)"
        )
    else:
        print("missing 0")
    if tails:
        print(
            f"newest record on disk at the kill: {min(tails) * 1000:.0f}-{max(tails) * 1000:.0f}"
            " ms old"
        )
    print(f"captures that did not read: {sum(not (r.info_ok and r.analyze_ok) for r in rounds)}")
    print("PASS" if not failed else f"FAIL: rounds {', '.join(str(r.n) for r in failed)}")
    return not failed


def run(opts: Options, out: Path) -> tuple[bool, list[Round]]:
    start = time.monotonic()
    rounds = anyio.run(soak, opts, out)
    return summary(rounds, opts, time.monotonic() - start), rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--kills", type=int, default=20, help="rounds (default 20)")
    parser.add_argument("--seed", type=int, default=36, help="kill moments and requests")
    parser.add_argument("--concurrency", type=int, default=32, help="client loops (32)")
    parser.add_argument("--kill-min", type=float, default=0.3, help="seconds into the load")
    parser.add_argument("--kill-max", type=float, default=3.0, help="seconds into the load")
    parser.add_argument(
        "--margin",
        type=float,
        default=0.5,
        help="seconds beyond FLUSH_INTERVAL before the kill after which a completed "
        "request must be in the capture (default 0.5)",
    )
    parser.add_argument("--out", type=Path, default=None, help="keep the captures here")
    args = parser.parse_args(argv)
    if not (0 < args.kills <= 200 and 0 < args.concurrency <= 256):
        parser.error("--kills 1..200, --concurrency 1..256")
    if not 0 < args.kill_min <= args.kill_max <= 60:
        parser.error("0 < --kill-min <= --kill-max <= 60")
    opts = Options(
        kills=args.kills,
        seed=args.seed,
        concurrency=args.concurrency,
        kill_min=args.kill_min,
        kill_max=args.kill_max,
        margin=args.margin,
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        ok, _ = run(opts, args.out)
    else:
        with tempfile.TemporaryDirectory(prefix="tracer-kill-soak-") as tmp:
            ok, _ = run(opts, Path(tmp))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
