"""`tracer analyze` over a fleet's folder of rotated captures: whole, and a 1-minute window.

`python -m bench.fleet [--taps 10,25,50] [--minutes 10] [--rate 20]` writes, in a
temporary directory deleted at the end, one capture per tap (a router replica each) of
`--minutes` of traffic at `--rate` requests/s: keep-alive connections of 4 requests,
streamed responses of 3 body records holding a few SSE events each, an engine sample a
second; rotated into 1-minute segments as `tracer proxy --capture-max-age 60
--capture-compress` leaves them (`cap.jsonl.zst`, `cap.1.jsonl.zst` ... and the last one
plain). Then, for each tap count, `tracer analyze FOLDER --format json` as a subprocess:
over the whole folder, and with `--since +330 --until +390`, which reads each tap's two
segments holding that minute (and the next one only as far as the requests open at its
end). Wall time, CPU time and peak RSS of the analysing process (its own, from wait4),
and how each grows with the taps. Results in bench-out/fleet.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import zstandard

T0 = 1_800_000_000.0
SEGMENT_SECONDS = 60.0
WINDOW = ("+330", "+390")  # one minute, across a segment boundary (as most are)
ENGINE = "http://127.0.0.1:30000/metrics"


def _records(tap: str, seconds: float, rate: float, t0: float = T0) -> Iterator[dict[str, Any]]:
    """One tap's records after its header, in time order (a request every 1/rate s, each
    0.5 s of streaming; connections of 4 requests, 2.5 s of each other's)."""
    out: list[tuple[float, int, dict[str, Any]]] = []
    n = int(seconds * rate)

    def put(t: float, record: dict[str, Any]) -> None:
        record["t"] = round(t0 + t, 6)
        record["m"] = round(t, 6)
        record["tap"] = tap
        out.append((t, len(out), record))

    for i in range(n):
        t = i / rate
        conn, seq = i // 4 + 1, i % 4 + 1
        c = {"conn": conn, "seq": seq}
        if seq == 1:
            put(t, {"type": "conn_open", "conn": conn, "peer": "10.0.0.9:5000", "local": "x"})
        put(
            t,
            {
                "type": "request",
                **c,
                "idle_before": 0.05 if seq > 1 else 0.0,
                "method": "POST",
                "target": "/v1/chat/completions",
                "version": "1.1",
                "headers": [["x-request-id", f"{tap}-{i}"]],
                "request_id": f"{tap}-{i}",
            },
        )
        put(t, {"type": "request_end", **c, "complete": True, "body_bytes": 200})
        put(
            t + 0.05,
            {
                "type": "response",
                **c,
                "status": 200,
                "reason": "OK",
                "version": "1.1",
                "headers": [],
                "ttfb": 0.05,
                "sse": True,
                "chunked": True,
            },
        )
        for b in range(3):  # 3 records of 4 events: 0.45 s of decode
            at = t + 0.05 + b * 0.15
            sse = [[k * 0.03, 120, "content"] for k in range(4)]
            reads = [[k * 0.03, 120, 1] for k in range(4)]
            put(at, {"type": "body", **c, "size": 480, "reads": reads, "sse": sse})
        put(
            t + 0.5,
            {
                "type": "response_end",
                **c,
                "termination": "complete",
                "status": 200,
                "body_bytes": 1440,
                "duration": 0.5,
                "first_token": 0.05,
                "events": 12,
                "done": True,
                "finish_reason": "stop",
            },
        )
        if seq == 4:
            put(
                t + 0.55,
                {
                    "type": "conn_close",
                    "conn": conn,
                    "closed_by": "client",
                    "how": "fin",
                    "in_flight": False,
                    "requests": 4,
                    "bytes_from_client": 800,
                    "bytes_from_upstream": 6000,
                    "upstream_opened": True,
                    "duration": 1.6,
                },
            )
    for s in range(int(seconds)):
        put(
            float(s),
            {
                "type": "engine",
                "url": ENGINE,
                "ok": True,
                "elapsed": 0.002,
                "profile": "sglang",
                "state": {"running": 10, "queued": 0, "generation_tokens_total": s * 240},
                "deltas": {"generation_tokens_total": 240},
                "interval": 1.0,
            },
        )
    out.sort(key=lambda x: (x[0], x[1]))
    for _, _, record in out:
        yield record
    end_t = seconds + 1.0
    yield {
        "type": "capture_end",
        "t": t0 + end_t,
        "m": end_t,
        "tap": tap,
        "records": 0,
        "dropped": 0,
        "reason": "stopped",
    }


def write_tap(
    folder: Path,
    tap: str,
    *,
    seconds: float,
    rate: float,
    segment_seconds: float = SEGMENT_SECONDS,
    compress: bool = True,
    t0: float = T0,
) -> list[Path]:
    """One tap's capture, rotated as the writer rotates it (each segment beginning with
    the header; closed segments zstd-compressed): the segments' paths."""
    header = orjson.dumps(
        {
            "type": "capture_start",
            "t": t0,
            "m": 0.0,
            "tap": tap,
            "version": 3,
            "tracer_version": "bench",
            "kind": "proxy",
            "listen": "0.0.0.0:8080",
            "upstream": "http://127.0.0.1:8000",
            "upstream_role": "router",
        },
        option=orjson.OPT_APPEND_NEWLINE,
    )
    paths: list[Path] = []
    fh = None
    segment = -1
    for record in _records(tap, seconds, rate, t0):
        k = min(int((record["t"] - t0) // segment_seconds), int(seconds // segment_seconds))
        if k != segment and record["type"] != "capture_end":
            if fh is not None:
                fh.close()
            segment = k
            paths.append(folder / (f"{tap}.jsonl" if k == 0 else f"{tap}.{k}.jsonl"))
            fh = paths[-1].open("wb")
            fh.write(header)
        assert fh is not None
        fh.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
    assert fh is not None
    fh.close()
    if compress:
        packer = zstandard.ZstdCompressor(level=3)
        for i, plain in enumerate(paths[:-1]):  # the last one is the one still written
            packed = plain.with_name(plain.name + ".zst")
            packed.write_bytes(packer.compress(plain.read_bytes()))
            plain.unlink()
            paths[i] = packed
    return paths


def measure(*command: str) -> dict[str, float]:
    """``python COMMAND...`` in a subprocess: wall time, CPU time, peak RSS (its own)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *command], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"bench.fleet: {' '.join(command)} exited {code}")
    return {
        "seconds": round(elapsed, 3),
        "cpu": round(usage.ru_utime + usage.ru_stime, 3),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
    }


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--taps", default="10,25,50", help="tap counts, comma-separated")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s per tap")
    parser.add_argument("--tmp", default=None, help="where the temporary captures go")
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    counts = sorted({int(x) for x in args.taps.split(",")})
    if not counts or counts[0] < 1 or args.minutes < 7 or args.rate <= 0:
        parser.error("--taps must be positive counts, --minutes at least 7, --rate positive")
    seconds = args.minutes * 60
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tracer-fleet-", dir=args.tmp) as tmp:
        folder = Path(tmp) / "captures"
        folder.mkdir()
        made = 0
        started = time.perf_counter()
        for taps in counts:
            while made < taps:  # the folder grows: 10 taps, then 15 more, ...
                write_tap(folder, f"replica-{made:02d}", seconds=seconds, rate=args.rate)
                made += 1
            segments = len(list(folder.iterdir()))
            disk = _size(folder)
            plain = sum(  # what the records are uncompressed, for the figures' sake
                len(zstandard.ZstdDecompressor().stream_reader(p.open("rb")).read())
                if p.suffix == ".zst"
                else p.stat().st_size
                for p in folder.iterdir()
            )
            requests = int(seconds * args.rate) * taps
            whole = measure("-m", "tracer", "analyze", str(folder), "--format", "json")
            since, until = WINDOW
            window = measure(
                "-m", "tracer", "analyze", str(folder), "--since", since, "--until", until,
                "--format", "json",
            )  # fmt: skip
            runs.append(
                {
                    "taps": taps,
                    "segments": segments,
                    "requests": requests,
                    "disk_mib": round(disk / 2**20, 1),
                    "plain_mib": round(plain / 2**20, 1),
                    "whole": whole,
                    "window": window,
                }
            )
            print(
                f"fleet: {taps} taps, {requests:,} requests, {segments} segments, "
                f"{disk / 2**20:.0f} MiB on disk ({plain / 2**20:.0f} MiB uncompressed): "
                f"whole {whole['seconds']:.1f} s (CPU {whole['cpu']:.1f} s, peak RSS "
                f"{whole['peak_rss_mib']:.0f} MiB); 1-minute window {window['seconds']:.1f} s "
                f"(CPU {window['cpu']:.1f} s, peak RSS {window['peak_rss_mib']:.0f} MiB)",
                flush=True,
            )
        generated = time.perf_counter() - started
    first, last = runs[0], runs[-1]
    grow = last["taps"] / first["taps"]
    for what in ("whole", "window"):
        a, b = first[what], last[what]
        print(
            f"fleet growth, {what}: x{grow:.1f} the taps ({first['taps']} -> {last['taps']}): "
            f"time x{b['seconds'] / a['seconds']:.2f}, CPU x{b['cpu'] / a['cpu']:.2f}, "
            f"peak RSS x{b['peak_rss_mib'] / a['peak_rss_mib']:.2f}"
        )
    print(f"fleet: disk needed {last['disk_mib']:.0f} MiB (deleted); run {generated:.0f} s")
    (out / "fleet.json").write_text(json.dumps({"runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
