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
   role: in the tap's header and a ``topology`` record (basis ``declared``). A
   connection's state and its own records are ``follow``'s.
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
   the gap (``gaps``: its rules); what the gap hid is never guessed.

What passive capture cannot see, and this does not guess: what an application did with
bytes its kernel acknowledged (read them, or left them in its socket buffer), anything
inside TLS, and bytes the capture lost (they are marked, not invented).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

from .. import __version__
from .. import events as ev
from ..protocol.probe_mark import nonce_for
from .follow import Follow
from .gaps import Resync
from .packets import PassiveStats, Skipped, decode_frame
from .request_line import PROBE_BYTES
from .request_line import looks_like_request as looks_like_request
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
    TcpTable,
)
from .wire import Bodies, ConnectionObserver

Emit = Callable[[ev.Event], None]

STALL_AFTER = 5.0  # the tap's default --stall-after
HELD_ITEMS = 256  # data items held per connection while it is undecided (more: skipped)


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
        self._follows: dict[int, Follow] = {}
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
                    probe_nonce=nonce_for(name) if self.kind == "sniff" else None,
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
            self._follows[item.conn] = Follow(item.connection, self._emit)
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

    def _decide(self, f: Follow, item: Item) -> None:
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

    def _client(self, f: Follow, item: Item) -> Endpoint | Literal[False] | None:
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

    def _follow(self, f: Follow, client: Endpoint) -> None:
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
        f.resync = Resync(f.obs, tap=f.tap, conn=f.num, emit=self._emit)
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

    def _apply(self, f: Follow, item: Item) -> None:
        obs, resync = f.obs, f.resync
        assert obs is not None and resync is not None
        if f.connected is None and not isinstance(item, (Syn, Reset, Closed)):
            f.connect_done(f.synack_t if f.synack_t is not None else item.t)
        match item:
            case Syn(t=t, ack=True):
                f.connect_done(t)
                return
            case Data(t=t, src=src, data=data):
                side = f.side(src)
                if not f.synced:
                    if side == "client" and looks_like_request(data):
                        f.synced = True
                        self._began_before(f, t)
                    else:
                        f.skipped[src] += len(data)
                        self.stats.skipped_bytes += len(data)
                        return
                if side == "client":
                    resync.client_data(data, t)
                else:
                    resync.upstream_data(data, t)
            case Gap(t=t, src=src, offset=offset, size=size, cause=cause):
                self.stats.gaps[f.tap] += 1
                self.stats.gap_bytes[f.tap] += size
                if f.synced:
                    resync.gap(t, f.side(src), offset, size, cause)
            case Fin(t=t, src=src):
                side = f.side(src)
                f.first(side, "fin")
                if side == "client":
                    obs.client_eof(t, reset=False)
                else:
                    obs.upstream_eof(t, reset=False)
            case Reset(t=t, src=src):
                side = f.side(src)
                if f.connected is None and f.syn_t is not None:  # no answer to the SYN
                    if side == "upstream":
                        f.connect_done(t, refused=True)
                elif f.connected is None:  # opened before the capture began
                    f.connect_done(t)
                f.first(side, "reset")
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

    def _close(self, f: Follow, t: float, why: str) -> None:
        tcp = f.tcp
        assert f.client is not None and f.server is not None
        self.stats.duplicate_bytes += (
            tcp.streams[f.server].duplicate + tcp.streams[f.client].duplicate
        )
        f.close(t, why)

    # ---- stalls -------------------------------------------------------------------------

    def _began_before(self, f: Follow, t: float) -> None:
        """A connection the capture joined mid-way (no SYN) with bytes before the first
        request head it saw: requests before that one are not in the capture, and the
        positions on it count from there — said, as a packet capture's own loss."""
        skipped = sum(f.skipped.values())
        if f.tcp.start_seen or not skipped:
            return
        self._emit(
            ev.Anomaly(
                t=t,
                m=t,
                tap=f.tap,
                conn=f.num,
                seq=None,
                direction="client",
                error=f"packet capture: the connection began before the capture, and {skipped} "
                "byte(s) of it came before the first request head seen: requests before it are "
                "not in the capture, and positions on it count from there",
                offset=0,
                gap=skipped,
            )
        )

    def _stall_time(self, last: float) -> float:
        """The first time at which ``last`` is ``stall_after`` old (exactly, in floats)."""
        at = last + self.stall_after
        while at - last < self.stall_after:
            at = math.nextafter(at, math.inf)
        return at

    def _schedule(self, f: Follow, at: float) -> None:
        self._order += 1
        f.scheduled = True
        heapq.heappush(self._due, (at, self._order, f.tcp.conn))

    # ---- output -------------------------------------------------------------------------

    def _emit(self, event: ev.Event) -> None:
        self._records[event.tap] += 1
        self._emit_out(event)
