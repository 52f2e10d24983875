"""A connection with faults (``--fault``, opt-in): every byte goes through
``faults.ConnectionFaults`` (sans-I/O) and the actions it returns are carried out. A
subclass picked per connection only when faults are configured, so the plain data path
has no check at all."""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import structlog

from .. import events as ev
from ..faults.plan import (
    Action,
    ArmIdle,
    ConnectionFaults,
    Cut,
    Deliver,
    Forward,
    Freeze,
    Hold,
    Injected,
)

if TYPE_CHECKING:
    from .pump import ClientPump

from .connection import (
    Connection,
    ConnectionTap,
    InjectingConnection,
    _abort,
)

log = structlog.get_logger("tracer.proxy.relay")


class FaultConnection(Connection):
    """A relay with faults (``--fault``): every byte goes through ``ConnectionFaults``.

    Actions toward the client pass through one ordered queue, so that a ``Hold`` holds
    everything behind it (bytes, records, the end of the upstream connection) until its
    timer releases it. While the queue holds more than ``QUEUE_LIMIT`` bytes, the
    upstream is not read. The observer is fed what the client sees: bytes written to the
    client when they are written, and the tap's own close of the client connection.
    """

    QUEUE_LIMIT = 1 << 20
    plain_client = plain_upstream = False  # every byte goes through the faults

    def __init__(
        self, tap: ConnectionTap, client: asyncio.Transport, pump: ClientPump | None = None
    ) -> None:
        super().__init__(tap, client, pump)
        assert tap.fault_plan is not None
        self.faults = ConnectionFaults(tap.fault_plan)
        self._queue: deque[Deliver | Hold | Cut | Injected | ArmIdle | Callable[[], None]] = deque()
        self._queued = 0  # bytes waiting in the queue
        self._holding = False
        self._hold: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._frozen = False  # half-open: neither side is read or written any more
        self._up_paused = False  # the upstream is not read: the queue is full

    # ---- bytes --------------------------------------------------------------------

    def from_client(self, data: bytes) -> None:
        if self._frozen:
            self.client.pause_reading()
            return
        if self.finished:
            return
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        # observed first (unlike the plain relay): the request's record precedes its fault's
        self._observe(self.obs.client_data, data, time.monotonic())
        self._act(self.faults.client_data(data))

    def from_upstream(self, data: bytes) -> None:
        if self._frozen:
            if self.upstream is not None:
                self.upstream.pause_reading()
            return
        self._act(self.faults.upstream_data(data))

    def _act(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Forward):
                upstream = self.upstream
                if upstream is not None:
                    if not upstream.is_closing():
                        upstream.write(action.data)
                elif not (self.finished or self.closed_by == "tracer"):
                    self._hold_for_upstream(action.data)
            elif isinstance(action, Freeze):
                self._freeze()
            elif isinstance(action, Injected) and action.now:
                self._record(action)
            else:
                if isinstance(action, Deliver):
                    self._queued += len(action.data)
                self._queue.append(action)
        if self._queue:
            self._drain()

    def _drain(self) -> None:
        queue = self._queue
        while queue and not self._holding:
            item = queue.popleft()
            if isinstance(item, Deliver):
                self._queued -= len(item.data)
                if not self.client.is_closing():
                    self.client.write(item.data)
                self._observe(self.obs.upstream_data, item.data, time.monotonic())
            elif isinstance(item, Hold):
                if item.merge and any(isinstance(i, Hold) and i.merge for i in queue):
                    continue  # what queued behind it goes out with this bunch
                self._holding = True
                if not math.isinf(item.seconds):
                    loop = asyncio.get_running_loop()
                    self._hold = loop.call_later(item.seconds, self._release)
            elif isinstance(item, Injected):
                self._record(item)
            elif isinstance(item, Cut):
                self._cut(item.how)
            elif isinstance(item, ArmIdle):
                if self._idle is not None:
                    self._idle.cancel()
                loop = asyncio.get_running_loop()
                self._idle = loop.call_later(item.fault.seconds, self._idle_close, item)
            else:
                item()  # the upstream's end, deferred behind a hold
        upstream = self.upstream
        if upstream is None or upstream.is_closing():
            return
        if self._queued > self.QUEUE_LIMIT and not self._up_paused:
            self._up_paused = True
            upstream.pause_reading()
        elif self._up_paused and self._queued <= self.QUEUE_LIMIT:
            self._up_paused = False
            if self.client_paused_since is None and not self._frozen:
                upstream.resume_reading()

    def _release(self) -> None:
        self._hold = None
        self._holding = False
        if not self.finished:
            self._drain()

    def _observe(self, fn: Callable[[bytes, float], None], data: bytes, now: float) -> None:
        """Observed when acted on: a fault's record must follow the records of the bytes
        it acted on."""
        try:
            fn(data, now)
        except Exception:
            self.observer_failed()

    # ---- what the faults do ---------------------------------------------------------

    def _record(self, item: Injected) -> None:
        now = time.monotonic()
        tap = self.tap
        tap.safe_emit(
            ev.FaultInjected(
                t=now + tap.wall_offset,
                m=now,
                tap=tap.config.name,
                conn=self.id,
                seq=item.seq,
                fault=item.fault.name,
                spec=item.fault.spec,
                detail=item.detail,
            )
        )

    def _cut(self, how: Literal["fin", "reset"]) -> None:
        """Close the client connection mid-response; the observer records the cut."""
        self._first("tracer", "tracer")
        self._observe_eof(self.obs.upstream_eof, time.monotonic(), reset=how == "reset")
        if how == "reset":
            _abort(self.client)
        elif not self.client.is_closing():
            self.client.close()
        if self.upstream is not None and not self.upstream.is_closing():
            self.upstream.close()
        self._queue.clear()

    def _freeze(self) -> None:
        self._frozen = True
        self._stop_timers()
        self._queue.clear()
        self.client.pause_reading()
        if self.upstream is not None and not self.upstream.is_closing():
            self.upstream.pause_reading()

    def _idle_close(self, item: ArmIdle) -> None:
        self._idle = None
        if self.finished or self.closed_by is not None or self.obs.in_flight or self.faults.busy:
            return
        detail = f"connection closed after {item.fault.seconds:g}s idle"
        self._record(Injected(item.fault, item.seq, detail))
        self.close_by_tracer("fault close-idle-after")

    def _stop_timers(self) -> None:
        for timer in (self._hold, self._idle):
            if timer is not None:
                timer.cancel()
        self._hold = self._idle = None
        self._holding = False

    # ---- ends -------------------------------------------------------------------------

    def on_upstream_eof(self) -> None:
        if self._frozen:
            return
        self._act(self.faults.upstream_eof())
        if self.faults.silent and not self.client_eof:
            # a dropped request: the client connection stays open and silent
            self.upstream_eof = True
            if self.upstream is not None:
                self.upstream.close()
            return
        if self._queue or self._holding:
            self._queue.append(super().on_upstream_eof)
            return
        super().on_upstream_eof()

    def on_upstream_lost(self, exc: Exception | None) -> None:
        if self._frozen or (self.faults.silent and not self.client_eof):
            self.upstream_lost = True
            self._maybe_finish()
            return
        if self._queue or self._holding:
            self._queue.append(functools.partial(super().on_upstream_lost, exc))
            return
        super().on_upstream_lost(exc)

    def on_client_lost(self, exc: Exception | None) -> None:
        self._stop_timers()
        deferred = [item for item in self._queue if callable(item)]
        self._queue.clear()
        super().on_client_lost(exc)
        for end in deferred:  # the upstream's end, held behind a hold that is moot now
            end()

    def finish(self, *, shutdown: bool = False) -> None:
        self._stop_timers()
        super().finish(shutdown=shutdown)

    # ---- backpressure -----------------------------------------------------------------

    def client_write_resumed(self) -> None:
        self.client_paused_since = None
        upstream = self.upstream
        if upstream is not None and not (upstream.is_closing() or self._frozen or self._up_paused):
            upstream.resume_reading()

    def upstream_write_resumed(self) -> None:
        if not self._frozen:
            super().upstream_write_resumed()


class InjectingFaultConnection(InjectingConnection, FaultConnection):
    """Both: ``x-request-id`` added first, so the faults and the observer see the request
    the upstream gets (and a request the tap answers itself is recorded with its id)."""
