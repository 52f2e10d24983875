"""The faults of one client connection, sans-I/O: ``ConnectionFaults`` follows both
directions of an HTTP/1.1 connection message by message (``plan.py`` says how) and
turns its bytes into ``Action`` values.

Request heads and response heads are read by ``protocol.head``, bodies walked by
``protocol.framing.BodyDecoder`` (a response's cut into segments by ``segments``), and
the faults of a response applied by ``stages``.
"""

from __future__ import annotations

from collections import deque

from ..protocol.framing import BodyDecoder, FramingError, body_framing, request_framing
from ..protocol.head import HeadError, HeadReader, parse_request_head, parse_response_head
from ..protocol.sse import is_event_stream
from .actions import Action, ArmIdle, Cut, Deliver, Forward, Freeze, Injected
from .decision import Decision, FaultPlan
from .kinds import Fault, status_response
from .segments import HEAD, BodySegments, Item, Seg, SseEvents
from .stages import EVENT_FAULTS, finish, pipeline, run


class _Unfollowable(Exception):
    """Followable bytes that the fault layer does not follow (a protocol switch): the
    connection goes blind."""


class _Response:
    """A request forwarded upstream: its response is parsed as it comes."""

    def __init__(self, seq: int, method: str, decision: Decision) -> None:
        self.seq = seq
        self.method = method
        self.idle = decision.idle
        self.stages = pipeline(decision.response, seq)
        self.wants_events = any(f.name in EVENT_FAULTS for f in decision.response)
        self.head = HeadReader(request=False)
        self.body: BodySegments | None = None
        self.done = False
        self.tunnel = False

    def feed(self, data: bytes, pos: int, segs: list[Seg]) -> int:
        """Segments of this response in ``data[pos:]``; returns where it ends there."""
        n = len(data)
        while pos < n and not self.done:
            body = self.body
            if body is not None:
                pos = body.walk(data, pos, segs) if self.stages else body.skip(data, pos)
                self.done = body.done
                continue
            end = self.head.feed(data, pos)
            if end < 0:
                segs.append(Seg(data[pos:], HEAD))
                return n
            seg = Seg(data[pos:end], HEAD)
            segs.append(seg)
            pos = end
            raw = self.head.head
            self.head.clear()
            head = parse_response_head(raw)
            status, headers = head.status, head.headers
            if status == 101 or (self.method == "CONNECT" and 200 <= status < 300):
                self.tunnel = self.done = seg.last = True
                return pos
            if status < 200:
                continue  # 1xx: the final head follows
            framing, length = body_framing(self.method, status, headers)
            sse = any(name == b"content-type" and is_event_stream(value) for name, value in headers)
            events = SseEvents() if sse and self.wants_events else None
            self.body = BodySegments(framing, length, events)
            for stage in self.stages:
                stage.head(framing, sse)
            seg.head_end = True
            if self.body.done:
                self.done = seg.last = True
        return pos


class _Answer:
    """A request the tap answers itself (status:CODE): delivered when it is its turn."""

    def __init__(self, seq: int, fault: Fault, idle: Fault | None) -> None:
        self.seq = seq
        self.fault = fault
        self.idle = idle
        self.ready = False  # the request has been read to its end


class ConnectionFaults:
    """The faults of one client connection: bytes in, ``Action`` values out."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.seq = 0
        self.blind = False  # not followable: every byte passes unchanged from now on
        self.stopped = False  # frozen or cut: nothing more either way
        self._hang: tuple[Fault, int] | None = None  # the fault and request that hung it
        self._deaf = False  # hung, and the client's bytes cannot be followed: just dropped
        self._head = HeadReader(request=True)  # holds a request head still incomplete
        self._body: BodyDecoder | None = None  # the current request's body
        self._swallow = False  # the current request is not forwarded
        self._answer: _Answer | None = None  # ... because the tap answers it (status)
        self._slots: deque[_Response | _Answer] = deque()  # answers due, in request order

    @property
    def hung(self) -> bool:
        """A request was dropped: nothing more goes upstream (later requests neither)."""
        return self._hang is not None

    @property
    def silent(self) -> bool:
        """A dropped request left the connection silent: nothing more reaches the client."""
        return self.hung and not self._slots

    @property
    def busy(self) -> bool:
        """A request is being read or answered."""
        return bool(self._head.held or self._body is not None or self._slots)

    # ---- client -> upstream ---------------------------------------------------------

    def client_data(self, data: bytes) -> list[Action]:
        if self.blind:
            return [Forward(data)]
        if self.stopped or self._deaf:
            return []
        out: list[Action] = []
        pos, n = 0, len(data)
        try:
            while pos < n and not (self.stopped or self.blind):
                body = self._body
                if body is not None:
                    end = body.walk(data, pos)
                    if not self._swallow:
                        out.append(Forward(data[pos:end]))
                    pos = end
                    if body.done:
                        self._request_done(out)
                    continue
                end = self._head.feed(data, pos)
                if end < 0:
                    break  # (held)
                self._request_head(self._head.raw, self._head.head, out)
                pos = end
                self._head.clear()
        except (HeadError, FramingError, _Unfollowable):
            if self.hung:  # nothing goes upstream any more, followable or not
                self._deaf = True
                return _merge(out)
            self._go_blind(out)
            rest = self._head.held + data[pos:]
            self._head.clear()
            if rest:
                out.append(Forward(rest))
        return _merge(out)

    def _request_head(self, raw: bytes, head_bytes: bytes, out: list[Action]) -> None:
        """``raw``: the head as it came, with any empty lines before it."""
        head = parse_request_head(head_bytes)
        method, target, headers = head.method, head.target, head.headers
        self.seq += 1
        seq = self.seq
        framing, length = request_framing(headers)
        if any(name == b"upgrade" for name, _ in headers):
            raise _Unfollowable("protocol upgrade")  # forwarded as is, blind from here
        if method == "CONNECT":
            raise _Unfollowable("CONNECT")
        self._body = BodyDecoder(framing, length)
        if self._hang is not None:  # read, recorded, never forwarded: the hang goes on
            hang, first = self._hang
            detail = (
                f"request {seq} read and not forwarded: the connection hangs since request {first}"
            )
            out.append(Injected(hang, seq, detail, now=True))
            self._swallow = True
            if self._body.done:
                self._request_done(out)
            return
        decision = self.plan.decide(method, target, seq, headers)
        fault = decision.request
        self._swallow = fault is not None
        if fault is None:
            out.append(Forward(raw))
            self._slots.append(_Response(seq, method, decision))
        elif fault.name in ("hang-on-reuse", "drop-request"):
            where = (
                f"request {seq} on its connection" if fault.name == "hang-on-reuse" else "request"
            )
            detail = f"{where} read and not forwarded; the connection stays open and silent"
            out.append(Injected(fault, seq, detail, now=True))
            self._hang = (fault, seq)
        elif fault.name == "half-open":
            detail = "the tap stopped reading and writing both sides, without closing"
            out.append(Injected(fault, seq, detail, now=True))
            out.append(Freeze())
            self.stopped = True
            self._body = None
            return
        else:
            self._answer = _Answer(seq, fault, decision.idle)
            self._slots.append(self._answer)
        if self._body.done:
            self._request_done(out)

    def _request_done(self, out: list[Action]) -> None:
        self._body = None
        self._swallow = False
        answer, self._answer = self._answer, None
        if answer is not None:
            answer.ready = True
            self._next(out)

    def _next(self, out: list[Action]) -> None:
        """Deliver the tap's own answers that are due now (no response before them)."""
        while self._slots:
            slot = self._slots[0]
            if not isinstance(slot, _Answer) or not slot.ready:
                return
            self._slots.popleft()
            fault = slot.fault
            out.append(Injected(fault, slot.seq, f"answered {fault.status} without forwarding"))
            out.append(Deliver(status_response(fault)))
            self._idle(slot.idle, slot.seq, out)

    def _idle(self, fault: Fault | None, seq: int, out: list[Action]) -> None:
        if fault is not None and not self.busy:
            out.append(ArmIdle(fault, seq))

    # ---- upstream -> client ---------------------------------------------------------

    def upstream_data(self, data: bytes) -> list[Action]:
        if self.blind:
            return [Deliver(data)]
        if self.stopped:
            return []
        out: list[Action] = []
        pos, n = 0, len(data)
        while pos < n and not (self.stopped or self.blind):
            slot = self._slots[0] if self._slots else None
            if not isinstance(slot, _Response):
                if self.silent:
                    return out  # nothing was asked: nothing reaches the client
                self._go_blind(out)
                out.append(Deliver(data[pos:]))
                break
            segs: list[Seg] = []
            try:
                end = slot.feed(data, pos, segs)
            except (HeadError, FramingError):
                self._go_blind(out)
                out.append(Deliver(data[pos:]))
                break
            if slot.stages:
                self._items(run(slot.stages, segs), out)
            else:
                out.append(Deliver(data[pos:end]))
            pos = end
            if slot.done and not self.stopped:
                self._slots.popleft()
                if slot.tunnel:
                    self._go_blind(out)
                    if pos < n:
                        out.append(Deliver(data[pos:]))
                    break
                self._next(out)
                self._idle(slot.idle, slot.seq, out)
        return _merge(out)

    def upstream_eof(self) -> list[Action]:
        """The upstream closed: what the front response's faults still hold goes out."""
        if self.blind or self.stopped or not self._slots:
            return []
        slot = self._slots[0]
        out: list[Action] = []
        if isinstance(slot, _Response) and slot.stages:
            self._items(finish(slot.stages), out)
        return _merge(out)

    def _items(self, items: list[Item], out: list[Action]) -> None:
        raws: list[bytes] = []
        for item in items:
            if isinstance(item, Seg):
                if item.raw:
                    raws.append(item.raw)
                continue
            if raws:
                out.append(Deliver(b"".join(raws)))
                raws = []
            out.append(item)
            if isinstance(item, Cut):
                self.stopped = True
        if raws:
            out.append(Deliver(b"".join(raws)))

    def _go_blind(self, out: list[Action]) -> None:
        """Stop following: release whatever the faults hold, then pass everything through."""
        if self.blind:
            return
        self.blind = True
        for slot in self._slots:
            if isinstance(slot, _Response) and slot.stages:
                self._items(finish(slot.stages), out)
        self._slots.clear()


def _merge(actions: list[Action]) -> list[Action]:
    """Adjacent writes to the same side become one (as they arrived in one read)."""
    if len(actions) < 2:
        return actions
    out: list[Action] = []
    for action in actions:
        prev = out[-1] if out else None
        if isinstance(action, Forward) and isinstance(prev, Forward):
            out[-1] = Forward(prev.data + action.data)
        elif isinstance(action, Deliver) and isinstance(prev, Deliver):
            out[-1] = Deliver(prev.data + action.data)
        else:
            out.append(action)
    return out
