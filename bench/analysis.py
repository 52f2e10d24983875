"""Analysis rate and peak memory on generated captures of a million-plus events.

`python -m bench.analysis [--requests N] [--scale K]` writes a synthetic capture of K*N
requests (keep-alive connections of 4 requests, SSE streams batched the way the tap
batches them, engine samples every second, a stall every 1000 requests) and a copy of
its first N requests, and times `tracer analyze --format json` on each as a subprocess:
events/s and the peak RSS of the analysing process (its own, from wait4). Memory bounded
by what is in flight shows as about the same peak for both sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

from tracer import events as ev


def generate(path: Path, requests: int, *, split: int = 0) -> tuple[int, tuple[int, int]]:
    """Write the capture: the number of records, and (records, bytes) after the first
    ``split`` requests (their connections closed: a whole capture on its own)."""
    t0 = 1_800_000_000.0
    n = 0
    cut = (0, 0)
    with path.open("wb") as fh:

        def put(event: ev.Event) -> None:
            nonlocal n
            fh.write(orjson.dumps(event.to_record(), option=orjson.OPT_APPEND_NEWLINE))
            n += 1

        put(
            ev.CaptureStart(
                t=t0,
                m=0.0,
                tap="gen",
                tracer_version="bench",
                kind="proxy",
                upstream="http://127.0.0.1:8000",
            )
        )
        t = 0.0
        for i in range(requests):
            conn, seq = i // 4 + 1, i % 4 + 1
            if seq == 1:
                put(
                    ev.ConnOpen(
                        t=t0 + t, m=t, tap="gen", conn=conn, peer="127.0.0.1:1", local="127.0.0.1:2"
                    )
                )
            put(
                ev.RequestHead(
                    t=t0 + t,
                    m=t,
                    tap="gen",
                    conn=conn,
                    seq=seq,
                    idle_before=0.2 if seq > 1 else 0.0,
                    method="POST",
                    target="/v1/chat/completions",
                    version="1.1",
                    headers=[],
                    request_id=f"r{i}",
                )
            )
            put(
                ev.RequestEnd(
                    t=t0 + t,
                    m=t,
                    tap="gen",
                    conn=conn,
                    seq=seq,
                    complete=True,
                    body_bytes=200,
                    body_sha256="0" * 64,
                )
            )
            put(
                ev.ResponseHead(
                    t=t0 + t + 0.05,
                    m=t + 0.05,
                    tap="gen",
                    conn=conn,
                    seq=seq,
                    status=200,
                    reason="OK",
                    version="1.1",
                    headers=[],
                    ttfb=0.05,
                    sse=True,
                )
            )
            for batch in range(4):  # 4 records of 10 events each: 0.4 s of decode
                start = t + 0.05 + batch * 0.1
                sse = [[k * 0.01, 120, "content"] for k in range(10)]
                put(
                    ev.BodyData(
                        t=t0 + start,
                        m=start,
                        tap="gen",
                        conn=conn,
                        seq=seq,
                        size=1200,
                        reads=[[k * 0.01, 120, 1] for k in range(10)],
                        sse=sse,
                    )
                )
            if i % 1000 == 999:
                put(
                    ev.Stall(
                        t=t0 + t + 0.3,
                        m=t + 0.3,
                        tap="gen",
                        conn=conn,
                        seq=seq,
                        phase="start",
                        direction="upstream_silent",
                        silent_for=5.0,
                    )
                )
            put(
                ev.ResponseEnd(
                    t=t0 + t + 0.5,
                    m=t + 0.5,
                    tap="gen",
                    conn=conn,
                    seq=seq,
                    termination="complete",
                    status=200,
                    body_bytes=4800,
                    duration=0.5,
                    events=40,
                    done=True,
                    finish_reason="stop",
                )
            )
            if int(t) != int(t + 0.1):
                put(
                    ev.EngineSample(
                        t=t0 + t,
                        m=t,
                        tap="gen",
                        url="http://127.0.0.1:30000/metrics",
                        ok=True,
                        elapsed=0.002,
                        profile="sglang",
                        state={"running": 8, "queued": 0, "generation_tokens_total": i * 40},
                        deltas={"generation_tokens_total": 400},
                        interval=1.0,
                    )
                )
            if seq == 4:
                put(
                    ev.ConnClose(
                        t=t0 + t + 0.6,
                        m=t + 0.6,
                        tap="gen",
                        conn=conn,
                        closed_by="client",
                        how="fin",
                        in_flight=False,
                        requests=4,
                        bytes_from_client=800,
                        bytes_from_upstream=20000,
                        upstream_opened=True,
                        duration=2.5,
                    )
                )
            t += 0.1
            if i + 1 == split:
                cut = (n, fh.tell())
    return n, cut


def measure(*command: str) -> dict[str, float]:
    """Run ``python COMMAND...`` in a subprocess: its wall time, CPU time and peak RSS
    (its own, from wait4)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *command], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"bench.analysis: {' '.join(command)} exited {proc.returncode}")
    return {
        "seconds": elapsed,
        "cpu": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--requests", type=int, default=130_000, help="requests in the first capture"
    )
    parser.add_argument(
        "--scale", type=int, default=2, help="the second capture is this many times bigger"
    )
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    if args.requests < 1 or args.scale < 2:
        parser.error("--requests must be at least 1 and --scale at least 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    big = out / "analysis-capture-big.jsonl"
    small = out / "analysis-capture.jsonl"
    try:
        records, cut = generate(big, args.requests * args.scale, split=args.requests)
        with big.open("rb") as src, small.open("wb") as dst:  # the first N requests
            left = cut[1]
            while left:
                left -= dst.write(src.read(min(left, 1 << 20)))
        baseline = measure("-c", "import tracer.cli.commands")
        runs = []
        for path, count in ((small, cut[0]), (big, records)):
            m = measure("-m", "tracer", "analyze", str(path), "--format", "json")
            runs.append(
                {
                    "records": count,
                    "capture_mib": path.stat().st_size / 2**20,
                    **m,
                    "events_per_s": count / m["seconds"],
                }
            )
    finally:
        small.unlink(missing_ok=True)
        big.unlink(missing_ok=True)
    for run in runs:
        print(
            f"analysis: {run['records']:,} records ({run['capture_mib']:.0f} MiB) in "
            f"{run['seconds']:.1f} s = {run['events_per_s']:,.0f} events/s; "
            f"peak RSS {run['peak_rss_mib']:.0f} MiB"
        )
    first, second = runs
    print(
        f"analysis memory: peak {first['peak_rss_mib']:.0f} MiB at {first['records'] / 1e6:.1f}M "
        f"events, {second['peak_rss_mib']:.0f} MiB at {second['records'] / 1e6:.1f}M "
        f"(x{second['peak_rss_mib'] / first['peak_rss_mib']:.2f} for x"
        f"{second['records'] / first['records']:.1f} the events; the interpreter and "
        f"modules alone: {baseline['peak_rss_mib']:.0f} MiB)"
    )
    result = {"runs": runs, "baseline_rss_mib": baseline["peak_rss_mib"]}
    (out / "analysis.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
