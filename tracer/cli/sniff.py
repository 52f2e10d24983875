"""``tracer sniff``: the passive tap, live. It reads the packets of an interface (Linux,
``AF_PACKET``; root or CAP_NET_RAW) and records the connections to the given server ports
as the inline tap would, without being in the traffic: nothing is re-pointed, nothing is
delayed. With ``--engine-metrics`` it polls the engines too; with ``--probe-on-stall`` it
probes the stalled connection's server over a fresh connection."""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from .. import events as ev
from .. import logs
from ..arguments import leaf_exception, positive_float
from ..bus import EventBus
from ..capture.files import CaptureWriter, boot_id
from ..evidence.options import engine_arguments, engine_poller, probe_arguments, stall_prober
from ..observe.passive import ROLES, STALL_AFTER, PacketTap, TapsByPort, parse_tap_by_port
from ..proxy.relay import loop_options
from .proxy import capture_arguments, open_capture

log = structlog.get_logger("tracer.cli.sniff")

SNIFF_EPILOG = """\
examples:
  tracer sniff --iface lo --port 8000 --capture front.jsonl
  tracer sniff --iface lo --port 30000 --upstream-role engine --capture engine.jsonl
  tracer sniff --iface lo --tap-by-port 8000=front,30000=back:engine --capture router.jsonl \\
               --engine-metrics http://127.0.0.1:30000/metrics --duration 600
  tracer analyze front.jsonl

It needs root or CAP_NET_RAW (sudo setcap cap_net_raw+ep on the Python it runs with, or
sudo). The kernel keeps only the ports' TCP segments (a BPF filter); packets it dropped
because the reader fell behind are recorded as capture_loss. SIGINT/SIGTERM (or
--duration) stop it; requests still open are recorded as in_flight. What passive capture
cannot see: what the client did with bytes its kernel acknowledged, and TLS payloads.
"""


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: a port is 1 to 65535")
    return port


def _tap_by_port(text: str) -> TapsByPort:
    try:
        return parse_tap_by_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare this command's options."""
    parser.epilog = SNIFF_EPILOG
    parser.add_argument(
        "--iface",
        required=True,
        metavar="NAME",
        help="the network interface to capture on (lo: traffic within this machine)",
    )
    parser.add_argument(
        "--port",
        action="append",
        type=_port,
        default=[],
        metavar="PORT",
        help="follow the TCP connections to this server port (repeatable; this or --tap-by-port)",
    )
    parser.add_argument(
        "--tap-by-port",
        type=_tap_by_port,
        metavar="PORT=TAP[:ROLE],...",
        help="one tap per server port, e.g. 8000=front,30000=back (both sides of a router on "
        "its host, as two taps in one capture); :ROLE says what the server at that port is "
        "(engine, router or proxy), e.g. 30000=back:engine",
    )
    parser.add_argument(
        "--upstream-role",
        choices=ROLES,
        default=None,
        help="what the server of --port is: an engine, the router or a proxy, written into "
        "the capture as `tracer proxy --upstream-role` writes it (a passive tap cannot ask "
        "it; with --tap-by-port: PORT=TAP:ROLE)",
    )
    parser.add_argument(
        "--tap", default="sniff", metavar="NAME", help="this tap's name in the capture"
    )
    capture_arguments(parser, required=True)
    parser.add_argument(
        "--duration",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="stop after this long (default: until SIGINT/SIGTERM)",
    )
    parser.add_argument(
        "--stall-after",
        type=positive_float,
        default=STALL_AFTER,
        metavar="SECONDS",
        help="no bytes for this long on a request in flight is a stall",
    )
    parser.add_argument(
        "--bodies",
        choices=["none", "requests", "all"],
        default="requests",
        help="bodies kept in the capture (default: requests, enough to replay; they hold the "
        "prompts: --bodies none where prompts are secret)",
    )
    parser.add_argument(
        "--buffer-size",
        type=positive_float,
        default=8.0,
        metavar="MIB",
        help="the kernel's buffer for packets not read yet (a burst waits there instead of "
        "being dropped)",
    )
    engine_arguments(parser)
    probe_arguments(parser, upstream="the stalled connection's server")


class StallProbes:
    """Probes on stall for a passive tap: the probes' ``upstream`` is the server the
    stalled connection was seen talking to (its ``conn_open.local``); one prober, with
    its own rate limit, per tap."""

    def __init__(self, make: Callable[[str, str], Any]) -> None:
        self._make = make  # (tap, upstream URL) -> Prober
        self._servers: dict[tuple[str, int], str] = {}  # open connections' servers
        self._probers: dict[str, Any] = {}

    def __call__(self, event: ev.Event) -> None:
        match event:
            case ev.ConnOpen(tap=tap, conn=conn, local=local):
                self._servers[(tap, conn)] = local
            case ev.ConnClose(tap=tap, conn=conn):
                self._servers.pop((tap, conn), None)
            case ev.Stall(phase="start", tap=tap, conn=conn):
                server = self._servers.get((tap, conn))
                if server is None:
                    return
                url = f"http://{server}"
                prober = self._probers.get(tap)
                if prober is None:
                    prober = self._probers[tap] = self._make(tap, url)
                prober.config.upstream_url = url
                prober(event)


class _Spawner:
    """Starts a probe's coroutine in the event loop's task group, from any thread, never
    waiting for the loop (the reader thread holds the bus's lock when it asks): the
    coroutine is queued, and a task of the group starts what is queued."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Callable[[], Coroutine[Any, Any, None]]] | None = None

    def __call__(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        loop, queue = self._loop, self._queue
        if loop is None or queue is None:
            return False
        try:
            loop.call_soon_threadsafe(queue.put_nowait, fn)
        except RuntimeError:  # the loop is closed
            return False
        return True

    async def serve(self, tg: TaskGroup, *, task_status: TaskStatus[None]) -> None:
        """Start what is queued, in ``tg``, until cancelled."""
        self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()
        task_status.started()
        try:
            while True:
                tg.start_soon(await self._queue.get())
        finally:
            self._loop = self._queue = None


def run(args: argparse.Namespace) -> int:
    from ..observe.live import LiveCapture, open_packet_socket

    spec: TapsByPort = args.tap_by_port or TapsByPort({})
    taps = spec.taps
    ports: list[int] = list(dict.fromkeys(args.port))
    if taps and ports:
        raise ValueError("give --port or --tap-by-port, not both")
    if not taps and not ports:
        raise ValueError("give the server port to follow: --port PORT (or --tap-by-port)")
    if taps and args.upstream_role is not None:
        raise ValueError(
            f"--upstream-role {args.upstream_role}: it is for --port; with --tap-by-port give "
            "the role after the tap's name, e.g. 30000=back:engine"
        )
    roles = dict(spec.roles) if taps else {}
    if args.upstream_role is not None:
        roles[args.tap] = args.upstream_role
    if taps and (args.capture_max_bytes is not None or args.capture_max_age is not None):
        raise ValueError(
            "--tap-by-port writes several taps into one capture, which is not rolled into "
            "segments: leave out --capture-max-bytes and --capture-max-age"
        )
    first_tap = next(iter(taps.values())) if taps else args.tap
    opened = open_packet_socket(
        args.iface, list(taps) or ports, rcvbuf=int(args.buffer_size * 1024 * 1024)
    )
    try:
        writer = open_capture(args.capture, first_tap, args)
    except BaseException:
        opened.sock.close()
        raise
    lock = threading.RLock()  # the reader thread and the event loop both publish
    bus = EventBus()
    bus.add("capture", _capture_sink(writer))

    def publish(event: ev.Event) -> None:
        with lock:
            bus.publish(event)

    def publish_wall(event: ev.Event) -> None:
        """The poller's and the probes' records, on the packets' clock: a passive tap's
        ``m`` is its ``t`` (the packets' wall-clock times), one clock in the capture."""
        event.m = event.t
        publish(event)

    passive = PacketTap(
        emit=publish,
        tap=args.tap,
        ports=ports or None,
        taps=taps or None,
        roles=roles,
        stall_after=args.stall_after,
        bodies=args.bodies,
        kind="sniff",
        options={
            "iface": args.iface,
            "filter": "kernel (BPF)" if opened.filtered else "user space",
            "timestamps": "kernel" if opened.stamped else "recvmsg",
            "buffer_bytes": opened.rcvbuf,
            "engine_metrics": args.engine_metrics,
            "probes": args.probe_on_stall,
        },
        boot_id=boot_id(),
    )
    passive.start(time.time())  # the headers first, before any engine sample
    wall = time.time() - time.monotonic()
    poller = engine_poller(args, first_tap, publish_wall, wall)
    spawner = _Spawner()
    if args.probe_on_stall:
        bus.add(
            "probes",
            StallProbes(
                lambda tap, url: stall_prober(
                    args,
                    upstream_url=url,
                    tap=tap,
                    emit=publish_wall,
                    wall_offset=wall,
                    spawn=spawner,
                    load=poller,
                )
            ),
        )
    capture = LiveCapture(opened.sock, passive, loss_tap=first_tap, emit=publish, where=args.iface)
    reason = "stopped"
    try:
        reason = anyio.run(_sniff, capture, poller, spawner, args, backend_options=loop_options())
    except BaseException as exc:
        leaf = leaf_exception(exc)
        reason = f"error: {str(leaf) or type(leaf).__name__}"[:300]
        raise
    finally:
        try:
            with lock:
                capture.finish(reason)  # (reads the kernel's last drops: the socket is open)
        finally:
            opened.sock.close()
            writer.close()
    stats, live = passive.stats, capture.stats
    logs.announce(
        f"tracer sniff: stopped ({reason}): {live.frames - live.duplicates} packets, "
        f"{stats.followed} connection(s) followed, {live.kernel_dropped} dropped by the "
        f"kernel; capture {args.capture}",
        "stopped",
        reason=reason,
        packets=live.frames - live.duplicates,
        followed=stats.followed,
        kernel_dropped=live.kernel_dropped,
        capture=args.capture,
    )
    return 0


def _capture_sink(writer: CaptureWriter) -> Callable[[ev.Event], None]:
    """The capture file's sink: the taps' headers and ends are always written (never
    dropped for a full buffer), each end with the writer's losses and the tap's count."""
    counts: Counter[str] = Counter()

    def write(event: ev.Event) -> None:
        if isinstance(event, ev.CaptureEnd):
            event.records = counts[event.tap] + 1
            event.dropped = writer.dropped
        counts[event.tap] += 1
        writer.write(event, force=isinstance(event, (ev.CaptureStart, ev.CaptureEnd)))

    return write


async def _sniff(capture: Any, poller: Any, spawner: _Spawner, args: argparse.Namespace) -> str:
    """The reader in a thread of its own; signals, the duration, the poller and the probes
    in the event loop. Returns why it stopped."""
    stop = threading.Event()
    reason = "stopped"

    def stopping(why: str) -> None:
        nonlocal reason
        if not stop.is_set():
            reason = why
            stop.set()

    async with anyio.create_task_group() as tg:

        async def watch_signals(*, task_status: TaskStatus[None]) -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                task_status.started()  # (the start line is printed once signals stop it)
                async for signum in signals:
                    log.info("stopping", signal=signal.Signals(signum).name)
                    stopping(signal.Signals(signum).name)
                    return

        async def guard() -> None:  # whatever cancels the group stops the reader too
            try:
                await anyio.sleep_forever()
            finally:
                stop.set()

        async def until_duration(seconds: float) -> None:
            await anyio.sleep(seconds)
            stopping("duration reached")

        await tg.start(watch_signals)
        tg.start_soon(guard)
        if args.duration is not None:
            tg.start_soon(until_duration, args.duration)
        if poller is not None:
            tg.start_soon(poller.run)
        await tg.start(spawner.serve, tg)
        ports = (
            ",".join(f"{p}={t}" for p, t in args.tap_by_port.taps.items())
            if args.tap_by_port
            else ",".join(map(str, args.port))
        )
        logs.announce(
            f"tracer sniff: capturing on {args.iface}, tcp port {ports}; capture {args.capture}",
            "capturing",
            iface=args.iface,
            ports=ports,
            capture=args.capture,
        )
        try:
            await anyio.to_thread.run_sync(capture.run, stop)
        finally:
            tg.cancel_scope.cancel()
    return reason
