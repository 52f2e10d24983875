"""``tracer proxy``: the inline tap. It forwards bytes unchanged in both directions, one
upstream connection per client connection, and records every connection, request,
stream event and stall into its capture; with ``--admin`` it serves /metrics, /status
(``tracer top``) and /mark; with ``--fault`` it injects faults (opt-in)."""

from __future__ import annotations

import argparse
import errno
import signal
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

if TYPE_CHECKING:
    from ..proxy.admin import AdminServer

from .. import logs
from ..arguments import http_url, non_negative_float, non_negative_int, positive_float, positive_int
from ..capture.files import CaptureWriter
from ..evidence.options import engine_arguments, engine_poller, probe_arguments, stall_prober
from ..faults.plan import KINDS, RULE_KEYS, Fault, FaultSpecError, parse_fault
from ..protocol.addresses import parse_hostport, parse_upstream
from ..proxy.relay import Tap, TapConfig, descriptor_budget, loop_options

PROXY_EPILOG = """\
examples:
  tracer proxy --listen 127.0.0.1:8080 --upstream http://127.0.0.1:30000 --capture front.jsonl
  tracer proxy --listen 127.0.0.1:8081 --upstream http://router:8000 --tap behind-nginx \\
               --capture behind.jsonl --stall-after 10 --admin 127.0.0.1:9100

The tap forwards bytes unchanged in both directions and keeps one upstream connection
per client connection. It answers by itself only when the upstream is unreachable (502)
or the client's first bytes are not HTTP/1.x (400). SIGINT/SIGTERM stop it within about
two seconds; requests still open are recorded as in_flight.
"""


def _fault_epilog() -> str:
    width = max(len(k.usage) for k in KINDS.values()) + 4
    lines = [
        "",
        "fault injection (--fault SPEC, repeatable, faults combine; opt-in: it alters traffic;",
        "every injection is a `fault` record in the capture). SPEC is NAME[:ARG...][@RULE,...]:",
    ]
    for k in KINDS.values():
        lines.append(
            textwrap.fill(
                k.summary,
                width=92,
                initial_indent=f"  {k.usage:<{width - 2}}",
                subsequent_indent=" " * width,
            )
        )
    lines.append("rules, joined by commas (every one given must hold; no rule: every request):")
    lines += [f"  {text}" for text in RULE_KEYS.values()]
    lines.append("one example of each fault, added to a proxy command line:")
    lines += [f"  --fault {k.example}" for k in KINDS.values()]
    lines.append(
        "  e.g. tracer proxy --listen 127.0.0.1:8080 --upstream http://127.0.0.1:30000 "
        "--fault hang-on-reuse:3"
    )
    lines += [
        "faults changed while the tap runs (--fault-control, with --admin 127.0.0.1:9100; each",
        "change applies from the next request head on, and is a `fault_plan` record; a",
        "change needs the admin token the tap printed at start, or --admin-token-file):",
        "  curl -s 127.0.0.1:9100/faults                          the plan and the injections",
        '  A="Authorization: Bearer $TOKEN"; J="content-type: application/json"',
        '  curl -s -X PUT -H "$A" -H "$J" -d \'["status:503@every=2"]\' 127.0.0.1:9100/faults',
        "                                                         a new plan (a JSON list)",
        '  curl -s -X POST -H "$A" -H "$J" -d \'["hang-on-reuse:3"]\' 127.0.0.1:9100/faults',
        "                                                         one more fault",
        '  curl -s -X DELETE -H "$A" 127.0.0.1:9100/faults        no faults',
    ]
    return "\n".join(lines) + "\n"


def _hostport_arg(text: str) -> str:
    try:
        parse_hostport(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _upstream_arg(text: str) -> str:
    try:
        parse_upstream(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _fault_arg(text: str) -> Fault:
    try:
        return parse_fault(text)
    except FaultSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare this command's options."""
    parser.epilog = PROXY_EPILOG + _fault_epilog()
    parser.add_argument(
        "--listen",
        required=True,
        type=_hostport_arg,
        metavar="HOST:PORT",
        help="where the clients connect (point their base_url here; port 0: any free one)",
    )
    parser.add_argument(
        "--upstream",
        required=True,
        type=_upstream_arg,
        metavar="URL",
        help="http://HOST:PORT of what the clients talked to before: the router, a proxy or "
        "an engine",
    )
    parser.add_argument(
        "--tap", default="tap", metavar="NAME", help="this tap's name in the capture"
    )
    parser.add_argument(
        "--upstream-role",
        choices=["engine", "router", "proxy"],
        default=None,
        help="what --upstream is: an engine, the router, or a proxy (any hop that is not the "
        "serving stack); written into the capture, and wins over the fingerprint (default: "
        "not declared; with --capture, inferred from a fingerprint of the upstream taken at "
        "start over one connection of the tap's own, recorded as a `topology` record)",
    )
    parser.add_argument(
        "--no-fingerprint",
        action="store_true",
        help="do not send the fingerprint's few GET requests to the upstream at start (for a "
        "hop that counts requests, or a test upstream); the role is then declared or inferred "
        "from the --engine-metrics/--health URLs only",
    )
    parser.add_argument(
        "--client-facing",
        action="store_true",
        help="the harness connects to this tap directly (no proxy in front of it); written "
        "into the capture header (default: not declared)",
    )
    capture_arguments(parser, required=False)
    parser.add_argument(
        "--stall-after",
        type=positive_float,
        default=5.0,
        metavar="SECONDS",
        help="no bytes for this long on a request in flight is a stall",
    )
    parser.add_argument(
        "--admin",
        type=_hostport_arg,
        metavar="HOST:PORT",
        help="serve /metrics, /status (for tracer top) and /mark here (default: off)",
    )
    parser.add_argument(
        "--admin-allow-remote",
        action="store_true",
        help="allow --admin on a non-loopback address (anyone who reaches it reads live "
        "traffic metadata; what changes state still needs the token)",
    )
    parser.add_argument(
        "--admin-token-file",
        metavar="FILE",
        help="the admin token (POST /mark, /faults need it as 'Authorization: Bearer TOKEN'); "
        "default: one generated at start and printed once",
    )
    parser.add_argument(
        "--max-connections",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="client connections open at once; past it the tap answers 503 itself and logs "
        "it (default: what the descriptor limit allows, each client taking two, after the "
        "soft limit is raised to the hard one; 0: no limit)",
    )
    parser.add_argument(
        "--body-memory",
        type=non_negative_float,
        default=64.0,
        metavar="MIB",
        help="memory all request bodies held at once may take (kept for the capture, JSON "
        "for its fields); past it a body is hashed as it streams, and its record says so "
        "(default: %(default)s MiB)",
    )
    parser.add_argument(
        "--redact-json-field",
        action="append",
        default=[],
        metavar="NAME",
        help="in kept JSON request bodies, replace this field's value (at any depth) by "
        "[redacted] (repeatable; --bodies keeps prompts by design: e.g. --redact-json-field "
        "content). Give the same names to every tap you join: a body's hash is taken after",
    )
    parser.add_argument(
        "--bodies",
        choices=["none", "requests", "all"],
        default="requests",
        help="bodies kept in the capture (default: requests, enough to replay; they hold the "
        "prompts: --bodies none, or --redact-json-field, where prompts are secret)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="give up connecting to the upstream after this long (the client gets a 502)",
    )
    parser.add_argument(
        "--header-timeout",
        type=non_negative_float,
        default=60.0,
        metavar="SECONDS",
        help="close a connection whose request head is not finished this long after its "
        "first byte (a slowloris client holds two descriptors; nginx's client_header_timeout "
        "is 60 s too; 0: never)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="close keep-alive connections idle this long (default: never)",
    )
    engine_arguments(parser)
    parser.add_argument(
        "--inject-request-id",
        action="store_true",
        help="ALTERS TRAFFIC (opt-in): add x-request-id: tracer-TAP-CONN-N to requests that "
        "have none, so taps behind this one join requests exactly",
    )
    probe_arguments(parser)
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        type=_fault_arg,
        metavar="SPEC",
        help="inject a fault into matching requests (repeatable; faults combine); "
        "NAME[:ARG...][@RULE,...], listed below. Off by default",
    )
    parser.add_argument(
        "--fault-control",
        action="store_true",
        help="ALTERS TRAFFIC (opt-in): the faults can be changed while the tap runs, through "
        "--admin's /faults (see below); every connection is then followed for faults",
    )
    parser.add_argument(
        "--otlp",
        type=http_url,
        metavar="URL",
        help="export one OpenTelemetry span per request to this OTLP/HTTP endpoint "
        "(e.g. http://127.0.0.1:4318; docs/otel.md)",
    )
    parser.add_argument(
        "--otlp-queue",
        type=positive_int,
        default=2048,
        metavar="SPANS",
        help="spans waiting for the OTLP exporter at most; past it a span is dropped and "
        "counted (tracer_otlp_spans_dropped_total on --admin's /metrics)",
    )
    parser.add_argument(
        "--max-header-bytes",
        type=positive_int,
        default=64 * 1024,
        metavar="BYTES",
        help="a request head past this is forwarded but not parsed (an anomaly says so)",
    )


def capture_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """The capture file's options, the same for ``proxy`` and ``watch`` (``open_capture``)."""
    parser.add_argument(
        "--capture",
        required=required,
        metavar="FILE",
        help="write the event stream here (JSON Lines; a new file, mode 0600)",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="extend an existing capture of this tap instead of refusing an existing --capture",
    )
    parser.add_argument(
        "--capture-max-bytes",
        type=positive_float,
        default=None,
        metavar="MIB",
        help="roll the capture into numbered segments of about this size (cap.jsonl, "
        "cap.1.jsonl, ...; each begins with the header; readers take the set or its folder)",
    )
    parser.add_argument(
        "--capture-max-age",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="roll the capture into a new segment at least this often",
    )
    parser.add_argument(
        "--capture-compress",
        action="store_true",
        help="zstd-compress each segment once it is closed (cap.1.jsonl.zst; readers take both)",
    )


def open_capture(path: str, tap: str, args: argparse.Namespace) -> CaptureWriter:
    """A capture file of this run's own: a new file (0600, not through a symlink), or
    with ``--append`` this tap's existing capture; rolled into numbered segments with
    ``--capture-max-bytes`` / ``--capture-max-age``. Errors say what to do."""
    append = args.append
    max_mib, max_age = args.capture_max_bytes, args.capture_max_age
    if args.capture_compress and max_mib is None and max_age is None:
        raise ValueError("--capture-compress compresses rotated segments: give --capture-max-bytes")
    try:
        return CaptureWriter(
            path,
            append=tap if append else None,
            max_bytes=int(max_mib * 1024 * 1024) if max_mib is not None else None,
            max_age=max_age,
            compress=args.capture_compress,
        )
    except FileExistsError as exc:
        if Path(path).is_symlink():  # O_EXCL refuses a link, even to nothing
            raise ValueError(f"capture {path} is a symbolic link: not followed") from None
        if append:
            raise ValueError(f"capture {exc}") from None
        raise ValueError(
            f"capture {path} exists: give another path, or --append to extend this tap's capture"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"capture {path} is a symbolic link: not followed") from None
        raise ValueError(f"cannot open capture {path}: {exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    host, port = parse_hostport(args.listen)
    up_host, up_port = parse_upstream(args.upstream)
    admin: tuple[str, int] | None = None
    if args.admin:
        from ..proxy.admin import is_loopback

        admin = parse_hostport(args.admin)
        if not is_loopback(admin[0]) and not args.admin_allow_remote:
            raise ValueError(
                f"--admin {args.admin} is not loopback; add --admin-allow-remote to allow it"
            )
    token = None
    if args.admin_token_file:
        try:
            token = Path(args.admin_token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--admin-token-file: {exc.strerror or exc}") from None
        if len(token) < 16:
            raise ValueError("--admin-token-file: the token must be 16 characters or more")
    if args.max_connections is None:
        args.max_connections = descriptor_budget()
    config = TapConfig(
        listen_host=host,
        listen_port=port,
        upstream_host=up_host,
        upstream_port=up_port,
        name=args.tap,
        stall_after=args.stall_after,
        connect_timeout=args.connect_timeout,
        idle_timeout=args.idle_timeout,
        header_timeout=args.header_timeout or None,
        bodies=args.bodies,
        body_memory=int(args.body_memory * 1024 * 1024),
        max_connections=args.max_connections,
        redact_json_fields=frozenset(n.lower() for n in args.redact_json_field),
        max_header_bytes=args.max_header_bytes,
        faults=list(args.fault),
        fault_control=args.fault_control,
        inject_request_id=args.inject_request_id,
        upstream_role=args.upstream_role,
        client_facing=args.client_facing,
        # the fingerprint is traffic of the tap's own: only when a capture records it
        fingerprint=args.upstream_role is None and bool(args.capture) and not args.no_fingerprint,
        serving_urls=[*args.engine_metrics, *args.health],
    )
    if args.fault_control and admin is None:
        raise ValueError("--fault-control needs --admin HOST:PORT (its /faults changes them)")
    writer = open_capture(args.capture, config.name, args) if args.capture else None
    tap = Tap(config, capture=writer)
    poller = engine_poller(args, config.name, tap.safe_emit, tap.wall_offset)
    prober = stall_prober(
        args,
        upstream_url=config.upstream_url,
        tap=config.name,
        emit=tap.safe_emit,
        wall_offset=tap.wall_offset,
        spawn=tap.start_soon,
        load=poller,
    )
    if prober is not None:
        tap.bus.add("probes", prober)
    otlp = None
    if args.otlp:
        from ..present.otlp import OtlpSink

        otlp = OtlpSink(
            args.otlp, tap=config.name, wall_offset=tap.wall_offset, max_queue=args.otlp_queue
        )
        tap.bus.add("otlp", otlp)
    if writer is not None:
        writer.write(tap.header(engine_metrics=args.engine_metrics, probes=args.probe_on_stall))
    server = None
    if admin is not None:
        from ..proxy.admin import AdminServer

        server = AdminServer(
            tap, admin[0], admin[1], token=token, allow_remote=args.admin_allow_remote
        )
        if otlp is not None:  # its spans exported and dropped, on /metrics
            server.registry.register(otlp.metrics())
    reason = "stopped"
    try:
        reason = anyio.run(_run_proxy, tap, server, poller, backend_options=loop_options())
    except BaseException:
        if writer is not None and not tap.bound:  # it never started: leave nothing behind
            writer.discard()
            writer = None
        raise
    finally:
        if otlp is not None:
            otlp.close()
        if writer is not None:
            writer.finish(config.name, reason)
    return 0


async def _run_proxy(tap: Tap, admin: AdminServer | None, poller: Any) -> str:
    log = structlog.get_logger("tracer.cli.proxy")
    reason = "stopped"
    async with anyio.create_task_group() as tg:

        async def watch_signals() -> None:
            nonlocal reason
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    reason = signal.Signals(signum).name
                    log.info("stopping", signal=reason)
                    tap.stop()
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch_signals)
        if poller is not None:
            tg.start_soon(poller.run)
        if admin is not None:
            bound = await tg.start(admin.serve)
            where = f"{bound[0]}:{bound[1]}"
            if admin.allow_remote:
                log.warning(
                    "ADMIN OPEN BEYOND THIS MACHINE: whoever reaches it reads live traffic "
                    "metadata; changes need the token",
                    admin=where,
                )
            token = "from --admin-token-file" if admin.token_given else admin.token
            logs.announce(
                f"tracer proxy: admin on {where}; token for POST /mark and /faults: {token}",
                "admin ready",
                admin=where,
                token=token,
            )
        await tg.start(tap.serve)
        capture = tap.capture.path if tap.capture is not None else None
        logs.announce(
            f"tracer proxy: listening on {_fmt(tap.bound)} -> {tap.config.upstream_url}; "
            + (f"capture {capture}" if capture else "NO CAPTURE (give --capture FILE to record)"),
            "listening",
            listen=_fmt(tap.bound),
            upstream=tap.config.upstream_url,
            capture=str(capture) if capture else None,
        )
    return reason


def _fmt(bound: list[tuple[str, int]]) -> str:
    return ", ".join(f"{h}:{p}" for h, p in bound)
