"""The passive tap: captured packets in, the same events as a tap's out. Sans-I/O.

Theory of operation
-------------------
A tap sits inline and sees each connection's bytes as its sockets read them. A capture
(``tcpdump -w``, or a live packet socket) sees the same bytes as TCP segments, from the
side. ``PacketTap`` turns the second into the first:

1. ``packets.decode_frame`` takes one link-layer frame (Ethernet, Linux cooked v1 and
   v2, raw IP, BSD loopback) apart with dpkt, down to an IPv4 or IPv6 TCP segment;
   anything else is counted and skipped. A packet the capture cut short (snaplen) says
   so: its IP header gives the length it had on the wire.
2. ``tcp.TcpTable`` reassembles each connection's two streams (in order, each byte once,
   gaps marked).
3. Each connection that carries HTTP/1.1 is followed by its own
   ``wire.ConnectionObserver``, exactly as the inline tap drives it, with the packet times
   as its clock (``wall_offset`` 0: ``t`` is the packet time): the client's bytes to
   ``client_data``, the server's to ``upstream_data``, FIN and RST of each side to
   ``client_eof`` / ``upstream_eof``, the connection's end to ``close``. The client is the
   SYN's sender; without a captured SYN, the side whose port is not one of ``ports``, or
   (no ports given) the side whose bytes start with an HTTP request line, from which on
   the connection is followed (the bytes before it are counted, not parsed).
4. Around it, what the tap itself writes per connection: ``conn_open`` (``peer`` the
   client, ``local`` the server; at the connection's first packet), ``upstream_connect``
   (``start`` at the client's SYN; ``done`` with the server's address, and the time from
   SYN to SYN-ACK where both were captured; ``failed`` when the server answered the SYN
   with a reset; ``local`` is never said: a passive tap has no socket of its own), and
   ``conn_close`` (who closed first and how, bytes each way). A connection still open at
   the capture's end is closed by nobody (``closed_by`` ``none``, ``how`` ``unknown``) and
   what was in flight ends ``in_flight``, as at a tap's stop. A capture cannot fingerprint
   the server as a tap does; what it is may be declared (``roles``: ``--upstream-role``,
   ``--tap-by-port 30000=back:engine``), and is written as the inline tap writes a declared
   role: in the tap's header and a ``topology`` record (basis ``declared``).
5. Time only moves with packets: before each packet (and at the end) every connection
   with a request in flight whose last bytes are ``stall_after`` old is ticked at the
   moment that became so, so a hang in a capture makes the same ``stall`` records as at a
   live tap. Passive has no send queue to read: the client is taken as not reading when
   its last advertised window was zero, and the server's bytes it has not acknowledged
   stand for the tap's unsent bytes.
6. Bytes the capture does not have (a gap in a stream) are an ``anomaly`` (``gap``: the
   bytes missing) for each request whose own bytes were in it, and, with the packets
   the capture cut (snaplen) and those the kernel dropped while capturing (when the file
   says), ``capture_loss`` records before ``capture_end``. Parsing picks up again after
   the gap (see "Gaps" below); what the gap hid is never guessed.

Gaps
----
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

What passive capture cannot see, and this does not guess: what an application did with
bytes its kernel acknowledged (read them, or left them in its socket buffer), anything
inside TLS, and bytes the capture lost (they are marked, not invented).
"""

from __future__ import annotations

import heapq
import math
import re
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

from .. import __version__
from .. import events as ev
from ..protocol.probe_mark import RUN_NONCE
from .packets import PassiveStats, Skipped, decode_frame
from .taps_by_port import ROLES as ROLES
from .taps_by_port import Role as Role
from .taps_by_port import TapsByPort as TapsByPort
from .taps_by_port import checked_role
from .taps_by_port import parse_tap_by_port as parse_tap_by_port
from .tcp import (
    MAX_BUFFER,
    MAX_PIECES,
    Closed,
    Data,
    Endpoint,
    Fin,
    Gap,
    Item,
    Opened,
    Reset,
    Segment,
    Syn,
    TcpConnection,
    TcpTable,
)
from .wire import Bodies, ConnectionObserver
from .wire_requests import WireRequest

Emit = Callable[[ev.Event], None]

STALL_AFTER = 5.0  # the tap's default --stall-after
PROBE_BYTES = 8192  # client bytes read to tell whether a stream is HTTP/1.x
HELD_ITEMS = 256  # data items held per connection while it is undecided (more: skipped)

# where parsing picks up again after a gap: a request line (of a method in use) ...
_REQUEST_AT = re.compile(
    rb"(?:GET|POST|PUT|DELETE|PATCH|HEAD|OPTIONS|CONNECT|TRACE) [!-~]+ HTTP/1\.[01]\r\n"
)
# ... or a status line
_STATUS_AT = re.compile(rb"HTTP/1\.[01] [1-5][0-9]{2}(?: [\t\x20-\x7e\x80-\xff]*)?\r\n")
RESYNC_KEEP = PROBE_BYTES  # bytes kept while looking for where parsing picks up again

_REQUEST_LINE = re.compile(rb"[A-Z][A-Z0-9_-]{0,31} [!-~]+ HTTP/1\.[01]\Z")
# what may still become a request line: a method, maybe a target, maybe a version's start
_REQUEST_PREFIX = re.compile(rb"[A-Z][A-Z0-9_-]{0,31}(?: [!-~]*(?: H?T?T?P?/?1?\.?[01]?)?)?\r?\Z")


def _find_request(data: bytes) -> int:
    """Where the first request line in ``data`` starts (-1: none whole in it)."""
    pos = 0
    while (line := _REQUEST_AT.search(data, pos)) is not None:
        if looks_like_request(data[line.start() : line.start() + PROBE_BYTES]):
            return line.start()
        pos = line.start() + 1
    return -1


def looks_like_request(data: bytes) -> bool | None:
    """Whether bytes start with an HTTP/1.x request line (None: too few to tell)."""
    end = data.find(b"\r\n", 0, PROBE_BYTES)
    if end >= 0:
        return _REQUEST_LINE.match(data, 0, end) is not None
    if len(data) >= PROBE_BYTES:
        return False
    return None if _REQUEST_PREFIX.match(data) else False


# ---- one followed connection -----------------------------------------------------------


class _Follow:
    """A TCP connection: undecided, followed (with its observer) or ignored."""

    __slots__ = (
        "allocated",
        "c_scan",
        "c_skip",
        "client",
        "closed_by",
        "connected",
        "fin_at_bytes",
        "fin_side",
        "held",
        "how",
        "in_flight_at_close",
        "num",
        "obs",
        "orphans_seen",
        "probe",
        "scheduled",
        "server",
        "skipped",
        "state",
        "swallow",
        "swallow_gap",
        "syn_t",
        "synack_t",
        "synced",
        "tap",
        "tcp",
        "u_gap",
        "u_scan",
        "u_skip",
    )

    def __init__(self, tcp: TcpConnection) -> None:
        self.tcp = tcp
        self.state: Literal["undecided", "followed", "ignored"] = "undecided"
        self.held: list[Item] = []
        self.probe = b""  # the client's first bytes, while telling whether it is HTTP
        self.skipped: Counter[Endpoint] = Counter()  # bytes not parsed (before a request)
        self.client: Endpoint | None = None
        self.server: Endpoint | None = None
        self.tap = ""
        self.num = 0
        self.obs: ConnectionObserver | None = None
        self.synced = False  # requests are parsed: from the start, or from a request head
        self.syn_t: float | None = None
        self.synack_t: float | None = None
        self.closed_by: Literal["client", "upstream"] | None = None
        self.how: Literal["fin", "reset"] | None = None
        self.in_flight_at_close = False
        self.fin_side: ev.Direction | None = None
        self.fin_at_bytes = (0, 0)
        self.scheduled = False  # a stall check is queued
        self.connected: bool | None = None  # the server answered (None: not said yet)
        # after a gap (bytes counted as they come; the held ones are fed when parsing
        # picks up again): looking for a request line / a status line (the bytes held
        # while a line may be cut across reads), or body bytes to skip first
        self.c_scan: bytes | None = None
        self.c_skip = 0
        self.u_scan: bytes | None = None
        self.u_skip = 0
        self.u_gap = 0  # bytes of the server's gaps since parsing was lost there
        # a gap in the client's stream may have swallowed requests (``certain``: at least
        # one, numbered): unknown until the first request read after it
        self.swallow: Literal["maybe", "certain"] | None = None
        self.swallow_gap = 0  # bytes of those gaps
        self.allocated = 0  # requests numbered as swallowed
        self.orphans_seen = 0  # responses seen with no request to answer (theirs)

    def side(self, src: Endpoint) -> ev.Direction:
        return "client" if src == self.client else "upstream"


# ---- the passive tap -------------------------------------------------------------------


class PacketTap:
    """Packets in, tap events out, for one tap or several (one per server port).

    ``ports``: the server ports to follow (None: every connection whose first bytes are
    an HTTP request). ``taps``: server port -> tap name, for several taps out of one
    capture (``--tap-by-port 8000=front,30000=back``); it replaces ``tap`` and ``ports``.
    ``roles``: tap name -> what the server behind its port(s) is (``engine``, ``router``,
    ``proxy``), as declared (``--upstream-role``, ``30000=back:engine``): in the tap's
    header and a ``topology`` record (basis ``declared``), as ``tracer proxy
    --upstream-role`` writes them. ``emit`` gets every event; the tap's header is written
    at the first packet (or at ``finish``), ``capture_end`` at ``finish``.
    """

    def __init__(
        self,
        *,
        emit: Emit,
        tap: str = "pcap",
        ports: Collection[int] | None = None,
        taps: Mapping[int, str] | None = None,
        roles: Mapping[str, str] | None = None,
        stall_after: float = STALL_AFTER,
        bodies: Bodies = "requests",
        kind: str = "pcap",
        options: Mapping[str, Any] | None = None,
        boot_id: str | None = None,
        loss_evidence: bool = True,
        max_buffer: int = MAX_BUFFER,
        max_pieces: int = MAX_PIECES,
    ) -> None:
        self._emit_out = emit
        if taps:
            self._by_port: dict[int, str] | None = dict(taps)
            self._ports: frozenset[int] | None = frozenset(taps)
            self.taps = list(dict.fromkeys(taps.values()))
        else:
            self._by_port = None
            self._ports = frozenset(ports) if ports is not None else None
            self.taps = [tap]
        self._default_tap = self.taps[0]
        self.roles = {name: checked_role(role) for name, role in (roles or {}).items()}
        self.stall_after = stall_after
        self.bodies: Bodies = bodies
        self.kind = kind
        self.options = dict(options or {})
        self.boot_id = boot_id
        self.loss_evidence = loss_evidence
        self.table = TcpTable(max_buffer=max_buffer, max_pieces=max_pieces)
        self.stats = PassiveStats()
        self._follows: dict[int, _Follow] = {}
        self._nums: Counter[str] = Counter()  # connections numbered per tap
        self._records: Counter[str] = Counter()  # records written per tap
        self._due: list[tuple[float, int, int]] = []  # (stall check time, order, conn)
        self._order = 0
        self.started = False
        self.finished = False

    # ---- input ----------------------------------------------------------------------

    def packet(self, t: float, linktype: int, frame: bytes, *, orig_len: int | None = None) -> None:
        """One captured frame (``orig_len``: its length on the wire, where the capture
        says; a frame kept shorter is counted as cut even when TCP cannot tell)."""
        self.stats.packets += 1
        decoded = decode_frame(linktype, frame, t)
        short = orig_len is not None and orig_len > len(frame)
        if isinstance(decoded, Skipped):
            self.stats.skipped[decoded.reason] += 1
            if decoded.cut or (short and decoded.reason == "cut_header"):
                self.stats.truncated_packets += 1
            return
        if decoded.cut:
            self.stats.truncated_packets += 1
            self.stats.truncated_bytes += decoded.cut
        elif short:
            self.stats.truncated_packets += 1
        self.segment(decoded.src, decoded.dst, decoded.segment)

    def segment(self, src: Endpoint, dst: Endpoint, seg: Segment) -> None:
        """One TCP segment (already out of its frame), sent by ``src`` to ``dst``."""
        t = seg.t
        if not self.started:
            self.start(t)
        stats = self.stats
        stats.tcp_packets += 1
        if stats.first_t is None:
            stats.first_t = t
        if stats.last_t is None or t > stats.last_t:
            stats.last_t = t
        self.advance(t)
        before = self.table.stragglers
        for item in self.table.feed(src, dst, seg):
            self._on(item)
        stats.stragglers += self.table.stragglers - before

    def start(self, t: float) -> None:
        """Write each tap's header (at the first packet's time)."""
        if self.started:
            return
        self.started = True
        for name in self.taps:
            ports = (
                sorted(p for p, n in self._by_port.items() if n == name)
                if self._by_port
                else sorted(self._ports)
                if self._ports is not None
                else None
            )
            listen = ",".join(f"*:{p}" for p in ports) if ports else None
            options: dict[str, Any] = {
                "stall_after": self.stall_after,
                "bodies": self.bodies,
                "passive": True,
                **({"ports": ports} if ports else {}),
                **self.options,
            }
            self._emit(
                ev.CaptureStart(
                    t=t,
                    m=t,
                    tap=name,
                    tracer_version=__version__,
                    kind=self.kind,
                    # a live sniff's own scrapes and probes carry this run's nonce
                    probe_nonce=RUN_NONCE if self.kind == "sniff" else None,
                    listen=listen,
                    boot_id=self.boot_id,
                    options=options,
                    upstream_role=self.roles.get(name),
                )
            )
            role = self.roles.get(name)
            if role is not None:  # declared: written at once, as the inline tap does
                said = (
                    "--tap-by-port " + ",".join(f"{p}={name}:{role}" for p in ports or ())
                    if self._by_port
                    else f"--upstream-role {role}"
                )
                self._emit(
                    ev.Topology(
                        t=t,
                        m=t,
                        tap=name,
                        upstream=listen or "*",
                        upstream_role=role,
                        basis="declared",
                        evidence=[f"declared: {said}"],
                    )
                )

    def advance(self, now: float) -> None:
        """Time is ``now`` (a packet's): tick every connection whose request in flight has
        been silent for ``stall_after`` by now, at the moment it became so."""
        due = self._due
        while due and due[0][0] <= now:
            when, _, conn = heapq.heappop(due)
            f = self._follows.get(conn)
            if f is None or f.obs is None:
                continue
            f.scheduled = False
            obs = f.obs
            if not obs.in_flight:
                continue
            at = self._stall_time(obs.last_activity_m)
            if at > when:  # bytes moved since: check again later
                self._schedule(f, at)
                continue
            client, server = f.client, f.server
            assert client is not None and server is not None
            window = f.tcp.streams[client].window
            obs.tick(
                at,
                stall_after=self.stall_after,
                client_blocked=window == 0,
                unsent=f.tcp.streams[server].unacked,
            )

    def finish(
        self,
        t: float | None = None,
        *,
        kernel_dropped: int | None = None,
        reason: str = "end of capture",
    ) -> None:
        """The capture is over (at ``t``, else its last packet): stalls due by then,
        every connection still open closed, what was lost, and each tap's end."""
        if self.finished:
            return
        end = t if t is not None else (self.stats.last_t or 0.0)
        if not self.started:
            self.start(end)
        self.advance(end)
        for item in self.table.close_all(end):
            self._on(item)
        self.finished = True
        if kernel_dropped is not None:
            self.stats.kernel_dropped = kernel_dropped
        if self.loss_evidence:
            for loss in self.stats.loss_events(self.taps, end):
                self._emit(loss)
        for name in self.taps:
            self._emit(
                ev.CaptureEnd(
                    t=end,
                    m=end,
                    tap=name,
                    records=self._records[name] + 1,
                    dropped=0,
                    reason=reason,
                )
            )

    # ---- connections ------------------------------------------------------------------

    def _on(self, item: Item) -> None:
        if isinstance(item, Opened):
            self._follows[item.conn] = _Follow(item.connection)
            self.stats.connections += 1
            return
        f = self._follows.get(item.conn)
        if f is None:
            return
        if isinstance(item, Syn):
            if item.ack:
                f.synack_t = item.t if f.synack_t is None else f.synack_t
            elif f.syn_t is None:
                f.syn_t = item.t
        if f.state == "undecided":
            self._decide(f, item)
        elif f.state == "followed":
            self._apply(f, item)
        if isinstance(item, Closed):
            self._follows.pop(item.conn, None)

    def _decide(self, f: _Follow, item: Item) -> None:
        if not isinstance(item, Data) or len(f.held) < HELD_ITEMS:
            f.held.append(item)  # (a connection is undecided for a few items but without
            # a handshake, where it waits for a request head: its bytes before are skipped)
        else:
            f.skipped[item.src] += len(item.data)
            self.stats.skipped_bytes += len(item.data)
        client = self._client(f, item)
        if client is None and isinstance(item, Closed):
            client = False
        if client is None:
            return
        held, f.held = f.held, []
        if client is False:
            f.state = "ignored"
            self.stats.ignored += 1
            f.tcp.ignore()
            return
        self._follow(f, client)
        for it in held:
            self._apply(f, it)

    def _client(self, f: _Follow, item: Item) -> Endpoint | Literal[False] | None:
        """Who the client is (False: not followed; None: not known yet)."""
        tcp = f.tcp
        ports = self._ports
        if ports is not None:
            client = tcp.client
            if client is None:
                if tcp.second.port in ports:
                    client = tcp.first
                elif tcp.first.port in ports:
                    client = tcp.second
                else:
                    return False
            return client if tcp.peer(client).port in ports else False
        if not isinstance(item, Data):
            return None
        if tcp.client is not None:
            if item.src != tcp.client:
                return False  # the server spoke first: not HTTP
            f.probe += item.data[: PROBE_BYTES - len(f.probe)]
            looks = looks_like_request(f.probe)
            return tcp.client if looks else None if looks is None else False
        return item.src if looks_like_request(item.data) else None

    def _follow(self, f: _Follow, client: Endpoint) -> None:
        tcp = f.tcp
        server = tcp.peer(client)
        f.state = "followed"
        f.client, f.server = client, server
        f.synced = tcp.start_seen and tcp.client == client
        f.tap = (
            self._by_port.get(server.port, self._default_tap)
            if self._by_port
            else self._default_tap
        )
        self._nums[f.tap] += 1
        f.num = self._nums[f.tap]
        self.stats.followed += 1
        if not tcp.start_seen:
            self.stats.without_start += 1
        opened = tcp.first_t if tcp.first_t is not None else 0.0
        f.obs = ConnectionObserver(
            tap=f.tap,
            conn=f.num,
            emit=self._emit,
            wall_offset=0.0,
            opened_m=opened,
            bodies=self.bodies,
        )
        self._emit(
            ev.ConnOpen(
                t=opened, m=opened, tap=f.tap, conn=f.num, peer=str(client), local=str(server)
            )
        )
        if f.syn_t is not None and tcp.client == client:  # the client's SYN: connecting
            self._emit(
                ev.UpstreamConnect(
                    t=f.syn_t, m=f.syn_t, tap=f.tap, conn=f.num, phase="start", addr=str(server)
                )
            )

    def _connect_done(self, f: _Follow, t: float, *, refused: bool = False) -> None:
        """The server answered the SYN (its SYN-ACK, or bytes from a connection whose
        handshake was not captured), or refused it (a reset in answer to the SYN)."""
        if f.connected is not None:
            return
        f.connected = not refused
        answered = refused or f.synack_t == t  # the answer itself was captured
        elapsed = round(t - f.syn_t, 6) if f.syn_t is not None and answered else None
        self._emit(
            ev.UpstreamConnect(
                t=t,
                m=t,
                tap=f.tap,
                conn=f.num,
                phase="failed" if refused else "done",
                addr=str(f.server),
                error="connection refused (a reset in answer to the SYN)" if refused else None,
                elapsed=elapsed,
            )
        )

    def _apply(self, f: _Follow, item: Item) -> None:
        obs = f.obs
        assert obs is not None
        if f.connected is None and not isinstance(item, (Syn, Reset, Closed)):
            self._connect_done(f, f.synack_t if f.synack_t is not None else item.t)
        match item:
            case Syn(t=t, ack=True):
                self._connect_done(f, t)
                return
            case Data(t=t, src=src, data=data):
                side = f.side(src)
                if not f.synced:
                    if side == "client" and looks_like_request(data):
                        f.synced = True
                    else:
                        f.skipped[src] += len(data)
                        self.stats.skipped_bytes += len(data)
                        return
                if side == "client":
                    self._client_data(f, data, t)
                else:
                    self._upstream_data(f, data, t)
            case Gap(t=t, src=src, offset=offset, size=size, cause=cause):
                self.stats.gaps[f.tap] += 1
                self.stats.gap_bytes[f.tap] += size
                if f.synced:
                    self._gap(f, t, f.side(src), offset, size, cause)
            case Fin(t=t, src=src):
                side = f.side(src)
                self._first(f, side, "fin")
                if side == "client":
                    obs.client_eof(t, reset=False)
                else:
                    obs.upstream_eof(t, reset=False)
            case Reset(t=t, src=src):
                side = f.side(src)
                if f.connected is None and f.syn_t is not None:  # no answer to the SYN
                    if side == "upstream":
                        self._connect_done(f, t, refused=True)
                elif f.connected is None:  # opened before the capture began
                    self._connect_done(f, t)
                self._first(f, side, "reset")
                if side == "client":
                    obs.client_eof(t, reset=True)
                else:
                    obs.upstream_eof(t, reset=True)
            case Closed(t=t, why=why):
                self._close(f, t, why)
                return
            case _:
                return
        if obs.in_flight and not f.scheduled:
            self._schedule(f, self._stall_time(obs.last_activity_m))

    # ---- gaps ---------------------------------------------------------------------------

    def _gap(
        self, f: _Follow, t: float, side: ev.Direction, offset: int, size: int, cause: str
    ) -> None:
        """Bytes missing from a stream: the requests whose bytes they were are marked,
        and parsing picks up again after them where it can (see "Gaps" above)."""
        obs = f.obs
        assert obs is not None
        if obs.blind:
            return
        why = {
            "not_captured": "acknowledged by the peer but not in the capture",
            "buffer_full": "never in the capture while later bytes piled up",
            "never_filled": "not in the capture by the stream's end",
            "snaplen": "cut by the capture's snapshot length",
        }.get(cause, cause)
        where = f"packet capture: {size} byte(s) of the {side} stream missing at offset {offset} ({why})"
        resumable = obs.client_position()[2] if side == "client" else not obs.tunnel
        if not resumable:  # a tunnel, bytes behind a protocol switch: not followed further
            pending = obs.in_flight_requests()
            seq = pending[0]["seq"] if pending else (obs.seq or None)
            self._anomaly(f, t, side, seq, size, f"{where}; not parsed from there on")
            obs.blind = True  # as after a parse failure: bytes are only counted from now on
            obs.head_started_m = None
            return
        if side == "client":
            self._client_gap(f, t, size, where)
        else:
            self._upstream_gap(f, t, size, where)

    def _client_gap(self, f: _Follow, t: float, size: int, where: str) -> None:
        obs = f.obs
        assert obs is not None
        if f.c_scan is not None:  # already skipping to a request line: more of it unknown
            f.swallow_gap += size
            return
        seq: int | None = None
        if f.c_skip:  # inside a body a gap already cut (its request marked then)
            remaining: int | None = f.c_skip
            f.c_skip = 0
            inside = True
        else:
            req, remaining, _ = obs.client_position()
            inside = req is not None
            seq = None if req is None else req.seq
            obs.restart_client(t)  # the request being read ends, not complete
        if inside:
            if remaining is not None and size < remaining:  # within its body: skip the rest
                f.c_skip = remaining - size
                if seq is not None:
                    self._anomaly(
                        f,
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
                        f,
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
                        f,
                        t,
                        "client",
                        seq,
                        size,
                        f"{where}, inside request {seq}'s body (where it ends is not known): it "
                        "is not complete; parsed again from the next request line",
                    )
                self._swallowing(f, size, certain=False)
                return
            if seq is not None:
                self._anomaly(
                    f,
                    t,
                    "client",
                    seq,
                    size,
                    f"{where}, from inside request {seq}'s body past its end: it is not complete",
                )
        # the head (the start at least) of the next request is in the gap: numbered
        obs.seq += 1
        f.allocated += 1
        self._anomaly(
            f,
            t,
            "client",
            obs.seq,
            size,
            f"{where}: request {obs.seq}'s head is not in the capture; parsed again from the "
            "next request line",
        )
        self._swallowing(f, size, certain=True)

    def _swallowing(self, f: _Follow, size: int, *, certain: bool) -> None:
        """The client's bytes are skipped to the next request line; requests the gap
        swallowed may still be answered (``certain``: one was, numbered)."""
        obs = f.obs
        assert obs is not None
        f.c_scan = b""
        f.swallow = "certain" if certain or f.swallow == "certain" else "maybe"
        f.swallow_gap += size
        obs.catch_orphans = True

    def _upstream_gap(self, f: _Follow, t: float, size: int, where: str) -> None:
        obs = f.obs
        assert obs is not None
        if f.swallow is not None:  # requests swallowed and responses lost: not pairable
            f.u_gap += size
            self._unpair(f, t, "upstream", f.u_gap)
            return
        if f.u_scan is not None:  # already skipping to a status line
            f.u_gap += size
            return
        f.u_gap = size
        if f.u_skip:  # inside a body a gap already cut (its request marked then)
            remaining: int | None = f.u_skip
            f.u_skip = 0
        else:
            remaining = None
            if obs.pending:
                req = obs.pending[0]
                remaining = obs.upstream_remaining()
                self._anomaly(
                    f,
                    t,
                    "upstream",
                    req.seq,
                    size,
                    f"{where}, in request {req.seq}'s response: not known from there on",
                )
                self._lost_response(f, t, req, size)
            else:
                self._anomaly(
                    f,
                    t,
                    "upstream",
                    None,
                    size,
                    f"{where}, while no request waited for a response; parsed again from the "
                    "next status line",
                )
            obs.restart_upstream()
        if remaining is not None and size < remaining:  # within that body: skip the rest
            f.u_skip = remaining - size
            return
        if remaining is not None and size == remaining:  # its end: the next response follows
            return
        if remaining is not None and obs.pending:  # past its end: the next response's head
            req = obs.pending[0]
            self._anomaly(
                f,
                t,
                "upstream",
                req.seq,
                size,
                f"{where}, past the end of the response before: request {req.seq}'s response "
                "head is not in the capture",
            )
            self._lost_response(f, t, req, size)
        f.u_scan = b""

    def _lost_response(self, f: _Follow, t: float, req: WireRequest, size: int) -> None:
        """A response bytes of which the capture does not have: ``unparsed``, never
        ``complete`` (its figures are those of the bytes before the gap)."""
        assert f.obs is not None
        f.obs.end_response(
            req,
            t,
            "unparsed",
            detail=f"packet capture: {size} byte(s) of the response stream missing: the "
            "response is not known past them",
        )

    def _client_data(self, f: _Follow, data: bytes, t: float) -> None:
        """The client's bytes to the observer, or skipped after a gap."""
        obs = f.obs
        assert obs is not None
        if obs.blind or obs.tunnel:
            f.c_scan, f.c_skip = None, 0
            obs.client_data(data, t)
            return
        if f.c_skip:
            n = min(f.c_skip, len(data))
            f.c_skip -= n
            obs.skip_client(n, t)
            data = data[n:]
            if f.c_skip:
                return
            obs.restart_client(t)
            if not data:
                return
        if f.c_scan is not None:
            obs.skip_client(len(data), t)  # (the bytes fed from the request line: not again)
            buf = f.c_scan + data
            at = _find_request(buf)
            if at < 0:
                f.c_scan = buf[-RESYNC_KEEP:]
                return
            f.c_scan = None
            data = buf[at:]
            obs.client_bytes -= len(data)
            obs.restart_client(t)
        before = obs.seq
        obs.client_data(data, t)
        if f.swallow is not None and obs.seq > before:
            self._resolve(f, t, before)

    def _resolve(self, f: _Follow, t: float, before: int) -> None:
        """The first request read after a client gap that may have swallowed requests:
        its response is the next one where that is sure, else nothing is paired."""
        obs = f.obs
        assert obs is not None
        earlier = any(r.seq <= before for r in obs.pending)
        if earlier or f.orphans_seen < f.allocated:
            self._unpair(f, t, "client", f.swallow_gap)
            return
        f.swallow = None
        f.swallow_gap = f.allocated = f.orphans_seen = 0
        obs.catch_orphans = False

    def _upstream_data(self, f: _Follow, data: bytes, t: float) -> None:
        """The server's bytes to the observer, or skipped after a gap."""
        obs = f.obs
        assert obs is not None
        if obs.blind or obs.tunnel:
            f.u_scan, f.u_skip = None, 0
            obs.upstream_data(data, t)
            return
        if f.u_skip:
            n = min(f.u_skip, len(data))
            f.u_skip -= n
            obs.skip_upstream(n, t)
            data = data[n:]
            if f.u_skip:
                return
            obs.restart_upstream()
            if not data:
                return
        if f.u_scan is None:
            obs.upstream_data(data, t)
            orphans = obs.orphans
            if orphans is None:
                return
            obs.orphans = None  # bytes after a response with no request to answer: counted
            f.u_scan = b""
            buf = orphans
        else:
            obs.skip_upstream(len(data), t)  # (the bytes fed from the status line: not again)
            buf = f.u_scan + data
        pos = 0
        while (line := _STATUS_AT.search(buf, pos)) is not None:
            at = line.start()
            if not obs.pending:  # no request waits: a swallowed request's response, or none
                if f.swallow is not None:
                    self._orphan(f, t, line.group().rstrip().decode("latin-1"))
                pos = line.end()
                continue
            if len(obs.pending) > 1 or f.swallow is not None:  # whose it is cannot be known
                f.u_scan = None
                self._unpair(f, t, "upstream", f.u_gap)
                return
            f.u_scan = None  # the response of the one request waiting
            f.u_gap = 0
            rest = buf[at:]
            obs.upstream_bytes -= len(rest)
            obs.restart_upstream()
            self._upstream_data(f, rest, t)
            return
        f.u_scan = buf[max(pos, len(buf) - RESYNC_KEEP) :]

    def _orphan(self, f: _Follow, t: float, status_line: str) -> None:
        """A response with no request left to answer, while a client gap may have
        swallowed requests: a swallowed request's (numbered, when not yet)."""
        obs = f.obs
        assert obs is not None
        f.orphans_seen += 1
        if f.orphans_seen <= f.allocated:
            return  # the request its gap numbered
        obs.seq += 1
        f.allocated += 1
        self._anomaly(
            f,
            t,
            "client",
            obs.seq,
            f.swallow_gap,
            f"packet capture: request {obs.seq} is not in the capture ({f.swallow_gap} byte(s) "
            f"of the client stream missing), its response is ({status_line})",
        )

    def _unpair(self, f: _Follow, t: float, side: ev.Direction, gap: int) -> None:
        """Responses can no longer be paired with requests after a gap: each request
        waiting ends ``unparsed``; the connection is not parsed from here on."""
        obs = f.obs
        assert obs is not None
        what = (
            f"packet capture: after {gap} byte(s) missing from the {side} stream, responses "
            "cannot be paired with their requests"
        )
        waiting = [r.seq for r in obs.pending]
        for seq in waiting:
            self._anomaly(
                f,
                t,
                side,
                seq,
                gap,
                f"{what}: request {seq}'s response is not known; not parsed from there on",
            )
        if not waiting:
            self._anomaly(f, t, side, None, gap, f"{what}; not parsed from there on")
        obs.unpaired(t, what)
        f.c_scan = f.u_scan = None
        f.c_skip = f.u_skip = 0
        f.swallow = None
        obs.catch_orphans = False

    def _anomaly(
        self, f: _Follow, t: float, side: ev.Direction, seq: int | None, gap: int, error: str
    ) -> None:
        obs = f.obs
        assert obs is not None
        self._emit(
            ev.Anomaly(
                t=t,
                m=t,
                tap=f.tap,
                conn=f.num,
                seq=seq,
                direction=side,
                error=error,
                offset=obs.client_bytes if side == "client" else obs.upstream_bytes,
                gap=gap,
            )
        )

    def _first(self, f: _Follow, side: ev.Direction, how: Literal["fin", "reset"]) -> None:
        """The first side to close, and how (as the inline tap records it)."""
        if f.closed_by is not None:
            return
        obs = f.obs
        assert obs is not None
        f.closed_by, f.how = side, how
        f.in_flight_at_close = obs.in_flight
        if how == "fin":
            f.fin_side = side
            f.fin_at_bytes = (obs.client_bytes, obs.upstream_bytes)

    def _close(self, f: _Follow, t: float, why: str) -> None:
        obs = f.obs
        assert obs is not None and f.client is not None and f.server is not None
        if f.closed_by is None:
            f.in_flight_at_close = obs.in_flight
        seen_end = why in ("fin", "reset")
        obs.close(t, shutdown=not seen_end)
        tcp = f.tcp
        up = tcp.streams[f.server]
        self.stats.duplicate_bytes += up.duplicate + tcp.streams[f.client].duplicate
        client_then, upstream_then = f.fin_at_bytes
        half: ev.Direction | None = None
        if f.fin_side == "client" and obs.upstream_bytes > upstream_then:
            half = "client"
        elif f.fin_side == "upstream" and obs.client_bytes > client_then:
            half = "upstream"
        opened = tcp.first_t if tcp.first_t is not None else t
        self._emit(
            ev.ConnClose(
                t=t,
                m=t,
                tap=f.tap,
                conn=f.num,
                closed_by=f.closed_by or "none",
                how=f.how or "unknown",
                half_close=half,
                in_flight=f.in_flight_at_close,
                requests=obs.seq,
                bytes_from_client=obs.client_bytes + f.skipped[f.client],
                bytes_from_upstream=obs.upstream_bytes + f.skipped[f.server],
                upstream_opened=bool(f.connected),
                duration=round(t - opened, 6),
            )
        )

    # ---- stalls -------------------------------------------------------------------------

    def _stall_time(self, last: float) -> float:
        """The first time at which ``last`` is ``stall_after`` old (exactly, in floats)."""
        at = last + self.stall_after
        while at - last < self.stall_after:
            at = math.nextafter(at, math.inf)
        return at

    def _schedule(self, f: _Follow, at: float) -> None:
        self._order += 1
        f.scheduled = True
        heapq.heappush(self._due, (at, self._order, f.tcp.conn))

    # ---- output -------------------------------------------------------------------------

    def _emit(self, event: ev.Event) -> None:
        self._records[event.tap] += 1
        self._emit_out(event)
