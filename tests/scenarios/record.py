"""Record the attribution scenario matrix (issue 23) from real processes on 127.0.0.1.

    .venv/bin/python -m tests.scenarios.record [NAME...]      (no NAME: every case)
    .venv/bin/python -m tests.scenarios.record --list

Each case starts real processes — the simulated SGLang engine (``tracer sim engine``,
always ``--token-counters finish``, as SGLang counts), taps (``tracer proxy``), the real
SGLang router (``smg``), nginx, haproxy — drives them with the openai SDK (the harness of
``tracer sim harness``) or httpx, stops them, and writes the taps' captures and an
``expect.json`` to ``tests/data/scenarios/<case>/`` (replacing what was there only once
the case has finished). ``tests/unit/test_scenarios.py`` analyses them in-process.

Every process is started here and stopped by its own id; ports come from binding port 0;
each case has a time limit. Logs and configs stay in a temporary directory (``--keep``
prints it and leaves it).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
from anyio.abc import Process

from tracer.sim.harness import HarnessConfig, HarnessReport, run_harness

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "scenarios"
TRACER = [sys.executable, "-m", "tracer"]
SMG = Path(sys.executable).parent / "smg"
READY = re.compile(r"listening on (?:http://)?(127\.0\.0\.1:\d+)")
FINISH = ["--token-counters", "finish"]  # how real SGLang counts tokens: at the end
TAP = ["--bodies", "none", "--stall-after", "1"]  # (engine metrics: every 1 s, the default)
FAST = ["--metrics-interval", "0.5"]  # where the engine's own figures decide the case
PROBES = ["--probe-on-stall", "--probe-interval", "0.5"]
CHAT: dict[str, Any] = {
    "model": "sim-model",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "hi"}],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Lab:
    """The processes of one case (stopped when ``stack`` closes) and where it writes."""

    work: Path
    stack: AsyncExitStack
    captures: dict[str, Path] = field(default_factory=dict)  # tap name -> capture
    notes: list[str] = field(default_factory=list)  # what happened, for expect.json
    found: dict[str, Any] = field(default_factory=dict)  # what a case measured (its Case.after)
    started: float = field(default_factory=time.monotonic)

    def say(self, text: str) -> None:
        print(f"  {time.monotonic() - self.started:5.1f}s  {text}", flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.say(text)

    def _log(self, name: str) -> tuple[Path, Any]:
        path = self.work / "logs" / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        log = path.open("wb")
        self.stack.callback(log.close)
        return path, log

    async def spawn(self, name: str, argv: list[str]) -> tuple[Process, Path]:
        log_path, log = self._log(name)
        proc = await anyio.open_process(argv, stdin=None, stdout=log, stderr=log)
        self.stack.push_async_callback(stop, proc)
        return proc, log_path

    async def start(self, name: str, argv: list[str]) -> str:
        """A process that logs ``listening on HOST:PORT`` when ready; its URL."""
        proc, log_path = await self.spawn(name, argv)
        with anyio.fail_after(30):
            while not (found := READY.search(log_path.read_text(errors="replace"))):
                if proc.returncode is not None:
                    raise RuntimeError(f"{name} exited early: {log_path.read_text()[-2000:]}")
                await anyio.sleep(0.05)  # (polls its log with a deadline)
        return f"http://{found.group(1)}"

    async def start_http(self, name: str, argv: list[str], url: str, path: str) -> str:
        """A process that is ready when ``url + path`` answers (any HTTP status)."""
        proc, log_path = await self.spawn(name, argv)
        async with httpx.AsyncClient(timeout=2) as client:
            with anyio.fail_after(30):
                while True:
                    if proc.returncode is not None:
                        raise RuntimeError(f"{name} exited early: {log_path.read_text()[-2000:]}")
                    try:
                        r = await client.get(url + path)
                        if name != "smg" or r.status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await anyio.sleep(0.1)  # (polls with a deadline)
        return url

    async def engine(self, *args: str, name: str = "engine") -> str:
        argv = [*TRACER, "sim", "engine", "--listen", "127.0.0.1:0", *FINISH, *args]
        url = await self.start(name, argv)
        self.say(f"{name} {url}: {' '.join(args)}")
        return url

    async def tap(self, name: str, upstream: str, *args: str) -> str:
        capture = self.work / f"{name}.jsonl"
        self.captures[name] = capture
        argv = [*TRACER, "proxy", "--listen", "127.0.0.1:0", "--upstream", upstream]
        argv += ["--tap", name, "--capture", str(capture), *TAP, *args]
        url = await self.start(f"tap-{name}", argv)
        self.say(f"tap {name} {url} -> {upstream} {' '.join(args)}")
        return url

    async def smg(self, *workers: str) -> tuple[str, str]:
        """The real SGLang router in front of ``workers``: (its URL, its metrics URL)."""
        if not SMG.exists():
            raise RuntimeError(f"{SMG} is not installed")
        port, prom = free_port(), free_port()
        argv = [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--worker-urls", *workers, "--policy", "round_robin", "--log-level", "warn"]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
        url = await self.start_http("smg", argv, f"http://127.0.0.1:{port}", "/readiness")
        self.say(f"smg {url} (metrics :{prom}) -> {' '.join(workers)}")
        return url, f"http://127.0.0.1:{prom}/metrics"

    async def nginx(self, upstream: str, location: str) -> str:
        """nginx (Debian's) on loopback, ``location /`` proxying to ``upstream``."""
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        port = free_port()
        prefix = self.work / "nginx"
        (prefix / "logs").mkdir(parents=True, exist_ok=True)
        temps = " ".join(
            f"{n}_temp_path {prefix}/{n};"
            for n in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        conf = f"""daemon off; worker_processes 1; pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log info;
events {{ worker_connections 64; }}
http {{
  access_log off; {temps}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass {upstream};
{location}
    }}
  }}
}}
"""
        (prefix / "nginx.conf").write_text(conf)
        version = subprocess.run([binary, "-v"], capture_output=True, text=True).stderr.strip()
        self.note(f"{version}; location /: {' '.join(location.split())}")
        argv = [binary, "-p", str(prefix), "-c", str(prefix / "nginx.conf")]
        return await self.start_http("nginx", argv, f"http://127.0.0.1:{port}", "/health")

    async def haproxy(self, upstream: str, timeout_server: str, rules: str = "") -> str:
        """haproxy (Debian's) on loopback in front of ``upstream``; ``rules``: more lines
        of its ``frontend`` section."""
        binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
        port = free_port()
        host, _, up_port = upstream.removeprefix("http://").partition(":")
        conf = f"""global
  maxconn 256
defaults
  mode http
  timeout connect 2s
  timeout client 30s
  timeout server {timeout_server}
frontend fe
  bind 127.0.0.1:{port}
{"".join(f"  {line}{chr(10)}" for line in rules.splitlines())}  default_backend be
backend be
  server engine {host}:{up_port}
"""
        path = self.work / "haproxy.cfg"
        path.write_text(conf)
        done = subprocess.run([binary, "-v"], capture_output=True, text=True)
        version = done.stdout.splitlines()[0] if done.stdout else "haproxy"
        said = f"{version}; mode http, timeout server {timeout_server}, http-reuse default"
        self.note(said + "".join(f"; {line}" for line in rules.splitlines()))
        argv = [binary, "-db", "-f", str(path)]
        return await self.start_http("haproxy", argv, f"http://127.0.0.1:{port}", "/health")

    async def harness(self, url: str, **cfg: Any) -> HarnessReport:
        config = HarnessConfig(base_url=url, **cfg)
        report = await run_harness(config)
        tally = Counter(r.outcome for r in report.rounds)
        ttfts = [r.ttft for r in report.rounds if r.ttft is not None]
        line = ", ".join(f"{n} {k}" for k, n in sorted(tally.items()))
        if ttfts:
            line += f"; ttft {min(ttfts):.2f}-{max(ttfts):.2f}s"
        self.note(
            f"openai SDK harness {config.sessions} sessions x {config.rounds} rounds, "
            f"max_tokens {config.max_tokens}, deadline {config.deadline:g}s: {line}"
        )
        return report


async def stop(proc: Process) -> None:
    """SIGTERM (a tap finishes its capture), then SIGKILL after 10 s; only this process."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(10):
            await proc.wait()
    if proc.returncode is None:
        proc.kill()
    with anyio.CancelScope(shield=True):
        await proc.aclose()


async def stream(
    client: httpx.AsyncClient,
    url: str,
    *,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
    content: bytes | None = None,
) -> dict[str, Any]:
    """One streaming chat completion with httpx: status, chunk arrival times, outcome
    (``content``: this JSON body instead of CHAT's)."""
    out: dict[str, Any] = {"status": None, "chunks": [], "outcome": "complete"}
    start = time.monotonic()
    body = {**CHAT, "max_tokens": max_tokens}
    sent: dict[str, Any] = {"json": body} if content is None else {"content": content}
    if content is not None:
        headers = {"content-type": "application/json", **(headers or {})}
    with anyio.move_on_after(timeout or 1e9) as scope:
        try:
            async with client.stream(
                "POST", url + "/v1/chat/completions", headers=headers or {}, **sent
            ) as r:
                out["status"] = r.status_code
                async for _ in r.aiter_raw():
                    out["chunks"].append(time.monotonic() - start)
        except httpx.HTTPError as exc:
            out["outcome"] = f"error ({type(exc).__name__})"
    if scope.cancelled_caught:
        out["outcome"] = f"gave up after {timeout:g}s"
    out["duration"] = time.monotonic() - start
    return out


def describe(name: str, got: dict[str, Any]) -> str:
    times = got["chunks"]
    spread = f"{len(times)} reads" + (f" from {times[0]:.2f}s to {times[-1]:.2f}s" if times else "")
    return f"{name}: status {got['status']}, {got['outcome']}, {spread}"


def chat_body(size: int, max_tokens: int, *, stream: bool = True) -> bytes:
    """A chat completion's JSON body of about ``size`` bytes: one user message of words."""
    body: dict[str, Any] = {**CHAT, "max_tokens": max_tokens, "stream": stream}
    if not stream:
        del body["stream_options"]
    empty = len(json.dumps({**body, "messages": [{"role": "user", "content": ""}]}))
    words = "please review this function and say what it does. " * (size // 50 + 1)
    body["messages"] = [{"role": "user", "content": words[: max(1, size - empty)]}]
    return json.dumps(body).encode()


async def complete(
    client: httpx.AsyncClient,
    url: str,
    content: bytes,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> dict[str, Any]:
    """One non-streamed chat completion with httpx: status, size and time of the answer."""
    out: dict[str, Any] = {"status": None, "bytes": 0, "outcome": "complete"}
    start = time.monotonic()
    with anyio.move_on_after(timeout) as scope:
        try:
            r = await client.post(
                url + "/v1/chat/completions",
                content=content,
                headers={"content-type": "application/json", **(headers or {})},
            )
            out["status"], out["bytes"] = r.status_code, len(r.content)
        except httpx.HTTPError as exc:
            out["outcome"] = f"error ({type(exc).__name__})"
    if scope.cancelled_caught:
        out["outcome"] = f"gave up after {timeout:g}s"
    out["duration"] = time.monotonic() - start
    return out


# ---- the cases -----------------------------------------------------------------------------


async def busy_at_capacity(lab: Lab) -> None:
    """8 sessions on an engine that runs 4: long slow streams fill it, 4 requests queue
    ~3 s, then stream normally; SGLang's counters move only as requests finish."""
    engine = await lab.engine("--max-running", "4", "--ttft", "0.05", "--itl", "0.06")
    url = await lab.tap("tap", engine, "--engine-metrics", f"{engine}/metrics", *FAST)
    await lab.harness(url, sessions=8, rounds=2, think=0.2, max_tokens=40, deadline=20)


async def wedged_engine(lab: Lab) -> None:
    """The scheduler stops (``wedge``: gauges and counters frozen) while 3 streams run; a
    4th request arrives during the wedge; every client gives up after 5 s."""
    fault = "wedge:after=5:for=20@nth=2"
    engine = await lab.engine("--ttft", "0.05", "--itl", "0.05", "--fault", fault)
    url = await lab.tap("tap", engine, "--engine-metrics", f"{engine}/metrics", *FAST, *PROBES)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: lab.harness(url, sessions=3, rounds=1, max_tokens=40, deadline=5))

        async def late() -> None:
            await anyio.sleep(1.5)
            async with httpx.AsyncClient(timeout=30) as client:
                got = await stream(client, url, max_tokens=10, timeout=5)
            lab.note(describe("httpx request sent 1.5 s in (during the wedge)", got))

        tg.start_soon(late)
    await anyio.sleep(0.5)


async def lost_at_engine(lab: Lab) -> None:
    """The engine reads its 5th request and never answers it (``lost@nth=5``); the other
    sessions go on being answered meanwhile. The tap is right in front of the engine."""
    engine = await lab.engine("--ttft", "0.02", "--itl", "0.02", "--fault", "lost@nth=5")
    url = await lab.tap("tap", engine, "--engine-metrics", f"{engine}/metrics", *FAST, *PROBES)
    await lab.harness(url, sessions=3, rounds=4, think=0.3, max_tokens=20, deadline=3)
    await anyio.sleep(0.5)


async def _lost_behind_router(lab: Lab, router_metrics: bool) -> None:
    engine = await lab.engine("--ttft", "0.02", "--itl", "0.02", "--fault", "lost@nth=5")
    router, prom = await lab.smg(engine)
    evidence = ["--engine-metrics", f"{engine}/metrics"]
    if router_metrics:
        evidence += ["--engine-metrics", prom]
    url = await lab.tap("front", router, *evidence, *FAST, *PROBES)
    await lab.harness(url, sessions=3, rounds=4, think=0.3, max_tokens=20, deadline=3)
    await anyio.sleep(0.5)


async def lost_behind_router_metrics(lab: Lab) -> None:
    """As lost_at_engine, with smg between the tap and the engine; the tap scrapes the
    engine and smg's own metrics port."""
    await _lost_behind_router(lab, router_metrics=True)


async def lost_behind_router_engine_only(lab: Lab) -> None:
    """As lost_behind_router_metrics, the tap scraping the engine only."""
    await _lost_behind_router(lab, router_metrics=False)


async def _nginx_chain(lab: Lab, location: str) -> str:
    """tap front -> nginx (``location``) -> tap back -> engine (50 ms tokens); front URL."""
    engine = await lab.engine("--ttft", "0.05", "--itl", "0.05")
    back = await lab.tap("back", engine, "--engine-metrics", f"{engine}/metrics")
    hop = await lab.nginx(back, "\n".join(f"      {line}" for line in location.split("\n")))
    return await lab.tap("front", hop)


async def _nginx_streams(lab: Lab, front: str) -> None:
    """Two ~3 s streams with httpx (their arrival at the client noted), then the openai
    SDK harness, 2 sessions of one ~3 s round."""
    async with httpx.AsyncClient(timeout=30) as client:
        for i in (1, 2):
            got = await stream(client, front, max_tokens=60, headers={"x-request-id": f"n{i}"})
            lab.note(describe(f"httpx stream n{i} (60 tokens, 50 ms apart) at the client", got))
    await lab.harness(front, sessions=2, rounds=1, max_tokens=60, deadline=15)


async def nginx_buffered_http10(lab: Lab) -> None:
    """tap front -> nginx (proxy_buffering on, HTTP/1.0 to its upstream, default buffers)
    -> tap back -> engine; ~3 s streams: nginx passes them on in 4 KiB pieces."""
    location = "proxy_http_version 1.0;\nproxy_buffering on;"
    await _nginx_streams(lab, await _nginx_chain(lab, location))


async def nginx_buffered_http10_bigbuf(lab: Lab) -> None:
    """As nginx_buffered_http10 with 64 KiB proxy buffers: each ~3 s stream (19 KB) stays
    in nginx's first buffer until the engine closes, and comes out in one burst."""
    location = (
        "proxy_http_version 1.0;\nproxy_buffering on;\n"
        "proxy_buffer_size 64k;\nproxy_buffers 8 64k;\nproxy_busy_buffers_size 128k;"
    )
    await _nginx_streams(lab, await _nginx_chain(lab, location))


async def nginx_gzip_sse(lab: Lab) -> None:
    """tap front -> nginx (HTTP/1.1 upstream, proxy_buffering on, gzip on for
    text/event-stream) -> tap back -> engine: the clients ask for gzip (httpx's default),
    nginx compresses each stream and sends it in one burst at the end."""
    location = (
        'proxy_http_version 1.1;\nproxy_set_header Connection "";\nproxy_buffering on;\n'
        "gzip on;\ngzip_types text/event-stream;\ngzip_proxied any;"
    )
    await _nginx_streams(lab, await _nginx_chain(lab, location))


async def _haproxy_chain(lab: Lab) -> str:
    engine = await lab.engine("--ttft", "0.05", "--itl", "0.02")
    back = await lab.tap("back", engine, "--engine-metrics", f"{engine}/metrics")
    hop = await lab.haproxy(back, "2s")
    return await lab.tap("front", hop)


async def haproxy_front(lab: Lab) -> None:
    """tap front -> haproxy (timeout server 2s) -> tap back -> engine: a healthy stream,
    one whose first token takes 3 s (x-sim-ttft), then a healthy one again."""
    url = await _haproxy_chain(lab)
    async with httpx.AsyncClient(timeout=30) as client:
        for rid, headers in (
            ("before", {}),
            ("slow-first-token", {"x-sim-ttft": "3"}),
            ("after", {}),
        ):
            got = await stream(client, url, max_tokens=10, headers={"x-request-id": rid, **headers})
            lab.note(describe(f"httpx {rid}", got))
    await anyio.sleep(2)  # the engine answers the slow one at ~3 s: let tap back see it


async def haproxy_healthy(lab: Lab) -> None:
    """The haproxy chain of haproxy_front with nothing wrong: the openai SDK harness."""
    url = await _haproxy_chain(lab)
    await lab.harness(url, sessions=2, rounds=3, think=0.2, max_tokens=16, deadline=10)


async def starved_demo(lab: Lab) -> None:
    """``tracer demo`` (hang-on-reuse: front tap, a proxy hanging on the 3rd request of a
    reused connection, back tap, smg, two engines) while two busy loops compete for the
    machine's cores; its front and back captures are kept."""
    spin = [sys.executable, "-c", "while True: pass"]
    for i in (1, 2):
        await lab.spawn(f"busy-{i}", spin)
    lab.note("two busy loops (python -c 'while True: pass') ran throughout")
    out = lab.work / "demo"
    proc, log = await lab.spawn("demo", [*TRACER, "demo", "--out", str(out)])
    with anyio.fail_after(300):
        await proc.wait()
    lab.note(f"tracer demo exited {proc.returncode} (0: it reached its own expected verdict)")
    verdict = re.search(r"verdict.*", log.read_text(errors="replace"))
    if verdict:
        lab.say(verdict.group(0))
    for name in ("front", "back"):
        lab.captures[name] = out / f"{name}.jsonl"


async def healthy_control(lab: Lab) -> None:
    """The openai SDK harness through one tap to the engine; nothing wrong."""
    engine = await lab.engine("--ttft", "0.02", "--itl", "0.01")
    url = await lab.tap("tap", engine, "--engine-metrics", f"{engine}/metrics")
    await lab.harness(url, sessions=2, rounds=3, think=0.2, max_tokens=16, deadline=10)


async def nginx_read_timeout_nonstream(lab: Lab) -> None:
    """tap front -> nginx (HTTP/1.1 upstream, proxy_read_timeout 3s) -> tap back ->
    engine (50 ms tokens, its decode progress written every 10 steps): two short
    non-streamed answers, then a non-streamed one of 150 tokens (~7.5 s): the engine
    decodes it, silent until done, as a non-streamed answer is; nginx answers 504 after
    3 s without a byte from upstream and closes its upstream connection (the engine then
    aborts the request)."""
    engine = await lab.engine("--ttft", "0.05", "--itl", "0.05", "--decode-log-interval", "10")
    back = await lab.tap("back", engine, "--engine-metrics", f"{engine}/metrics", *FAST)
    location = 'proxy_http_version 1.1;\nproxy_set_header Connection "";\nproxy_read_timeout 3s;'
    hop = await lab.nginx(back, "\n".join(f"      {line}" for line in location.split("\n")))
    front = await lab.tap("front", hop)
    async with httpx.AsyncClient(timeout=30) as client:
        for rid, tokens in (("short-1", 10), ("short-2", 10), ("long", 150)):
            body = chat_body(300, tokens, stream=False)
            got = await complete(client, front, body, headers={"x-request-id": rid}, timeout=20)
            lab.note(
                f"httpx {rid} (stream false, max_tokens {tokens}) at the client: status "
                f"{got['status']}, {got['outcome']}, {got['bytes']} bytes after {got['duration']:.2f}s"
            )
    await anyio.sleep(1.5)  # the engine's figures after the abort


LARGE = 64_000  # request bodies haproxy tarpits (Content-Length over 60000)


async def hop_swallows_large_bodies(lab: Lab) -> None:
    """tap front -> haproxy (``http-request tarpit`` for a Content-Length over 60000,
    timeout tarpit 60s) -> tap back -> engine: 10 streamed requests with bodies of
    0.3-37 KB on three keep-alive connections (a, b, c) complete; then two with 64 KB
    bodies, one the 5th request of connection a (reused), one on a fresh connection d,
    are held by haproxy and never reach tap back, while b and c send two more small
    ones each, and two fresh connections (e, f) one small one each, answered (fresh
    connections answering meanwhile: what once made the reused one read as a hang on
    reuse); the clients give up on the big ones after 5 s."""
    engine = await lab.engine("--ttft", "0.05", "--itl", "0.02")
    back = await lab.tap("back", engine, "--engine-metrics", f"{engine}/metrics", *FAST)
    rules = "timeout tarpit 60s\nhttp-request tarpit if { req.hdr_val(content-length) gt 60000 }"
    front = await lab.tap("front", await lab.haproxy(back, "30s", rules))
    async with AsyncExitStack() as clients:
        conns: dict[str, httpx.AsyncClient] = {}
        for name in "abcdef":  # one keep-alive connection each
            one_conn = httpx.Limits(max_connections=1)
            conns[name] = await clients.enter_async_context(
                httpx.AsyncClient(timeout=30, limits=one_conn)
            )

        async def send(name: str, seq: int, size: int, give_up: float = 10) -> None:
            body = chat_body(size, 8)
            rid = f"{name}{seq}-{len(body)}B"
            got = await stream(
                conns[name],
                front,
                max_tokens=8,
                headers={"x-request-id": rid},
                timeout=give_up,
                content=body,
            )
            lab.note(describe(f"httpx {rid} (connection {name}, request {seq} on it)", got))

        async def run(name: str, sizes: list[int], first: int = 1, gap: float = 0) -> None:
            for seq, size in enumerate(sizes, first):
                await anyio.sleep(gap)
                await send(name, seq, size)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a", [300, 5_000, 20_000, 37_000])
            tg.start_soon(run, "b", [1_000, 12_000, 30_000])
            tg.start_soon(run, "c", [500, 8_000, 25_000])
        async with anyio.create_task_group() as tg:
            tg.start_soon(send, "a", 5, LARGE, 5)  # reused: after 4 answered on it
            tg.start_soon(send, "d", 1, LARGE, 5)  # fresh
            tg.start_soon(run, "b", [2_000, 37_000], 4, 1.0)
            tg.start_soon(run, "c", [3_000, 15_000], 4, 1.0)
            tg.start_soon(run, "e", [4_000], 1, 1.5)  # fresh, answered meanwhile
            tg.start_soon(run, "f", [6_000], 1, 3.0)
    await anyio.sleep(1)


async def agents_one_stops(lab: Lab) -> None:
    """4 agent sessions (the openai SDK, streaming, each its own client and keep-alive
    connection) through one client-facing tap in front of the engine: agent a4 stops
    after its 2nd round (it waits on itself; its client stays open) while a1-a3 go on for
    8 rounds (~9 s); the harness is seen hung when a4 has been idle ~4 s and the others
    are streaming (hang_at). The engine closes its side of a keep-alive connection idle
    5 s (uvicorn's default, as SGLang runs it); the tap records a4's connection closed
    when its client closes it, at the end."""
    engine = await lab.engine("--ttft", "0.05", "--itl", "0.02")
    url = await lab.tap(
        "tap", engine, "--client-facing", "--engine-metrics", f"{engine}/metrics", *FAST
    )
    done = anyio.Event()
    busy: set[int] = set()  # the agents with a request in flight

    async def agent(n: int, rounds: int, stops: bool) -> None:
        client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="sk-sim-harness", max_retries=0, timeout=30
        )
        messages: list[Any] = [{"role": "system", "content": "You are a coding agent."}]
        try:
            for rnd in range(1, rounds + 1):
                if rnd > 1:
                    await anyio.sleep(0.5)
                messages.append({"role": "user", "content": f"agent {n} round {rnd}: continue"})
                text: list[str] = []
                busy.add(n)
                with anyio.fail_after(10):
                    answer = await client.chat.completions.create(
                        model="sim-model",
                        messages=messages,
                        max_tokens=30,
                        stream=True,
                        extra_headers={"x-request-id": f"a{n}-r{rnd}"},
                    )
                    async for chunk in answer:
                        text += [c.delta.content for c in chunk.choices if c.delta.content]
                busy.discard(n)
                messages.append({"role": "assistant", "content": "".join(text)})
            lab.note(f"agent a{n}: {rounds} rounds complete")
            if stops:
                lab.found["stopped"] = time.time()
                lab.note(f"agent a{n} stops: it waits on itself, its client left open")
                await done.wait()
        finally:
            with anyio.CancelScope(shield=True):
                await client.close()

    async def mark() -> None:
        with anyio.fail_after(20):
            while "stopped" not in lab.found:
                await anyio.sleep(0.05)
        await anyio.sleep(lab.found["stopped"] + 4.0 - time.time())
        with anyio.fail_after(5):  # a moment the three others are streaming
            while busy != {1, 2, 3}:
                await anyio.sleep(0.01)
        await anyio.sleep(0.2)
        lab.found["hang_at"] = now = time.time()
        idle = now - lab.found["stopped"]
        lab.note(f"the harness seen hung: agent a4 idle {idle:.1f} s, a1-a3 streaming")

    async with anyio.create_task_group() as outer:
        outer.start_soon(agent, 4, 2, True)
        async with anyio.create_task_group() as tg:
            for n in (1, 2, 3):
                tg.start_soon(agent, n, 8, False)
            tg.start_soon(mark)
        done.set()
    await anyio.sleep(0.5)


def agents_marks(lab: Lab, folder: Path) -> dict[str, Any]:
    """agents_one_stops: the hang mark (from the capture's start, as ``--hang-at +S``
    takes it) and the connection of the agent that stopped, read from its capture."""
    from tracer.analysis.summary import Summary
    from tracer.capture.files import read_into

    with Summary() as summary:
        read_into(folder / "tap.jsonl", summary.feed)
        origin = summary.first_t
    assert origin is not None
    conns = set()
    for line in (folder / "tap.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "request" and str(rec.get("request_id")).startswith("a4-"):
            conns.add(f"{rec['tap']}/{rec['conn']}")
    (conn,) = conns  # its two rounds on one keep-alive connection
    mark = lab.found["hang_at"]
    lab.notes.append(
        f"agent a4's connection: {conn}; hang mark +{mark - origin:.2f} s from the capture's "
        f"start (epoch {mark:.3f})"
    )
    return {
        "hang_at": [f"+{mark - origin:.2f}"],
        "hang_at_epoch": [round(mark, 3)],
        "idle_connections": [conn],
    }


async def hop_withholds_end(lab: Lab) -> None:
    """tap front -> a hop that relays every SSE event and data: [DONE] but never the
    chunked body's terminating chunk (a tracer proxy without a capture, fault
    stall-after-events:K:inf for requests marked held-*, K every event of the answer,
    [DONE] included) -> tap back -> engine: two healthy streams on one keep-alive
    connection, then two held ones at once, the 3rd on that connection and one on a
    fresh connection; the clients (httpx) give up on them after 4 s."""
    engine = await lab.engine("--ttft", "0.05", "--itl", "0.02")
    tokens, events = 20, 0
    async with httpx.AsyncClient(timeout=10) as client:  # the answer's events, counted
        body = {**CHAT, "max_tokens": tokens}
        async with client.stream("POST", engine + "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                events += line.startswith("data:")
    lab.note(
        f"an answer of {tokens} tokens is {events} SSE events, data: [DONE] included "
        "(counted once straight from the engine, before the taps)"
    )
    back = await lab.tap("back", engine, "--engine-metrics", f"{engine}/metrics", *FAST)
    fault = f"stall-after-events:{events}:inf@header=x-request-id:held-*"
    argv = [*TRACER, "proxy", "--listen", "127.0.0.1:0", "--upstream", back, "--tap", "hop"]
    hop = await lab.start("hop", [*argv, "--fault", fault])
    lab.note(f"hop {hop} -> {back}: tracer proxy without a capture, --fault {fault}")
    front = await lab.tap("front", hop, "--engine-metrics", f"{engine}/metrics", *FAST)

    async def send(
        client: httpx.AsyncClient, rid: str, give_up: float | None = None, on: str = ""
    ) -> None:
        headers = {"x-request-id": rid}
        got = await stream(client, front, max_tokens=tokens, headers=headers, timeout=give_up)
        lab.note(describe(f"httpx {rid} ({tokens} tokens{on}) at the client", got))

    async with httpx.AsyncClient(timeout=30) as reused, httpx.AsyncClient(timeout=30) as fresh:
        for rid in ("ok-1", "ok-2"):
            await send(reused, rid)
        async with anyio.create_task_group() as tg:
            tg.start_soon(send, reused, "held-1", 4.0, ", 3rd on its connection")
            tg.start_soon(send, fresh, "held-2", 4.0, ", a fresh connection")
    await anyio.sleep(0.5)


PROXY_KINDS = ["proxy_*"]
STALLS = ["engine_stall", "engine_stall_mid_stream"]


@dataclass
class Case:
    run: Callable[[Lab], Awaitable[None]]
    verdict: dict[str, Any]  # {party, kind (a name or a list of names)[, confidence]}
    forbidden: list[str] = field(default_factory=list)  # kinds (fnmatch) that must not appear
    required: list[dict[str, Any]] = field(default_factory=list)  # {party, kind[, note]}
    no_faults: bool = False  # no finding other than notes
    limit: float = 90.0
    more: dict[str, Any] = field(default_factory=dict)  # more keys for expect.json
    # what more keys the finished captures give (their folder): e.g. hang_at
    after: Callable[[Lab, Path], dict[str, Any]] | None = None
    of: str | None = None  # a variant: written from that case's recording (``taps``)
    taps: list[str] | None = None  # a variant's captures (default: every tap's)
    about: str = ""  # a variant: what it adds to its case's description


CASES: dict[str, Case] = {
    "busy_at_capacity": Case(
        busy_at_capacity,
        {"party": "none", "kind": "healthy"},
        forbidden=[*STALLS, *PROXY_KINDS, "engine_lost_request", "upstream_silent"],
        required=[{"party": "engine", "kind": "engine_queueing", "note": True}],
        no_faults=True,
    ),
    "wedged_engine": Case(
        wedged_engine,
        {"party": "engine", "kind": STALLS},
        forbidden=[*PROXY_KINDS, "engine_lost_request", "client_*"],
    ),
    "lost_at_engine": Case(
        lost_at_engine,
        {"party": "engine", "kind": "engine_lost_request"},
        forbidden=[*PROXY_KINDS, *STALLS],
    ),
    "lost_behind_router_metrics": Case(
        lost_behind_router_metrics,
        {"party": "engine", "kind": "engine_lost_request"},
        forbidden=[*PROXY_KINDS],
    ),
    "lost_behind_router_engine_only": Case(
        lost_behind_router_engine_only,
        {"party": "engine", "kind": "engine_lost_request"},
        forbidden=[*PROXY_KINDS],
    ),
    "nginx_buffered_http10": Case(
        nginx_buffered_http10,
        {"party": "proxy", "kind": "buffered_response", "confidence": "high"},
        forbidden=[*STALLS, "engine_*"],
    ),
    "nginx_buffered_http10_bigbuf": Case(
        nginx_buffered_http10_bigbuf,
        {"party": "proxy", "kind": "buffered_response", "confidence": "high"},
        forbidden=[*STALLS, "engine_*"],
    ),
    "nginx_gzip_sse": Case(
        nginx_gzip_sse,
        # (the whole response, head included, comes at the end, gzipped: the front tap
        # sees no events in it; held or buffered, it is the hop's)
        {
            "party": "proxy",
            "kind": ["buffered_response", "proxy_held_stream"],
            "confidence": "high",
        },
        forbidden=[*STALLS, "engine_*"],
    ),
    "haproxy_front": Case(
        haproxy_front,
        {"party": "proxy", "kind": "proxy_error_status"},
        forbidden=["engine_error_status", "client_*"],
    ),
    "haproxy_healthy": Case(
        haproxy_healthy,
        {"party": "none", "kind": "healthy"},
        no_faults=True,
    ),
    "starved_demo": Case(
        starved_demo,
        {"party": "proxy", "kind": "proxy_hung_on_reuse"},
        forbidden=["engine_*", "client_*"],
        limit=330.0,
    ),
    "healthy_control": Case(
        healthy_control,
        {"party": "none", "kind": "healthy"},
        no_faults=True,
    ),
    "nginx_read_timeout_nonstream": Case(
        nginx_read_timeout_nonstream,
        # (nginx's own 504 over an engine that was decoding the answer the whole time)
        {"party": "proxy", "kind": "proxy_error_status"},
        forbidden=["upstream_silent", "engine_*", "client_*"],
    ),
    "hop_swallows_large_bodies": Case(
        hop_swallows_large_bodies,
        # (reuse does not separate the held requests from the answered ones: body size does)
        {"party": "proxy", "kind": "proxy_swallowed_request"},
        forbidden=["proxy_hung_on_reuse", "engine_*", "client_*"],
        more={"separating": ["request_bytes"]},
    ),
    "hop_swallows_large_bodies_front_only": Case(
        hop_swallows_large_bodies,
        # (the front tap alone has no engine figures and no tap behind the hop: it sees
        # the large bodies unanswered while small ones are answered, on fresh and reused
        # connections alike, but not whether the hop or the serving stack held them)
        {"party": "unknown", "kind": "upstream_silent"},
        forbidden=["proxy_hung_on_reuse", "engine_*", "client_*"],
        more={"separating": ["request_bytes"]},
        of="hop_swallows_large_bodies",
        taps=["front"],
        about="Only the front capture: the engine's metrics are in back's.",
    ),
    "agents_one_stops": Case(
        agents_one_stops,
        {"party": "client", "kind": "client_idle_hang"},
        forbidden=["engine_*", "proxy_*", "upstream_silent"],
        after=agents_marks,
    ),
    "hop_withholds_end": Case(
        hop_withholds_end,
        # (every event and data: [DONE] reached tap front, the body's end did not; tap
        # back saw it end: the hop between them withheld it)
        {"party": "proxy", "kind": "proxy_held_stream"},
        forbidden=[
            "engine_*",
            "client_*",
            "proxy_cut_stream",
            "stream_cut",
            "proxy_hung_on_reuse",
            "proxy_swallowed_request",
        ],
    ),
    "hop_withholds_end_front_only": Case(
        hop_withholds_end,
        # (the front tap alone, with the engine's own figures: every event and [DONE]
        # reached it, then nothing while the hop after it held the body's end — what it
        # says must be what its figures say, never "none reached the tap")
        {"party": "proxy", "kind": "proxy_held_stream"},
        forbidden=["engine_*", "client_*", "proxy_hung_on_reuse", "proxy_swallowed_request"],
        of="hop_withholds_end",
        taps=["front"],
        about="Only the front capture, which scraped the engine's metrics too.",
    ),
}


async def record(name: str, scratch: Path, cases: dict[str, Case] | None = None) -> None:
    """Record case ``name`` of ``cases`` (default ``CASES``), then write its directory
    and its variants' (``Case.of``)."""
    cases = CASES if cases is None else cases
    case = cases[name]
    work = scratch / name
    work.mkdir(parents=True)
    print(f"{name}: {case.run.__doc__.split(chr(10))[0] if case.run.__doc__ else ''}", flush=True)
    async with AsyncExitStack() as stack:
        lab = Lab(work=work, stack=stack)
        with anyio.fail_after(case.limit):
            await case.run(lab)
    # (every process has stopped: the captures are complete)
    for out in [name, *(n for n, c in cases.items() if c.of == name)]:
        write(cases[out], out, lab, scratch)


def write(case: Case, name: str, lab: Lab, scratch: Path) -> None:
    """Case ``name``'s directory: its captures and expect.json, from ``lab``'s recording."""
    target = DATA / name
    staged = scratch / f"{name}.out"
    staged.mkdir()
    taps = [t for t in lab.captures if case.taps is None or t in case.taps]
    for tap in taps:
        shutil.copyfile(lab.captures[tap], staged / f"{tap}.jsonl")
    found = case.after(lab, staged) if case.after else {}
    about = " ".join(f"{case.run.__doc__ or ''} {case.about}".split())
    expect = {
        "case": name,
        "about": about,
        "captures": sorted(f"{tap}.jsonl" for tap in taps),
        "verdict": case.verdict,
        "forbidden": case.forbidden,
        "required": case.required,
        "no_faults": case.no_faults,
        "recorded": lab.notes,
        **case.more,
        **found,
    }
    (staged / "expect.json").write_text(json.dumps(expect, indent=2) + "\n")
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(staged), target)
    sizes = ", ".join(f"{p.name} {p.stat().st_size // 1024} KiB" for p in sorted(target.iterdir()))
    print(f"  -> {target.relative_to(ROOT)}: {sizes}", flush=True)


def main(
    argv: list[str] | None = None,
    *,
    cases: dict[str, Case] | None = None,
    prog: str = "python -m tests.scenarios.record",
    doc: str | None = __doc__,
) -> int:
    """The recorder's command line, over ``cases`` (default ``CASES``: the modules of
    more cases call it with theirs)."""
    cases = CASES if cases is None else cases
    parser = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="cases to record (default all)")
    parser.add_argument("--list", action="store_true", help="list the cases")
    parser.add_argument("--keep", action="store_true", help="keep logs and configs")
    args = parser.parse_args(argv)
    if args.list:
        for name, case in cases.items():
            line = (case.run.__doc__ or "").split(chr(10))[0]
            print(f"{name:32} {f'(from {case.of}) {case.about}' if case.of else line}")
        return 0
    unknown = [n for n in args.names if n not in cases]
    if unknown:
        parser.error(f"unknown case(s): {', '.join(unknown)} (see --list)")
    # a variant is written when its case is recorded
    names = list(dict.fromkeys(cases[n].of or n for n in args.names or list(cases)))
    scratch = Path(tempfile.mkdtemp(prefix="tracer-scenarios-"))
    failed: list[str] = []
    try:
        for name in names:
            try:
                anyio.run(record, name, scratch, cases)
            except Exception as exc:  # one case failing does not stop the others
                failed.append(name)
                print(f"  FAILED {name}: {type(exc).__name__}: {exc}", flush=True)
    finally:
        if args.keep:
            print(f"logs and configs: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
