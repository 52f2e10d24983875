"""The response faults at work: each fault on a response is a stage that takes and gives
segments (``segments.Seg``) and the records and holds it adds; the stages of one response
run in a fixed order (``pipeline``), whatever order the faults were given in.

``drop-done``, ``stall-after-events``, ``truncate-after-events``, ``buffer-stream``,
``coalesce``, ``delay-first-byte``: of these only ``drop-done`` changes bytes (it
removes the ``[DONE]`` event and re-frames the chunk that held it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from ..protocol.framing import Framing
from .actions import Cut, Hold, Injected
from .kinds import Fault
from .segments import CRLF, DATA, END, HEAD, SIZE, Item, Seg

BUFFER_LIMIT = 16 * 1024 * 1024  # a buffer-stream response held beyond this is released

EVENT_FAULTS = frozenset(("drop-done", "stall-after-events", "truncate-after-events"))
"""The faults that need a response's SSE events found."""


class Stage:
    """One fault acting on one response: items in, items out (``end``: upstream closed)."""

    def __init__(self, fault: Fault, seq: int) -> None:
        self.fault = fault
        self.seq = seq

    def head(self, framing: Framing, sse: bool) -> None:
        """The final response head was parsed."""

    def push(self, items: list[Item]) -> list[Item]:
        return items

    def end(self) -> list[Item]:
        return []

    def injected(self, detail: str) -> Injected:
        return Injected(self.fault, self.seq, detail)


class _DelayFirst(Stage):
    fired = False

    def push(self, items: list[Item]) -> list[Item]:
        if self.fired or not items:
            return items
        self.fired = True
        seconds = self.fault.seconds
        record: Item = self.injected(f"response held {seconds:g}s before its first byte")
        return [record, Hold(seconds), *items]


class _Coalesce(Stage):
    """coalesce: a merging hold after each write unit of the body (see ``Hold.merge``).

    A write unit is a whole chunk (its CRLF) of a chunked body, else an SSE event: what an
    upstream writes at once, and what Nagle holds whole.
    """

    fired = False
    chunked = True

    def head(self, framing: Framing, sse: bool) -> None:
        self.chunked = framing == "chunked"

    def push(self, items: list[Item]) -> list[Item]:
        out: list[Item] = []
        for item in items:
            if not self.fired and isinstance(item, Seg) and item.kind not in (HEAD, END):
                self.fired = True  # recorded before the first byte of the body
                seconds = self.fault.seconds
                out.append(self.injected(f"response delivered in bunches: held {seconds:g}s"))
            out.append(item)
            if not isinstance(item, Seg) or item.last:
                continue
            if (item.kind == CRLF and item.chunk_end) if self.chunked else item.event:
                out.append(Hold(self.fault.seconds, merge=True))
        return out


class _Buffer(Stage):
    def __init__(self, fault: Fault, seq: int) -> None:
        super().__init__(fault, seq)
        self.held: list[Item] = []
        self.size = 0
        self.state = "waiting"  # holding, released

    def push(self, items: list[Item]) -> list[Item]:
        if self.state == "released":
            return items
        out: list[Item] = []
        for item in items:
            if self.state == "released":
                out.append(item)
                continue
            if self.state == "waiting":
                self.state = "holding"
                out.append(self.injected("response held until its end, then released at once"))
            self.held.append(item)
            if isinstance(item, Seg):
                self.size += len(item.raw)
                if item.last or self.size > BUFFER_LIMIT:
                    out.extend(self.end())
                    self.state = "released"
        return out

    def end(self) -> list[Item]:
        held, self.held = self.held, []
        return held  # adjacent segments become one write: the client gets it all at once


class _AfterEvents(Stage):
    """stall-after-events and truncate-after-events: act after the K-th event."""

    def __init__(self, fault: Fault, seq: int) -> None:
        super().__init__(fault, seq)
        self.events = 0
        self.sse = False
        self.state = "counting"  # armed (wait for the chunk's CRLF), done, gone

    def head(self, framing: Framing, sse: bool) -> None:
        self.sse = sse

    def push(self, items: list[Item]) -> list[Item]:
        if self.state == "done":
            return items
        out: list[Item] = []
        for item in items:
            state = self.state
            if state == "gone":
                continue  # cut: nothing more
            if state == "done" or not isinstance(item, Seg):
                out.append(item)
            elif state == "armed":  # the K-th event ended its chunk's data: wait for the CRLF
                if item.kind == CRLF:
                    out.append(item)
                    if item.chunk_end:
                        out.extend(self._act())
                    continue
                out.extend(self._act())
                if self.state == "done":
                    out.append(item)
            else:
                out.append(item)
                if self.sse and not item.last and self._reached(item):
                    if item.kind == DATA and item.chunk_end:
                        self.state = "armed"
                    else:
                        out.extend(self._act())
        return out

    def _reached(self, seg: Seg) -> bool:
        if seg.head_end:
            return self.fault.count == 0
        if seg.kind == DATA and seg.event not in (None, "comment"):
            self.events += 1
            return self.events == self.fault.count
        return False

    def _act(self) -> list[Item]:
        fault = self.fault
        if fault.name == "stall-after-events":
            self.state = "done"
            span = "for good" if math.isinf(fault.seconds) else f"for {fault.seconds:g}s"
            detail = f"relaying stopped after {fault.count} events {span}"
            return [self.injected(detail), Hold(fault.seconds)]
        self.state = "gone"
        detail = f"connection closed ({fault.how}) after {fault.count} events, without the end of the body"
        return [self.injected(detail), Cut(fault.how)]


class _DropDone(Stage):
    """Remove ``data: [DONE]``: hold each chunk until it ends on an event boundary."""

    def __init__(self, fault: Fault, seq: int) -> None:
        super().__init__(fault, seq)
        self.active = False
        self.chunked = False
        self.held: list[Seg] = []
        self.partial = False  # inside an event

    def head(self, framing: Framing, sse: bool) -> None:
        self.active = sse and framing in ("chunked", "close")
        self.chunked = framing == "chunked"

    def push(self, items: list[Item]) -> list[Item]:
        if not self.active:
            return items
        out: list[Item] = []
        for item in items:
            if not isinstance(item, Seg) or item.kind == HEAD:
                out.append(item)
                continue
            self.held.append(item)
            if item.kind == DATA:
                if item.event is not None:
                    self.partial = False
                elif item.raw:
                    self.partial = True
            # a chunk's end (chunked) or an event's end (read until close)
            boundary = item.kind == CRLF and item.chunk_end if self.chunked else item.kind == DATA
            if item.last or (boundary and not self.partial):
                out.extend(self._release())
        return out

    def end(self) -> list[Item]:
        return self._release() if self.held else []

    def _release(self) -> list[Item]:
        held, self.held = self.held, []
        if not any(s.event == "done" for s in held):
            return list(held)
        events: list[tuple[bytes, str | None]] = []
        current = b""
        dropped = 0
        for seg in held:
            if seg.kind != DATA:
                continue
            current += seg.raw
            if seg.event is not None:
                if seg.event == "done":
                    dropped += len(current)
                else:
                    events.append((current, seg.event))
                current = b""
        if current:
            events.append((current, None))
        out: list[Item] = [
            self.injected(
                f"removed data: [DONE] ({dropped} bytes)"
                + ("; chunk re-framed, the body still ends cleanly" if self.chunked else "")
            )
        ]
        body = b"".join(raw for raw, _ in events)
        if body and self.chunked:
            out.append(Seg(b"%x\r\n" % len(body), SIZE))
        for raw, kind in events:
            out.append(Seg(raw, DATA, event=kind))
        if body and self.chunked:
            out.append(Seg(b"\r\n", CRLF, chunk_end=True))
        out.extend(s for s in held if s.kind == END)  # (the last one carries ``last``)
        return out


_STAGE_ORDER = (
    ("drop-done", _DropDone),
    ("stall-after-events", _AfterEvents),
    ("truncate-after-events", _AfterEvents),
    ("buffer-stream", _Buffer),
    ("coalesce", _Coalesce),
    ("delay-first-byte", _DelayFirst),
)


def pipeline(faults: Iterable[Fault], seq: int) -> list[Stage]:
    """The stages of response ``seq``'s faults, in the order they act."""
    faults = tuple(faults)
    return [cls(f, seq) for name, cls in _STAGE_ORDER for f in faults if f.name == name]


def run(stages: list[Stage], segs: Sequence[Item]) -> list[Item]:
    """The segments of one read through the stages: what goes out now."""
    items = list(segs)
    for stage in stages:
        items = stage.push(items)
    return items


def finish(stages: list[Stage]) -> list[Item]:
    """The upstream closed (or the connection went blind): what the stages still hold."""
    items: list[Item] = []
    for stage in stages:
        items = stage.push(items) + stage.end()
    return items
