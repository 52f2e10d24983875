"""``tracer replay``'s client: raw HTTP/1.1 through the replay's own tap, paced as captured.

One socket per planned connection (no pool, so the connection structure is exactly the
one planned), each request sent after its gap and each response read no faster than the
original client read it; what happened to each request is the client's own account
(``Sent``), matched with the tap's capture afterwards.
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio
import h11
from anyio.abc import SocketAttribute, SocketStream

from .. import events as ev
from ..redact import REDACTED
from .replay_capture import CapturedRequest
from .replay_compare import Sent
from .replay_plan import Job

READ_SIZE = 65536
PACE_SLACK = 256  # bytes a paced read may take beyond the original's (chunk framing)
DEFAULT_STALL_TIMEOUT = 30.0


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
