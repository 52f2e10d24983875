"""Closed-loop load generator on raw asyncio Protocols that times every SSE event.

``concurrency`` keep-alive connections, one request in flight on each: the next request
is written the moment the previous response ends. Responses are parsed incrementally
(Content-Length or chunked); an SSE event is counted when its closing blank line
(``\\n\\n``) arrives, and stamped with the time of the read that brought it. Several events
in one read get the same stamp: a zero gap, which is how coalescing on the path shows.

A run has a warm-up (traffic, nothing recorded), then a measurement window. Throughput
counts what arrives inside the window; latency, time to first event and gaps come from
every request that started inside it (slow ones too: no survivor bias). At the end of the
window no new requests are started; the ones in flight are drained (bounded, counted as
``undrained`` if cut) and the connections closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

perf = time.perf_counter

ZERO_GAP = 100e-6
"""A gap shorter than this counts as zero: the events arrived in the same read or burst."""


AGENT_BODY_BYTES = 64 * 1024
"""The request body of ``agent`` mode: an agent harness's context (tool output and earlier
turns; 64 KiB is about 16k tokens), where the other modes send a one-line question."""


TURN_MARK = b"turn 00000000"
"""In the last message of ``agent_body``: the load generator writes its request count in
the digits, so that no two requests are the same (as an agent's turns are not)."""


def agent_body(size: int = AGENT_BODY_BYTES) -> bytes:
    """A streaming OpenAI chat request of about ``size`` bytes: a system prompt, then user
    turns (tool output) and assistant turns in alternation, as an agent's context grows,
    and a last question marked with ``TURN_MARK``."""
    turn = ("Tool output: 12 files changed, 340 insertions(+), 51 deletions(-). " * 48)[:3000]
    messages = [{"role": "system", "content": "You are a coding agent."}]
    while len(messages) * 3040 < size:  # a turn is its 3000 characters and ~40 of JSON
        role = "assistant" if len(messages) % 2 == 0 else "user"
        messages.append({"role": role, "content": turn})
    messages.append({"role": "user", "content": f"{TURN_MARK.decode()}: what next?"})
    doc = {"model": "bench", "messages": messages, "max_tokens": 64, "stream": True}
    return json.dumps(doc, separators=(",", ":")).encode()


class Turns:
    """The requests of a run: the same bytes every time, except an agent's (with
    ``TURN_MARK``), which carry the count of requests sent so far in its digits."""

    __slots__ = ("at", "request", "sent")

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.sent = 0
        mark = request.rfind(TURN_MARK)
        self.at = mark + len(TURN_MARK) - 8 if mark >= 0 else -1  # where the digits are

    def next(self) -> bytes:
        if self.at < 0:
            return self.request
        self.sent += 1
        at, req = self.at, self.request
        return b"%b%08d%b" % (req[:at], self.sent % 100_000_000, req[at + 8 :])


def request_bytes(mode: str, port: int) -> bytes:
    """One request of ``mode``: ``plain`` (JSON answer), ``stream`` or ``paced`` (SSE), or
    ``agent`` (``stream`` with an agent-sized body)."""
    stream = "false" if mode == "plain" else "true"
    path = "stream" if mode == "agent" else mode
    if mode == "agent":
        body = agent_body()
    else:
        body = (
            '{"model":"bench","messages":[{"role":"user","content":"Say hello."}],'
            f'"max_tokens":64,"stream":{stream}}}'
        ).encode()
    return (
        f"POST /{path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"accept: {'text/event-stream' if stream == 'true' else 'application/json'}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


@dataclass
class LoadResult:
    mode: str
    concurrency: int
    window: float
    completed: int = 0  # responses that ended inside the window
    events: int = 0  # SSE events that arrived inside the window
    errors: int = 0
    latency: list[float] = field(default_factory=list)  # request start -> response end
    ttfb: list[float] = field(default_factory=list)  # request start -> response head
    ttfe: list[float] = field(default_factory=list)  # request start -> first SSE event
    gaps: list[float] = field(default_factory=list)  # between consecutive events of a stream
    bad_events: int = 0  # streams whose event count was not the expected one
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds in the window, by role
    drain: float = 0.0  # seconds to finish the requests in flight after the window
    undrained: int = 0  # requests still in flight when the drain timed out


_HEAD, _CL, _SIZE, _DATA, _CRLF, _TRAILER = range(6)


class _Gen:
    """Shared state of one run."""

    def __init__(self, request: bytes, port: int, expect_events: int) -> None:
        self.turns = Turns(request)
        self.port = port
        self.expect_events = expect_events
        self.recording = False
        self.running = True
        self.completed = 0
        self.events = 0
        self.errors = 0
        self.bad_events = 0
        self.latency: list[float] = []
        self.ttfb: list[float] = []
        self.ttfe: list[float] = []
        self.gaps: list[float] = []
        self.conns: set[_Conn] = set()
        self.busy = 0
        self.drained: asyncio.Future[None] | None = None
        self.reconnects: set[asyncio.Task[Any]] = set()

    def idle(self, conn: _Conn) -> None:
        self.busy -= 1
        if self.busy <= 0 and self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def reconnect(self) -> None:
        if not self.running or self.errors > 1000:
            return
        task = asyncio.get_running_loop().create_task(self._reconnect())
        self.reconnects.add(task)
        task.add_done_callback(self.reconnects.discard)

    async def _reconnect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Conn(self), "127.0.0.1", self.port)
        except OSError:
            self.errors += 1
            await asyncio.sleep(0.05)
            self.reconnect()
            return
        if self.running:
            self.busy += 1
            conn.start()


class _Conn(asyncio.Protocol):
    __slots__ = (
        "buf",
        "close_after",
        "first",
        "gaps",
        "gen",
        "in_flight",
        "last",
        "n_events",
        "need",
        "nl",
        "rec",
        "state",
        "t_head",
        "t_start",
        "tr",
    )

    def __init__(self, gen: _Gen) -> None:
        self.gen = gen
        self.tr: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = _HEAD
        self.need = 0
        self.nl = False  # the previous body byte was b"\n"
        self.in_flight = False
        self.close_after = False
        self.rec = False
        self.t_start = 0.0
        self.t_head = 0.0
        self.first: float | None = None
        self.last = 0.0
        self.n_events = 0
        self.gaps: list[float] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.tr = transport
        self.gen.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        gen = self.gen
        gen.conns.discard(self)
        self.tr = None
        if self.in_flight:
            self.in_flight = False
            gen.errors += 1
            gen.idle(self)
            gen.reconnect()
        elif self.close_after:
            gen.idle(self)
            gen.reconnect()

    def start(self) -> None:
        self.in_flight = True
        self.state = _HEAD
        self.first = None
        self.n_events = 0
        self.nl = False
        self.close_after = False
        self.rec = self.gen.recording
        self.gaps = []
        self.t_start = perf()
        assert self.tr is not None
        self.tr.write(self.gen.turns.next())

    def _events(self, piece: bytes | bytearray, now: float) -> None:
        n = piece.count(b"\n\n")
        if self.nl and piece[:1] == b"\n":
            n += 1
        self.nl = piece[-1:] == b"\n"
        if not n:
            return
        gen = self.gen
        if gen.recording:
            gen.events += n
        self.n_events += n
        if self.first is None:
            self.first = now
            n -= 1
        else:
            self.gaps.append(now - self.last)
            n -= 1
        if n:
            self.gaps.extend([0.0] * n)
        self.last = now

    def data_received(self, data: bytes) -> None:
        now = perf()
        buf = self.buf
        buf += data
        while buf:
            state = self.state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buf[:end]).lower()
                del buf[: end + 4]
                self.t_head = now
                if head[9:12] != b"200":
                    self.gen.errors += 1
                    self.close_after = True
                if b"\r\nconnection: close" in head:
                    self.close_after = True
                if b"\r\ntransfer-encoding: chunked" in head:
                    self.state = _SIZE
                else:
                    m = re.search(rb"\r\ncontent-length:\s*(\d+)", head)
                    self.need = int(m.group(1)) if m else 0
                    self.state = _CL
                    if not self.need:
                        self._finish(now)
            elif state == _CL:
                if len(buf) < self.need:
                    self.need -= len(buf)
                    buf.clear()
                    return
                del buf[: self.need]
                self._finish(now)
            elif state == _SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
                del buf[: end + 2]
                if size:
                    self.need = size
                    self.state = _DATA
                else:
                    self.state = _TRAILER
            elif state == _DATA:
                take = self.need
                if len(buf) <= take:
                    self._events(buf, now)
                    self.need -= len(buf)
                    buf.clear()
                    if not self.need:
                        self.state = _CRLF
                    return
                self._events(buf[:take], now)
                del buf[:take]
                self.state = _CRLF
            elif state == _CRLF:
                if len(buf) < 2:
                    return
                del buf[:2]
                self.state = _SIZE
            else:  # _TRAILER
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:
                    self._finish(now)

    def _finish(self, now: float) -> None:
        gen = self.gen
        self.in_flight = False
        self.state = _HEAD
        if gen.recording:
            gen.completed += 1
        if self.rec:
            gen.latency.append(now - self.t_start)
            gen.ttfb.append(self.t_head - self.t_start)
            if self.first is not None:
                gen.ttfe.append(self.first - self.t_start)
                gen.gaps.extend(self.gaps)
            if gen.expect_events and self.n_events != gen.expect_events:
                gen.bad_events += 1
        if self.close_after:
            if self.tr is not None:
                self.tr.close()
            return
        if gen.running and self.tr is not None:
            self.start()
        else:
            gen.idle(self)


async def _connect_all(gen: _Gen, port: int, n: int, batch: int = 64) -> list[_Conn]:
    loop = asyncio.get_running_loop()
    conns: list[_Conn] = []
    for i in range(0, n, batch):
        pairs = await asyncio.wait_for(
            asyncio.gather(
                *[
                    loop.create_connection(lambda: _Conn(gen), "127.0.0.1", port)
                    for _ in range(min(batch, n - i))
                ]
            ),
            timeout=15,
        )
        conns += [c for _, c in pairs]
    return conns


async def run_load(
    port: int,
    mode: str,
    concurrency: int,
    *,
    warmup: float,
    duration: float,
    expect_events: int,
    probes: dict[str, Probe],
    drain_timeout: float = 5.0,
) -> LoadResult:
    """One closed-loop run; ``probes`` give CPU seconds by role, read at the window's edges."""
    gen = _Gen(request_bytes(mode, port), port, expect_events if mode != "plain" else 0)
    conns = await _connect_all(gen, port, concurrency)
    try:
        gen.busy = len(conns)
        for c in conns:
            c.start()
        await asyncio.sleep(warmup)
        before = {k: f() for k, f in probes.items()}
        t0 = perf()
        gen.recording = True
        await asyncio.sleep(duration)
        gen.recording = False
        window = perf() - t0
        after = {k: f() for k, f in probes.items()}
        gen.running = False
        t_end = perf()
        if gen.busy > 0:
            gen.drained = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gen.drained, drain_timeout)
        drain, undrained = perf() - t_end, max(0, gen.busy)
    finally:
        gen.running = False
        for task in list(gen.reconnects):
            task.cancel()
        for c in list(gen.conns):
            if c.tr is not None:
                c.tr.close()
        await asyncio.sleep(0.05)
    return LoadResult(
        mode=mode,
        concurrency=concurrency,
        window=window,
        completed=gen.completed,
        events=gen.events,
        errors=gen.errors,
        latency=gen.latency,
        ttfb=gen.ttfb,
        ttfe=gen.ttfe,
        gaps=gen.gaps,
        bad_events=gen.bad_events,
        cpu={k: _delta(before[k], after[k]) for k in probes},
        drain=drain,
        undrained=undrained,
    )


Probe = Callable[[], "float | dict[int, float]"]
"""CPU seconds now: one number, or per PID (then only PIDs seen at both edges count)."""


def _delta(before: float | dict[int, float], after: float | dict[int, float]) -> float:
    if isinstance(before, dict) and isinstance(after, dict):
        return sum(max(0.0, after[p] - v) for p, v in before.items() if p in after)
    assert isinstance(before, float | int) and isinstance(after, float | int)
    return after - before


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


# ---- idle connections ------------------------------------------------------------------


class IdleConns:
    """``n`` keep-alive connections, each after one plain request, left open and idle.

    They are opened ``batch`` at a time (connect all, then one request on each): the
    latency of that first request includes the proxy's accept and its upstream connect.
    """

    def __init__(self) -> None:
        self.gen = _Gen(b"", 0, 0)
        self.opened = 0

    async def open(self, port: int, n: int, batch: int = 50) -> int:
        gen = self.gen
        gen.turns = Turns(request_bytes("plain", port))
        gen.port = port
        gen.running = False  # one request each, no reconnects
        loop = asyncio.get_running_loop()
        gen.recording = True  # each conn's latency: connect of its batch -> response
        for i in range(0, n, batch):
            t0 = perf()
            part = await _connect_all(gen, port, min(batch, n - i), batch=batch)
            gen.busy = len(part)
            gen.drained = loop.create_future()
            first = len(gen.latency)
            for c in part:
                c.start()
            await asyncio.wait_for(gen.drained, 15)
            for j in range(first, len(gen.latency)):
                gen.latency[j] += part[0].t_start - t0
            self.opened += len(part)
        gen.recording = False
        return gen.errors

    @property
    def first_request(self) -> list[float]:
        """Per connection: from the start of connecting its batch to the end of its response."""
        return self.gen.latency

    def close(self) -> None:
        for c in list(self.gen.conns):
            if c.tr is not None:
                c.tr.close()


# ---- wrk ---------------------------------------------------------------------------------

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def _seconds(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_wrk(out: str) -> dict[str, Any]:
    res: dict[str, Any] = {"latency": {}, "errors": 0}
    for line in out.splitlines():
        s = line.strip()
        m = re.match(r"(50|75|90|99)%\s+(\S+)", s)
        if m:
            res["latency"][f"p{m.group(1)}"] = _seconds(m.group(2))
        elif s.startswith("Requests/sec:"):
            res["rps"] = float(s.split()[1])
        elif s.startswith("Non-2xx or 3xx responses:"):
            res["errors"] += int(s.split()[-1])
        elif s.startswith("Socket errors:"):
            res["errors"] += sum(int(x) for x in re.findall(r"\d+", s))
        elif re.match(r"\d+ requests in", s):
            res["requests"] = int(s.split()[0])
    return res


async def run_wrk(
    port: int,
    concurrency: int,
    *,
    warmup: float,
    duration: float,
    probes: dict[str, Probe],
    core: int,
) -> dict[str, Any]:
    """``wrk -t1 -cN --latency`` on /plain pinned to ``core``; CPU read around the run."""
    url = f"http://127.0.0.1:{port}/plain"

    def argv(d: float) -> list[str]:
        return [
            "taskset",
            "-c",
            str(core),
            "wrk",
            "-t1",
            f"-c{concurrency}",
            f"-d{max(1, round(d))}s",
            "--latency",
            "--timeout",
            "5s",
            url,
        ]

    if warmup > 0:
        proc = await asyncio.create_subprocess_exec(
            *argv(warmup), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        await asyncio.wait_for(proc.wait(), warmup + 15)
    before = {k: f() for k, f in probes.items()}
    t0 = perf()
    proc = await asyncio.create_subprocess_exec(
        *argv(duration), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), duration + 20)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    window = perf() - t0
    after = {k: f() for k, f in probes.items()}
    res = parse_wrk(out.decode(errors="replace"))
    res["window"] = window
    res["cpu"] = {k: _delta(before[k], after[k]) for k in probes}
    res["raw"] = out.decode(errors="replace")
    return res
