"""``tracer replay CAPTURE --target URL``: a captured session sent again, as an experiment.

By default every captured connection becomes one replay connection opened at the same
offset from the start, carrying its requests in the same order, each sent after the
same idle gap following the previous response (so keep-alive reuse happens exactly as
captured), and each response read no faster than the original client read it.
``--connections fresh`` sends every request on a connection of its own instead: the
differential test (a hang that follows reuse goes away). The replay runs its own tap
in-process (the target is its upstream), so the replay is a capture like any other and
``tracer analyze`` works on it; then it prints the original and the replay side by
side, request by request, and a verdict: reproduced or where the runs diverged.

The client is raw HTTP/1.1 over anyio sockets with h11: no pool, so the connection
structure is exactly the one planned. Bodies are sent as captured (``--bodies
requests`` on the tap, its default); headers as captured, except ``Host`` (set to the
target) and values the capture redacted (dropped, and listed; ``--header`` sets them).
Nothing cuts a stream that is flowing unless asked: ``--stall-timeout`` counts only
silence from the target, ``--timeout`` (total) is off by default.
"""

from __future__ import annotations

import argparse
import itertools
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import h11
from anyio.abc import SocketAttribute, SocketStream

from .. import events as ev
from ..arguments import http_url, positive_float
from ..capture.files import CaptureWriter
from ..errors import start_error
from ..protocol.addresses import parse_upstream
from ..proxy.relay import Tap, TapConfig
from ..redact import REDACTED
from ..wording import counted
from .replay_compare import (
    ONLY_HELP,
    Capture,
    CapturedRequest,
    Selection,
    Sent,
    compare,
    load,
    parse_only,
    to_json,
    to_text,
)

EXIT_INPUT = 3
READ_SIZE = 65536
PACE_SLACK = 256  # bytes a paced read may take beyond the original's (chunk framing)
DEFAULT_STALL_TIMEOUT = 30.0
SETTLE = 2.0  # at most this long for the tap to record the last closes


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("capture", metavar="CAPTURE", help="a capture of `tracer proxy`")
    parser.add_argument(
        "--target",
        required=True,
        type=http_url,
        metavar="URL",
        help="http://HOST:PORT to send the requests to",
    )
    parser.add_argument(
        "--connections",
        choices=["original", "fresh"],
        default="original",
        help="original: the captured connections and reuse (default); fresh: every "
        "request on a new connection",
    )
    parser.add_argument(
        "--speed",
        type=positive_float,
        default=1.0,
        metavar="X",
        help="time runs X times faster: offsets, idle gaps and read pacing divided by X",
    )
    parser.add_argument("--only", action="append", default=[], metavar="KEY=VALUE", help=ONLY_HELP)
    parser.add_argument(
        "--stall-timeout",
        type=positive_float,
        default=DEFAULT_STALL_TIMEOUT,
        metavar="SECONDS",
        help="give up on a request after this long with no byte from the target; it is "
        f"reported hung (default {DEFAULT_STALL_TIMEOUT:g})",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="give up on a request this long after it was sent, even while it streams; "
        "reported hung (default: none)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="give up connecting to the target after this long",
    )
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="set this header on every request (repeatable), e.g. the Authorization the "
        "capture redacted",
    )
    parser.add_argument(
        "--capture",
        dest="out",
        metavar="FILE",
        help="write the replay's capture here (default: replay-YYYYmmdd-HHMMSS.jsonl in "
        "the current directory); an existing file is refused",
    )
    parser.add_argument("--tap", default="replay", metavar="NAME", help="the replay tap's name")
    parser.add_argument(
        "--bodies",
        choices=["none", "requests", "all"],
        default="requests",
        help="bodies kept in the replay's capture (default: requests)",
    )
    parser.add_argument(
        "--format", choices=["text", "json"], default="text", help="text for people, or json"
    )
    parser.add_argument(
        "--engine-metrics",
        action="append",
        default=[],
        metavar="URL",
        type=http_url,
        help="an engine's or the router's Prometheus /metrics URL (repeatable), scraped "
        "into the replay's capture",
    )
    parser.add_argument(
        "--metrics-interval",
        type=positive_float,
        default=1.0,
        metavar="SECONDS",
        help="how often the metrics and health URLs are read",
    )
    parser.add_argument(
        "--metrics-timeout",
        type=positive_float,
        default=2.0,
        metavar="SECONDS",
        help="a scrape slower than this is recorded as failed",
    )
    parser.add_argument(
        "--health",
        action="append",
        default=[],
        type=http_url,
        metavar="URL",
        help="a health URL to poll",
    )
    parser.add_argument(
        "--engine-profile",
        choices=["sglang", "vllm", "llamacpp", "smg", "sgl_router"],
        help="metric names to expect (default: detected)",
    )


EPILOG = """\
examples:
  tracer replay front.jsonl --target http://127.0.0.1:8000
  tracer replay front.jsonl --target http://127.0.0.1:8000 --connections fresh --stall-timeout 10
  tracer replay front.jsonl --target http://router:8000 --only conn=3 --only req=5:1-3 --format json

Outcomes per request: complete, error, truncated, hung, aborted, in_flight, unparsed,
not_sent. The verdict is "reproduced" when every replayed request ended as in the
original, else "not reproduced" with the first request whose outcome differs.
--stall-timeout defaults to 30 s: longer than the silences of a healthy stack (a long
prefill under load, the tap's own 5 s stall threshold), far shorter than the minutes a
harness sits on a hung connection. Raise it for targets slower than that to first byte.
Exit status: 0 whatever the verdict; 2 bad options; 3 a capture that cannot be replayed
(unreadable, or without the bodies of the selected requests).
"""


# ---- the plan -------------------------------------------------------------------------


@dataclass
class Job:
    """One captured connection's replay: when it opens and what it carries."""

    conn: int
    start: float  # original seconds after the first job's start
    requests: list[CapturedRequest]
    gaps: list[float]  # original seconds before each request (see ``plan``)
    offsets: list[float]  # original seconds from the first job's start to each request
    aborts: list[float | None]  # close this long after sending, as the original client did
    hold: float = 0.0  # a connection without requests: how long it stayed open


def plan(capture: Capture, selection: Selection, *, fresh: bool) -> list[Job]:
    """The replay's schedule, in original seconds.

    A connection whose first selected request is its first opens when the original
    opened and sends after the original's ``idle_before``; otherwise it opens when that
    request was sent. Each later request goes after its ``idle_before`` from the end of
    the previous response (when requests in between are left out: after the original
    time from the previous selected response's end to its head), and never before its
    original offset. A request the original client closed while bytes still flowed is
    closed at the same time after sending.
    """
    jobs: list[Job] = []
    for conn in sorted(capture.conns.values(), key=lambda c: c.open_m):
        chosen = [r for r in conn.requests if selection.selects(r)]
        if not chosen:
            wanted = selection.everything or conn.conn in selection.conns
            if conn.requests or not wanted or fresh:
                continue
            close = conn.close_m if conn.close_m is not None else capture.end_m
            hold = max(0.0, close - conn.open_m)
            jobs.append(Job(conn.conn, conn.open_m, [], [], [], [], hold=hold))
            continue
        first = chosen[0]
        start = conn.open_m if first.seq == 1 else first.head_m
        gaps = [first.idle_before if first.seq == 1 else 0.0]
        for prev, req in itertools.pairwise(chosen):
            if req.seq == prev.seq + 1:
                gaps.append(req.idle_before)
            else:
                gaps.append(max(0.0, req.head_m - (prev.end_m or prev.head_m)))
        aborts = [
            r.end_m - r.head_m if r.end_m is not None and capture.outcome(r) == "aborted" else None
            for r in chosen
        ]
        jobs.append(Job(conn.conn, start, chosen, gaps, [r.head_m for r in chosen], aborts))
    if jobs:
        t0 = min(j.start for j in jobs)
        for job in jobs:
            job.start -= t0
            job.offsets = [at - t0 for at in job.offsets]
    return jobs


def missing_bodies(jobs: list[Job]) -> list[CapturedRequest]:
    return [r for j in jobs for r in j.requests if r.body is None]


# ---- the client -----------------------------------------------------------------------


@dataclass
class Options:
    host: str  # the replay tap
    port: int
    target_host: str  # for the Host header
    speed: float = 1.0
    fresh: bool = False
    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    timeout: float | None = None
    connect_timeout: float = 10.0
    headers: list[tuple[str, str]] = field(default_factory=list)


class _Conn:
    """One replay connection: a socket and its h11 client state."""

    def __init__(self, stream: SocketStream, peer: str) -> None:
        self.stream = stream
        self.peer = peer
        self.h11 = h11.Connection(h11.CLIENT)
        self.sent = 0
        self.gone: str | None = None  # why it cannot carry another request

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


class TapClock:
    """When the in-process replay tap saw each connection open, each request head and
    each response end, by client address (its monotonic clock is this process's), and
    how long a request head takes from this client to the tap (``lag``)."""

    MAX_LAG = 0.05  # an outlier on a loaded machine is not a lag to plan with

    def __init__(self) -> None:
        self._conn: dict[str, int] = {}
        self._opened: dict[int, float] = {}
        self._heads: dict[tuple[int, int], float] = {}
        self._ends: dict[tuple[int, int], float] = {}
        self.lag = 0.0

    def __call__(self, event: ev.Event) -> None:
        match event:
            case ev.ConnOpen():
                self._conn[event.peer] = event.conn
                self._opened[event.conn] = event.m
            case ev.RequestHead():
                self._heads[(event.conn, event.seq)] = event.m
            case ev.ResponseEnd():
                self._ends[(event.conn, event.seq)] = event.m
            case _:
                pass

    def opened(self, peer: str) -> float | None:
        conn = self._conn.get(peer)
        return self._opened.get(conn) if conn is not None else None

    def head(self, peer: str, position: int) -> float | None:
        conn = self._conn.get(peer)
        return self._heads.get((conn, position)) if conn is not None else None

    def ended(self, peer: str, position: int) -> float | None:
        conn = self._conn.get(peer)
        return self._ends.get((conn, position)) if conn is not None else None

    def sent(self, peer: str, position: int, sent_at: float) -> None:
        """Learn the lag from a request the tap has seen."""
        head = self.head(peer, position)
        if head is not None and 0.0 <= head - sent_at <= self.MAX_LAG:
            self.lag = head - sent_at


class Client:
    """Sends the jobs through the replay tap and records what happened to each request."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.sent: dict[str, Sent] = {}
        self.dropped: Counter[str] = Counter()  # redacted header name -> requests
        self.t0 = 0.0
        self._busy = 0
        self.all_done = anyio.Event()  # every job with requests has finished
        self.clock = TapClock()  # a sink of the replay tap

    def at(self, offset: float) -> float:
        return self.t0 + offset / self.opts.speed

    async def run(self, jobs: list[Job], lead: float = 0.05) -> None:
        self.t0 = time.monotonic() + lead
        self._busy = sum(1 for j in jobs if j.requests)
        if not self._busy:
            self.all_done.set()
        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(self._job, job)

    async def _job(self, job: Job) -> None:
        for req in job.requests:
            self.sent[req.key] = Sent()
        try:
            await _sleep_until(self.at(job.start))
            if job.requests:
                await self._requests(job)
            else:
                await self._hold(job)
        finally:
            if job.requests:
                self._busy -= 1
                if self._busy == 0:
                    self.all_done.set()

    async def _hold(self, job: Job) -> None:
        """A connection that carried no request: open it, keep it as long (at most until
        the rest of the replay is done), close it."""
        try:
            conn = await self._connect()
        except OSError:
            return
        with anyio.move_on_after(job.hold / self.opts.speed):
            await self.all_done.wait()
        await conn.close()

    async def _requests(self, job: Job) -> None:
        """The job's requests in order, each its gap after the previous response ended.

        Gaps are kept as the tap measures them (the original's were measured by its
        tap): from the tap's record of the previous response's end (or of the
        connection's open), less the time a request takes from this client to the tap.
        A request is never sent before its original offset either: a target faster than
        the original does not pull the session ahead (the original client could not go
        on before its answer had come), and timer lateness does not add up over rounds.
        """
        opts, clock = self.opts, self.clock
        conn: _Conn | None = None
        gone = ""
        prev_end = 0.0
        try:
            for i, req in enumerate(job.requests):
                sent = self.sent[req.key]
                gap = job.gaps[i] / opts.speed
                if i > 0 and not opts.fresh and conn is None:
                    sent.not_sent = gone
                    continue
                due = self.at(job.offsets[i])  # never before the original's offset
                if i > 0:
                    await _sleep_until(max(prev_end + gap, due) - clock.lag)
                if conn is None:
                    try:
                        conn = await self._connect()
                    except OSError as exc:
                        sent.not_sent = f"cannot connect to the replay tap: {exc}"
                        gone = sent.not_sent
                        continue
                    if i == 0:
                        opened = clock.opened(conn.peer) or time.monotonic()
                        await _sleep_until(max(opened + gap, due) - clock.lag)
                await self._exchange(conn, req, sent, job.aborts[i])
                prev_end = clock.ended(conn.peer, conn.sent) or time.monotonic()
                if conn.gone is not None or opts.fresh:
                    gone = conn.gone or ""
                    await conn.close()
                    conn = None
        finally:
            if conn is not None:
                await conn.close()

    async def _connect(self) -> _Conn:
        opts = self.opts
        with anyio.fail_after(opts.connect_timeout):
            stream = await anyio.connect_tcp(opts.host, opts.port)
        raw = stream.extra(SocketAttribute.raw_socket)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        addr = stream.extra(SocketAttribute.local_address)
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        return _Conn(stream, peer)

    def headers_for(self, req: CapturedRequest) -> list[tuple[str, str]]:
        """The captured headers, Host set to the target, redacted values dropped, and
        ``--header`` values in place of any of the same name."""
        override = {name.lower() for name, _ in self.opts.headers}
        out: list[tuple[str, str]] = []
        has_host = False
        for name, value in req.headers:
            low = name.lower()
            if low in override:
                continue
            if low == "host":
                out.append((name, self.opts.target_host))
                has_host = True
            elif value == REDACTED or value.endswith(" " + REDACTED):
                self.dropped[low] += 1
            else:
                out.append((name, value))
        if not has_host and "host" not in override:
            out.insert(0, ("Host", self.opts.target_host))
        return out + self.opts.headers

    async def _exchange(
        self, conn: _Conn, req: CapturedRequest, sent: Sent, abort: float | None
    ) -> None:
        try:
            head = h11.Request(
                method=req.method,
                target=req.target,
                headers=[
                    (k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers_for(req)
                ],
            )
            data = conn.h11.send(head) or b""
            if req.body:
                data += conn.h11.send(h11.Data(data=req.body)) or b""
            data += conn.h11.send(h11.EndOfMessage()) or b""
        except (h11.LocalProtocolError, UnicodeEncodeError) as exc:
            sent.not_sent = f"h11 cannot send it as captured: {exc}"
            conn.gone = f"{req.key} could not be sent"
            return
        conn.sent += 1
        sent.peer, sent.position = conn.peer, conn.sent
        sent_at = time.monotonic()
        try:
            await conn.stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            sent.detail = f"the connection broke while sending: {exc or type(exc).__name__}"
            conn.gone = f"the connection broke at {req.key}"
            return
        await _Reader(self.opts, conn, req, sent, sent_at, abort).read()
        sent.read_time = time.monotonic() - sent_at
        self.clock.sent(conn.peer, conn.sent, sent_at)


class _Reader:
    """Reads one response: paced like the original, with the stall and total timeouts."""

    def __init__(
        self,
        opts: Options,
        conn: _Conn,
        req: CapturedRequest,
        sent: Sent,
        sent_at: float,
        abort: float | None,
    ) -> None:
        self.opts, self.conn, self.req, self.sent, self.sent_at = opts, conn, req, sent, sent_at
        self.limits: list[tuple[float, str, bool]] = []  # deadline, why, counts as hung
        if opts.timeout is not None:
            self.limits.append(
                (
                    sent_at + opts.timeout,
                    f"not done {opts.timeout:g}s after sending (--timeout)",
                    True,
                )
            )
        if abort is not None:
            self.limits.append(
                (
                    sent_at + abort / opts.speed,
                    f"closed {abort / opts.speed:.3f}s after sending, as the original client did",
                    False,
                )
            )
        self.body = 0
        self.started = False  # the response head came

    async def read(self) -> None:
        conn, sent = self.conn, self.sent
        while True:
            if self.body and not await self._pace():
                return
            try:
                event = conn.h11.next_event()
            except h11.RemoteProtocolError as exc:
                sent.detail = f"the target's response broke off: {exc}"
                conn.gone = f"the target's response to {self.req.key} broke off"
                return
            if event is h11.NEED_DATA:
                if not await self._receive():
                    return
            elif isinstance(event, h11.Response):
                self.started = True
            elif isinstance(event, h11.Data):
                self.body += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._next_cycle()
                return
            elif isinstance(event, h11.ConnectionClosed):
                conn.gone = f"the target closed the connection at {self.req.key}"
                return
            # InformationalResponse: wait for the final one

    def _next_cycle(self) -> None:
        conn = self.conn
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
        else:
            conn.gone = f"the target ended the connection after {self.req.key} (Connection: close)"

    async def _pace(self) -> bool:
        """Go on only once the original client had received as many body bytes (False:
        a limit came first and the replay gave up)."""
        wake = self.sent_at + self.req.time_for(self.body) / self.opts.speed
        if time.monotonic() >= wake:
            return True
        return await self._wait_until(wake)

    async def _receive(self) -> bool:
        """One read, no larger than the original's pace allows now; False when it gave up."""
        opts = self.opts
        max_bytes = READ_SIZE
        if self.started:
            elapsed = (time.monotonic() - self.sent_at) * opts.speed
            allowed = self.req.allowed_bytes(elapsed)
            if allowed is not None:
                max_bytes = max(0, allowed - self.body) + PACE_SLACK
        now = time.monotonic()
        wait = min([opts.stall_timeout, *(d - now for d, _, _ in self.limits)])
        data = b""
        with anyio.move_on_after(max(0.0, wait)) as scope:
            try:
                data = await self.conn.stream.receive(max_bytes)
            except (
                anyio.EndOfStream,
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
                OSError,
            ):
                data = b""
        if scope.cancelled_caught:
            self._give_up(
                f"no byte from the target for {opts.stall_timeout:g}s (--stall-timeout)", True
            )
            return False
        self.conn.h11.receive_data(data)
        return True

    async def _wait_until(self, wake: float) -> bool:
        """Sleep for pacing, unless a limit comes first (then give up)."""
        first = min((d for d, _, _ in self.limits), default=wake)
        if first <= wake:
            await _sleep_until(first)
            return self._check_limits()
        await _sleep_until(wake)
        return True

    def _check_limits(self) -> bool:
        now = time.monotonic()
        for deadline, why, hung in self.limits:
            if now >= deadline:
                self._give_up(why, hung)
                return False
        return True

    def _give_up(self, why: str, hung: bool) -> None:
        now = time.monotonic()
        for deadline, limit_why, limit_hung in self.limits:  # a limit, not silence
            if now >= deadline - 0.001:
                why, hung = limit_why, limit_hung
                break
        if hung:
            self.sent.gave_up = why
        else:
            self.sent.detail = why
        self.conn.gone = f"the replay gave up on {self.req.key}" if hung else why


async def _sleep_until(when: float) -> None:
    delay = when - time.monotonic()
    if delay > 0:
        await anyio.sleep(delay)


# ---- the run --------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    target_host, target_port = parse_upstream(args.target)
    headers = [_header(h) for h in args.header]
    selection = parse_only(args.only)
    out = Path(args.out or time.strftime("replay-%Y%m%d-%H%M%S.jsonl"))
    if out.exists():
        raise ValueError(f"--capture {out} exists; choose another file")
    try:
        original = load(args.capture)
    except OSError as exc:
        print(f"tracer: cannot read {args.capture}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_INPUT
    selection.check(original)
    jobs = plan(original, selection, fresh=args.connections == "fresh")
    if not any(j.requests for j in jobs):
        print(f"tracer: {args.capture} has no requests to replay", file=sys.stderr)
        return EXIT_INPUT
    missing = missing_bodies(jobs)
    if missing:
        print(f"tracer: {_missing_text(args.capture, missing)}", file=sys.stderr)
        return EXIT_INPUT
    try:  # fail fast: a target that refuses is not a replay that "did not reproduce"
        socket.create_connection((target_host, target_port), timeout=args.connect_timeout).close()
    except OSError as exc:
        raise start_error(f"replay target {args.target} cannot be reached", exc) from None

    config = TapConfig(
        listen_host="127.0.0.1",
        listen_port=0,
        upstream_host=target_host,
        upstream_port=target_port,
        name=args.tap,
        stall_after=min(5.0, args.stall_timeout / 2),
        connect_timeout=args.connect_timeout,
        bodies=args.bodies,
    )
    try:
        writer = CaptureWriter(out)
    except FileExistsError:
        raise ValueError(f"capture {out} exists: give another --capture") from None
    except OSError as exc:
        raise ValueError(f"cannot open capture {out}: {exc.strerror or exc}") from exc
    tap = Tap(config, capture=writer)
    header = tap.header(
        engine_metrics=args.engine_metrics,
        replay_of=str(args.capture),
        connections=args.connections,
        speed=args.speed,
        stall_timeout=args.stall_timeout,
        timeout=args.timeout,
        only=args.only,
    )
    header.kind = "replay"
    writer.write(header)
    opts = Options(
        host="127.0.0.1",
        port=0,
        target_host=f"{target_host}:{target_port}",
        speed=args.speed,
        fresh=args.connections == "fresh",
        stall_timeout=args.stall_timeout,
        timeout=args.timeout,
        connect_timeout=args.connect_timeout,
        headers=headers,
    )
    client = Client(opts)
    print(
        f"tracer replay: {sum(len(j.requests) for j in jobs)} requests on {len(jobs)} "
        f"connections -> {args.target}; capture {out}",
        file=sys.stderr,
        flush=True,
    )
    reason = "interrupted"
    try:
        anyio.run(_run, tap, client, jobs, _poller(args, tap))
        reason = "replay finished"
    finally:
        writer.finish(config.name, reason)
    replayed = load(out)
    doc = compare(
        original,
        replayed,
        [(j.conn, j.requests) for j in jobs],
        client.sent,
        client.dropped,
        mode=args.connections,
        speed=args.speed,
    )
    document = doc.document(original=str(args.capture), target=args.target, capture=str(out))
    sys.stdout.write(to_json(document) if args.format == "json" else to_text(document))
    return 0


async def _run(tap: Tap, client: Client, jobs: list[Job], poller: Any) -> None:
    tap.bus.add("replay-clock", client.clock)
    async with anyio.create_task_group() as tg:
        bound = await tg.start(tap.serve)
        client.opts.port = bound[0][1]
        if poller is not None:  # a first sample of every URL before the replay starts
            tg.start_soon(poller.run)
            wanted = len(poller.config.urls) + len(poller.config.health_urls)
            with anyio.move_on_after(poller.config.timeout + 0.5):
                while len(poller.latest) + len(poller.latest_health) < wanted:
                    await anyio.sleep(0.01)
        await client.run(jobs)
        with anyio.move_on_after(SETTLE):  # let the tap see the last closes
            while tap.live:
                await anyio.sleep(0.01)
        tap.stop()
        tg.cancel_scope.cancel()


def _poller(args: argparse.Namespace, tap: Tap) -> Any:
    """The engine poller, as ``tracer proxy`` builds it."""
    from ..evidence.options import engine_poller

    return engine_poller(args, tap.config.name, tap.safe_emit, tap.wall_offset)


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--header {text!r}: expected 'NAME: VALUE'")
    return name.strip(), value.strip()


def _missing_text(path: str, missing: list[CapturedRequest]) -> str:
    by_problem: dict[str, list[str]] = {}
    for req in missing:
        by_problem.setdefault(req.body_problem or "no body", []).append(req.key)
    parts = [f"{', '.join(keys)}: {problem}" for problem, keys in by_problem.items()]
    return (
        f"cannot replay {counted(len(missing), 'request')} of {path} without their bodies: "
        + "; ".join(parts)
        + ". Capture with `tracer proxy --bodies requests` (the default), or leave them "
        "out with --only"
    )
