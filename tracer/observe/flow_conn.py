"""A client connection as mitmproxy shows it: the exchange tracker (``exchange.py``) with
what mitmproxy's facts add. Body pieces come in lists and their SSE is read a batch at a
time (``flow_sse.batch_sse``); from an HTTP/2 (or 3) client, requests run at once, each as
its own stream: each is watched for stalls by its own last sign of life, and the bytes
mitmproxy holds for the client under flow control are followed (``delivery_check``).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from ..capture.bodies import RequestBody
from .exchange import Emit, ExchangeTracker
from .exchange_state import ResponseState, stall_direction
from .flow_sse import ContentShape, SseObserver, batch_sse

log = logging.getLogger("tracer.observe.flows")

Cause = Literal["client", "upstream", "tracer"]


class Stream:
    """The client's HTTP/2 stream that carries a flow: the bytes mitmproxy held for it
    under flow control at the addon's last look (``FlowConn.delivery_check``)."""

    __slots__ = ("delivered", "held", "held_since", "upstream_end_m")

    def __init__(self, since: float) -> None:
        self.held = 0  # bytes held for the client at the last look
        self.held_since = since  # since when the client has taken none of them
        self.delivered = 0  # bytes the client has taken
        # the upstream's end, while the last bytes wait for the client (the response
        # ends when they leave)
        self.upstream_end_m: float | None = None


class Flow(ResponseState[SseObserver]):
    """Mutable per-request state while it is in flight (``wire_requests.WireRequest``'s counterpart)."""

    __slots__ = (
        "active_m",
        "by_proxy",
        "closes",
        "conn",
        "fid",
        "injected_stop",
        "req_body",
        "stream",
        "streamed_response",
    )

    def __init__(self, fid: str, conn: FlowConn, head_m: float, json_body: bool) -> None:
        super().__init__(head_m, json_body)
        self.active_m = head_m  # its last sign of life (a stream's own, on HTTP/2)
        self.fid = fid
        self.conn = conn
        self.req_body: RequestBody | None = None  # a streamed request body as it arrives
        self.by_proxy = False
        # who ends the connection after this exchange (Connection: close, HTTP/1.0)
        self.closes: Literal["upstream", "tracer"] | None = None
        self.streamed_response = False
        self.stream: Stream | None = None  # HTTP/2, when mitmproxy's stream is found
        # addons/faults.py stopped passing the body on (stall- or truncate-after-events):
        # the upstream's end is not the client's, the kill or hold that follows is
        self.injected_stop: str | None = None


class FlowConn(ExchangeTracker[Flow]):
    """One client connection: its exchanges, and what mitmproxy tells about it."""

    def __init__(
        self,
        conn: int,
        cid: str,
        opened_m: float,
        flows: dict[str, Flow],
        *,
        tap: str,
        emit: Emit,
        wall: float,
        bodies: str = "requests",
        redact_fields: frozenset[str] = frozenset(),
    ) -> None:
        # (the tracker's arguments by name: mypyc passes a **splat to a native __init__ wrong)
        super().__init__(
            tap=tap,
            conn=conn,
            emit=emit,
            wall=wall,
            opened_m=opened_m,
            bodies=bodies,
            redact_fields=redact_fields,
        )
        self.cid = cid
        self.opened_m = opened_m
        self._flows = flows  # the observer's flows in flight, by id
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

    # ---- the tracker's, as mitmproxy shows it -----------------------------------------

    def batch_sse(self, st: Flow, dts: list[float]) -> list[Any] | None:
        return batch_sse(st, dts)

    def flush_body(self, st: Flow) -> None:
        """As the tracker's; the first pieces after a stall end it (pieces are not a sign
        of life until written), and a failure costs the batch, not the fact."""
        times = st.times
        if not times:
            return
        first, last = times[0], times[-1]
        before = st.resp_bytes
        try:
            if st.stall_start_m is not None and first > st.stall_start_m and not held_back(st):
                self.end_stall(st, first)  # the first bytes after a stall end it
            super().flush_body(st)
        except Exception:
            log.exception("tracer: writing a body record failed")
            st.clear_batch()
        self.upstream_bytes += st.resp_bytes - before
        if self.multiplexed and last > st.active_m:
            st.active_m = last

    def ended(self, st: Flow, m: float, *, oldest: bool) -> None:
        self._flows.pop(st.fid, None)
        if m > self.last_activity_m:
            self.last_activity_m = m

    # ---- activity and stalls ------------------------------------------------------------

    def sign_of_life(self, st: Flow, m: float) -> None:
        """Something happened on ``st``'s exchange: on HTTP/1 that ends the stall of the
        connection's oldest request (the one the connection waits for), on HTTP/2 only
        ``st``'s own."""
        if not self.multiplexed:
            self.activity(m)
            return
        if m > self.last_activity_m:
            self.last_activity_m = m
        if m > st.active_m:
            st.active_m = m
        if st.stall_start_m is not None and not held_back(st):
            self.end_stall(st, m)

    def look(
        self,
        now: float,
        stall_after: float,
        blocked: bool,
        unsent: int | None,
        streams: dict[str, tuple[int | None, bool]],
    ) -> None:
        """The ticker's look: batches old enough written; HTTP/1: the oldest request,
        silent while nothing happens on the connection; HTTP/2: each stream by its own
        sign of life (the others may go on meanwhile), unless mitmproxy holds bytes of it
        for the client. ``blocked``, ``unsent``: the client connection's backlog;
        ``streams``: what mitmproxy holds for each HTTP/2 flow."""
        self.flush(now)
        if not self.multiplexed:
            self.tick(now, stall_after=stall_after, client_blocked=blocked, unsent=unsent)
            return
        for st in list(self.pending):
            if not self.delivery_check(st, now, streams.get(st.fid), stall_after):
                self._stream_stall_check(st, now, stall_after, blocked, unsent)

    def delivery_check(
        self, st: Flow, now: float, look: tuple[int | None, bool] | None, stall_after: float
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
            self.end_response(st, now, "complete", detail="mitmproxy's HTTP/2 state went away")
            return True
        delivered = st.resp_bytes + sum(st.sizes) - held
        if delivered > stream.delivered or not held:  # the client takes bytes
            stream.delivered = delivered
            stream.held_since = now
            if st.stall_start_m is not None and st.stall_direction == "client_not_reading":
                self.end_stall(st, now)
        stream.held = held
        if stream.upstream_end_m is not None and not held:
            if reset:
                detail = "stream reset by client (bytes held)"
                self.end_response(st, now, "client_abort", detail=detail)
            else:
                waited = now - stream.upstream_end_m
                detail = f"the client took the last bytes {waited:.3f} s after the upstream's end"
                self.end_response(st, now, "complete", detail=detail)
            return True
        if not held:
            return False
        if st.stall_start_m is None and now - stream.held_since >= stall_after:
            self.start_stall(st, now, stream.held_since, "client_not_reading", held)
        return True

    def _stream_stall_check(
        self, st: Flow, now: float, stall_after: float, blocked: bool, unsent: int | None
    ) -> None:
        """Start a stall for ``st`` when its stream has been silent for ``stall_after``."""
        last = st.active_m
        if st.times and st.times[-1] > last:
            last = st.times[-1]
        if st.stall_start_m is not None or now - last < stall_after:
            return
        # a backlog is the connection's: it holds this stream back only when the other
        # streams are held too (while they go on, the client reads)
        if now - self._last_sign() < stall_after:
            direction = stall_direction(st, client_blocked=False, unsent=None)
        else:
            direction = stall_direction(st, client_blocked=blocked, unsent=unsent)
        self.start_stall(st, now, last, direction, unsent)

    def _last_sign(self) -> float:
        """The connection's last sign of life, its streams' pieces not yet written included."""
        return max([self.last_activity_m, *(st.times[-1] for st in self.pending if st.times)])


def held_back(st: Flow) -> bool:
    """Whether mitmproxy held bytes of ``st`` for the client at the last look: then bytes
    from the upstream do not end its stall."""
    return st.stream is not None and st.stream.held > 0
