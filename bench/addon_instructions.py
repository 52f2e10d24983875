"""``python -m bench.addon_instructions``: what ``addons/trace.py`` costs mitmdump, counted
in instructions (callgrind), so that the machine's load does not blur it.

Three mitmdumps, one after the other, each under ``valgrind --tool=callgrind``, exactly as
``bench/addon.py`` starts them: alone, with the do-nothing addon of the same hooks, with
the trace addon writing a capture. Each gets a warm-up, then its counters are zeroed
(``callgrind_control -z``), then the same fixed workload (``--requests`` streaming
requests of 64 SSE events over 4 keep-alive connections, from ``bench.upstream``), then
a dump (``-d``). Reported: instructions per event and the ratios to mitmdump alone.
Instructions are not time (cache misses are not counted), but they repeat to the last
digit, which the throughput ratios of ``bench.run --scenarios addon`` do not.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from .addon import HOOKS_SCRIPT, mitmdump_argv
from .loadgen import Turns, agent_body
from .peers import PROXY_CORE
from .procs import free_port, spawn, wait_port
from .run import REPO

EVENTS_PER_REQUEST = 65  # 64 events and [DONE]
REQUEST_HEAD = b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
REQUEST = REQUEST_HEAD + b"content-length: 2\r\n\r\n{}"


def agent_request() -> bytes:
    """``REQUEST`` with an agent's 64 KiB context as its body (``bench.run``'s agent-c16)."""
    body = agent_body()
    return REQUEST_HEAD + f"content-length: {len(body)}\r\n\r\n".encode() + body


def _drive(
    port: int, requests: int, deadline: float, *, conns: int = 4, request: bytes = REQUEST
) -> int:
    """``requests`` streaming requests over ``conns`` keep-alive connections, one request on
    each at a time; how many completed."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=120) for _ in range(conns)]
    turns = Turns(request)  # an agent's requests numbered, as bench.run's
    done = 0
    try:
        while done < requests and time.monotonic() < deadline:
            for s in socks:
                s.sendall(turns.next())
            for s in socks:
                buf = b""
                while not buf.endswith(b"0\r\n\r\n"):
                    got = s.recv(65536)
                    if not got:
                        raise RuntimeError("mitmdump closed the connection")
                    buf += got
                done += 1
    finally:
        for s in socks:
            s.close()
    return done


def cpu_per_event(
    name: str,
    argv: list[str],
    port: int,
    out: Path,
    requests: int,
    *,
    warmup: int,
    request: bytes = REQUEST,
) -> tuple[float, int]:
    """(µs of CPU per SSE event, requests done) of a fresh process started from ``argv``
    on the proxy's core and listening on ``port``: ``warmup`` requests, then ``requests``
    in lockstep over 16 connections, its CPU read around them; stopped after."""
    proc = spawn(name, argv, core=PROXY_CORE, log_dir=out, cwd=REPO)
    try:
        wait_port(port, proc.popen, timeout=30)
        deadline = time.monotonic() + 300
        _drive(port, warmup, deadline, conns=16, request=request)
        before = proc.cpu()
        done = _drive(port, requests, deadline, conns=16, request=request)
        spent = proc.cpu() - before
    finally:
        proc.stop()
    return spent / (done * EVENTS_PER_REQUEST) * 1e6, done


def _summary(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary in {path}")


def measure(
    name: str, upstream: int, out: Path, requests: int, request: bytes = REQUEST
) -> tuple[int, int]:
    """(instructions, events) for one mitmdump variant."""
    port = free_port()
    argv = mitmdump_argv(upstream, port, out)
    if name == "hooks":
        hooks = out / "mitm_hooks.py"
        hooks.write_text(HOOKS_SCRIPT)
        argv += ["-s", str(hooks)]
    elif name == "trace":
        capture = out / "instructions-tap.jsonl"
        capture.unlink(missing_ok=True)
        argv += ["-s", str(REPO / "addons" / "trace.py"), "--set", f"tracer_capture={capture}"]
    base = out / f"callgrind.{name}"
    for old in out.glob(f"callgrind.{name}*"):
        old.unlink()
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={base}.%p", *argv]
    log = (out / f"callgrind-{name}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_port(port, proc, timeout=300)
        deadline = time.monotonic() + 600
        _drive(port, 8, deadline, request=request)  # warm-up: imports, first connections
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        done = _drive(port, requests, deadline, request=request)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        dump = Path(f"{base}.{proc.pid}.1")
        for _ in range(200):  # the dump is written by the process itself, soon after
            if dump.exists() and "summary:" in dump.read_text():
                break
            time.sleep(0.1)
        return _summary(dump), done * EVENTS_PER_REQUEST
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--out", default="bench-out")
    p.add_argument(
        "--agent",
        action="store_true",
        help="requests carrying an agent's 64 KiB context (bench.run's agent-c16)",
    )
    a = p.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench addon instructions: valgrind is not installed; skipped")
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    up_port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "bench.upstream", "--port", str(up_port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(up_port, upstream, timeout=15)
        per_event: dict[str, float] = {}
        request = agent_request() if a.agent else REQUEST
        for name in ("mitmdump", "hooks", "trace"):
            instructions, events = measure(name, up_port, out, a.requests, request)
            per_event[name] = instructions / events
            print(f"{name:9} {instructions / 1e6:9.1f} M instructions for {events} events")
    finally:
        upstream.terminate()
        upstream.wait(10)
    base = per_event["mitmdump"]
    bodies = ", each with an agent's 64 KiB context" if a.agent else ""
    print(f"\ninstructions per SSE event (callgrind, {a.requests} streaming requests{bodies}):")
    for name, value in per_event.items():
        print(f"  {name:9} {value / 1000:7.1f} k   x{value / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
