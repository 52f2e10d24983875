"""``make soak``: the tap left inline under mixed, hostile traffic for minutes.

C client loops (256 by default) through ``tracer proxy`` (capture on) to the simulated
engine, each picking, request by request: a stream read to its end (most), a plain
request, a stream the client aborts mid-way, a stream it resets (RST), a slow reader.
Every 10 s the tap's RSS and open descriptors are sampled. At the end: requests done by
kind, records the capture lost (target 0), RSS and descriptors over time (flat). These
are figures, not assertions: ``python -m bench.soak [--duration 600] [--concurrency 256]``.
Everything runs on 127.0.0.1; every process is started here and ended by its pid.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio
from anyio.abc import SocketStream

from .procs import free_port, spawn, wait_port

KINDS = ("stream", "stream", "stream", "stream", "stream", "plain", "abort", "reset", "slow")


def _request(stream: bool, tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "soak"}],
            "max_tokens": tokens,
            "stream": stream,
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


async def _read_to_end(s: SocketStream, *, slow: bool = False) -> bool:
    """Read one response to its end (chunked terminator or the whole Content-Length)."""
    got = b""
    while True:
        piece = await s.receive(65536 if not slow else 512)
        got += piece
        head, sep, body = got.partition(b"\r\n\r\n")
        if sep:
            lower = head.lower()
            if b"transfer-encoding: chunked" in lower and body.endswith(b"0\r\n\r\n"):
                return True
            if b"content-length:" in lower:
                length = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    return True
        if slow:
            await anyio.sleep(0.05)


async def _one(port: int, kind: str, done: Counter[str], rnd: random.Random) -> None:
    try:
        with anyio.fail_after(60):
            s = await anyio.connect_tcp("127.0.0.1", port)
            async with s:
                for _ in range(rnd.randint(1, 4)):  # keep-alive reuse too
                    await s.send(_request(kind != "plain", rnd.randint(4, 40)))
                    if kind in ("abort", "reset"):
                        await s.receive()
                        if kind == "reset":
                            raw = s.extra(anyio.abc.SocketAttribute.raw_socket)
                            raw.setsockopt(
                                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                            )
                        break
                    await _read_to_end(s, slow=kind == "slow")
        done[kind] += 1
    except Exception as exc:  # a soak counts what failed; it does not stop
        done[f"failed: {type(exc).__name__}"] += 1


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return -1.0


async def soak(args: argparse.Namespace, out: Path) -> None:
    engine_port, tap_port = free_port(), free_port()
    py = [sys.executable, "-m", "tracer", "--log-level", "warning"]
    engine = spawn(
        "engine",
        [*py, "sim", "engine", "--listen", f"127.0.0.1:{engine_port}", "--itl", "0.002",
         "--max-running", "1024"],
        core=0,
        log_dir=out,
    )  # fmt: skip
    capture = out / "soak.jsonl"
    tap = spawn(
        "tap",
        [*py, "proxy", "--listen", f"127.0.0.1:{tap_port}", "--upstream",
         f"http://127.0.0.1:{engine_port}", "--capture", str(capture), "--upstream-role",
         "engine", "--max-connections", str(args.concurrency * 4)],
        core=1,
        log_dir=out,
    )  # fmt: skip
    try:
        wait_port(engine_port, engine.popen, 30)
        wait_port(tap_port, tap.popen, 30)
        done: Counter[str] = Counter()
        samples: list[tuple[float, float, int]] = []
        start = time.monotonic()
        deadline = start + args.duration

        async def worker(n: int) -> None:
            rnd = random.Random(n)
            while time.monotonic() < deadline:
                await _one(tap_port, rnd.choice(KINDS), done, rnd)

        async def sampler() -> None:
            while time.monotonic() < deadline:
                samples.append((time.monotonic() - start, _rss_mib(tap.pid), _fds(tap.pid)))
                await anyio.sleep(10)

        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler)
            for n in range(args.concurrency):
                tg.start_soon(worker, n)
        samples.append((time.monotonic() - start, _rss_mib(tap.pid), _fds(tap.pid)))
    finally:
        tap.stop()
        engine.stop()
    lost = 0
    ended = False
    for line in capture.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("type") == "capture_loss":
            lost += int(record.get("dropped", 0))
        if record.get("type") == "capture_end":
            ended, lost = True, max(lost, int(record.get("dropped", 0)))
    print(f"soak: {args.duration:g} s at C={args.concurrency}, tap pid {tap.pid}")
    print("requests: " + ", ".join(f"{k} {v}" for k, v in sorted(done.items())))
    print(f"capture: {capture.stat().st_size / 1e6:.1f} MB, records lost {lost}, ended {ended}")
    print("  t (s)   RSS (MiB)   descriptors")
    for t, rss, fds in samples:
        print(f"  {t:6.0f}   {rss:9.1f}   {fds:11d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--concurrency", type=int, default=256, help="client loops (default 256)")
    parser.add_argument("--out", type=Path, default=None, help="keep the capture and logs here")
    args = parser.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        anyio.run(soak, args, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="tracer-soak-") as tmp:
        anyio.run(soak, args, Path(tmp))


if __name__ == "__main__":
    main()
