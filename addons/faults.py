"""The tracer's fault specs inside mitmproxy: ``tracer proxy --fault`` for mitmdump.

    mitmdump -s addons/faults.py --mode reverse:http://127.0.0.1:30000 \\
        --set tracer_faults=hang-on-reuse:3 --set tracer_faults='status:503@every=4'

Theory of operation
-------------------
The specs, rules and decisions are ``tracer/faults/plan.py``'s: ``configure`` parses
``tracer_faults`` (one spec per value) into a ``FaultPlan``; ``requestheaders`` counts
the request's position on its client connection and asks the plan. What each fault
becomes in mitmproxy's hooks:

=========================  ============================================================
fault                      in mitmproxy
=========================  ============================================================
``hang-on-reuse``,         ``request``: the flow is intercepted and never resumed: read,
``drop-request``           never forwarded, never answered; the connection stays open
``half-open``              ``requestheaders``: the same, before the body (mitmproxy still
                           reads the socket: an approximation of a peer that stops)
``status:CODE``            ``request``: the tap's JSON error answer (``Response.make``)
``delay-first-byte:S``     ``responseheaders`` waits S seconds (an async hook)
``buffer-stream``          ``responseheaders``: streaming off (mitmproxy then holds the
                           whole response and sends it at its end)
``drop-done``,             ``responseheaders``: a stream callable that finds SSE event
``stall-after-events:K``,  ends (``SseEvents``), removes ``[DONE]`` (mitmproxy frames the
``truncate-after-events``  chunks itself) or stops passing bytes after the K-th event;
                           at ``response`` a stall intercepts the flow (the end never
                           comes) and a truncation kills it (closed without the end)
=========================  ============================================================

A request body mitmproxy streams (``stream_large_bodies``: it sends the body upstream as
it comes, and an addon cannot turn that off for one request) is on its way before
``request``: ``hang-on-reuse`` and ``drop-request`` hold such a request at its head
(as ``half-open``: never forwarded), and ``status`` is not applied to it (mitmproxy
cannot send an addon's response for a streamed request): logged, no ``fault`` record.

Limits, refused by ``configure`` with a clear message (``tracer proxy`` has them all):
mitmproxy gives an addon no hook inside a streamed body, so a stall can only be for good
(``stall-after-events:K:inf``) and a truncation takes effect when the upstream's response
ends, closing with FIN (``:reset`` is refused); it has no hook on an idle connection, so
``close-idle-after`` is refused. With ``buffer-stream`` the event faults do not apply.

Each injection is logged, appended to ``flow.metadata["tracer.faults"]`` as
``{"fault", "spec", "seq", "detail"}``, and, when ``addons/trace.py`` is loaded, written
to its capture as a ``fault`` record (as ``tracer proxy --fault`` writes it). Load this
addon after ``addons/trace.py`` so that its hooks have the last word; its stream callable
shapes the pieces first and hands what is left to the trace addon's, so the capture
shows what the client got, as the tap's does with its own faults.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

if importlib.util.find_spec("tracer") is None:  # a mitmdump without tracer installed
    sys.path.append(str(Path(__file__).resolve().parent.parent))

from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.addonmanager import Loader
from mitmproxy.utils import human

from tracer.faults.plan import (
    Decision,
    Fault,
    FaultPlan,
    FaultSpecError,
    SseEvents,
    parse_fault,
    status_body,
)

log = logging.getLogger("tracer.faults")

StreamFn = Callable[[bytes], Iterable[bytes] | bytes]
_EVENT_FAULTS = ("drop-done", "stall-after-events", "truncate-after-events")


def unsupported(fault: Fault) -> str | None:
    """Why mitmproxy cannot inject this fault as ``tracer proxy`` does, or None."""
    if fault.name == "close-idle-after":
        return "mitmproxy has no hook on an idle connection; use tracer proxy --fault"
    if fault.name == "coalesce":
        return "mitmproxy cannot hold a streamed body's pieces for a time; use tracer proxy --fault"
    if fault.name == "stall-after-events" and not math.isinf(fault.seconds):
        return (
            "mitmproxy cannot pause inside a streamed body: only a stall for good "
            f"(stall-after-events:{fault.count}:inf) here; tracer proxy --fault does both"
        )
    if fault.name == "truncate-after-events" and fault.how == "reset":
        return "mitmproxy closes with FIN only; use :fin here, or tracer proxy --fault"
    return None


class _Flow:
    """A request some fault applies to. (No dataclass: mitmproxy loads scripts unregistered.)"""

    __slots__ = ("decision", "early", "seq", "stopped")

    def __init__(self, seq: int, decision: Decision) -> None:
        self.seq = seq
        self.decision = decision
        self.stopped: Fault | None = None  # the event fault that stopped the stream
        self.early = False  # its request fault was dealt with at its head (streamed body)


def _stream_large_bodies() -> str | None:
    """mitmproxy's ``stream_large_bodies`` (a proxy's option: a bare test context may
    not have it)."""
    try:
        value = ctx.options.stream_large_bodies
    except AttributeError:
        return None
    return str(value) if value else None


def _streamed(req: http.Request) -> bool:
    """Whether mitmproxy streams this request's body upstream as it comes: it says so at
    the head when the body's length is over ``stream_large_bodies``; a chunked body it
    streams once what it buffered is over it."""
    if req.stream:
        return True
    limit = human.parse_size(_stream_large_bodies())
    if limit is None:
        return False
    if "chunked" in req.headers.get("transfer-encoding", "").lower():
        return True
    length = req.headers.get("content-length", "")
    return length.isdigit() and int(length) > limit


class TracerFaults:
    def __init__(self) -> None:
        self.plan = FaultPlan()
        self._positions: dict[str, int] = {}  # client connection id -> requests seen
        self._flows: dict[str, _Flow] = {}

    def load(self, loader: Loader) -> None:
        loader.add_option(
            "tracer_faults",
            Sequence[str],
            [],
            "Faults to inject, as tracer proxy --fault specs (NAME[:ARG...][@RULE,...]), "
            "one per value.",
        )

    def configure(self, updated: set[str]) -> None:
        if "tracer_faults" not in updated:
            return
        faults = []
        for spec in ctx.options.tracer_faults:
            try:
                fault = parse_fault(spec)
            except FaultSpecError as exc:
                raise _options_error(f"tracer_faults: {exc}") from None
            why = unsupported(fault)
            if why is not None:
                raise _options_error(f"tracer_faults: {spec!r}: {why}")
            faults.append(fault)
        if [f.spec for f in faults] == self.plan.specs:
            # nothing set at the start; or mitmproxy setting the option back after it
            # refused another value: the plan in force goes on, counters and all
            return
        # the same plan object, anew: flows already decided keep their faults, positions
        # on open connections go on counting
        self.plan.replace(faults)
        tracer = ctx.master.addons.get("traceaddon")  # type: ignore[no-untyped-call]
        if tracer is not None:
            tracer.record_fault_plan(self.plan.specs, "replace" if faults else "clear")
        log.warning("tracer faults now: %s", ", ".join(self.plan.specs) or "none")
        streams = _stream_large_bodies()
        if streams and any(f.name == "status" for f in faults):
            log.warning(
                "tracer faults: status does not apply to a request whose body mitmproxy "
                "streams (stream_large_bodies=%s): such a request goes upstream",
                streams,
            )

    # ---- requests -------------------------------------------------------------------

    def client_disconnected(self, client: connection.Client) -> None:
        self._positions.pop(client.id, None)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        cid = flow.client_conn.id
        seq = self._positions[cid] = self._positions.get(cid, 0) + 1
        if not self.plan.faults:
            return
        req = flow.request
        decision = self.plan.decide(req.method, req.path, seq, req.headers.fields)
        if decision.empty:
            return
        st = self._flows[flow.id] = _Flow(seq, decision)
        fault = decision.request
        if fault is not None and fault.name == "half-open":
            self._note(flow, st, fault, "the flow is held before its body: never answered")
            flow.intercept()  # type: ignore[no-untyped-call]
        elif fault is not None and _streamed(req):
            # mitmproxy sends a body it streams (stream_large_bodies) upstream as it comes,
            # and turns streaming back on if an addon turns it off: ``request`` would come
            # too late to hold the request, and a response cannot be set for it at all
            st.early = True
            if fault.name == "status":
                log.warning(
                    "tracer fault %s not applied to request %d: mitmproxy streams its body "
                    "(stream_large_bodies), and a streamed request cannot be answered by "
                    "an addon; it goes upstream",
                    fault.spec,
                    seq,
                )
                return
            detail = "held before its body, which mitmproxy streams: never forwarded"
            self._note(flow, st, fault, detail)
            flow.intercept()  # type: ignore[no-untyped-call]

    def request(self, flow: http.HTTPFlow) -> None:
        st = self._flows.get(flow.id)
        fault = None if st is None else st.decision.request
        if st is None or fault is None or fault.name == "half-open" or st.early:
            return
        if fault.name == "status":
            self._note(flow, st, fault, f"answered {fault.status} without forwarding")
            headers = {"content-type": "application/json", "x-tracer-fault": fault.spec}
            flow.response = http.Response.make(fault.status, status_body(fault), headers)
            return
        detail = "request read and not forwarded; the connection stays open and silent"
        self._note(flow, st, fault, detail)
        flow.intercept()  # type: ignore[no-untyped-call]  # never resumed

    # ---- responses ------------------------------------------------------------------

    async def responseheaders(self, flow: http.HTTPFlow) -> None:
        st = self._flows.get(flow.id)
        resp = flow.response
        if st is None or resp is None or not st.decision.response:
            return
        faults = {f.name: f for f in st.decision.response}
        if "buffer-stream" in faults:
            self._note(flow, st, faults["buffer-stream"], "response held until its end")
            resp.stream = False
        elif resp.headers.get("content-type", "").lower().startswith("text/event-stream"):
            events = [faults[name] for name in _EVENT_FAULTS if name in faults]
            if events:
                resp.stream = _Shaper(self, flow, st, events, resp.stream).feed
        delay = faults.get("delay-first-byte")
        if delay is not None:
            self._note(flow, st, delay, f"response held {delay.seconds:g}s before its first byte")
            await asyncio.sleep(delay.seconds)

    def response(self, flow: http.HTTPFlow) -> None:
        st = self._flows.pop(flow.id, None)
        if st is None or st.stopped is None:
            return
        if st.stopped.name == "stall-after-events":
            flow.intercept()  # type: ignore[no-untyped-call]  # the end of the body never comes
        else:
            flow.kill()  # type: ignore[no-untyped-call]  # closed without the end of the body

    def error(self, flow: http.HTTPFlow) -> None:
        self._flows.pop(flow.id, None)

    def _note(self, flow: http.HTTPFlow, st: _Flow, fault: Fault, detail: str) -> None:
        note: dict[str, object] = {
            "fault": fault.name,
            "spec": fault.spec,
            "seq": st.seq,
            "detail": detail,
        }
        flow.metadata.setdefault("tracer.faults", []).append(note)
        tracer = ctx.master.addons.get("traceaddon")  # type: ignore[no-untyped-call]
        if tracer is not None:
            tracer.record_fault(flow, st.seq, fault.name, fault.spec, detail)
        log.warning("tracer fault injected: %s (request %d): %s", fault.spec, st.seq, detail)


class _Shaper:
    """The stream callable of one SSE response with event faults (mitmproxy de-chunks)."""

    def __init__(
        self,
        addon: TracerFaults,
        flow: http.HTTPFlow,
        st: _Flow,
        faults: list[Fault],
        chain: StreamFn | bool,
    ) -> None:
        self.addon, self.flow, self.st = addon, flow, st
        self.drop_done = next((f for f in faults if f.name == "drop-done"), None)
        self.stop = next((f for f in faults if f.name != "drop-done"), None)
        self.chain = chain if callable(chain) else None
        self.events = SseEvents()
        self.count = 0
        self.pending = b""  # bytes of an event not complete yet (held only for drop-done)
        if self.stop is not None and self.stop.count == 0:
            self._stopped()

    def _stopped(self) -> None:
        stop = self.stop
        assert stop is not None
        self.st.stopped = stop
        what = "stopped for good" if stop.name == "stall-after-events" else "cut"
        self.addon._note(self.flow, self.st, stop, f"stream {what} after {stop.count} events")

    def feed(self, data: bytes) -> list[bytes]:
        """The faults first, then the callable set before this one on what is left: so
        ``addons/trace.py``'s observer sees what the client gets, as the tap's does."""
        shaped = self._shape(data)
        if self.chain is None:
            return shaped
        if not data and self.st.stopped is None:  # the end of the message, passed on
            shaped.append(b"")
        out: list[bytes] = []
        for piece in shaped:
            got = self.chain(piece)
            out += [got] if isinstance(got, bytes) else list(got)
        return [piece for piece in out if piece]  # (an empty piece would end the body)

    def _shape(self, data: bytes) -> list[bytes]:
        if self.st.stopped is not None:
            return []
        if not data:  # the end of the message
            rest, self.pending = self.pending, b""
            return [rest] if rest else []  # (an empty piece would end the chunked body)
        out: list[bytes] = []
        start = 0
        for end, kind in self.events.feed(data):
            event = self.pending + data[start:end]
            self.pending = b""
            start = end
            if kind == "done" and self.drop_done is not None:
                self.addon._note(self.flow, self.st, self.drop_done, "removed data: [DONE]")
                continue
            out.append(event)
            if kind == "comment":  # heartbeats are not events (as the observer counts)
                continue
            self.count += 1
            if self.stop is not None and self.count == self.stop.count:
                self._stopped()
                return [b"".join(out)]
        rest = data[start:]
        if self.drop_done is not None:
            self.pending += rest  # it may be the start of [DONE]
        elif rest:
            out.append(rest)
        joined = b"".join(out)
        return [joined] if joined else []


def _options_error(message: str) -> exceptions.OptionsError:
    return exceptions.OptionsError(message)  # type: ignore[no-untyped-call]


addons = [TracerFaults()]
