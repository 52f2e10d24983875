"""mitmproxy's side of the addon's capture, below its hooks (``addons/trace.py``).

``FactShipper``: the facts the hooks take go to the engine (``flows.FlowObserver``) at
once when it runs in mitmproxy's process, else they are queued and shipped to the
capture process every ``SHIP_INTERVAL``; the body pieces the stream callables take
(``FlowPieces``) go with the next ship, or in the loop's next round when they are many
or big. ``CaptureProcess``: that process, and the pipe to it, written without ever
blocking mitmproxy. The wire between them: length-prefixed ``marshal`` batches of facts,
each as ``facts.to_wire`` makes it (the same interpreter at both ends; nothing else
reads them)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import marshal
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .exchange import BIG_PIECE, BODY_BATCH_READS
from .facts import Close, Fact, Lost, Open, Pieces, RequestPieces, from_wire, to_wire

if TYPE_CHECKING:
    from .flows import FlowObserver, Settings

log = logging.getLogger("tracer.observe.flows")

StreamFn = Callable[[bytes], Iterable[bytes] | bytes]
SHIP_INTERVAL = 0.005  # facts wait at most this long for the capture process
MAX_BACKLOG = 64 << 20  # bytes of facts waiting for a slow capture process, at most
PIPE_SIZE = 1 << 20  # asked of the kernel for the pipe (its default is 64 KiB)
CLOSE_WAIT = 30.0  # seconds the capture process gets to write what it has, at the end


_LENGTH = struct.Struct("<I")


def frame(facts: list[Fact]) -> bytes:
    """One batch of facts as the capture process reads it (``ValueError``: a fact holds
    a value ``marshal`` cannot take)."""
    data = marshal.dumps(to_wire(facts))
    return _LENGTH.pack(len(data)) + data


def read_frames(stream: IO[bytes]) -> Iterator[list[Fact]]:
    """The batches of facts on ``stream`` until it ends (a torn last frame is dropped)."""
    while True:
        head = stream.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            return
        (size,) = _LENGTH.unpack(head)
        data = stream.read(size)
        if len(data) < size:
            return
        raw: list[tuple[Any, ...]] = marshal.loads(data)
        yield from_wire(raw)


class CaptureProcess:
    """The capture process and the pipe to it, written without ever blocking mitmproxy."""

    def __init__(self, path: str, settings: Settings, header: dict[str, Any]) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # (tracer is imported from there)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tracer.observe.flow_process"], stdin=subprocess.PIPE, env=env
        )
        assert self.proc.stdin is not None
        self.stdin = self.proc.stdin
        self.fd = self.stdin.fileno()
        set_size = getattr(fcntl, "F_SETPIPE_SZ", None)  # Linux only
        with contextlib.suppress(OSError):  # else the kernel's default size will do
            if set_size is not None:
                fcntl.fcntl(self.fd, set_size, PIPE_SIZE)
        os.set_blocking(self.fd, False)
        self.backlog = bytearray()
        self.lost_facts = self.lost_bytes = 0
        self.gone = False
        self._waiting = False  # for the pipe to take more (the loop's add_writer)
        self.send([Open(path, asdict(settings), header)])

    def send(self, facts: list[Fact], *, last: bool = False) -> None:
        """Queue a batch and write what the pipe takes; past ``MAX_BACKLOG`` the batch is
        dropped and counted (a ``lost`` fact says so once the backlog has room again, or
        with the ``last`` batch, which is never dropped: ``close`` waits for it)."""
        if self.gone or not facts:
            return
        if self.lost_facts and (last or len(self.backlog) < MAX_BACKLOG // 2):
            lost = Lost(time.monotonic(), self.lost_facts, self.lost_bytes)
            facts = [lost, *facts]
            self.lost_facts = self.lost_bytes = 0
        try:
            data = frame(facts)
        except ValueError:  # a value marshal cannot take (mitmproxy gave something odd)
            data = self._frame_what_can_go(facts)
        if not last and len(self.backlog) + len(data) > MAX_BACKLOG:
            self.lost_facts += len(facts)
            self.lost_bytes += len(data)
            return
        self.backlog += data
        if not last:
            self._write()

    def _frame_what_can_go(self, facts: list[Fact]) -> bytes:
        """The batch without the facts that cannot be sent, each logged and counted."""
        good: list[Fact] = []
        for fact in facts:
            try:
                frame([fact])
            except ValueError:
                self.lost_facts += 1
                log.error("tracer: a %s fact could not be sent: %r", type(fact).__name__, fact)
            else:
                good.append(fact)
        return frame(good)

    def _write(self) -> None:
        """Write what the pipe takes now; wait for it to take more in mitmproxy's loop."""
        self._waiting = False
        try:
            self._write_backlog()
        except BlockingIOError:
            self._wait_writable()
        except OSError as exc:
            self._lost(exc)

    def _write_backlog(self) -> None:
        while self.backlog:
            written = os.write(self.fd, self.backlog)
            del self.backlog[:written]

    def _wait_writable(self) -> None:
        if self._waiting:
            return
        try:
            asyncio.get_running_loop().add_writer(self.fd, self._writable)
            self._waiting = True
        except RuntimeError:  # no loop: the next send or the close writes it
            pass

    def _writable(self) -> None:
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().remove_writer(self.fd)
        self._write()

    def _lost(self, exc: OSError) -> None:
        self.gone = True
        self.backlog.clear()
        code = self.proc.poll()
        why = "broken pipe" if exc.errno == errno.EPIPE else (exc.strerror or str(exc))
        log.error(
            "tracer: the capture process is gone (%s, exit %s); tracing stopped, traffic goes on",
            why,
            code,
        )

    def close(self, facts: list[Fact], *, wait: bool) -> threading.Thread | None:
        """Send the last facts, let the process write them all, and wait for it: here
        (``wait``: mitmproxy is stopping), or in a thread of its own, returned, so that
        mitmproxy's loop goes on meanwhile (a capture file changed while it runs)."""
        self.send(facts, last=True)
        if self._waiting:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().remove_writer(self.fd)
        if wait:
            self._finish()
            return None
        finishing = threading.Thread(target=self._finish, name="tracer-capture-close")
        finishing.start()
        return finishing

    def _finish(self) -> None:
        if not self.gone:
            os.set_blocking(self.fd, True)
            try:
                self._write_backlog()
            except OSError as exc:
                self._lost(exc)
        with contextlib.suppress(OSError):
            self.stdin.close()
        try:
            self.proc.wait(CLOSE_WAIT)
        except subprocess.TimeoutExpired:
            log.error("tracer: the capture process did not finish in %.0f s", CLOSE_WAIT)


class FlowPieces:
    """A flow's body pieces not yet handed to the engine, as its stream callables take
    them (the addon's flow state extends it)."""

    __slots__ = ("body_end", "dirty", "fid", "keep", "pieces", "req_pieces", "req_times", "times")

    def __init__(self, fid: str) -> None:
        self.fid = fid
        self.times: list[float] = []  # response pieces: arrival times ...
        self.pieces: list[Any] = []  # ... and the pieces (or their sizes: ``keep``)
        self.keep = False  # the engine needs the pieces themselves (SSE, bodies=all)
        self.req_times: list[float] = []  # a streamed request body's pieces
        self.req_pieces: list[bytes] = []
        self.dirty = False  # has pieces the engine has not had yet
        self.body_end: float | None = None  # mitmproxy's end-of-message call


class FactShipper:
    """Facts to the engine here (``engine``) or to the capture process (``process``)."""

    def __init__(self) -> None:
        self.engine: FlowObserver | None = None  # tracer_sidecar=false
        self.process: CaptureProcess | None = None  # tracer_sidecar=true
        self._facts: list[Fact] = []  # for the capture process, not sent yet
        self._dirty: list[FlowPieces] = []  # flows with pieces the engine has not had
        self._ship_handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self._closing: list[threading.Thread] = []  # earlier captures' processes finishing

    @property
    def _on(self) -> bool:
        """Tracing: a capture is open (its engine here, or its capture process)."""
        return self.engine is not None or self.process is not None

    def _put(self, fact: Fact) -> None:
        engine = self.engine
        if engine is not None:
            engine.apply(fact)
        elif self.process is not None:
            self._facts.append(fact)
            if self._ship_handle is None:
                self._schedule(SHIP_INTERVAL)

    def _schedule(self, delay: float) -> None:
        """Ship in ``delay`` (0: in the loop's next round, after the piece at hand went
        on); at once when there is no loop to ask."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._ship()
            return
        if self._ship_handle is not None:
            if delay > 0:
                return
            self._ship_handle.cancel()
        self._ship_handle = (
            loop.call_soon(self._ship) if delay <= 0 else loop.call_later(delay, self._ship)
        )

    def _ship(self) -> None:
        """Hand the pieces gathered to the engine, and the facts to the capture process."""
        self._ship_handle = None
        try:
            self._drain_all()
            if self.process is not None and self._facts:
                queued, self._facts = self._facts, []
                self.process.send(queued)
        except Exception:  # observation must never stop mitmproxy
            log.exception("tracer: handing facts on failed")

    def _drain_all(self) -> None:
        dirty, self._dirty = self._dirty, []
        for flow in dirty:
            self._drain(flow)

    def _drain(self, flow: FlowPieces) -> None:
        """The flow's pieces so far, as facts (before any later fact of the flow)."""
        if not flow.dirty:
            return
        flow.dirty = False
        if flow.req_times:
            self._put(RequestPieces(flow.fid, flow.req_times[:], flow.req_pieces[:]))
            flow.req_times.clear()
            flow.req_pieces.clear()
        if flow.times:
            self._put(Pieces(flow.fid, flow.times[:], flow.pieces[:]))
            flow.times.clear()
            flow.pieces.clear()

    def _mark(self, flow: FlowPieces, soon: bool) -> None:
        """The flow has pieces to hand on: with the next ship, or in the loop's next round
        when ``soon`` (many or big pieces: what is kept stays bounded)."""
        if not flow.dirty:
            flow.dirty = True
            self._dirty.append(flow)
        if soon:
            self._schedule(0)
        elif self._ship_handle is None:
            self._schedule(SHIP_INTERVAL)

    def _request_observer(self, state: FlowPieces, chain: StreamFn | bool) -> StreamFn:
        times, pieces = state.req_times, state.req_pieces
        monotonic = time.monotonic
        then = chain if callable(chain) else None

        def observe(data: bytes) -> Iterable[bytes] | bytes:
            if data:
                times.append(monotonic())
                pieces.append(data)
                self._mark(state, len(times) >= BODY_BATCH_READS or len(data) >= BIG_PIECE)
            return data if then is None else then(data)

        return observe

    def _response_observer(self, state: FlowPieces, chain: StreamFn | bool) -> StreamFn:
        """The stream callable: the hot path, one call per piece of body. It takes the
        piece's time and keeps the piece (or its size) for the next ship."""
        times, pieces, keep = state.times, state.pieces, state.keep
        monotonic = time.monotonic
        then = chain if callable(chain) else None

        def observe(data: bytes) -> Iterable[bytes] | bytes:
            if data:
                times.append(monotonic())
                pieces.append(data if keep else len(data))
                soon = len(times) >= BODY_BATCH_READS or len(data) >= BIG_PIECE
                if soon or not state.dirty:
                    self._mark(state, soon)
            elif state.body_end is None:  # mitmproxy's end-of-message call
                state.body_end = monotonic()
            return data if then is None else then(data)

        return observe

    def _stop(self, reason: str, *, wait: bool) -> None:
        """The last facts and ``close`` handed on; the engine or the process let go (the
        process finishes here with ``wait``, else beside mitmproxy's loop)."""
        self._drain_all()
        close = Close(time.monotonic(), reason)
        if self._ship_handle is not None:
            self._ship_handle.cancel()
            self._ship_handle = None
        process, self.process = self.process, None
        engine, self.engine = self.engine, None
        queued, self._facts = self._facts, []
        if process is not None:
            finishing = process.close([*queued, close], wait=wait)
            self._closing = [t for t in self._closing if t.is_alive()]
            if finishing is not None:
                self._closing.append(finishing)
        if engine is not None:
            engine.apply(close)
