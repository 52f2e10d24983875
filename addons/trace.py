"""The tracer's capture from inside mitmproxy: the same events as the native tap.

    mitmdump -s addons/trace.py --mode reverse:http://127.0.0.1:30000 \\
        --set tracer_capture=front.jsonl [--set tracer_tap=NAME] \\
        [--set tracer_stall_after=5] [--set tracer_bodies=none|requests|all] \\
        [--set tracer_sidecar=false]

Theory of operation
-------------------
A thin adapter: mitmproxy parses HTTP and calls hooks; this addon takes from each hook
the facts the tracer needs (times, ids, heads, body pieces: the named tuples of
``tracer/observe/facts.py``) and hands them to ``tracer.observe.flows.FlowObserver``,
which drives the exchange tracker the native tap uses (``tracer/observe/exchange.py``)
and writes the tracer's typed events (``tracer/events.py``) with its capture writer,
classifying SSE with ``tracer/protocol/sse.py`` and redacting headers with
``tracer/redact.py``. ``tracer analyze`` reads the result like any other capture
(``capture_start.kind`` is ``mitmproxy``). What it reads of mitmproxy's internals is in
``trace_mitm.py`` beside it.

The engine runs in a capture process of its own (``python -m tracer.observe.flow_process``,
started when the capture opens; ``tracer_sidecar=false`` runs it in mitmproxy's process
instead): the facts go to it in batches every ``SHIP_INTERVAL`` over a pipe that never
blocks mitmproxy (``tracer/observe/flow_pipe.py``). So the work per request and per SSE
event (the SSE classification, the body and request records, their JSON) is not done on
mitmproxy's core: done there it cost mitmdump 9-12 % of its throughput, and this way
about 1 % (``bench/README.md``). The capture process keeps to the cores mitmproxy is not
pinned to, when there are any.

=========================  ===============================================================
mitmproxy hook             events
=========================  ===============================================================
``client_connected``       ``conn_open`` (connections numbered 1, 2 ... in accept order)
``server_connect`` /       ``upstream_connect`` ``start`` / ``done`` / ``failed`` (mitmproxy
``server_connected`` /     may open several upstream connections for one client connection:
``server_connect_error``   each gives its own records)
``server_disconnected``    ``upstream_close``, when the client connection stays open
``requestheaders``         ``request`` (its position ``seq`` on the client connection)
``request``                ``request_end`` (size; the body per option, else its hash and
                           OpenAI fields: a reader derives those of a kept body)
``responseheaders``        ``response``; switches streaming on for ``text/event-stream``
                           (mitmproxy #4469) with a callable that takes each piece's time
                           and returns it unchanged
stream callable            ``body`` records, batched as the tap does (per piece: its time
                           and size; SSE events with their kinds, via ``SseObserver``)
``response`` / ``error``   ``response_end`` with the termination
``client_disconnected``    ``conn_close``
``tls_failed_client`` /    ``anomaly`` on the connection (``client`` / ``upstream``): the
``tls_failed_server``      TLS handshake failed, in mitmproxy's words
a ticker (``running``)     ``stall`` start/end (with what only mitmproxy's process can see:
                           bytes it holds for the client, the kernel's unsent bytes);
                           flushes body batches
``done``                   ``response_end`` ``in_flight`` and ``conn_close`` for what is
                           open, then ``capture_end``
=========================  ===============================================================

Rules:

1. Observation never changes traffic, nor holds it back: the stream callable returns its
   input (or hands it on to a stream callable another addon set first) after taking its
   time; once the exchange has ended the flow's ``stream`` attributes get back what they
   held before; the pipe to the capture process is written without blocking (a backlog,
   bounded by ``MAX_BACKLOG``, waits for it; beyond that facts are dropped and counted in
   a ``capture_loss`` record); a failure in this addon is logged and forwarding goes on.
   Without ``tracer_capture`` the addon does nothing.
2. Times: ``m`` is this process's monotonic clock, ``t`` = ``m`` + a wall offset fixed at
   start, as in the tap. Heads and ends are timed by mitmproxy's own timestamps where it
   keeps them; body pieces when mitmproxy hands them over.
3. A termination is decided from what mitmproxy says: the end of the message
   (complete), its ``error`` text and which side's socket stopped reading (client abort
   or truncated), a kill (in flight), a parse failure (unparsed, with an ``anomaly``),
   an answer made by mitmproxy itself (``tracer_response``: its 502 when the upstream
   cannot be reached, or a response an addon set). On HTTP/2 from the client a stream's
   end is that stream's alone, each stream in flight is watched for stalls by its own
   last sign of life, and the bytes mitmproxy holds for the client under flow control
   are followed (``FlowConn.delivery_check``): a streamed response ends when they
   have left.
4. What mitmproxy does not show is not invented: chunk boundaries (``chunks`` is 0),
   FIN versus reset (``close`` is absent; ``conn_close.how`` is ``unknown``), half-close.
   See ``addons/README.md``.
5. Cost: the stream callable is called once per piece of body, so it only takes the
   time and keeps the piece (its size, when neither SSE nor ``tracer_bodies=all`` needs
   it); everything else happens in the capture process. ``python -m bench.run
   --scenarios addon`` measures what the addon costs mitmdump.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal

if importlib.util.find_spec("tracer") is None:  # a mitmdump without tracer installed
    sys.path.append(str(Path(__file__).resolve().parent.parent))
if importlib.util.find_spec("trace_mitm") is None:  # loaded by path, not by mitmproxy's -s
    sys.path.append(str(Path(__file__).resolve().parent))

from mitmproxy import connection, ctx, exceptions, http, tls
from mitmproxy import version as mitmproxy_version
from mitmproxy.addonmanager import Loader
from mitmproxy.proxy import server_hooks
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode
from trace_mitm import client_backlog, h2_of, held_now, reset_by_client, stream_id

from tracer import __version__
from tracer.capture.files import boot_id
from tracer.observe import facts
from tracer.observe.exchange import BODY_BATCH_READS, MAX_KEPT_BYTES, tick_interval
from tracer.observe.flow_pipe import CLOSE_WAIT, CaptureProcess, FactShipper, FlowPieces, StreamFn
from tracer.observe.flow_process import open_engine
from tracer.observe.flows import BODIES, Settings
from tracer.protocol.sse import is_event_stream

__all__ = ["BODY_BATCH_READS", "MAX_KEPT_BYTES", "TraceAddon"]

log = logging.getLogger(__name__)


class _Client:
    """A client connection: its flows in flight, and mitmproxy's HTTP/2 state for it."""

    __slots__ = ("cid", "client", "flows", "h2", "h2_layer", "h2_looked")

    def __init__(self, client: connection.Client) -> None:
        self.client = client
        self.cid: str = client.id
        self.flows: dict[str, _Flow] = {}
        # mitmproxy's HTTP layer and HTTP/2 connection for it, found on the first stream
        # (``h2_of``; None when its internals are not as expected): where the bytes it
        # holds for the client under HTTP/2 flow control are
        self.h2_looked = False
        self.h2_layer: Any = None
        self.h2: Any = None


class _Flow(FlowPieces):
    """A flow in flight: its body pieces not yet handed to the engine (``FlowPieces``),
    and what to give back to mitmproxy when it ends."""

    __slots__ = (
        "answered",
        "client",
        "h2",
        "injected",
        "req_chain",
        "request_seen",
        "resp_chain",
        "stream_id",
        "streamed_request",
        "streamed_response",
        "upstream_done",
    )

    def __init__(self, fid: str, client: _Client) -> None:
        super().__init__(fid)
        self.client = client
        self.request_seen = False
        self.answered = False  # an addon answered before the upstream was asked
        self.streamed_request = False
        self.streamed_response = False
        self.req_chain: StreamFn | bool = False  # what request.stream was before ours
        self.resp_chain: StreamFn | bool = False  # ... and response.stream
        self.h2: Any = None  # mitmproxy's HTTP/2 connection to the client, and ...
        self.stream_id: int | None = None  # ... the stream that carries this flow
        self.injected: str | None = None  # a fault addons/faults.py applied to it
        self.upstream_done = False  # HTTP/2: ended upstream, last bytes held for the client


class TraceAddon(FactShipper):
    """mitmproxy hooks in, facts for ``tracer.observe.flows.FlowObserver`` out (shipped
    by ``FactShipper``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tap = "mitmproxy"
        self.stall_after = 5.0
        self.bodies = "requests"
        self.body_memory = 64 * 1024 * 1024
        self.sidecar = True
        self._clients: dict[str, _Client] = {}  # by mitmproxy's client connection id
        self._flows: dict[str, _Flow] = {}  # by flow id
        self._ticker: asyncio.Task[None] | None = None

    # ---- options ----------------------------------------------------------------------

    def load(self, loader: Loader) -> None:
        loader.add_option(
            "tracer_capture",
            str,
            "",
            "Write the tracer's capture (JSON Lines) to this file; empty: tracing off.",
        )
        loader.add_option("tracer_tap", str, "mitmproxy", "The tap's name in the capture.")
        loader.add_option(  # a string: mitmproxy's --set has no float options
            "tracer_stall_after",
            str,
            "5",
            "Seconds without progress on a request in flight before a stall is recorded.",
        )
        loader.add_option(
            "tracer_bodies",
            str,
            "requests",
            "Bodies kept in the capture: none, requests (default) or all.",
            choices=list(BODIES),
        )
        loader.add_option(  # a string, as tracer_stall_after
            "tracer_body_memory",
            str,
            "64",
            "MiB all request bodies held at once may take; past it a body is hashed as it "
            "streams, and its record says so.",
        )
        loader.add_option(
            "tracer_sidecar",
            bool,
            True,
            "Build and write the capture in a process of its own (off: in mitmproxy's).",
        )

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        if "tracer_stall_after" in updated:
            try:
                stall_after = float(opts.tracer_stall_after)
            except ValueError:
                stall_after = float("nan")
            if not 0 < stall_after <= 86400:
                raise _options_error(
                    "tracer_stall_after must be seconds in (0, 86400], "
                    f"got {opts.tracer_stall_after!r}"
                )
            self.stall_after = stall_after
        if "tracer_body_memory" in updated:
            try:
                mib = float(opts.tracer_body_memory)
            except ValueError:
                mib = float("nan")
            if not 0 <= mib <= 1 << 20:
                raise _options_error(
                    f"tracer_body_memory must be MiB, 0 or more, got {opts.tracer_body_memory!r}"
                )
            self.body_memory = int(mib * 1024 * 1024)
        if "tracer_tap" in updated:
            tap = str(opts.tracer_tap).strip()
            if not tap:
                raise _options_error("tracer_tap must not be empty")
            self.tap = tap
        if "tracer_bodies" in updated:
            if opts.tracer_bodies not in BODIES:  # choices are checked too; be explicit
                raise _options_error(f"tracer_bodies must be one of {', '.join(BODIES)}")
            self.bodies = opts.tracer_bodies
        if "tracer_sidecar" in updated:
            self.sidecar = bool(opts.tracer_sidecar)
        if "tracer_capture" in updated:
            self._close_capture("capture file changed", wait=False)
            if opts.tracer_capture:
                self._open_capture(opts.tracer_capture)

    def _open_capture(self, path: str) -> None:
        full = Path(path).expanduser()
        try:  # a new file (0600, not through a symlink), which the capture process extends
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            os.close(os.open(full, flags, 0o600))
        except FileExistsError:
            raise _options_error(
                f"tracer_capture: {path} exists: give another path (two runs never mix)"
            ) from None
        except OSError as exc:
            raise _options_error(
                f"tracer_capture: cannot open {path}: {exc.strerror or exc}"
            ) from exc
        wall = time.time() - time.monotonic()
        settings = Settings(
            tap=self.tap,
            stall_after=self.stall_after,
            bodies=self.bodies,
            body_memory=self.body_memory,
            tcp_timeout=_number(getattr(ctx.options, "tcp_timeout", None)),
            wall=wall,
        )
        header = self._header(wall)
        if self.sidecar:
            try:
                self.process = CaptureProcess(str(full), settings, header)
            except OSError as exc:
                raise _options_error(
                    f"tracer_capture: cannot start the capture process: {exc.strerror or exc}"
                ) from exc
        else:
            self.engine = open_engine(str(full), settings, header)

    def _header(self, wall: float) -> dict[str, Any]:
        """The ``capture_start`` record's fields (but the tap's name)."""
        opts = ctx.options
        now = time.monotonic()
        modes = list(opts.mode)
        specs = [ProxyMode.parse(m) for m in modes]  # "reverse:URL@PORT": URL, PORT
        # the server a reverse proxy sends to (replays go there), when there is one: an
        # upstream mode's next hop is a forward proxy, which origin-form requests cannot
        # be replayed to, and with several reverse modes each connection has its own
        upstream = [m.data for m in specs if isinstance(m, ReverseMode)]
        listen = [
            f"{m.custom_listen_host or opts.listen_host or '*'}:"
            f"{m.custom_listen_port or opts.listen_port or 'default'}"
            for m in specs
        ]
        return {
            "t": now + wall,
            "m": now,
            "tracer_version": __version__,
            "kind": "mitmproxy",
            "listen": ", ".join(dict.fromkeys(listen)),
            "upstream": upstream[0] if len(upstream) == 1 else None,
            "boot_id": boot_id(),
            "options": {
                "stall_after": self.stall_after,
                "bodies": self.bodies,
                "mitmproxy": mitmproxy_version.VERSION,
                "mode": modes,
                "connection_strategy": getattr(opts, "connection_strategy", None),
                "tcp_timeout": getattr(opts, "tcp_timeout", None),
                "capture_process": self.sidecar,
            },
        }

    def _close_capture(self, reason: str, *, wait: bool = True) -> None:
        """Settle what is open (in flight, closed by the tap) and end the capture."""
        if not self._on:
            return
        self._stop(reason, wait=wait)
        self._clients.clear()
        self._flows.clear()

    # ---- lifecycle --------------------------------------------------------------------

    def running(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())

    def done(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        self._close_capture("mitmproxy stopped")
        for finishing in self._closing:
            finishing.join(CLOSE_WAIT)
        self._closing.clear()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(tick_interval(self.stall_after))
            try:
                self.tick(time.monotonic())
            except Exception:  # observation must never stop mitmproxy
                log.exception("tracer: tick failed")

    def tick(self, now: float) -> None:
        """What the engine's stall checks need of mitmproxy's state, now: for each client
        connection with flows in flight, its backlog; for each HTTP/2 flow, the bytes
        mitmproxy holds for it and whether the client reset it."""
        if not self._on:
            return
        self._drain_all()
        backlog: dict[str, tuple[bool, int | None]] = {}
        streams: dict[str, tuple[int | None, bool]] = {}
        delivered: list[_Flow] = []
        for client in self._clients.values():
            if not client.flows:
                continue
            backlog[client.cid] = client_backlog(client.client)
            for flow in client.flows.values():
                if flow.h2 is not None and flow.stream_id is not None:
                    held = held_now(flow.h2, flow.stream_id)
                    streams[flow.fid] = (held, reset_by_client(flow.h2, flow.stream_id))
                    if flow.upstream_done and not held:
                        delivered.append(flow)  # the engine ends it with this tick
        self._put(facts.Tick(now, backlog, streams))
        for flow in delivered:
            self._forget(flow)
        if self.process is not None:
            self._schedule(0)

    # ---- connections ------------------------------------------------------------------

    def _client(self, client: connection.Client) -> _Client:
        known = self._clients.get(client.id)
        if known is None:
            known = self._clients[client.id] = _Client(client)
            now = time.monotonic()
            self._put(facts.Conn(client.id, now, client.timestamp_start, client.peername, client.sockname))  # fmt: skip
        return known

    def client_connected(self, client: connection.Client) -> None:
        if self._on:
            self._client(client)

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        if self._on:
            cid = self._client(data.client).cid
            now = time.monotonic()
            self._put(facts.Upstream(cid, now, "start", data.server.address, None, None, None, None))  # fmt: skip

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        if self._on:
            s = data.server
            cid = self._client(data.client).cid
            now = time.monotonic()
            self._put(facts.Upstream(cid, now, "done", s.address, s.sockname, s.timestamp_start, s.timestamp_tcp_setup, None))  # fmt: skip

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        if self._on:
            s = data.server
            cid = self._client(data.client).cid
            now = time.monotonic()
            self._put(facts.Upstream(cid, now, "failed", s.address, None, s.timestamp_start, None, s.error))  # fmt: skip

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        if not self._on:
            return
        known = self._clients.get(data.client.id)
        if known is None or not data.client.connected:  # the client's ends: conn_close
            return
        s = data.server
        now = time.monotonic()
        self._put(facts.UpstreamClosed(known.cid, now, s.timestamp_end, s.address, s.sockname, s.error))  # fmt: skip

    def tls_failed_client(self, data: tls.TlsData) -> None:
        self._tls_failed(data, "client")

    def tls_failed_server(self, data: tls.TlsData) -> None:
        self._tls_failed(data, "upstream")

    def _tls_failed(self, data: tls.TlsData, direction: Literal["client", "upstream"]) -> None:
        if self._on:
            cid = self._client(data.context.client).cid
            self._put(facts.TlsFailed(cid, time.monotonic(), direction, data.conn.error))

    def client_disconnected(self, client: connection.Client) -> None:
        if not self._on:
            return
        known = self._clients.pop(client.id, None)
        if known is None:
            return
        for flow in known.flows.values():  # no hook for them any more: settled here
            self._drain(flow)
            self._flows.pop(flow.fid, None)
        self._put(facts.ClientGone(client.id, time.monotonic()))

    # ---- requests ---------------------------------------------------------------------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if not self._on:
            return
        now = time.monotonic()
        req = flow.request
        client = self._client(flow.client_conn)
        state = _Flow(flow.id, client)
        h2 = False
        if req.http_version.startswith(("HTTP/2", "HTTP/3")):
            if not client.h2_looked:
                client.h2_looked = True
                client.h2_layer, client.h2 = h2_of(flow.client_conn)
            if client.h2 is not None:
                state.stream_id = stream_id(client.h2_layer, flow)
                if state.stream_id is not None:
                    state.h2 = client.h2
                    h2 = True
        client.flows[flow.id] = state
        self._flows[flow.id] = state
        line = len(req.data.method) + len(req.data.path)
        streamed = bool(req.stream)
        self._put(facts.Request(flow.id, client.cid, now, req.timestamp_start, req.method, req.path, req.http_version, req.headers.fields, line, streamed, h2))  # fmt: skip
        if streamed:  # another addon streams the request: count it as it goes by
            state.streamed_request = True
            state.req_chain = req.stream
            req.stream = self._request_observer(state, req.stream)

    def request(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        if state is None or state.request_seen:
            return
        state.request_seen = True
        state.answered = flow.response is not None
        self._drain(state)
        req = flow.request
        content = None if state.streamed_request else req.raw_content
        self._put(facts.RequestEnd(flow.id, time.monotonic(), req.timestamp_end, content, state.answered))  # fmt: skip

    # ---- responses --------------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        resp = flow.response
        if state is None or resp is None:
            return
        now = time.monotonic()
        fields = resp.headers.fields
        sse = _is_sse(fields)
        state.keep = sse or self.bodies == "all"
        streamed = not state.answered and (sse or bool(resp.stream))
        line = len(resp.data.reason)
        self._put(facts.Response(flow.id, now, resp.timestamp_start, resp.status_code, resp.reason, resp.http_version, fields, line, streamed))  # fmt: skip
        if streamed:  # SSE must not be buffered (mitmproxy #4469)
            state.streamed_response = True
            state.resp_chain = resp.stream
            resp.stream = self._response_observer(state, resp.stream)

    def response(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        resp = flow.response
        if state is None or resp is None:
            return
        self._drain(state)
        content: bytes | int | None = None
        if not state.streamed_response:
            raw = resp.raw_content
            content = raw if raw is None or state.keep else len(raw)
        request = None if state.request_seen else flow.request.raw_content
        held = held_now(state.h2, state.stream_id) if state.h2 is not None else None
        self._put(facts.ResponseEnd(flow.id, time.monotonic(), resp.timestamp_end, state.body_end, content, request, held))  # fmt: skip
        if state.injected == "stall-after-events":  # held for good by faults.py: in flight
            return
        if held:  # the engine ends it when the bytes have left (tick)
            state.upstream_done = True
        else:
            self._forget(state)
        _let_go(state, flow)

    def error(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        if state is None:
            return
        self._drain(state)
        err = flow.error
        server = flow.server_conn
        client_reads = bool(flow.client_conn.state & connection.ConnectionState.CAN_READ)
        request = None if state.request_seen else flow.request.raw_content
        msg = err.msg if err is not None else "error"
        ts = err.timestamp if err is not None else None
        self._put(facts.Error(flow.id, time.monotonic(), msg, ts, server.error, bool(server.peername), server.alpn == b"h2", client_reads, request))  # fmt: skip
        self._forget(state)
        _let_go(state, flow)

    def _forget(self, state: _Flow) -> None:
        self._flows.pop(state.fid, None)
        state.client.flows.pop(state.fid, None)

    # ---- injected faults (from addons/faults.py) ------------------------------------------

    def record_fault(
        self, flow: http.HTTPFlow, seq: int, fault: str, spec: str, detail: str
    ) -> None:
        """A fault ``addons/faults.py`` injected into this flow, written as the tap writes it.

        Called by the faults addon when the fault acts, so that analysis never takes an
        injected fault for an external one. Works whichever addon mitmproxy loaded first:
        the connection is found (or opened) from the flow's client connection.
        """
        if not self._on:
            return
        cid = self._client(flow.client_conn).cid
        state = self._flows.get(flow.id)
        if state is not None:
            self._drain(state)  # the pieces before the fault go on record first
            if fault in ("stall-after-events", "truncate-after-events"):
                state.injected = fault
        self._put(facts.Fault(flow.id, cid, time.monotonic(), seq, fault, spec, detail))

    def record_fault_plan(self, specs: list[str], change: Literal["replace", "clear"]) -> None:
        """The faults ``addons/faults.py`` applies from now on (``tracer_faults`` set, at
        the start or anew while mitmproxy runs), as a ``fault_plan`` record."""
        if self._on:
            self._put(facts.FaultPlan(time.monotonic(), list(specs), change))


def _let_go(state: _Flow, flow: http.HTTPFlow) -> None:
    """Give the flow's stream attributes back what they held before the observers.

    Once the exchange has ended mitmproxy calls them no more, but the flow keeps them
    (and through them the request's state) until the garbage collector frees the flow:
    mitmproxy's flows are in reference cycles. Let go now, and that state is freed at
    once instead of adding to every collection.
    """
    if state.streamed_request:
        flow.request.stream = state.req_chain
    if state.streamed_response and flow.response is not None:
        flow.response.stream = state.resp_chain


def _is_sse(fields: tuple[tuple[bytes, bytes], ...]) -> bool:
    """Whether a response head says ``text/event-stream`` (as ``response_head_facts``)."""
    for name, value in fields:
        if name.lower() == b"content-type":
            return is_event_stream(value)
    return False


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _options_error(message: str) -> Exception:
    return exceptions.OptionsError(message)  # type: ignore[no-untyped-call]


addons = [TraceAddon()]
