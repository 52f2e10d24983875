"""The tracer's side of ``addons/trace.py``: mitmproxy's facts in, capture events out.

The addon inside mitmproxy only takes the facts each hook offers (times, ids, heads,
body pieces) and ships them; ``FlowObserver`` turns them into the tracer's events, the
same as the native tap's (connections and their reuse, requests, SSE event timing,
terminations, stalls), and writes the capture. It imports nothing of mitmproxy: it runs
in mitmproxy's process (``tracer_sidecar=false``, and the addon's unit tests) or in a
capture process of its own (the default, ``python -m tracer.observe.flow_process``), so
that the work per request and per SSE event is not done on mitmproxy's core, between its
own work on every piece (``bench/README.md``: the addon cost mitmdump 9-12 % of its
throughput when it did all of it there).

A fact is a named tuple of ``facts.py``; ``FlowObserver.apply`` takes one and hands it
to the handler of its kind. Each client connection is a ``flow_conn.FlowConn``: the
exchange tracker the native observer uses too, which numbers the requests, batches body
pieces, settles responses and stalls and stamps the records; this module translates
mitmproxy's facts and words into its calls. Times: ``now`` is the monotonic clock of
mitmproxy's process when the hook ran (the capture process on the same host reads the
same clock), ``ts`` a mitmproxy timestamp (wall clock), turned into the monotonic clock
with the wall offset fixed at the start (``Settings.wall``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

from .. import events as ev
from ..bus import EventBus
from ..capture.bodies import BodyBudget, RequestBody
from ..capture.files import CaptureWriter
from ..redact import redact_headers, redact_target, scrub_text
from . import facts
from .exchange import MAX_BODY_KEEP
from .exchange_state import request_head_facts, response_head_facts
from .flow_conn import Cause, Flow, FlowConn, Stream
from .flow_sse import ContentShape as ContentShape
from .flow_sse import SseObserver

log = logging.getLogger("tracer.observe.flows")

BODY_MEMORY = 64 * 1024 * 1024  # what all the request bodies held at once may take (as the tap)
BODIES = ("none", "requests", "all")

# mitmproxy's words for the ends it reports only as text (mitmproxy/proxy/layers/http)
KILLED = "Connection killed."  # mitmproxy.flow.Error.KILLED_MESSAGE
_CLIENT_GONE = ("Client disconnected", "Client closed connection")
_UPSTREAM_CUT = ("peer closed connection", "server closed connection")
# ... and its HTTP/2 layer's, for one stream or the whole connection (mitmproxy's
# proxy/layers/http/_http2.py: the same words whichever peer it speaks HTTP/2 with)
_H2_RESET = "stream reset by client"
_H2_ENDS = (_H2_RESET, "HTTP/2 connection closed", "HTTP/2 protocol error")
TLS_FAILED = "TLS handshake failed: "  # an anomaly's error, then mitmproxy's reason
_UNPARSED = ("HTTP/1 protocol error", "Cannot parse HTTP", "unexpected server response")


@dataclass(frozen=True, slots=True)
class Settings:
    """What the engine needs of mitmproxy's options, fixed when the capture opens."""

    tap: str = "mitmproxy"
    stall_after: float = 5.0
    bodies: str = "requests"
    tcp_timeout: float | None = None
    body_memory: int = BODY_MEMORY  # tracer_body_memory
    wall: float = 0.0  # time.time() - time.monotonic() in mitmproxy's process


class FlowObserver:
    """Facts from mitmproxy's hooks in, tracer events out (one capture): the flows'
    counterpart of ``observe.wire.ConnectionObserver`` (which reads bytes)."""

    def __init__(self, writer: CaptureWriter, settings: Settings, header: dict[str, Any]) -> None:
        self.writer: CaptureWriter | None = writer
        self.bus = EventBus()  # as the tap's: a sink that raises is switched off, alone
        self.bus.add("capture", writer.write)
        self.bus.add("log", _log_event)
        self.settings = settings
        self.body_budget = BodyBudget(settings.body_memory)  # every request body held, together
        self.tap = settings.tap
        self._wall = settings.wall
        self._next_conn = 0
        self._conns: dict[str, FlowConn] = {}  # by mitmproxy's client connection id
        self._flows: dict[str, Flow] = {}  # by flow id
        self._apply: dict[type[facts.Fact], Callable[[Any], None]] = {
            facts.Conn: self._on_conn,
            facts.Upstream: self._on_upstream,
            facts.UpstreamClosed: self._on_upstream_closed,
            facts.TlsFailed: self._on_tls_failed,
            facts.ClientGone: self._on_client_gone,
            facts.Request: self._on_request,
            facts.RequestPieces: self._on_request_pieces,
            facts.RequestEnd: self._on_request_end,
            facts.Response: self._on_response,
            facts.Pieces: self._on_pieces,
            facts.ResponseEnd: self._on_response_end,
            facts.Error: self._on_error,
            facts.Fault: self._on_fault,
            facts.FaultPlan: self._on_fault_plan,
            facts.Tick: self._on_tick,
            facts.Lost: self._on_lost,
            facts.Close: self._on_close,
        }
        writer.write(ev.CaptureStart(tap=self.tap, **header))

    def apply(self, fact: facts.Fact) -> None:
        """One fact; a failure is logged and the next fact goes on."""
        try:
            self._apply[type(fact)](fact)
        except Exception:
            log.exception("tracer: a %s fact could not be recorded", type(fact).__name__)

    @property
    def closed(self) -> bool:
        return self.writer is None

    def _on_close(self, f: facts.Close) -> None:
        """Settle what is open (in flight, closed by the tap) and end the capture."""
        for conn in list(self._conns.values()):
            _note_cause(conn, "tracer")
            for st in list(conn.pending):
                conn.end_response(st, f.now, "in_flight", detail="tap stopped")
            self._conn_close(conn, f.now)
        self._conns.clear()
        self._flows.clear()
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.finish(self.tap, f.reason)

    # ---- connections ------------------------------------------------------------------

    def _on_conn(self, f: facts.Conn) -> None:
        if f.cid in self._conns:
            return
        self._next_conn += 1
        opened = min(f.ts - self._wall if f.ts else f.now, f.now)
        conn = self._conns[f.cid] = FlowConn(
            self._next_conn,
            f.cid,
            opened,
            self._flows,
            tap=self.tap,
            emit=self._emit,
            wall=self._wall,
            bodies=self.settings.bodies,
        )
        conn.record(ev.ConnOpen, opened, peer=_addr(f.peer), local=_addr(f.local))

    def _conn(self, cid: str, now: float) -> FlowConn:
        conn = self._conns.get(cid)
        if conn is None:  # the addon ships ``conn`` first; a lost one still gets a record
            self._on_conn(facts.Conn(cid, now, None, None, None))
            conn = self._conns[cid]
        return conn

    def _on_upstream(self, f: facts.Upstream) -> None:
        conn = self._conn(f.cid, f.now)
        elapsed = None
        if f.phase == "done":
            conn.upstream_opened = True
            if f.ts_start and f.ts_setup:
                elapsed = round(f.ts_setup - f.ts_start, 6)
        elif f.phase == "failed" and f.ts_start:
            elapsed = round(f.now + self._wall - f.ts_start, 6)
        conn.record(
            ev.UpstreamConnect,
            f.now,
            phase=f.phase,
            addr=_addr(f.addr),
            local=_addr(f.local) if f.phase == "done" else None,
            elapsed=elapsed,
            error=(f.error or "connect failed") if f.phase == "failed" else None,
        )

    def _on_upstream_closed(self, f: facts.UpstreamClosed) -> None:
        """mitmproxy's ``server_disconnected`` while the client connection is open: the
        upstream (or mitmproxy) closed one of its upstream connections; the next request
        on the client connection gets a new one."""
        conn = self._conns.get(f.cid)
        if conn is None or conn.cause is not None:  # the client connection is ending
            return
        m = min(f.ts - self._wall, f.now) if f.ts else f.now
        conn.record(
            ev.UpstreamClose,
            m,
            addr=_addr(f.addr),
            local=_addr(f.local) if f.local else None,
            idle=round(max(0.0, m - conn.last_activity_m), 6),
            in_flight=bool(conn.pending),
            requests=conn.seq,
            error=f.error or None,
        )

    def _on_tls_failed(self, f: facts.TlsFailed) -> None:
        """A TLS handshake failed: no request can come (from the client) or go (to the
        upstream) on it. mitmproxy's text says why, e.g. that the client does not trust
        its certificate; the request that needed the upstream gets mitmproxy's 502."""
        self._conn(f.cid, f.now).record(
            ev.Anomaly,
            f.now,
            seq=None,
            direction=f.direction,
            error=f"{TLS_FAILED}{f.error or 'no reason given'}",
            offset=0,
        )

    def _on_client_gone(self, f: facts.ClientGone) -> None:
        conn = self._conns.get(f.cid)
        if conn is None:
            return
        now = f.now
        if conn.cause is None:
            idle = now - conn.last_activity_m
            timeout = self.settings.tcp_timeout
            closed_by_timeout = timeout is not None and idle >= timeout - 1
            _note_cause(conn, "tracer" if closed_by_timeout else "client")
        if conn.pending:  # no error hook for them (yet): settle them by what is known
            termination: ev.Termination = (
                "truncated"
                if conn.cause == "upstream"
                else "in_flight"
                if conn.cause == "tracer"
                else "client_abort"
            )
            for st in list(conn.pending):
                conn.end_response(st, now, termination, detail="client connection closed")
        self._conn_close(conn, now)

    def _conn_close(self, conn: FlowConn, now: float) -> None:
        self._conns.pop(conn.cid, None)
        closed_by = conn.cause or "client"
        # mitmproxy does not tell FIN from reset, nor who half-closed (see README)
        how: Any = "tracer" if closed_by == "tracer" else "unknown"
        conn.record(
            ev.ConnClose,
            now,
            closed_by=closed_by,
            how=how,
            in_flight=conn.in_flight_at_cause,
            requests=conn.seq,
            bytes_from_client=conn.client_bytes,
            bytes_from_upstream=conn.upstream_bytes,
            upstream_opened=conn.upstream_opened,
            duration=round(now - conn.opened_m, 6),
        )

    # ---- requests ---------------------------------------------------------------------

    def _on_request(self, f: facts.Request) -> None:
        head_m = min(f.ts - self._wall, f.now)
        conn = self._conn(f.cid, f.now)
        version = f.version
        if version.startswith(("HTTP/2", "HTTP/3")):
            conn.multiplexed = True
        head = request_head_facts((name.lower(), value) for name, value in f.fields)
        json_body = head.json_body
        conn.client_bytes += f.line + 14 + _fields_size(f.fields)
        st = Flow(f.fid, conn, head_m, json_body)
        connection = [value for name, value in head.hop if name == b"connection"]
        if _client_closes(version, connection):
            st.closes = "tracer"  # mitmproxy closes the client connection after it
        if f.h2:
            st.stream = Stream(head_m)
        conn.sign_of_life(st, head_m)
        conn.request_head(
            st,
            method=f.method,
            target=redact_target(f.path),
            version=_version(version),
            headers=redact_headers(f.fields),
            facts=head,
        )
        self._flows[f.fid] = st
        if f.streamed:  # another addon streams the request: count it as it goes by
            keep = json_body or self.settings.bodies != "none"  # for the record or its fields
            st.req_body = RequestBody(MAX_BODY_KEEP, keep=keep, budget=self.body_budget)

    def _on_request_pieces(self, f: facts.RequestPieces) -> None:
        st = self._flows.get(f.fid)
        if st is None or st.req_body is None:
            return
        for m, data in zip(f.times, f.pieces, strict=True):
            st.req_body.add(data)
            st.conn.sign_of_life(st, m)

    def _on_request_end(self, f: facts.RequestEnd) -> None:
        st = self._flows.get(f.fid)
        if st is None or st.request_done:
            return
        end_m = (f.ts - self._wall) if f.ts else f.now
        st.conn.sign_of_life(st, end_m)
        if f.answered:  # an addon answered before the upstream was asked
            st.by_proxy = True
        self._request_end(st, f.content, end_m, complete=True)

    def _request_end(self, st: Flow, content: bytes | None, m: float, *, complete: bool) -> None:
        body = st.req_body
        if body is None:  # buffered by mitmproxy: one piece
            body = RequestBody(MAX_BODY_KEEP, budget=self.body_budget)
            if content:
                body.add(content)
        st.req_body = None
        st.conn.client_bytes += body.size
        st.conn.request_end(st, m, body, complete=complete)

    # ---- responses --------------------------------------------------------------------

    def _on_response(self, f: facts.Response) -> None:
        st = self._flows.get(f.fid)
        if st is None or st.ended:
            return
        head_m = min(f.ts - self._wall, f.now) if f.ts else f.now
        fields = f.fields
        content_length, chunked, sse, keep_alive = response_head_facts(
            ((name.lower(), value) for name, value in fields),
            keep_alive=f.version != "HTTP/1.0",
        )
        conn = st.conn
        conn.upstream_bytes += f.line + 15 + _fields_size(fields)
        if sse:
            st.sse = SseObserver(conn.shape)
        if sse or self.settings.bodies == "all":
            st.kept = []
        conn.sign_of_life(st, head_m)
        conn.response_head(
            st,
            head_m,
            status=f.status,
            reason=f.reason,
            version=_version(f.version),
            headers=redact_headers(fields),
            sse=sse,
            content_length=content_length,
            chunked=chunked,
            keep_alive=keep_alive,
            by_tracer=st.by_proxy,
        )
        if not keep_alive:
            st.closes = "upstream"
        st.streamed_response = f.streamed and not st.by_proxy

    def _on_pieces(self, f: facts.Pieces) -> None:
        """Body pieces as mitmproxy handed them to the stream callable: their times, and
        the pieces themselves (the addon sends only their sizes when neither SSE nor
        ``tracer_bodies=all`` needs them). They go into the batch the next ``body``
        record writes (``ExchangeTracker.add_pieces``): on a tick, before a stall record
        and at the end of the response too."""
        st = self._flows.get(f.fid)
        if st is None or st.ended:
            return
        st.conn.add_pieces(st, f.times, f.pieces)

    def _on_response_end(self, f: facts.ResponseEnd) -> None:
        """mitmproxy's ``response`` hook. ``content``: the body mitmproxy buffered (not
        streamed; its size when the pieces are not needed); ``request``: the request's
        body when its ``request`` hook had not come (a response before the upload ended);
        ``held``: on HTTP/2, the bytes mitmproxy still holds for the client."""
        st = self._flows.get(f.fid)
        if st is None or st.ended:
            return
        now, conn = f.now, st.conn
        if not st.request_done:  # the response came first (e.g. 413 during an upload)
            self._request_end(st, f.request, now, complete=True)
        if f.body_end is not None:
            end_m = f.body_end
        else:
            end_m = min((f.ts or (now + self._wall)) - self._wall, now)
        if not st.streamed_response and st.resp_head_m is not None and f.content:
            conn.add_pieces(st, [end_m], [f.content])  # buffered: one piece, at the end
        conn.body_done(st, end_m)
        if st.injected_stop == "truncate-after-events":  # faults.py kills it right after
            _ended_by(conn, "tracer")
            conn.end_response(st, now, "truncated", detail="cut by an injected fault")
            return
        if st.injected_stop is not None:  # held for good by faults.py: in flight, stalls
            return
        if st.by_proxy:
            conn.end_response(st, end_m, "tracer_response", detail="answered by a mitmproxy addon")
        elif st.stream is not None and f.held:
            st.stream.held = f.held  # ends when its last bytes leave (FlowConn.delivery_check)
            st.stream.upstream_end_m = end_m
        elif st.status == 101:
            conn.end_response(st, end_m, "complete", detail="switched protocols")
        else:
            conn.end_response(st, end_m, "complete")
        if st.closes is not None:  # the connection ends after this exchange
            _ended_by(conn, st.closes)

    def _on_error(self, f: facts.Error) -> None:
        """End the response by what mitmproxy's error says (see ``addons/trace.py``,
        rule 3)."""
        st = self._flows.get(f.fid)
        if st is None or st.ended:
            return
        msg = f.msg
        m = min(f.ts - self._wall, f.now) if f.ts else f.now
        conn = st.conn
        if msg == KILLED:
            _ended_by(conn, "tracer")
            if not st.request_done:
                self._request_end(st, f.request, m, complete=False)
            conn.end_response(st, m, "in_flight", detail=f"killed in mitmproxy: {msg}")
            return
        termination = _cut_termination(
            conn, msg, server_h2=f.server_h2, client_reads=f.client_reads
        )
        if not st.request_done:
            self._request_end(st, f.request, m, complete=False)
        if termination == "client_abort":
            if not msg.startswith(_H2_RESET):  # (a reset ends one HTTP/2 stream, no more)
                _note_cause(conn, "client")  # the client's connection ends
            conn.end_response(st, m, "client_abort", detail=msg)
            return
        if st.resp_head_m is None and (f.server_error or not f.server_peer):
            # mitmproxy answered the client itself (its 502: the upstream is unreachable)
            conn.tracer_answer(st, m, 502, "Bad Gateway", msg)
            _ended_by(conn, "tracer")  # after the answer: nothing is left in flight
            return
        _ended_by(conn, "upstream")
        if msg.startswith(_UNPARSED) and not any(s in msg for s in _UPSTREAM_CUT):
            conn.record(
                ev.Anomaly,
                m,
                seq=st.seq,
                direction="upstream",
                error=scrub_text(msg),
                offset=st.resp_bytes,  # body bytes before it (mitmproxy hides framing)
            )
            conn.end_response(st, m, "unparsed", detail=msg)
            return
        conn.end_response(st, m, "truncated", detail=msg)

    # ---- the ticker -------------------------------------------------------------------

    def _on_tick(self, f: facts.Tick) -> None:
        """The addon's ticker: flush old body batches; start stalls for requests gone
        silent (``FlowConn.look``)."""
        stall_after = self.settings.stall_after
        for conn in list(self._conns.values()):
            blocked, unsent = f.backlog.get(conn.cid, (False, None))
            conn.look(f.now, stall_after, blocked, unsent, f.streams)

    # ---- injected faults (from addons/faults.py) ------------------------------------------

    def _on_fault(self, f: facts.Fault) -> None:
        st = self._flows.get(f.fid)
        conn = st.conn if st is not None else self._conn(f.cid, f.now)
        if st is not None and f.fault in ("stall-after-events", "truncate-after-events"):
            st.injected_stop = f.fault
        conn.record(
            ev.FaultInjected,
            f.now,
            seq=st.seq if st is not None else f.seq,
            fault=f.fault,
            spec=f.spec,
            detail=f.detail,
        )

    def _on_fault_plan(self, f: facts.FaultPlan) -> None:
        now = f.now
        self._emit(
            ev.FaultPlanChanged(
                t=now + self._wall, m=now, tap=self.tap, faults=list(f.specs), change=f.change
            )
        )

    def _on_lost(self, f: facts.Lost) -> None:
        """Facts mitmproxy's process dropped: the capture process fell behind and the
        backlog for it passed its bound (``addons/trace.py``, ``MAX_BACKLOG``)."""
        self._emit(
            ev.CaptureLoss(
                t=f.now + self._wall,
                m=f.now,
                tap=self.tap,
                dropped=f.facts,
                dropped_bytes=f.size,
                reason="the capture process fell behind: facts from mitmproxy dropped",
            )
        )

    # ---- output ---------------------------------------------------------------------------

    def _emit(self, event: ev.Event) -> None:
        if self.writer is not None:  # (None: the capture was closed)
            self.bus.publish(event)


def _log_event(event: ev.Event) -> None:
    """mitmproxy's log: the stalls and the responses that did not end complete."""
    if isinstance(event, ev.Stall):
        if event.phase == "start":
            log.warning(
                "tracer: stall started (conn %d, request %d): %s for %.3fs",
                event.conn,
                event.seq,
                event.direction,
                event.silent_for,
            )
        else:
            log.info(
                "tracer: stall ended (conn %d, request %d) after %.3fs",
                event.conn,
                event.seq,
                event.silent_for,
            )
    elif isinstance(event, ev.ResponseEnd) and event.termination != "complete":
        log.warning(
            "tracer: response ended %s (conn %d, request %d): %s",
            event.termination,
            event.conn,
            event.seq,
            event.detail or "-",
        )


def _ended_by(conn: FlowConn, cause: Cause) -> None:
    """An exchange ended in a way that ends an HTTP/1 connection; an HTTP/2 stream's
    end (a reset, a cut upstream, a kill) leaves its connection open."""
    if not conn.multiplexed:
        _note_cause(conn, cause)


def _note_cause(conn: FlowConn, cause: Cause) -> None:
    if conn.cause is None:
        conn.cause = cause
        conn.in_flight_at_cause = bool(conn.pending)


def _cut_termination(
    conn: FlowConn, msg: str, *, server_h2: bool, client_reads: bool
) -> ev.Termination:
    """Who went first: the client (mitmproxy says so, or its socket stopped reading)."""
    if msg.startswith(_CLIENT_GONE):
        return "client_abort"
    if conn.multiplexed and msg.startswith(_H2_ENDS) and not server_h2:
        return "client_abort"  # HTTP/2 words, and only the client speaks HTTP/2 here
    if not client_reads:
        return "client_abort"
    return "truncated"


def _version(http_version: str) -> str:
    return http_version.removeprefix("HTTP/")


def _addr(value: Any) -> str:
    if isinstance(value, tuple | list) and len(value) >= 2:
        host = str(value[0])
        return f"[{host}]:{value[1]}" if ":" in host else f"{host}:{value[1]}"
    return str(value) if value else "-"


def _fields_size(fields: tuple[tuple[bytes, bytes], ...]) -> int:
    """The bytes of a head's header lines (``name: value`` and CRLF each)."""
    return 4 * len(fields) + sum(map(len, chain.from_iterable(fields)))


def _client_closes(http_version: str, connection: list[bytes]) -> bool:
    """Whether mitmproxy ends the client connection after this request: its own
    ``http1.connection_close`` (``Connection`` tokens, else the version's default), from
    the header values the loop over the head already picked out."""
    if connection:
        tokens = [token.strip() for token in b", ".join(connection).split(b",")]
        if b"close" in tokens:
            return True
        if b"keep-alive" in tokens:
            return False
    return http_version not in ("HTTP/1.1", "HTTP/2.0")
