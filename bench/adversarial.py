"""Adversarial checks against ``tracer proxy``: one table of outcomes, to compare versions.

The tracer at ``--tracer-path DIR`` is run (``PYTHONPATH=DIR``, in a temporary folder so
that copy is the one imported), e.g. before and after the bounds work:

    git worktree add --detach /tmp/before24 480b115
    .venv/bin/python bench/adversarial.py --tracer-path /tmp/before24
    .venv/bin/python bench/adversarial.py --tracer-path "$PWD"          # --json: JSON rows

Cases (``--cases 137`` runs some): 1 inject smuggling, 2 admin, 3 secrets, 4 capture
files, 5 full disk (not run: it needs a size-limited filesystem, which needs a mount),
6 resources, 7 capture readers. An option a version does not know is reported n/a.
All on 127.0.0.1; processes started here, ended by pid; files in one temporary folder;
loops bounded in count and time (about 5 minutes in all); a failed case prints
``error: ...`` in its row. Where the bytes matter the upstream is this script's own
(``RawUpstream``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import math
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

PY = sys.executable
SECRET = "sk-SECRET123456789abcdef"
NEEDLE = SECRET[3:]  # counted without its prefix: a partial leak counts too
ORIG_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)
TOTAL_BUDGET = 300.0
BAD_LINE = re.compile(r"could not be read|wrong type|unreadable", re.I)
GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
WRAP = (
    "import resource,runpy,sys; resource.setrlimit(resource.RLIMIT_NOFILE,(160,160)); "
    "sys.argv=['tracer',*sys.argv[1:]]; runpy.run_module('tracer', run_name='__main__')"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_limits() -> None:  # children get the descriptor limits this script was given
    resource.setrlimit(resource.RLIMIT_NOFILE, ORIG_NOFILE)


class Proc:
    """A process of ours: stdout and stderr in files, stopped by its pid."""

    def __init__(self, env: Env, argv: list[str], name: str) -> None:
        self.name, self.err = name, env.tmp / f"{name}.{len(env.procs)}.stderr"
        with open(self.err.with_suffix(".stdout"), "wb") as out, open(self.err, "wb") as err:
            self.p = subprocess.Popen(argv, stdout=out, stderr=err, **env.kw)
        env.procs.append(self)

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_listening(self, port: int, timeout: float = 15.0) -> bool:
        """True once the port accepts (a proxy must also say so); False if it exited."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.p.poll() is not None:
                return False
            if self.name != "proxy" or "listening on" in self.stderr():
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    return True
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not listening on {port} after {timeout:g}s")

    def stop(self) -> None:
        self.p.terminate()  # (nothing if it has exited)
        try:
            self.p.wait(5)
        except subprocess.TimeoutExpired:
            self.p.kill()

    def rss_mib(self) -> tuple[float, float]:
        text = Path(f"/proc/{self.p.pid}/status").read_text()
        rss, hwm = (re.search(rf"{k}:\s+(\d+)", text) for k in ("VmRSS", "VmHWM"))
        return int(rss.group(1)) / 1024, int(hwm.group(1)) / 1024  # type: ignore[union-attr]

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.p.pid}/fd"))


class Env:
    """The version under test, the temporary folder, what a case started, the rows."""

    def __init__(self, tracer_path: str, tmp: Path) -> None:
        env = {**os.environ, "PYTHONPATH": tracer_path, "PYTHONUNBUFFERED": "1"}
        self.tmp, self.start, self.case = tmp, time.monotonic(), "0 options"
        self.kw: dict[str, Any] = dict(cwd=tmp, env=env, stdin=subprocess.DEVNULL)
        if ORIG_NOFILE[0] != ORIG_NOFILE[1]:  # main() raised ours: the children get the original
            self.kw["preexec_fn"] = _child_limits
        self.procs: list[Proc] = []
        self.upstreams: list[RawUpstream] = []
        self.socks: list[socket.socket] = []
        self.rows: list[dict[str, str]] = []
        self.help = self.tracer("proxy", "--help", timeout=30).stdout

    def has(self, option: str) -> bool:
        return option in self.help

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **self.kw)

    def tracer(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.run(PY, "-m", "tracer", *args, timeout=timeout)

    def engine(self) -> int:
        port = free_port()
        argv = f"-m tracer sim engine --listen 127.0.0.1:{port} --tokens 4 --ttft 0.01"
        Proc(self, [PY, *argv.split()], "engine").wait_listening(port)
        return port

    def raw(self, keep: int = 1 << 20) -> RawUpstream:
        self.upstreams.append(RawUpstream(keep))
        return self.upstreams[-1]

    def proxy(
        self,
        upstream: int,
        *extra: str,
        pre: tuple[str, ...] = (),
        wrap: bool = False,
        must: bool = True,
    ) -> tuple[Proc, int, bool]:
        """A tap on a free port: (process, port, listening?)."""
        port = free_port()
        argv = f"proxy --listen 127.0.0.1:{port} --upstream http://127.0.0.1:{upstream}"
        head = [PY, "-c", WRAP] if wrap else [PY, "-m", "tracer"]
        p = Proc(
            self, [*head, *pre, *argv.split(), "--tap", "adv", "--no-fingerprint", *extra], "proxy"
        )
        ok = p.wait_listening(port)
        if must and not ok:
            raise RuntimeError(f"the proxy did not start: {p.stderr().strip()[-200:]}")
        return p, port, ok

    def connect(self, port: int, timeout: float = 5) -> socket.socket:
        self.socks.append(socket.create_connection(("127.0.0.1", port), timeout=timeout))
        return self.socks[-1]

    def cleanup(self) -> None:
        for s in self.socks:
            s.close()
        for p in self.procs:
            p.stop()
        for u in self.upstreams:
            u.close()
        self.socks, self.procs, self.upstreams = [], [], []

    def row(self, measure: str, result: str) -> None:
        self.rows.append({"case": self.case, "measure": measure, "result": result})
        print(f"  {self.case:11} | {measure:50} | {result}", file=sys.stderr, flush=True)

    def left(self) -> float:
        return TOTAL_BUDGET - (time.monotonic() - self.start)


class RawUpstream:
    """An upstream that keeps each connection's raw bytes (up to ``keep``), splits
    requests leniently (a bare LF ends a line; Content-Length honoured) and answers
    each with 200, except a request line holding ``/hold`` (never answered)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.conns: list[tuple[bytearray, list[bytes]]] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        if not ready.wait(5):
            raise RuntimeError("the raw upstream did not start")

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        start = asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=2048)
        self.server = self.loop.run_until_complete(start)
        self.port = int(self.server.sockets[0].getsockname()[1])
        ready.set()
        self.loop.run_forever()
        self.loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raw, lines, buf, left = bytearray(), list[bytes](), b"", 0
        self.conns.append((raw, lines))
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                raw += data[: max(0, self.keep - len(raw))]
                while data:
                    if left:  # a body
                        n = min(left, len(data))
                        left, data = left - n, data[n:]
                        continue
                    buf, data = buf + data, b""
                    if len(buf) > 262144:  # a flood: not parsed, read on
                        buf = b""
                    m = re.search(rb"\n\r?\n", buf)
                    if not m:
                        break
                    head, data, buf = buf[: m.start()].rstrip(b"\r"), buf[m.end() :], b""
                    parts = re.split(rb"\r?\n", head)
                    lines.append(parts[0])
                    for line in parts[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length" and value.strip().isdigit():
                            left = int(value.strip())
                    if b"/hold" not in parts[0]:
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        writer.close()

    async def _shutdown(self) -> None:
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.stop()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        self.thread.join(5)


def read_status(sock: socket.socket, timeout: float) -> int | str:
    """The status of the first response on this socket, or EOF / reset / timeout."""
    buf, end = b"", time.monotonic() + timeout
    try:
        while b"\r\n" not in buf:
            if end - time.monotonic() <= 0:
                return "timeout"
            sock.settimeout(end - time.monotonic())
            data = sock.recv(4096)
            if not data:
                return "EOF/reset"
            buf += data
    except TimeoutError:
        return "timeout"
    except ConnectionResetError:
        return "EOF/reset"
    except OSError as exc:
        return f"error {exc.errno}"
    parts = buf.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else "garbage"


def exchange(port: int, data: bytes, timeout: float = 5.0) -> int | str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        return read_status(s, timeout)


def req(
    port: int, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> tuple[int, bytes]:
    """One request on a fresh connection; a ``Host`` in ``headers`` replaces the usual."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = headers or {}
        c.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
        for k, v in headers.items():
            c.putheader(k, v)
        if body or method not in ("GET", "HEAD", "DELETE"):
            c.putheader("Content-Length", str(len(body)))
        c.endheaders(body or None)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def case1_inject(env: Env) -> None:
    up = env.raw()
    _, port, _ = env.proxy(up.port, "--inject-request-id")
    assert exchange(port, b"GET /warm HTTP/1.1\r\nHost: x\r\n\r\n") == 200, "no answer"
    time.sleep(0.3)
    m = re.search(rb"x-request-id: tracer-adv-(\d+)-1", b"".join(c[0] for c in up.conns))
    conn_id = int(m.group(1)) + 1 if m else 2
    # The injector, reading the head's bare-LF line as no Content-Length, takes the body
    # for a second head and adds K bytes to it; a lenient upstream honours the length,
    # ends the POST body K bytes early, and reads the body's last K bytes as a request.
    k = len(f"x-request-id: tracer-adv-{conn_id}-2\r\n")
    smuggled = b"GET /smuggled HTTP/1.0\r\n\r\n"  # (1.0: no Host needed)
    smuggled = smuggled.replace(b" HTTP", b"?" + b"p" * (k - len(smuggled) - 1) + b" HTTP")
    body = b"GET /x HTTP/1.1\r\nX-A: " + smuggled
    env.connect(port).sendall(
        b"POST /a HTTP/1.1\r\nHost: x\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    first = read_status(env.socks[-1], 3)
    time.sleep(0.5)
    lines = [x.decode("latin-1") for c in up.conns if c[0].startswith(b"POST /a") for x in c[1]]
    reached = "YES" if any("/smuggled" in x for x in lines) else "no"
    env.row(
        "bare-LF head, body holding GET /smuggled: upstream", f"{len(lines)} request(s) {lines}"
    )
    env.row("  /smuggled reached the upstream", f"{reached} (the client got {first})")
    got = exchange(port, b"GET /lf HTTP/1.1\nHost: x\n\n", timeout=5)
    res = f"answered ({got})" if isinstance(got, int) else f"HELD: no answer ({got})"
    env.row("request with bare-LF line endings (5 s)", res)


def case2_admin(env: Env) -> None:
    aport = free_port()
    env.proxy(env.raw().port, "--admin", f"127.0.0.1:{aport}", "--fault-control")
    hdrs = {"Content-Type": "text/plain", "Origin": "http://evil.example"}
    status, _ = req(aport, "POST", "/faults", hdrs, b"status:503")
    plan = json.loads(req(aport, "GET", "/faults")[1]).get("faults")
    res = f"{'ACCEPTED' if status == 200 else 'refused'}: HTTP {status}; plan now {plan}"
    env.row("cross-origin POST /faults (text/plain, Origin)", res)
    status, _ = req(aport, "GET", "/status", {"Host": "evil.example"})
    env.row("GET /status with Host: evil.example", f"HTTP {status}" + " (SERVED)" * (status == 200))
    codes: Counter[int | str] = Counter()
    end = time.monotonic() + 30
    for _ in range(200):
        if time.monotonic() > end:
            codes["not sent (30 s)"] += 1
            continue
        try:
            status, _ = req(aport, "POST", "/mark", {"Content-Type": "application/json"}, b"{}")
            codes[status] += 1
        except OSError as exc:
            codes[type(exc).__name__] += 1
    env.row("200 x POST /mark without token", f"{codes[200]}/200 accepted; {dict(codes)}")


def case3_secrets(env: Env) -> None:
    aport, cap = free_port(), env.tmp / "secrets.jsonl"
    admin = ("--admin", f"127.0.0.1:{aport}")
    proc, port, _ = env.proxy(
        env.raw().port, "--capture", str(cap), *admin, pre=("--log-level", "debug")
    )
    names = "X-Custom-Auth X-Auth-Key Ocp-Apim-Subscription-Key x-functions-key X-Access-Tokens"
    tags = {f"/s/h{i}": n for i, n in enumerate(names.split())}
    for path, name in tags.items():
        exchange(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n{name}: {SECRET}\r\n\r\n".encode())
    mal = f"GET /s/mal HTTP/1.1\r\nHost: x\r\nAuthorization : Bearer {SECRET}\r\n\r\n"
    exchange(port, mal.encode())
    env.connect(port).sendall(f"GET /hold/q?api_key={SECRET} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    time.sleep(1.0)  # the query's request is in flight: /status shows it
    status = req(aport, "GET", "/status")[1].decode(errors="replace")
    env.socks.pop().close()
    time.sleep(0.3)
    proc.stop()
    text = cap.read_text(errors="replace")
    tags |= {"/hold/q": "?api_key", "/s/mal": "Authorization :"}
    recs = [json.loads(x) for x in text.splitlines() if x.strip()]
    via = {
        tags.get(str(r.get("target")).split("?")[0], r["type"]) for r in recs if NEEDLE in str(r)
    }
    kinds = Counter(r["type"] for r in recs)
    env.row(
        "occurrences in the capture file",
        f"{text.count(NEEDLE)}" + f" via {sorted(via)}" * bool(via),
    )
    env.row("  (what it recorded)", f"{kinds['request']} requests, {kinds['anomaly']} anomalies")
    env.row("occurrences in the proxy's stderr (--log-level debug)", f"{count(proc.stderr())}")
    res = f"{count(status)} (/hold/q shown in flight: {'/hold/q' in status})"
    env.row("occurrences in GET /status (query request in flight)", res)
    a = env.tracer("analyze", str(cap), "--format", "json", timeout=120)
    env.row(
        "occurrences in analyze --format json", f"{count(a.stdout, a.stderr)} (rc={a.returncode})"
    )
    rep = env.tmp / "secrets-report"
    rep.mkdir()
    r = env.tracer("report", str(cap), "-o", f"{rep}/r.md", "--json", f"{rep}/r.json", timeout=120)
    n = count(r.stdout, r.stderr, *(p.read_text(errors="replace") for p in rep.glob("*[dgn]")))
    env.row("occurrences in report (md, json, svg, its output)", f"{n} (rc={r.returncode})")


def count(*texts: str) -> int:
    return sum(t.count(NEEDLE) for t in texts)


def case4_files(env: Env) -> None:
    up = env.raw()

    def start(path: Path) -> str:
        proc, _, ok = env.proxy(up.port, "--capture", str(path), must=False)
        proc.stop()
        last = (proc.stderr().strip().splitlines() or [""])[-1].replace(f"{env.tmp}/", "")
        return "started" if ok else f"refused (rc={proc.p.returncode}: {last[:70]})"

    existing, new = env.tmp / "existing.jsonl", env.tmp / "new.jsonl"
    existing.write_text("precious\n")
    how, after = start(existing), existing.read_text()
    kept = "content kept" if after.startswith("precious\n") else "CONTENT CHANGED"
    grew = f", {after.count(chr(10)) - 1} line(s) APPENDED" if len(after) > 9 else ""
    env.row("--capture at an existing (non-capture) file", f"{how}; {kept}{grew}")
    how, mask = start(new), os.umask(0)
    os.umask(mask)
    mode = oct(new.stat().st_mode & 0o777) if new.exists() else "no file"
    env.row(f"mode of a new capture (umask {mask:03o})", f"{mode} ({how})")
    target, link = env.tmp / "target.txt", env.tmp / "link.jsonl"
    target.write_text("precious\n")
    link.symlink_to(target)
    how = start(link)
    res = "WRITTEN (followed)" if target.read_text() != "precious\n" else "untouched"
    env.row("capture path = symlink to an existing file", f"{how}; target {res}")
    missing, link2 = env.tmp / "created.txt", env.tmp / "link2.jsonl"
    link2.symlink_to(missing)
    how = start(link2)
    res = "CREATED (followed)" if missing.exists() else "not created"
    env.row("capture path = symlink to a missing file", f"{how}; target {res}")


def case6_body_memory(env: Env) -> None:
    proc, port, _ = env.proxy(env.raw(65536).port, "--capture", str(env.tmp / "bodies.jsonl"))
    idle = proc.rss_mib()[0]
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
    data = head + b'\r\nContent-Length: 15000000\r\n\r\n{"messages": "' + b"a" * 13_999_986
    sent: list[int] = []

    def client() -> None:
        with contextlib.suppress(OSError):
            env.connect(port, timeout=60).sendall(data)
            sent.append(1)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(24)]
    for t in threads:
        t.start()
    end = time.monotonic() + 90
    for t in threads:
        t.join(max(0.1, end - time.monotonic()))
    time.sleep(1.5)
    rss, peak = proc.rss_mib()
    res = f"{rss:.0f} MiB (peak {peak:.0f}, idle {idle:.0f}; {len(sent)}/24 sent)"
    env.row("24 x 14 MB of 15 MB JSON bodies held: proxy RSS", res + _na(env, "--body-memory"))


def _na(env: Env, option: str) -> str:
    return "" if env.has(option) else f"; {option}: n/a"


def case6_partial_heads(env: Env) -> None:
    up = env.raw(4096)
    proc, port, _ = env.proxy(up.port)
    idle, end, before = proc.fds(), time.monotonic() + 30, len(up.conns)
    with contextlib.suppress(OSError):
        for _ in range(500):
            if time.monotonic() < end:
                env.connect(port).sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-a: ")
    time.sleep(2.0)
    res = f"{proc.fds()} fds (idle {idle}; {len(env.socks)} clients, {len(up.conns) - before} upstream)"
    env.row("500 partial heads held: proxy descriptors", res + _na(env, "--max-connections"))


def _tally(socks: list[socket.socket | None], wait: float) -> str:
    tally: Counter[str] = Counter()
    end = time.monotonic() + wait
    for s in socks:
        got = "connect failed" if s is None else read_status(s, max(0.05, end - time.monotonic()))
        tally[str(got).replace("timeout", f"no answer in {wait:g} s")] += 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(tally.items()))


def _open(env: Env, port: int, n: int, data: bytes) -> list[socket.socket | None]:
    socks: list[socket.socket | None] = []
    for _ in range(n):
        try:
            socks.append(env.connect(port, timeout=3))
            env.socks[-1].sendall(data)
        except OSError:
            socks.append(None)
    return socks


def case6_fd_limit(env: Env) -> None:
    proc, port, _ = env.proxy(env.engine(), wrap=True)
    socks = _open(env, port, 100, b"")
    for s in socks:
        with contextlib.suppress(OSError, AttributeError):
            s.sendall(GET)  # type: ignore[union-attr]
    res = _tally(socks, 15)
    limit = re.search(r"max_connections=(\d+)", proc.stderr())
    note = f"; --max-connections default {limit.group(1)}" if limit else ""
    res += _na(env, "--max-connections") or note
    env.row("RLIMIT_NOFILE 160, 100 GET /v1/models held open", res)
    for s in env.socks:  # all closed; then 60 slow clients, each a partial head, and 10 GETs
        s.close()
    env.socks = []
    time.sleep(1.0)
    _open(env, port, 60, GET[:-2])
    time.sleep(0.5)
    env.row("same, 60 partial heads held, then 10 GETs", _tally(_open(env, port, 10, GET), 5))


def case6_header_flood(env: Env) -> None:
    _, port, _ = env.proxy(env.raw(4096).port, "--capture", str(env.tmp / "flood.jsonl"))

    def gets(n: int = 50) -> str:
        c, took = http.client.HTTPConnection("127.0.0.1", port, timeout=10), []
        for _ in range(n):
            t0 = time.perf_counter()
            c.request("GET", "/v1/models")
            c.getresponse().read()
            took.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.01)
        c.close()
        return f"p50 {statistics.median(took):.1f} ms, max {max(took):.1f} ms"

    quiet, done = gets(), threading.Event()
    # 20,000 header lines in 60 KB (LF-ended: under the 64 KiB head limit of both versions)
    flood = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"a:\n" * 20_000 + b"\n"

    def flooder() -> None:  # the whole head at once, 0.2 s into the GETs
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
            done.wait(0.2)
            s.sendall(flood)
            done.wait(20)

    t = threading.Thread(target=flooder, daemon=True)
    t.start()
    loud = gets()
    done.set()
    t.join(5)
    env.row("50 GETs without / with a 20k-line head beside", f"without: {quiet}; with: {loud}")


def small_capture(env: Env, path: Path) -> list[str]:
    proc, port, _ = env.proxy(env.engine(), "--capture", str(path))
    chat = '{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4'
    for _ in range(5):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/v1/models")
        c.getresponse().read()
        for stream in ("false", "true"):
            c.request("POST", "/v1/chat/completions", f'{chat}, "stream": {stream}}}')
            c.getresponse().read()
        c.close()
    time.sleep(0.5)
    proc.stop()
    return path.read_text().splitlines()


def case7_readers(env: Env) -> None:
    lines = small_capture(env, env.tmp / "real.jsonl")
    recs = [json.loads(x) for x in lines]
    for kind, field, value in [
        ("request", "t", "oops"),
        ("response_end", "status", "200"),
        ("response_end", "t", 1e308),
    ]:
        i = next(i for i, r in enumerate(recs) if r["type"] == kind)
        path, md = env.tmp / f"bad-{kind}-{field}.jsonl", env.tmp / f"bad-{kind}-{field}.md"
        path.write_text(
            "\n".join([*lines[:i], json.dumps({**recs[i], field: value}), *lines[i + 1 :]]) + "\n"
        )
        outcome = []
        for cmd in (["analyze", str(path)], ["report", str(path), "-o", str(md)]):
            try:
                r = env.tracer(*cmd, timeout=60)
                out = r.stdout + (md.read_text() if cmd[0] == "report" and md.exists() else "")
                tb = "TRACEBACK" if "Traceback" in r.stderr else "clean"
                said = " (bad line reported)" * bool(BAD_LINE.search(out))
                outcome.append(f"{cmd[0]} rc={r.returncode} {tb}{said}")
            except subprocess.TimeoutExpired:
                outcome.append(f"{cmd[0]} timed out (60 s)")
        env.row(f"{kind} {field} = {json.dumps(value)}", "; ".join(outcome))
    # 10k connections: the small capture's connections copied, renumbered, shifted in time
    head = [r for r in recs if r["type"] == "capture_start"]
    body = [r for r in recs if r["type"] not in ("capture_start", "capture_end")]
    per = max(int(r["conn"]) for r in body if "conn" in r)
    copies, written, synth = math.ceil(10_000 / per), 0, env.tmp / "synth.jsonl"
    with open(synth, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in head)
        for k in range(copies):
            for r in body:
                rec = dict(r)
                if "conn" in r:
                    rec["conn"] = r["conn"] + k * per
                    rec |= {f: r[f] + k * 0.002 for f in ("t", "m") if isinstance(r.get(f), float)}
                    if r.get("request_id"):
                        rec["request_id"] = f"{r['request_id']}-{k}"
                elif k:
                    continue
                fh.write(json.dumps(rec) + "\n")
                written += 1
        last = max(float(r["t"]) for r in body) + copies * 0.002 + 1
        end = {"type": "capture_end", "t": last, "m": last, "tap": "adv", "records": written + 2}
        fh.write(json.dumps(end | {"dropped": 0, "reason": "SIGTERM"}) + "\n")
    budget, t0 = max(30.0, min(150.0, env.left() - 10)), time.monotonic()
    try:
        r = env.tracer("analyze", str(synth), timeout=budget)
        res = f"{time.monotonic() - t0:.1f} s, rc={r.returncode}"
        res += " TRACEBACK" * ("Traceback" in r.stderr)
    except subprocess.TimeoutExpired:
        res = f"over {budget:.0f} s (stopped)"
    env.row(f"analyze (text): {copies * per} connections, {written} records", res)


def case5_full_disk(env: Env) -> None:
    env.row("records lost on a full disk", "not run: needs a size-limited filesystem (a mount)")


NAMES = ["inject", "admin", "secrets", "files", "full disk", "resources", "readers"]
CASES = [case1_inject, case2_admin, case3_secrets, case4_files, case5_full_disk]
CASES += [case6_body_memory, case6_partial_heads, case6_fd_limit, case6_header_flood, case7_readers]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tracer-path", required=True, help="the folder holding the tracer package")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--cases", default="1234567", help="the cases to run, by number (default: all)")
    args = ap.parse_args()
    with contextlib.suppress(ValueError, OSError):  # our own sockets: 1000+ held at once
        resource.setrlimit(resource.RLIMIT_NOFILE, (ORIG_NOFILE[1], ORIG_NOFILE[1]))
    with tempfile.TemporaryDirectory(prefix="tracer-adv-") as tmp:
        env = Env(str(Path(args.tracer_path).resolve()), Path(tmp))
        found = env.run(PY, "-c", "import tracer; print(tracer.__file__)").stdout.strip()
        print(f"tracer imported from {found}", file=sys.stderr)
        opts = ["--admin-token-file", "--max-connections", "--body-memory", "--append"]
        res = ", ".join(f"{o}: {'known' if env.has(o) else 'n/a'}" for o in opts)
        env.row("options of the newer version", res)
        for fn in CASES:
            env.case = f"{fn.__name__[4]} {NAMES[int(fn.__name__[4]) - 1]}"
            if env.case[0] not in args.cases:
                continue
            if env.left() <= 20:
                env.row(fn.__name__, "not run: the 5-minute cap was reached")
            else:
                try:
                    fn(env)
                except Exception as exc:
                    env.row(fn.__name__, f"error: {type(exc).__name__}: {exc}")
                finally:
                    env.cleanup()
    if args.json:
        print(json.dumps(env.rows, indent=1))
        return 0
    w = max(len(r["measure"]) for r in env.rows)
    print(f"{'case':11} | {'measure':{w}} | result")
    for r in env.rows:
        print(f"{r['case']:11} | {r['measure']:{w}} | {r['result']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
