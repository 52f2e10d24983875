"""The tracer's side of ``addons/trace.py``: mitmproxy's facts in, capture events out.

The addon inside mitmproxy only takes the facts each hook offers (times, ids, heads,
body pieces) and ships them; ``FlowObserver`` turns them into the tracer's events, the
same as the native tap's (connections and their reuse, requests, SSE event timing,
terminations, stalls), and writes the capture. It imports nothing of mitmproxy: it runs
in mitmproxy's process (``tracer_sidecar=false``, and the addon's unit tests) or in a
capture process of its own (the default, ``python -m tracer.observe.flows``), so that the work
per request and per SSE event is not done on mitmproxy's core, between its own work on
every piece (``bench/README.md``: the addon cost mitmdump 9-12 % of its throughput when it
did all of it there).

A fact is a tuple: its kind, then its fields (``FACTS`` names them); ``FlowObserver.apply``
takes one. Times: ``now`` is the monotonic clock of mitmproxy's process when the hook
ran (the capture process on the same host reads the same clock), ``ts`` a mitmproxy
timestamp (wall clock), turned into the monotonic clock with the wall offset fixed at
the start (``Settings.wall``). The wire between the two processes is ``write_frames`` /
``read_frames``: length-prefixed ``marshal`` batches of facts (the same interpreter at
both ends; nothing else reads them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, islice, repeat
from operator import sub
from typing import Any, Literal

from .. import events as ev
from ..bus import EventBus
from ..capture.bodies import BodyBudget, RequestBody, encode_body
from ..capture.files import CaptureWriter
from ..protocol.sse import SseEvent
from ..redact import redact_headers, redact_target, scrub_text
from .exchange import (
    BODY_BATCH_READS,
    BODY_BATCH_SECONDS,
    MAX_BODY_KEEP,
    ResponseState,
    StallDirection,
    count_sse,
    end_stall,
    response_end,
    response_head_facts,
    stall_direction,
    start_stall,
)
from .flow_sse import ContentShape as ContentShape
from .flow_sse import SseObserver as SseObserver

log = logging.getLogger("tracer.observe.flows")

BODY_MEMORY = 64 * 1024 * 1024  # what all the request bodies held at once may take (as the tap)
BODIES = ("none", "requests", "all")
# The pieces of a batch kept until it is written (SSE, tracer_bodies=all) stay under about
# MAX_KEPT_BYTES: pieces under BIG_PIECE are bounded by BODY_BATCH_READS (256 x 4 KiB);
# a bigger one makes the batch due once the batch would pass the bound.
MAX_KEPT_BYTES = 1 << 20
BIG_PIECE = 4096

Cause = Literal["client", "upstream", "tracer"]
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

# What each fact carries after its kind (the order of its tuple).
FACTS: dict[str, tuple[str, ...]] = {
    "conn": ("cid", "now", "ts", "peer", "local"),
    "upstream": ("cid", "now", "phase", "addr", "local", "ts_start", "ts_setup", "error"),
    "upstream_closed": ("cid", "now", "ts", "addr", "local", "error"),
    "tls_failed": ("cid", "now", "direction", "error"),
    "client_gone": ("cid", "now"),
    "request": ("fid", "cid", "now", "ts", "method", "path", "version", "fields", "line", "streamed", "h2"),
    "request_pieces": ("fid", "times", "pieces"),
    "request_end": ("fid", "now", "ts", "content", "answered"),
    "response": ("fid", "now", "ts", "status", "reason", "version", "fields", "line", "streamed"),
    "pieces": ("fid", "times", "pieces"),
    "response_end": ("fid", "now", "ts", "body_end", "content", "request", "held"),
    "error": ("fid", "now", "msg", "ts", "server_error", "server_peer", "server_h2", "client_reads", "request"),
    "fault": ("fid", "cid", "now", "seq", "fault", "spec", "detail"),
    "fault_plan": ("now", "specs", "change"),
    "tick": ("now", "backlog", "streams"),
    "lost": ("now", "facts", "size"),
    "close": ("now", "reason"),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Settings:
    """What the engine needs of mitmproxy's options, fixed when the capture opens."""

    tap: str = "mitmproxy"
    stall_after: float = 5.0
    bodies: str = "requests"
    tcp_timeout: float | None = None
    body_memory: int = BODY_MEMORY  # tracer_body_memory
    wall: float = 0.0  # time.time() - time.monotonic() in mitmproxy's process


class _Conn:
    """One client connection as seen through mitmproxy."""

    __slots__ = (
        "cause",
        "cid",
        "client_bytes",
        "conn",
        "in_flight_at_cause",
        "last_activity_m",
        "last_end_m",
        "multiplexed",
        "opened_m",
        "pending",
        "seq",
        "shape",
        "upstream_bytes",
        "upstream_opened",
    )

    def __init__(self, conn: int, cid: str, opened_m: float) -> None:
        self.conn = conn
        self.cid = cid
        self.opened_m = opened_m
        self.seq = 0
        self.last_end_m = opened_m
        self.last_activity_m = opened_m
        self.pending: list[_Flow] = []  # requests whose response has not ended, in order
        self.client_bytes = 0  # message bytes (heads + bodies) as mitmproxy assembled them
        self.upstream_bytes = 0
        self.upstream_opened = False
        # HTTP/2 (or 3) from the client: requests run at once, each as its own stream,
        # and one ending (a reset, a cut upstream) does not end the connection
        self.multiplexed = False
        self.shape = ContentShape()  # of the content chunks on this connection
        # why the client connection is going to end, decided at the first sign of it
        self.cause: Cause | None = None
        self.in_flight_at_cause = False


class _Stream:
    """The client's HTTP/2 stream that carries a flow: the bytes mitmproxy held for it
    under flow control at the addon's last look (``FlowObserver._delivery_check``)."""

    __slots__ = ("delivered", "held", "held_since", "upstream_end_m")

    def __init__(self, since: float) -> None:
        self.held = 0  # bytes held for the client at the last look
        self.held_since = since  # since when the client has taken none of them
        self.delivered = 0  # bytes the client has taken
        # the upstream's end, while the last bytes wait for the client (the response
        # ends when they leave)
        self.upstream_end_m: float | None = None


class _Flow(ResponseState[SseObserver]):
    """Mutable per-request state while it is in flight (``sniff._Request``'s counterpart)."""

    __slots__ = (
        "active_m",
        "by_proxy",
        "closes",
        "conn",
        "fid",
        "injected_stop",
        "json_body",
        "kept",
        "pieces",
        "req_body",
        "sizes",
        "stream",
        "streamed_response",
        "times",
    )

    def __init__(self, fid: str, conn: _Conn, seq: int, head_m: float, json_body: bool) -> None:
        super().__init__(seq, head_m)
        self.active_m = head_m  # its last sign of life (a stream's own, on HTTP/2)
        self.fid = fid
        self.conn = conn
        self.json_body = json_body
        self.req_body: RequestBody | None = None  # a streamed request body as it arrives
        self.by_proxy = False
        # who ends the connection after this exchange (Connection: close, HTTP/1.0)
        self.closes: Literal["upstream", "tracer"] | None = None
        self.streamed_response = False
        # the batch of body pieces not yet written: arrival times, sizes, and the pieces
        # themselves for SSE (classified a batch at a time) and with tracer_bodies=all
        self.times: list[float] = []
        self.sizes: list[int] = []
        self.pieces: list[bytes] | None = None
        self.kept = 0  # bytes of the pieces kept in the batch
        self.stream: _Stream | None = None  # HTTP/2, when mitmproxy's stream is found
        # addons/faults.py stopped passing the body on (stall- or truncate-after-events):
        # the upstream's end is not the client's, the kill or hold that follows is
        self.injected_stop: str | None = None


class FlowObserver:
    """Facts from mitmproxy's hooks in, tracer events out (one capture): the flows'
    counterpart of ``observe.wire.ConnectionObserver`` (which reads bytes)."""

    def __init__(self, writer: CaptureWriter, settings: Settings, header: dict[str, Any]) -> None:
        self.writer: CaptureWriter | None = writer
        self.bus = EventBus()  # as the tap's: a sink that raises is switched off, alone
        self.bus.add("capture", writer.write)
        self.settings = settings
        self.body_budget = BodyBudget(settings.body_memory)  # every request body held, together
        self.tap = settings.tap
        self._wall = settings.wall
        self._next_conn = 0
        self._conns: dict[str, _Conn] = {}  # by mitmproxy's client connection id
        self._flows: dict[str, _Flow] = {}  # by flow id
        self._apply: dict[str, Callable[..., None]] = {
            kind: getattr(self, "_on_" + kind) for kind in FACTS
        }
        writer.write(ev.CaptureStart(tap=self.tap, **header))

    def apply(self, fact: tuple[Any, ...]) -> None:
        """One fact; a failure is logged and the next fact goes on."""
        try:
            self._apply[fact[0]](*fact[1:])
        except Exception:
            log.exception("tracer: a %s fact could not be recorded", fact[0])

    @property
    def closed(self) -> bool:
        return self.writer is None

    def _on_close(self, now: float, reason: str) -> None:
        """Settle what is open (in flight, closed by the tap) and end the capture."""
        for conn in list(self._conns.values()):
            self._note_cause(conn, "tracer")
            for st in list(conn.pending):
                self._end(st, now, "in_flight", detail="tap stopped")
            self._conn_close(conn, now)
        self._conns.clear()
        self._flows.clear()
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.finish(self.tap, reason)

    # ---- connections ------------------------------------------------------------------

    def _on_conn(self, cid: str, now: float, ts: float | None, peer: Any, local: Any) -> None:
        if cid in self._conns:
            return
        self._next_conn += 1
        opened = ts - self._wall if ts else now
        conn = self._conns[cid] = _Conn(self._next_conn, cid, min(opened, now))
        self._emit(
            ev.ConnOpen(
                t=conn.opened_m + self._wall,
                m=conn.opened_m,
                tap=self.tap,
                conn=conn.conn,
                peer=_addr(peer),
                local=_addr(local),
            )
        )

    def _conn(self, cid: str, now: float) -> _Conn:
        conn = self._conns.get(cid)
        if conn is None:  # the addon ships ``conn`` first; a lost one still gets a record
            self._on_conn(cid, now, None, None, None)
            conn = self._conns[cid]
        return conn

    def _on_upstream(
        self,
        cid: str,
        now: float,
        phase: Literal["start", "done", "failed"],
        addr: Any,
        local: Any,
        ts_start: float | None,
        ts_setup: float | None,
        error: str | None,
    ) -> None:
        conn = self._conn(cid, now)
        elapsed = None
        if phase == "done":
            conn.upstream_opened = True
            if ts_start and ts_setup:
                elapsed = round(ts_setup - ts_start, 6)
        elif phase == "failed" and ts_start:
            elapsed = round(now + self._wall - ts_start, 6)
        self._emit(
            ev.UpstreamConnect(
                t=now + self._wall,
                m=now,
                tap=self.tap,
                conn=conn.conn,
                phase=phase,
                addr=_addr(addr),
                local=_addr(local) if phase == "done" else None,
                elapsed=elapsed,
                error=(error or "connect failed") if phase == "failed" else None,
            )
        )

    def _on_upstream_closed(
        self,
        cid: str,
        now: float,
        ts: float | None,
        addr: Any,
        local: Any,
        error: str | None,
    ) -> None:
        """mitmproxy's ``server_disconnected`` while the client connection is open: the
        upstream (or mitmproxy) closed one of its upstream connections; the next request
        on the client connection gets a new one."""
        conn = self._conns.get(cid)
        if conn is None or conn.cause is not None:  # the client connection is ending
            return
        m = min(ts - self._wall, now) if ts else now
        self._emit(
            ev.UpstreamClose(
                t=m + self._wall,
                m=m,
                tap=self.tap,
                conn=conn.conn,
                addr=_addr(addr),
                local=_addr(local) if local else None,
                idle=round(max(0.0, m - conn.last_activity_m), 6),
                in_flight=bool(conn.pending),
                requests=conn.seq,
                error=error or None,
            )
        )

    def _on_tls_failed(
        self, cid: str, now: float, direction: Literal["client", "upstream"], error: str | None
    ) -> None:
        """A TLS handshake failed: no request can come (from the client) or go (to the
        upstream) on it. mitmproxy's text says why, e.g. that the client does not trust
        its certificate; the request that needed the upstream gets mitmproxy's 502."""
        conn = self._conn(cid, now)
        self._emit(
            ev.Anomaly(
                t=now + self._wall,
                m=now,
                tap=self.tap,
                conn=conn.conn,
                seq=None,
                direction=direction,
                error=f"{TLS_FAILED}{error or 'no reason given'}",
                offset=0,
            )
        )

    def _on_client_gone(self, cid: str, now: float) -> None:
        conn = self._conns.get(cid)
        if conn is None:
            return
        if conn.cause is None:
            idle = now - conn.last_activity_m
            timeout = self.settings.tcp_timeout
            closed_by_timeout = timeout is not None and idle >= timeout - 1
            self._note_cause(conn, "tracer" if closed_by_timeout else "client")
        if conn.pending:  # no error hook for them (yet): settle them by what is known
            termination: ev.Termination = (
                "truncated"
                if conn.cause == "upstream"
                else "in_flight"
                if conn.cause == "tracer"
                else "client_abort"
            )
            for st in list(conn.pending):
                self._end(st, now, termination, detail="client connection closed")
        self._conn_close(conn, now)

    def _conn_close(self, conn: _Conn, now: float) -> None:
        self._conns.pop(conn.cid, None)
        closed_by = conn.cause or "client"
        # mitmproxy does not tell FIN from reset, nor who half-closed (see README)
        how: Any = "tracer" if closed_by == "tracer" else "unknown"
        self._emit(
            ev.ConnClose(
                t=now + self._wall,
                m=now,
                tap=self.tap,
                conn=conn.conn,
                closed_by=closed_by,
                how=how,
                in_flight=conn.in_flight_at_cause,
                requests=conn.seq,
                bytes_from_client=conn.client_bytes,
                bytes_from_upstream=conn.upstream_bytes,
                upstream_opened=conn.upstream_opened,
                duration=round(now - conn.opened_m, 6),
            )
        )

    def _ended_by(self, conn: _Conn, cause: Cause) -> None:
        """An exchange ended in a way that ends an HTTP/1 connection; an HTTP/2 stream's
        end (a reset, a cut upstream, a kill) leaves its connection open."""
        if not conn.multiplexed:
            self._note_cause(conn, cause)

    def _note_cause(self, conn: _Conn, cause: Cause) -> None:
        if conn.cause is None:
            conn.cause = cause
            conn.in_flight_at_cause = bool(conn.pending)

    # ---- requests ---------------------------------------------------------------------

    def _on_request(
        self,
        fid: str,
        cid: str,
        now: float,
        ts: float,
        method: str,
        path: str,
        version: str,
        fields: tuple[tuple[bytes, bytes], ...],
        line: int,
        streamed: bool,
        h2: bool,
    ) -> None:
        head_m = min(ts - self._wall, now)
        conn = self._conn(cid, now)
        conn.seq += 1
        if version.startswith(("HTTP/2", "HTTP/3")):
            conn.multiplexed = True
        content_length: int | None = None
        chunked = expect = json_body = False
        request_id: str | None = None
        connection: list[bytes] = []
        for name, value in fields:
            lower = name.lower()
            if lower not in _REQUEST_HEADERS_READ:
                continue
            if lower == b"content-length":
                try:
                    content_length = int(value)
                except ValueError:
                    content_length = None
            elif lower == b"transfer-encoding":
                chunked = True
            elif lower == b"expect":
                expect = value.lower() == b"100-continue"
            elif lower == b"x-request-id":
                request_id = value.decode("latin-1")
            elif lower == b"content-type":
                json_body = b"json" in value.lower()
            elif lower == b"connection":
                connection.append(value)
        conn.client_bytes += line + 14 + _fields_size(fields)
        pipelined = bool(conn.pending)
        st = _Flow(fid, conn, conn.seq, head_m, json_body)
        if _client_closes(version, connection):
            st.closes = "tracer"  # mitmproxy closes the client connection after it
        if h2:
            st.stream = _Stream(head_m)
        conn.pending.append(st)
        self._flows[fid] = st
        self._activity(conn, head_m, st)
        idle = 0.0 if pipelined else max(0.0, head_m - conn.last_end_m)
        self._emit(
            ev.RequestHead(
                t=head_m + self._wall,
                m=head_m,
                tap=self.tap,
                conn=conn.conn,
                seq=st.seq,
                idle_before=round(idle, 6),
                method=method,
                target=redact_target(path),
                version=_version(version),
                headers=redact_headers(fields),
                request_id=request_id,
                content_length=content_length,
                chunked=chunked,
                expect_continue=expect,
                pipelined=pipelined,
            )
        )
        if streamed:  # another addon streams the request: count it as it goes by
            keep = json_body or self.settings.bodies != "none"  # for the record or its fields
            st.req_body = RequestBody(MAX_BODY_KEEP, keep=keep, budget=self.body_budget)

    def _on_request_pieces(self, fid: str, times: list[float], pieces: list[bytes]) -> None:
        st = self._flows.get(fid)
        if st is None or st.req_body is None:
            return
        for m, data in zip(times, pieces, strict=True):
            st.req_body.add(data)
            self._activity(st.conn, m, st)

    def _on_request_end(
        self, fid: str, now: float, ts: float | None, content: bytes | None, answered: bool
    ) -> None:
        st = self._flows.get(fid)
        if st is None or st.request_done:
            return
        end_m = (ts - self._wall) if ts else now
        self._activity(st.conn, end_m, st)
        if answered:  # an addon answered before the upstream was asked
            st.by_proxy = True
        self._request_end(st, content, end_m, complete=True)

    def _request_end(self, st: _Flow, content: bytes | None, m: float, *, complete: bool) -> None:
        st.request_done = True
        body = st.req_body
        if body is None:  # buffered by mitmproxy: one piece
            body = RequestBody(MAX_BODY_KEEP, budget=self.body_budget)
            if content:
                body.add(content)
        st.req_body = None
        st.conn.client_bytes += body.size
        fields = body.record(keep=self.settings.bodies != "none", json_body=st.json_body)
        self._emit(
            ev.RequestEnd(
                t=m + self._wall,
                m=m,
                tap=self.tap,
                conn=st.conn.conn,
                seq=st.seq,
                complete=complete,
                body_bytes=body.size,
                **fields,
            )
        )

    # ---- responses --------------------------------------------------------------------

    def _on_response(
        self,
        fid: str,
        now: float,
        ts: float | None,
        status: int,
        reason: str,
        version: str,
        fields: tuple[tuple[bytes, bytes], ...],
        line: int,
        streamed: bool,
    ) -> None:
        st = self._flows.get(fid)
        if st is None or st.ended:
            return
        head_m = min(ts - self._wall, now) if ts else now
        st.status = status
        st.resp_head_m = st.last_data_m = head_m
        content_length, chunked, sse, keep_alive = response_head_facts(
            ((name.lower(), value) for name, value in fields),
            keep_alive=version != "HTTP/1.0",
        )
        st.conn.upstream_bytes += line + 15 + _fields_size(fields)
        if sse:
            st.sse = SseObserver(st.conn.shape)
        if sse or self.settings.bodies == "all":
            st.pieces = []
        self._activity(st.conn, head_m, st)
        self._emit(
            ev.ResponseHead(
                t=head_m + self._wall,
                m=head_m,
                tap=self.tap,
                conn=st.conn.conn,
                seq=st.seq,
                status=status,
                reason=reason,
                version=_version(version),
                headers=redact_headers(fields),
                ttfb=round(head_m - st.head_m, 6),
                sse=sse,
                content_length=content_length,
                chunked=chunked,
                keep_alive=keep_alive,
                by_tracer=st.by_proxy,
            )
        )
        if not keep_alive:
            st.closes = "upstream"
        st.streamed_response = streamed and not st.by_proxy

    def _on_pieces(self, fid: str, times: list[float], pieces: list[bytes | int]) -> None:
        """Body pieces as mitmproxy handed them to the stream callable: their times, and
        the pieces themselves (the addon sends only their sizes when neither SSE nor
        ``tracer_bodies=all`` needs them). They go into the batch the next ``body``
        record writes: when a piece comes ``BODY_BATCH_SECONDS`` (or
        ``BODY_BATCH_READS`` pieces, or ``MAX_KEPT_BYTES`` kept) after the batch's first,
        on a tick, before a stall record and at the end of the response."""
        st = self._flows.get(fid)
        if st is None or st.ended:
            return
        self._add_pieces(st, times, pieces)

    def _add_pieces(self, st: _Flow, times: list[float], pieces: list[bytes | int]) -> None:
        batch_times, sizes, kept = st.times, st.sizes, st.pieces
        for m, piece in zip(times, pieces, strict=True):
            size = piece if isinstance(piece, int) else len(piece)
            if batch_times and (
                m - batch_times[0] >= BODY_BATCH_SECONDS
                or len(batch_times) >= BODY_BATCH_READS
                or (size >= BIG_PIECE and kept is not None and st.kept + size > MAX_KEPT_BYTES)
            ):
                self._flush_guarded(st)
            batch_times.append(m)
            sizes.append(size)
            if kept is not None and not isinstance(piece, int):
                kept.append(piece)
                st.kept += size

    def _flush_guarded(self, st: _Flow) -> None:
        try:
            self._flush_body(st)
        except Exception:
            log.exception("tracer: writing a body record failed")
        finally:
            st.times.clear()
            st.sizes.clear()
            st.kept = 0
            if st.pieces:
                st.pieces.clear()

    def _flush_body(self, st: _Flow) -> None:
        """Write the pieces observed so far as one ``body`` record (``_flush_guarded``
        empties the batch)."""
        times, sizes, pieces = st.times, st.sizes, st.pieces
        if not times:
            return
        first, last = times[0], times[-1]
        if st.stall_start_m is not None and first > st.stall_start_m and not _held_back(st):
            self._end_stall(st, first)  # the first bytes after a stall end it
        dts = [((m - first) * 1e6 + 0.5) // 1 / 1e6 for m in times]  # round(…, 6), cheaper
        total = sum(sizes)
        prev = st.last_data_m
        gap = max(map(sub, islice(dts, 1, None), dts), default=0.0)  # within the batch
        if prev is not None and first - prev > gap:
            gap = first - prev
        if gap > st.max_gap:
            st.max_gap = gap
        st.last_data_m = last
        events: list[Any] | None = None
        if st.sse is not None and pieces:
            try:
                specials = st.sse.batch(pieces)
            except Exception:
                specials = [(i, []) for i in range(len(pieces))]
                log.exception("tracer: observing a response body failed")
            events, plain = self._sse_records(st, dts, sizes, specials, times)
            st.events += len(times) - len(specials)
            if plain >= 0 and (st.first_token_m is None or times[plain] < st.first_token_m):
                st.first_token_m = times[plain]
        st.resp_bytes += total
        conn = st.conn
        conn.upstream_bytes += total
        if last > conn.last_activity_m:
            conn.last_activity_m = last
        if conn.multiplexed and last > st.active_m:
            st.active_m = last
        data_text = encoding = None
        if pieces and self.settings.bodies == "all":
            data_text, encoding = encode_body(b"".join(pieces))
        self._emit(
            ev.BodyData(
                t=first + self._wall,
                m=first,
                tap=self.tap,
                conn=conn.conn,
                seq=st.seq,
                size=total,
                chunks=0,  # mitmproxy does not show chunk boundaries
                reads=list(zip(dts, sizes, repeat(0))),
                sse=events or None,
                data=data_text,
                data_encoding=encoding,
            )
        )

    def _sse_records(
        self,
        st: _Flow,
        dts: list[float],
        sizes: list[int],
        specials: list[tuple[int, list[SseEvent]]],
        times: list[float],
    ) -> tuple[list[Any], int]:
        """The batch's ``sse`` entries, and the index of its first plain content chunk.

        Pieces between the specials are plain content chunks, one ``content`` event
        each: they are zipped in runs (C speed); only the specials are looked at.
        """
        if not specials:
            return list(zip(dts, sizes, repeat("content"))), 0
        events: list[Any] = []
        plain = -1
        start = 0
        for i, found in specials:
            if i > start:
                events += zip(dts[start:i], sizes[start:i], repeat("content"))
                if plain < 0:
                    plain = start
            dt = dts[i]
            for sse in found:
                events.append([dt, *sse.as_record()])
                count_sse(st, sse, times[i])
            start = i + 1
        if start < len(dts):
            events += zip(dts[start:], sizes[start:], repeat("content"))
            if plain < 0:
                plain = start
        return events, plain

    def _on_response_end(
        self,
        fid: str,
        now: float,
        ts: float | None,
        body_end: float | None,
        content: bytes | int | None,
        request: bytes | None,
        held: int | None,
    ) -> None:
        """mitmproxy's ``response`` hook. ``content``: the body mitmproxy buffered (not
        streamed; its size when the pieces are not needed); ``request``: the request's
        body when its ``request`` hook had not come (a response before the upload ended);
        ``held``: on HTTP/2, the bytes mitmproxy still holds for the client."""
        st = self._flows.get(fid)
        if st is None or st.ended:
            return
        if not st.request_done:  # the response came first (e.g. 413 during an upload)
            self._request_end(st, request, now, complete=True)
        if body_end is not None:
            end_m = body_end
        else:
            end_m = min((ts or (now + self._wall)) - self._wall, now)
        if not st.streamed_response and st.resp_head_m is not None and content:
            self._add_pieces(st, [end_m], [content])  # buffered: one piece, at the end
        self._flush_guarded(st)
        last = st.last_data_m
        if last is not None and end_m - last > st.max_gap:
            st.max_gap = end_m - last
        if st.injected_stop == "truncate-after-events":  # faults.py kills it right after
            self._ended_by(st.conn, "tracer")
            self._end(st, now, "truncated", detail="cut by an injected fault")
            return
        if st.injected_stop is not None:  # held for good by faults.py: in flight, stalls
            return
        if st.by_proxy:
            self._end(st, end_m, "tracer_response", detail="answered by a mitmproxy addon")
        elif st.stream is not None and held:
            st.stream.held = held  # ends when its last bytes leave (tick, _delivery_check)
            st.stream.upstream_end_m = end_m
        elif st.status == 101:
            self._end(st, end_m, "complete", detail="switched protocols")
        else:
            self._end(st, end_m, "complete")
        if st.closes is not None:  # the connection ends after this exchange
            self._ended_by(st.conn, st.closes)

    def _on_error(
        self,
        fid: str,
        now: float,
        msg: str,
        ts: float | None,
        server_error: str | None,
        server_peer: bool,
        server_h2: bool,
        client_reads: bool,
        request: bytes | None,
    ) -> None:
        """End the response by what mitmproxy's error says (see ``addons/trace.py``,
        rule 3)."""
        st = self._flows.get(fid)
        if st is None or st.ended:
            return
        m = min(ts - self._wall, now) if ts else now
        conn = st.conn
        if msg == KILLED:
            self._ended_by(conn, "tracer")
            if not st.request_done:
                self._request_end(st, request, m, complete=False)
            self._end(st, m, "in_flight", detail=f"killed in mitmproxy: {msg}")
            return
        termination = _cut_termination(conn, msg, server_h2=server_h2, client_reads=client_reads)
        if not st.request_done:
            self._request_end(st, request, m, complete=False)
        if termination == "client_abort":
            if not msg.startswith(_H2_RESET):  # (a reset ends one HTTP/2 stream, no more)
                self._note_cause(conn, "client")  # the client's connection ends
            self._end(st, m, "client_abort", detail=msg)
            return
        if st.resp_head_m is None and (server_error or not server_peer):
            # mitmproxy answered the client itself (its 502: the upstream is unreachable)
            st.status = 502
            self._emit(
                ev.ResponseHead(
                    t=m + self._wall,
                    m=m,
                    tap=self.tap,
                    conn=conn.conn,
                    seq=st.seq,
                    status=502,
                    reason="Bad Gateway",
                    version="1.1",
                    headers=[],
                    ttfb=round(m - st.head_m, 6),
                    keep_alive=False,
                    by_tracer=True,
                )
            )
            self._end(st, m, "tracer_response", detail=msg)
            self._ended_by(conn, "tracer")  # after the answer: nothing is left in flight
            return
        self._ended_by(conn, "upstream")
        if msg.startswith(_UNPARSED) and not any(s in msg for s in _UPSTREAM_CUT):
            self._emit(
                ev.Anomaly(
                    t=m + self._wall,
                    m=m,
                    tap=self.tap,
                    conn=conn.conn,
                    seq=st.seq,
                    direction="upstream",
                    error=scrub_text(msg),
                    offset=st.resp_bytes,  # body bytes before it (mitmproxy hides framing)
                )
            )
            self._end(st, m, "unparsed", detail=msg)
            return
        self._end(st, m, "truncated", detail=msg)

    def _end(
        self,
        st: _Flow,
        m: float,
        termination: ev.Termination,
        *,
        detail: str | None = None,
    ) -> None:
        if st.ended:
            return
        st.ended = True
        self._flush_guarded(st)
        conn = st.conn
        pending = conn.pending
        if pending and pending[0] is st:  # the usual: responses end in order
            del pending[0]
        elif st in pending:
            pending.remove(st)
        self._flows.pop(st.fid, None)
        if st.stall_start_m is not None:
            self._end_stall(st, m)
        conn.last_end_m = m
        conn.last_activity_m = max(conn.last_activity_m, m)
        self._emit(
            response_end(
                st, m, termination, tap=self.tap, conn=conn.conn, wall=self._wall, detail=detail
            )
        )
        if termination != "complete":
            log.warning(
                "tracer: response ended %s (conn %d, request %d): %s",
                termination,
                conn.conn,
                st.seq,
                detail or "-",
            )

    # ---- stalls -------------------------------------------------------------------------

    def _activity(self, conn: _Conn, m: float, st: _Flow) -> None:
        """Something happened on ``st``'s exchange: on HTTP/1 that ends the stall of the
        connection's oldest request (the one the connection waits for), on HTTP/2 only
        ``st``'s own."""
        conn.last_activity_m = max(conn.last_activity_m, m)
        if conn.multiplexed:
            if m > st.active_m:
                st.active_m = m
            if st.stall_start_m is not None and not _held_back(st):
                self._end_stall(st, m)
        elif conn.pending:
            oldest = conn.pending[0]
            if oldest.stall_start_m is not None:
                self._end_stall(oldest, m)

    def _end_stall(self, st: _Flow, m: float) -> None:
        event = end_stall(st, m, tap=self.tap, conn=st.conn.conn, wall=self._wall)
        if event is None:
            return
        self._emit(event)
        log.info(
            "tracer: stall ended (conn %d, request %d) after %.3fs",
            st.conn.conn,
            st.seq,
            event.silent_for,
        )

    def _on_tick(
        self,
        now: float,
        backlog: dict[str, tuple[bool, int | None]],
        streams: dict[str, tuple[int | None, bool]],
    ) -> None:
        """The addon's ticker: flush old body batches; start stalls for requests gone
        silent. ``backlog``: by client connection, whether mitmproxy holds bytes for the
        client and the kernel's unsent bytes; ``streams``: by HTTP/2 flow, the bytes
        mitmproxy holds for the client (None: cannot look) and whether the client reset
        the stream."""
        for conn in list(self._conns.values()):
            for st in conn.pending:
                if st.times and (
                    now - st.times[0] >= BODY_BATCH_SECONDS or st.stall_start_m is not None
                ):
                    self._flush_guarded(st)
            # HTTP/1: the oldest request, silent while nothing happens on the connection;
            # HTTP/2: each stream by its own sign of life (the others may go on meanwhile),
            # unless mitmproxy holds bytes of it for the client
            blocked, unsent = backlog.get(conn.cid, (False, None))
            if not conn.multiplexed:
                if conn.pending:
                    self._stall_check(conn, conn.pending[0], now, blocked, unsent)
                continue
            for st in list(conn.pending):
                if not self._delivery_check(conn, st, now, streams.get(st.fid)):
                    self._stall_check(conn, st, now, blocked, unsent)

    def _delivery_check(
        self, conn: _Conn, st: _Flow, now: float, look: tuple[int | None, bool] | None
    ) -> bool:
        """HTTP/2: follow the bytes mitmproxy holds for the client on ``st``'s stream.

        The client taking none of them for ``stall_after`` is a ``client_not_reading``
        stall (ended when it takes some); a response whose upstream end has come ends
        when they have all left (``complete``), or when the client resets the stream
        instead (``client_abort``). True while bytes are held (or the stream ended here):
        the stream's silence towards the upstream is then not the question.
        """
        stream = st.stream
        if stream is None:
            return False
        held, reset = look if look is not None else (None, False)
        if held is None:  # cannot look (any more): end by what is known
            if stream.upstream_end_m is None:
                return False
            self._end(st, now, "complete", detail="mitmproxy's HTTP/2 state went away")
            return True
        delivered = st.resp_bytes + sum(st.sizes) - held
        if delivered > stream.delivered or not held:  # the client takes bytes
            stream.delivered = delivered
            stream.held_since = now
            if st.stall_start_m is not None and st.stall_direction == "client_not_reading":
                self._end_stall(st, now)
        stream.held = held
        if stream.upstream_end_m is not None and not held:
            if reset:
                self._end(st, now, "client_abort", detail="stream reset by client (bytes held)")
            else:
                waited = now - stream.upstream_end_m
                detail = f"the client took the last bytes {waited:.3f} s after the upstream's end"
                self._end(st, now, "complete", detail=detail)
            return True
        if not held:
            return False
        if st.stall_start_m is None and now - stream.held_since >= self.settings.stall_after:
            self._start_stall(conn, st, now, stream.held_since, "client_not_reading", held)
        return True

    def _stall_check(
        self, conn: _Conn, st: _Flow, now: float, blocked: bool, unsent: int | None
    ) -> None:
        """Start a stall for ``st`` when it has been silent for ``stall_after``."""
        stall_after = self.settings.stall_after
        last = st.active_m if conn.multiplexed else conn.last_activity_m
        if st.times and st.times[-1] > last:
            last = st.times[-1]
        silent = now - last
        if st.stall_start_m is not None or silent < stall_after:
            return
        # on HTTP/2 a backlog is the connection's: it holds this stream back only when
        # the other streams are held too (while they go on, the client reads)
        if conn.multiplexed and now - _last_sign(conn) < stall_after:
            direction = stall_direction(st, client_blocked=False, unsent=None)
        else:
            direction = stall_direction(st, client_blocked=blocked, unsent=unsent)
        self._start_stall(conn, st, now, last, direction, unsent)

    def _start_stall(
        self,
        conn: _Conn,
        st: _Flow,
        now: float,
        since: float,
        direction: StallDirection,
        unsent: int | None,
    ) -> None:
        self._flush_guarded(st)  # the last bytes before the stall go on record first
        self._emit(
            start_stall(
                st,
                now,
                since,
                direction,
                unsent=unsent,
                tap=self.tap,
                conn=conn.conn,
                wall=self._wall,
            )
        )
        log.warning(
            "tracer: stall started (conn %d, request %d): %s for %.3fs",
            conn.conn,
            st.seq,
            direction,
            now - since,
        )

    # ---- injected faults (from addons/faults.py) ------------------------------------------

    def _on_fault(
        self, fid: str, cid: str, now: float, seq: int, fault: str, spec: str, detail: str
    ) -> None:
        st = self._flows.get(fid)
        conn = st.conn if st is not None else self._conn(cid, now)
        if st is not None and fault in ("stall-after-events", "truncate-after-events"):
            st.injected_stop = fault
        self._emit(
            ev.FaultInjected(
                t=now + self._wall,
                m=now,
                tap=self.tap,
                conn=conn.conn,
                seq=st.seq if st is not None else seq,
                fault=fault,
                spec=spec,
                detail=detail,
            )
        )

    def _on_fault_plan(
        self, now: float, specs: list[str], change: Literal["replace", "clear"]
    ) -> None:
        self._emit(
            ev.FaultPlanChanged(
                t=now + self._wall, m=now, tap=self.tap, faults=list(specs), change=change
            )
        )

    def _on_lost(self, now: float, facts: int, size: int) -> None:
        """Facts mitmproxy's process dropped: the capture process fell behind and the
        backlog for it passed its bound (``addons/trace.py``, ``MAX_BACKLOG``)."""
        self._emit(
            ev.CaptureLoss(
                t=now + self._wall,
                m=now,
                tap=self.tap,
                dropped=facts,
                dropped_bytes=size,
                reason="the capture process fell behind: facts from mitmproxy dropped",
            )
        )

    # ---- output ---------------------------------------------------------------------------

    def _emit(self, event: ev.Event) -> None:
        if self.writer is not None:  # (None: the capture was closed)
            self.bus.publish(event)


def _cut_termination(
    conn: _Conn, msg: str, *, server_h2: bool, client_reads: bool
) -> ev.Termination:
    """Who went first: the client (mitmproxy says so, or its socket stopped reading)."""
    if msg.startswith(_CLIENT_GONE):
        return "client_abort"
    if conn.multiplexed and msg.startswith(_H2_ENDS) and not server_h2:
        return "client_abort"  # HTTP/2 words, and only the client speaks HTTP/2 here
    if not client_reads:
        return "client_abort"
    return "truncated"


def _held_back(st: _Flow) -> bool:
    """Whether mitmproxy held bytes of ``st`` for the client at the last look: then bytes
    from the upstream do not end its stall."""
    return st.stream is not None and st.stream.held > 0


def _last_sign(conn: _Conn) -> float:
    """The connection's last sign of life, its streams' pieces not yet written included."""
    return max([conn.last_activity_m, *(st.times[-1] for st in conn.pending if st.times)])


def _version(http_version: str) -> str:
    return http_version.removeprefix("HTTP/")


def _addr(value: Any) -> str:
    if isinstance(value, tuple | list) and len(value) >= 2:
        host = str(value[0])
        return f"[{host}]:{value[1]}" if ":" in host else f"{host}:{value[1]}"
    return str(value) if value else "-"


_REQUEST_HEADERS_READ = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"expect",
        b"x-request-id",
        b"content-type",
        b"connection",
    }
)


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
