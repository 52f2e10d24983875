"""Analysis rate and peak memory on a generated capture of a million-plus events.

`python -m bench.analysis [--requests N]` writes a synthetic capture (keep-alive
connections of 4 requests, SSE streams batched the way the tap batches them, engine
samples every second, a few stalls) and times `tracer analyze --format json` on it as
a subprocess: events/s and the peak RSS of the analysing process.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import orjson

from tracer import events as ev


def generate(path: Path, requests: int) -> int:
    """Write the capture; returns the number of records."""
    t0 = 1_800_000_000.0
    n = 0
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
    return n


def measure(path: Path) -> dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "tracer", "analyze", str(path), "--format", "json"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "seconds": elapsed,
        "cpu": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "peak_rss_mib": after.ru_maxrss / 1024,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=130_000)
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "analysis-capture.jsonl"
    records = generate(path, args.requests)
    size = path.stat().st_size
    m = measure(path)
    result = {
        "records": records,
        "capture_mib": size / 2**20,
        **m,
        "events_per_s": records / m["seconds"],
    }
    print(
        f"analysis: {records:,} records ({size / 2**20:.0f} MiB) in {m['seconds']:.1f} s "
        f"= {records / m['seconds']:,.0f} events/s; peak RSS {m['peak_rss_mib']:.0f} MiB"
    )
    (out / "analysis.json").write_text(json.dumps(result, indent=1))
    path.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
