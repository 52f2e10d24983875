"""A packet capture's gaps: the requests whose bytes a capture lost are marked, and parsing
picks up again after the gap. Sans-I/O.

Why
---
An inline tap reads every byte its sockets read; a capture may miss some (the kernel
dropped packets, the snapshot length cut them, a segment was never captured). A gap
must not blind the rest of its connection, nor be papered over: each request whose own
bytes were in it gets an ``anomaly`` (its ``seq``, ``gap``: the bytes missing,
``direction``), it is never ``complete``, and the requests after the gap are parsed and
paired with their own responses where that is sure. What the gap hid is never guessed.
``Resync`` does this for one connection ``passive`` follows, between the reassembled
streams and its ``wire.ConnectionObserver``.

Rules
-----
A gap in the client's stream cuts the request whose body was being read (its
``request_end`` not complete; its response, whole in the capture, is still its own).
When the body's length says where it ends, parsing goes on right after it; otherwise
(and when the gap ran into the next request) the bytes are skipped up to the next
request line (``METHOD target HTTP/1.x``). A request whose head was in the gap is
numbered all the same (the inline tap saw it), from the gap or from its response:
while the requests after the gap are unknown, a response with no request left to
answer is a swallowed request's (an ``anomaly`` for it), and the first request read
after the gap is paired with the responses after them only where that is sure (no
request of before still waiting for its response, and each request known swallowed
seen answered): a client waits for a response before its next request. Where it is
not sure, nothing is paired from there on (each request waiting ends ``unparsed``, with
an anomaly): better unknown than wrong.

A gap in the server's stream ends the response being received, ``unparsed`` (not
``complete``: bytes of it are missing), with an ``anomaly`` for its request, and for
the next one when the gap ran past a body whose length was known into the next
response. Parsing goes on right after a body whose length says where it ends, else at
the next status line (``HTTP/1.x NNN``): a status line while no request waits is not a
response (bytes of the lost one's body); one while one request waits is its response
(the response of any later request would follow that request in the capture); one
while several wait cannot be paired (they end ``unparsed``, and nothing more is parsed).

A gap behind a protocol switch (a tunnel) or a parse failure held back is not followed
further: an ``anomaly``, and the connection's bytes are only counted from there on.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from .. import events as ev
from .request_line import PROBE_BYTES, find_request
from .wire import ConnectionObserver
from .wire_requests import WireRequest

# where the server's stream picks up again after a gap: a status line
_STATUS_AT = re.compile(rb"HTTP/1\.[01] [1-5][0-9]{2}(?: [\t\x20-\x7e\x80-\xff]*)?\r\n")
RESYNC_KEEP = PROBE_BYTES  # bytes kept while looking for where parsing picks up again

_WHY = {
    "not_captured": "acknowledged by the peer but not in the capture",
    "buffer_full": "never in the capture while later bytes piled up",
    "never_filled": "not in the capture by the stream's end",
    "snaplen": "cut by the capture's snapshot length",
}


class _Stream:
    """One direction after a gap (its bytes counted as they come; the held ones fed when
    parsing picks up again): body bytes to skip first (``skip``), or looking for a
    request line / a status line (``scan``: the bytes held while a line may be cut
    across reads); and the observer's calls for that direction."""

    __slots__ = ("feed", "restart", "scan", "skip", "skip_bytes")

    def __init__(
        self,
        feed: Callable[[bytes, float], None],
        skip_bytes: Callable[[int, float], None],
        restart: Callable[[float], None],
    ) -> None:
        self.feed = feed  # bytes parsed
        self.skip_bytes = skip_bytes  # bytes counted, not parsed
        self.restart = restart  # the next bytes fed start a head
        self.scan: bytes | None = None
        self.skip = 0


class Resync:
    """One followed connection's gaps: ``gap`` for bytes the capture does not have, and
    every byte it does have through ``client_data`` / ``upstream_data``, which feed the
    observer what can be parsed (the rest counted). Anomalies go to ``emit``."""

    __slots__ = (
        "allocated",
        "client",
        "conn",
        "emit",
        "obs",
        "orphans_seen",
        "swallow",
        "swallow_gap",
        "tap",
        "u_gap",
        "upstream",
    )

    def __init__(
        self, obs: ConnectionObserver, *, tap: str, conn: int, emit: Callable[[ev.Event], None]
    ) -> None:
        self.obs = obs
        self.tap = tap
        self.conn = conn
        self.emit = emit
        self.client = _Stream(obs.client_data, obs.skip_client, obs.restart_client)
        self.upstream = _Stream(
            obs.upstream_data, obs.skip_upstream, lambda _m: obs.restart_upstream()
        )
        self.u_gap = 0  # bytes of the server's gaps since parsing was lost there
        # a gap in the client's stream may have swallowed requests (``certain``: at least
        # one, numbered): unknown until the first request read after it
        self.swallow: Literal["maybe", "certain"] | None = None
        self.swallow_gap = 0  # bytes of those gaps
        self.allocated = 0  # requests numbered as swallowed
        self.orphans_seen = 0  # responses seen with no request to answer (theirs)

    # ---- bytes missing ------------------------------------------------------------------

    def gap(self, t: float, side: ev.Direction, offset: int, size: int, cause: str) -> None:
        """Bytes missing from a stream: the requests whose bytes they were are marked,
        and parsing picks up again after them where it can."""
        obs = self.obs
        if obs.blind:
            return
        why = _WHY.get(cause, cause)
        where = f"packet capture: {size} byte(s) of the {side} stream missing at offset {offset} ({why})"
        resumable = obs.client_position()[2] if side == "client" else not obs.tunnel
        if not resumable:  # a tunnel, bytes behind a protocol switch: not followed further
            pending = obs.in_flight_requests()
            seq = pending[0]["seq"] if pending else (obs.seq or None)
            self._anomaly(t, side, seq, size, f"{where}; not parsed from there on")
            obs.blind = True  # as after a parse failure: bytes are only counted from now on
            obs.head_started_m = None
            return
        if side == "client":
            self._client_gap(t, size, where)
        else:
            self._upstream_gap(t, size, where)

    def _client_gap(self, t: float, size: int, where: str) -> None:
        obs = self.obs
        c = self.client
        if c.scan is not None:  # already skipping to a request line: more of it unknown
            self.swallow_gap += size
            return
        seq: int | None = None
        if c.skip:  # inside a body a gap already cut (its request marked then)
            remaining: int | None = c.skip
            c.skip = 0
            inside = True
        else:
            req, remaining, _ = obs.client_position()
            inside = req is not None
            seq = None if req is None else req.seq
            obs.restart_client(t)  # the request being read ends, not complete
        if inside:
            if remaining is not None and size < remaining:  # within its body: skip the rest
                c.skip = remaining - size
                if seq is not None:
                    self._anomaly(
                        t,
                        "client",
                        seq,
                        size,
                        f"{where}, inside request {seq}'s body: it is not complete; parsed "
                        "again after its body",
                    )
                return
            if remaining is not None and size == remaining:  # the end of its body
                if seq is not None:
                    self._anomaly(
                        t,
                        "client",
                        seq,
                        size,
                        f"{where}, the end of request {seq}'s body: it is not complete; parsed "
                        "again from the next request head",
                    )
                return
            if remaining is None:  # where its body ends is not known
                if seq is not None:
                    self._anomaly(
                        t,
                        "client",
                        seq,
                        size,
                        f"{where}, inside request {seq}'s body (where it ends is not known): it "
                        "is not complete; parsed again from the next request line",
                    )
                self._swallowing(size, certain=False)
                return
            if seq is not None:
                self._anomaly(
                    t,
                    "client",
                    seq,
                    size,
                    f"{where}, from inside request {seq}'s body past its end: it is not complete",
                )
        # the head (the start at least) of the next request is in the gap: numbered
        obs.seq += 1
        self.allocated += 1
        self._anomaly(
            t,
            "client",
            obs.seq,
            size,
            f"{where}: request {obs.seq}'s head is not in the capture; parsed again from the "
            "next request line",
        )
        self._swallowing(size, certain=True)

    def _swallowing(self, size: int, *, certain: bool) -> None:
        """The client's bytes are skipped to the next request line; requests the gap
        swallowed may still be answered (``certain``: one was, numbered)."""
        self.client.scan = b""
        self.swallow = "certain" if certain or self.swallow == "certain" else "maybe"
        self.swallow_gap += size
        self.obs.catch_orphans = True

    def _upstream_gap(self, t: float, size: int, where: str) -> None:
        obs = self.obs
        u = self.upstream
        if self.swallow is not None:  # requests swallowed and responses lost: not pairable
            self.u_gap += size
            self._unpair(t, "upstream", self.u_gap)
            return
        if u.scan is not None:  # already skipping to a status line
            self.u_gap += size
            return
        self.u_gap = size
        if u.skip:  # inside a body a gap already cut (its request marked then)
            remaining: int | None = u.skip
            u.skip = 0
        else:
            remaining = None
            if obs.pending:
                req = obs.pending[0]
                remaining = obs.upstream_remaining()
                self._anomaly(
                    t,
                    "upstream",
                    req.seq,
                    size,
                    f"{where}, in request {req.seq}'s response: not known from there on",
                )
                self._lost_response(t, req, size)
            else:
                self._anomaly(
                    t,
                    "upstream",
                    None,
                    size,
                    f"{where}, while no request waited for a response; parsed again from the "
                    "next status line",
                )
            obs.restart_upstream()
        if remaining is not None and size < remaining:  # within that body: skip the rest
            u.skip = remaining - size
            return
        if remaining is not None and size == remaining:  # its end: the next response follows
            return
        if remaining is not None and obs.pending:  # past its end: the next response's head
            req = obs.pending[0]
            self._anomaly(
                t,
                "upstream",
                req.seq,
                size,
                f"{where}, past the end of the response before: request {req.seq}'s response "
                "head is not in the capture",
            )
            self._lost_response(t, req, size)
        u.scan = b""

    def _lost_response(self, t: float, req: WireRequest, size: int) -> None:
        """A response bytes of which the capture does not have: ``unparsed``, never
        ``complete`` (its figures are those of the bytes before the gap)."""
        self.obs.end_response(
            req,
            t,
            "unparsed",
            detail=f"packet capture: {size} byte(s) of the response stream missing: the "
            "response is not known past them",
        )

    # ---- bytes the capture has ----------------------------------------------------------

    def _unskipped(self, s: _Stream, data: bytes, t: float) -> bytes | None:
        """``data`` less what is not parsed as it comes (None: nothing left): on a
        connection no longer parsed (or a tunnel) all of it, fed as it is; after a gap
        inside a body of known length, the rest of that body (counted, not parsed),
        after which the next bytes start a head."""
        if self.obs.blind or self.obs.tunnel:
            s.scan, s.skip = None, 0
            s.feed(data, t)
            return None
        if s.skip:
            n = min(s.skip, len(data))
            s.skip -= n
            s.skip_bytes(n, t)
            data = data[n:]
            if s.skip:
                return None
            s.restart(t)
            if not data:
                return None
        return data

    def client_data(self, data: bytes, t: float) -> None:
        """The client's bytes to the observer, or skipped after a gap."""
        obs, c = self.obs, self.client
        if (rest := self._unskipped(c, data, t)) is None:
            return
        if c.scan is not None:
            obs.skip_client(len(rest), t)  # (the bytes fed from the request line: not again)
            buf = c.scan + rest
            at = find_request(buf)
            if at < 0:
                c.scan = buf[-RESYNC_KEEP:]
                return
            c.scan = None
            rest = buf[at:]
            obs.client_bytes -= len(rest)
            obs.restart_client(t)
        before = obs.seq
        obs.client_data(rest, t)
        if self.swallow is not None and obs.seq > before:
            self._resolve(t, before)

    def _resolve(self, t: float, before: int) -> None:
        """The first request read after a client gap that may have swallowed requests:
        its response is the next one where that is sure, else nothing is paired."""
        obs = self.obs
        earlier = any(r.seq <= before for r in obs.pending)
        if earlier or self.orphans_seen < self.allocated:
            self._unpair(t, "client", self.swallow_gap)
            return
        self.swallow = None
        self.swallow_gap = self.allocated = self.orphans_seen = 0
        obs.catch_orphans = False

    def upstream_data(self, data: bytes, t: float) -> None:
        """The server's bytes to the observer, or skipped after a gap."""
        obs, u = self.obs, self.upstream
        if (rest := self._unskipped(u, data, t)) is None:
            return
        if u.scan is None:
            obs.upstream_data(rest, t)
            orphans = obs.orphans
            if orphans is None:
                return
            obs.orphans = None  # bytes after a response with no request to answer: counted
            u.scan = b""
            buf = orphans
        else:
            obs.skip_upstream(len(rest), t)  # (the bytes fed from the status line: not again)
            buf = u.scan + rest
        pos = 0
        while (line := _STATUS_AT.search(buf, pos)) is not None:
            at = line.start()
            if not obs.pending:  # no request waits: a swallowed request's response, or none
                if self.swallow is not None:
                    self._orphan(t, line.group().rstrip().decode("latin-1"))
                pos = line.end()
                continue
            if len(obs.pending) > 1 or self.swallow is not None:  # whose it is: not known
                u.scan = None
                self._unpair(t, "upstream", self.u_gap)
                return
            u.scan = None  # the response of the one request waiting
            self.u_gap = 0
            resumed = buf[at:]
            obs.upstream_bytes -= len(resumed)
            obs.restart_upstream()
            self.upstream_data(resumed, t)
            return
        u.scan = buf[max(pos, len(buf) - RESYNC_KEEP) :]

    # ---- pairing after a client gap -----------------------------------------------------

    def _orphan(self, t: float, status_line: str) -> None:
        """A response with no request left to answer, while a client gap may have
        swallowed requests: a swallowed request's (numbered, when not yet)."""
        obs = self.obs
        self.orphans_seen += 1
        if self.orphans_seen <= self.allocated:
            return  # the request its gap numbered
        obs.seq += 1
        self.allocated += 1
        self._anomaly(
            t,
            "client",
            obs.seq,
            self.swallow_gap,
            f"packet capture: request {obs.seq} is not in the capture ({self.swallow_gap} "
            f"byte(s) of the client stream missing), its response is ({status_line})",
        )

    def _unpair(self, t: float, side: ev.Direction, gap: int) -> None:
        """Responses can no longer be paired with requests after a gap: each request
        waiting ends ``unparsed``; the connection is not parsed from here on."""
        obs = self.obs
        what = (
            f"packet capture: after {gap} byte(s) missing from the {side} stream, responses "
            "cannot be paired with their requests"
        )
        waiting = [r.seq for r in obs.pending]
        for seq in waiting:
            self._anomaly(
                t,
                side,
                seq,
                gap,
                f"{what}: request {seq}'s response is not known; not parsed from there on",
            )
        if not waiting:
            self._anomaly(t, side, None, gap, f"{what}; not parsed from there on")
        obs.unpaired(t, what)
        self.client.scan = self.upstream.scan = None
        self.client.skip = self.upstream.skip = 0
        self.swallow = None
        obs.catch_orphans = False

    def _anomaly(self, t: float, side: ev.Direction, seq: int | None, gap: int, error: str) -> None:
        obs = self.obs
        self.emit(
            ev.Anomaly(
                t=t,
                m=t,
                tap=self.tap,
                conn=self.conn,
                seq=seq,
                direction=side,
                error=error,
                offset=obs.client_bytes if side == "client" else obs.upstream_bytes,
                gap=gap,
            )
        )
