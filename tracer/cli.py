"""Command line: parses arguments, maps errors to exit codes, calls the library."""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

if TYPE_CHECKING:
    from .admin import AdminServer

from . import __version__, logs
from .capture import CaptureError, CaptureWriter, boot_id
from .cliparse import (
    TracerParser,
    http_url,
    leaf_exception,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from .errors import StartError
from .faults import KINDS, RULE_KEYS, Fault, FaultSpecError, parse_fault
from .relay import Tap, TapConfig, descriptor_budget, parse_hostport, parse_upstream

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INPUT = 3

MAIN_EPILOG = """\
start here:
  make demo                 the incident reproduced on this machine, with its report
  tracer proxy --listen 127.0.0.1:8080 --upstream http://127.0.0.1:30000 --capture front.jsonl
                            put the tap in front of the router; point the client's base_url
                            at http://127.0.0.1:8080/v1
  tracer report front.jsonl -o incident.md
                            when it hangs: who is at fault, with the evidence
  tracer info front.jsonl   what a capture holds

exit codes: 0 done, 1 failed at run time, 2 bad arguments, 3 input that is not a capture
"""

# `tracer demo --scenario` (tracer/demo.py; named here so that parsing imports no SDK)
DEMOS = {
    "hang-on-reuse": "a proxy hangs on the 3rd request of a reused keep-alive connection",
    "engine-stall": "the engine stops producing tokens mid-stream",
    "engine-queueing": "slow because busy, not a cold start: more sessions than the engine runs",
    "buffering-proxy": "a hop holds the stream and releases it at the end",
    "client-not-reading": "the client stops reading its answer",
    "healthy": "nothing wrong",
}

# Commands that live in a module of their own: each has configure(parser) and run(args).
COMMANDS = {
    "analyze": "the verdict, findings and tables from captures",
    "replay": "replay a capture against a target (same connections and timing, or fresh)",
    "bench": "closed-loop streaming benchmark (tokens/s, TTFT, ITL, TPOT) per concurrency",
    "compare": "compare two bench results per concurrency, with the run-to-run spread",
    "report": "a Markdown incident report with a timeline picture",
    "info": "what a capture holds: tap, time range, records, losses, a clean end or not",
    "top": "live terminal view of a running tap (through its admin endpoint)",
}

PROXY_EPILOG = """\
examples:
  tracer proxy --listen 127.0.0.1:8080 --upstream http://127.0.0.1:30000 --capture front.jsonl
  tracer proxy --listen 127.0.0.1:8081 --upstream http://router:8000 --tap behind-nginx \\
               --capture behind.jsonl --stall-after 10 --admin 127.0.0.1:9100

The tap forwards bytes unchanged in both directions and keeps one upstream connection
per client connection. It answers by itself only when the upstream is unreachable (502)
or the client's first bytes are not HTTP/1.x (400). SIGINT/SIGTERM stop it within about
a second; requests still open are recorded as in_flight.
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


def _parser() -> argparse.ArgumentParser:
    p = TracerParser(
        prog="tracer",
        description="Traffic-layer diagnostic proxy for LLM serving.",
        epilog=MAIN_EPILOG,
        top=True,
    )
    p.add_argument("--version", action="version", version=f"tracer {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    px = sub.add_parser(
        "proxy",
        help="run the inline tap",
        epilog=PROXY_EPILOG + _fault_epilog(),
    )
    px.add_argument(
        "--listen",
        required=True,
        type=_hostport_arg,
        metavar="HOST:PORT",
        help="where the clients connect (point their base_url here; port 0: any free one)",
    )
    px.add_argument(
        "--upstream",
        required=True,
        type=_upstream_arg,
        metavar="URL",
        help="http://HOST:PORT of what the clients talked to before: the router, a proxy or "
        "an engine",
    )
    px.add_argument("--tap", default="tap", metavar="NAME", help="this tap's name in the capture")
    px.add_argument(
        "--upstream-role",
        choices=["engine", "router", "proxy"],
        default=None,
        help="what --upstream is: an engine, the router, or a proxy (any hop that is not the "
        "serving stack); written into the capture, and wins over the fingerprint (default: "
        "not declared; with --capture, inferred from a fingerprint of the upstream taken at "
        "start over one connection of the tap's own, recorded as a `topology` record)",
    )
    px.add_argument(
        "--no-fingerprint",
        action="store_true",
        help="do not send the fingerprint's few GET requests to the upstream at start (for a "
        "hop that counts requests, or a test upstream); the role is then declared or inferred "
        "from the --engine-metrics/--health URLs only",
    )
    px.add_argument(
        "--client-facing",
        action="store_true",
        help="the harness connects to this tap directly (no proxy in front of it); written "
        "into the capture header (default: not declared)",
    )
    _capture_arguments(px, required=False)
    px.add_argument(
        "--stall-after",
        type=positive_float,
        default=5.0,
        metavar="SECONDS",
        help="no bytes for this long on a request in flight is a stall",
    )
    px.add_argument(
        "--admin",
        type=_hostport_arg,
        metavar="HOST:PORT",
        help="serve /metrics, /status (for tracer top) and /mark here (default: off)",
    )
    px.add_argument(
        "--admin-allow-remote",
        action="store_true",
        help="allow --admin on a non-loopback address (anyone who reaches it reads live "
        "traffic metadata; what changes state still needs the token)",
    )
    px.add_argument(
        "--admin-token-file",
        metavar="FILE",
        help="the admin token (POST /mark, /faults need it as 'Authorization: Bearer TOKEN'); "
        "default: one generated at start and printed once",
    )
    px.add_argument(
        "--max-connections",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="client connections open at once; past it the tap answers 503 itself and logs "
        "it (default: what the descriptor limit allows, each client taking two, after the "
        "soft limit is raised to the hard one; 0: no limit)",
    )
    px.add_argument(
        "--body-memory",
        type=non_negative_float,
        default=64.0,
        metavar="MIB",
        help="memory all request bodies held at once may take (kept for the capture, JSON "
        "for its fields); past it a body is hashed as it streams, and its record says so "
        "(default: %(default)s MiB)",
    )
    px.add_argument(
        "--redact-json-field",
        action="append",
        default=[],
        metavar="NAME",
        help="in kept JSON request bodies, replace this field's value (at any depth) by "
        "[redacted] (repeatable; --bodies keeps prompts by design: e.g. --redact-json-field "
        "content). Give the same names to every tap you join: a body's hash is taken after",
    )
    px.add_argument(
        "--bodies",
        choices=["none", "requests", "all"],
        default="requests",
        help="bodies kept in the capture (default: requests, enough to replay; they hold the "
        "prompts: --bodies none, or --redact-json-field, where prompts are secret)",
    )
    px.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="give up connecting to the upstream after this long (the client gets a 502)",
    )
    px.add_argument(
        "--header-timeout",
        type=non_negative_float,
        default=60.0,
        metavar="SECONDS",
        help="close a connection whose request head is not finished this long after its "
        "first byte (a slowloris client holds two descriptors; nginx's client_header_timeout "
        "is 60 s too; 0: never)",
    )
    px.add_argument(
        "--idle-timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="close keep-alive connections idle this long (default: never)",
    )
    _engine_arguments(px)
    px.add_argument(
        "--inject-request-id",
        action="store_true",
        help="ALTERS TRAFFIC (opt-in): add x-request-id: tracer-TAP-CONN-N to requests that "
        "have none, so taps behind this one join requests exactly",
    )
    px.add_argument(
        "--probe-on-stall",
        action="store_true",
        help="on a stall, send a tiny request over a fresh connection to the upstream and "
        "to each --engine-metrics host, and record the outcome (off by default)",
    )
    px.add_argument(
        "--probe-kind",
        choices=["models", "completion", "health"],
        default="models",
        help="GET /v1/models (default), a 1-token completion, or GET /health",
    )
    px.add_argument("--probe-model", metavar="NAME", help="model for --probe-kind completion")
    px.add_argument(
        "--probe-interval",
        type=positive_float,
        default=5.0,
        metavar="SECONDS",
        help="at most one round of probes per this many seconds",
    )
    px.add_argument(
        "--probe-busy-threshold",
        type=positive_int,
        default=32,
        metavar="N",
        help="skip probes while an engine reports running+queued >= N",
    )
    px.add_argument(
        "--fault",
        action="append",
        default=[],
        type=_fault_arg,
        metavar="SPEC",
        help="inject a fault into matching requests (repeatable; faults combine); "
        "NAME[:ARG...][@RULE,...], listed below. Off by default",
    )
    px.add_argument(
        "--fault-control",
        action="store_true",
        help="ALTERS TRAFFIC (opt-in): the faults can be changed while the tap runs, through "
        "--admin's /faults (see below); every connection is then followed for faults",
    )
    px.add_argument(
        "--otlp",
        type=http_url,
        metavar="URL",
        help="export one OpenTelemetry span per request to this OTLP/HTTP endpoint "
        "(e.g. http://127.0.0.1:4318)",
    )
    px.add_argument(
        "--max-header-bytes",
        type=positive_int,
        default=64 * 1024,
        metavar="BYTES",
        help="a request head past this is forwarded but not parsed (an anomaly says so)",
    )

    wt = sub.add_parser(
        "watch",
        help="record engine evidence alone (no proxy)",
        description="Scrape the engines' (and the router's) Prometheus metrics and health "
        "into a capture, with no tap in the traffic: evidence to analyse beside another "
        "tap's capture, or alone.",
        epilog="examples:\n"
        "  tracer watch --engine-metrics http://127.0.0.1:30000/metrics --capture engine.jsonl\n"
        "  tracer watch --engine-metrics http://router:29000/metrics \\\n"
        "               --health http://router:8000/readiness --capture router.jsonl "
        "--duration 600\n"
        "  tracer analyze front.jsonl engine.jsonl      (the tap's capture and this one)\n",
    )
    _capture_arguments(wt, required=True)
    wt.add_argument(
        "--tap", default="watch", metavar="NAME", help="this recorder's name in the capture"
    )
    wt.add_argument(
        "--duration",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="stop after this long (default: until SIGINT/SIGTERM)",
    )
    _engine_arguments(wt, required=True)

    demo = sub.add_parser(
        "demo",
        help="reproduce the incident (or another scenario) on this machine",
        epilog="scenarios:\n"
        + "\n".join(f"  {name:20} {text}" for name, text in DEMOS.items())
        + "\n\nexamples:\n"
        "  tracer demo                                   the incident, its report in demo-out/\n"
        "  tracer demo --scenario engine-stall --out /tmp/d\n",
    )
    demo.add_argument(
        "--out", default="demo-out", metavar="DIR", help="where the captures and report go"
    )
    demo.add_argument(
        "--scenario",
        default="hang-on-reuse",
        choices=list(DEMOS),
        help="which incident to reproduce (default hang-on-reuse; others go to DIR/NAME/)",
    )

    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f".{name}", __package__)
        module.configure(sub.add_parser(name, help=help_text, description=module.__doc__))

    sim = sub.add_parser("sim", help="simulated engine and harness")
    sim_sub = sim.add_subparsers(dest="sim_command", required=True)
    from .sim import cli as sim_cli

    sim_cli.register(sim_sub)
    return p


def _engine_arguments(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument(
        "--engine-metrics",
        action="append",
        default=[],
        metavar="URL",
        type=http_url,
        required=required,
        help="an engine's, worker's or the router's Prometheus /metrics URL "
        "(repeatable); scraped every --metrics-interval into the capture",
    )
    p.add_argument(
        "--metrics-interval",
        type=positive_float,
        default=1.0,
        metavar="SECONDS",
        help="how often the metrics and health URLs are read",
    )
    p.add_argument(
        "--metrics-timeout",
        type=positive_float,
        default=2.0,
        metavar="SECONDS",
        help="a scrape slower than this is recorded as failed",
    )
    p.add_argument(
        "--health",
        action="append",
        default=[],
        type=http_url,
        metavar="URL",
        help="a health URL polled on the same schedule (e.g. the router's /readiness)",
    )
    p.add_argument(
        "--engine-profile",
        choices=["sglang", "vllm", "llamacpp", "smg", "sgl_router"],
        help="metric names to expect (default: detected from what the endpoint exposes)",
    )
    p.add_argument(
        "--keep-raw-metrics", action="store_true", help="also keep metrics no profile knows, raw"
    )


def engine_poller(args: argparse.Namespace, tap: str, emit: Any, wall_offset: float) -> Any:
    """The engine poller the evidence options ask for (``_engine_arguments``), or None."""
    from .poller import EnginePoller, PollerConfig

    if not args.engine_metrics and not args.health:
        return None
    config = PollerConfig(
        urls=list(args.engine_metrics),
        interval=args.metrics_interval,
        timeout=args.metrics_timeout,
        health_urls=list(args.health),
        keep_raw=getattr(args, "keep_raw_metrics", False),
        profile=args.engine_profile,
    )
    return EnginePoller(config, tap=tap, emit=emit, wall_offset=wall_offset)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logs.configure(json=args.log_json, level=args.log_level)
    try:
        return _dispatch(args)
    except BaseException as exc:  # every way out is one line and an exit code
        return _exit_for(exc, args)


def _exit_for(exc: BaseException, args: argparse.Namespace) -> int:
    """What an exception becomes for the user: one line on stderr and an exit code
    (2 usage, 3 input that is not a capture, 1 anything else); never a traceback but at
    ``--log-level debug``."""
    leaf = leaf_exception(exc)
    if isinstance(leaf, SystemExit):
        raise leaf
    if isinstance(leaf, KeyboardInterrupt):
        return 130
    if isinstance(leaf, BrokenPipeError):  # the reader of our output went away (`| head`)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more to flush at exit
        return 128 + signal.SIGPIPE
    if isinstance(leaf, ValueError):
        _say(str(leaf))
        return EXIT_USAGE
    if isinstance(leaf, CaptureError):
        _say(str(leaf))
        return EXIT_INPUT
    if isinstance(leaf, StartError):
        _say(str(leaf))
    elif isinstance(leaf, OSError):
        where = f"{leaf.filename}: " if leaf.filename else ""
        _say(f"{where}{leaf.strerror or leaf}")
    else:
        _say(
            f"internal error: {type(leaf).__name__}: {leaf} (a bug; --log-level debug shows where)"
        )
    if args.log_level == "debug":
        import traceback

        traceback.print_exception(leaf, file=sys.stderr)
    return EXIT_RUNTIME


def _say(text: str) -> None:
    print(f"tracer: {text}", file=sys.stderr, flush=True)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "proxy":
        return _proxy(args)
    if args.command == "watch":
        return _watch(args)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args.out, args.scenario)
    if args.command in COMMANDS:
        module = importlib.import_module(f".{args.command}", __package__)
        return int(module.run(args))
    if args.command == "sim":
        from .sim import cli as sim_cli

        return sim_cli.run(args)
    return EXIT_USAGE


def _capture_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
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


def _proxy(args: argparse.Namespace) -> int:
    host, port = parse_hostport(args.listen)
    up_host, up_port = parse_upstream(args.upstream)
    admin: tuple[str, int] | None = None
    if args.admin:
        from .admin import is_loopback

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
    if args.probe_on_stall:
        from .probes import ProbeConfig, Prober, engine_base

        prober = Prober(
            ProbeConfig(
                upstream_url=config.upstream_url,
                engine_urls=[engine_base(u) for u in args.engine_metrics],
                kind=args.probe_kind,
                model=args.probe_model,
                min_interval=args.probe_interval,
                busy_threshold=args.probe_busy_threshold,
            ),
            tap=config.name,
            emit=tap.safe_emit,
            wall_offset=tap.wall_offset,
            spawn=tap.start_soon,
            load=poller,
        )
        tap.sinks.append(prober)
    otlp = None
    if args.otlp:
        from .otlp import OtlpSink

        otlp = OtlpSink(args.otlp, tap=config.name, wall_offset=tap.wall_offset)
        tap.sinks.append(otlp)
    if writer is not None:
        writer.write(tap.header(engine_metrics=args.engine_metrics, probes=args.probe_on_stall))
    server = None
    if admin is not None:
        from .admin import AdminServer

        server = AdminServer(
            tap, admin[0], admin[1], token=token, allow_remote=args.admin_allow_remote
        )
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
    log = structlog.get_logger("tracer.cli")
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
        logs.announce(
            f"tracer proxy: listening on {_fmt(tap.bound)} -> {tap.config.upstream_url}",
            "listening",
            listen=_fmt(tap.bound),
            upstream=tap.config.upstream_url,
        )
    return reason


def loop_options() -> dict[str, Any]:
    """uvloop where it is installed: the relay's callbacks then cost about half as much."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


def _watch(args: argparse.Namespace) -> int:
    """Engine evidence alone: the poller writing its own capture."""
    import time as _time

    from . import __version__
    from . import events as ev

    writer = open_capture(args.capture, args.tap, args)
    wall = _time.time() - _time.monotonic()
    now = _time.monotonic()
    writer.write(
        ev.CaptureStart(
            t=now + wall,
            m=now,
            tap=args.tap,
            tracer_version=__version__,
            kind="watch",
            boot_id=boot_id(),
            options={
                "engine_metrics": args.engine_metrics,
                "health": args.health,
                "interval": args.metrics_interval,
            },
        )
    )
    poller = engine_poller(args, args.tap, writer.write, wall)
    reason = "stopped"

    async def run() -> None:
        nonlocal reason
        async with anyio.create_task_group() as tg:

            async def watch_signals() -> None:
                nonlocal reason
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        reason = signal.Signals(signum).name
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_signals)
            tg.start_soon(poller.run)
            print(
                f"tracer watch: {len(args.engine_metrics)} metrics URL(s) -> {args.capture}",
                file=sys.stderr,
                flush=True,
            )
            if args.duration is not None:
                await anyio.sleep(args.duration)
                reason = "duration reached"
                tg.cancel_scope.cancel()

    try:
        anyio.run(run, backend_options=loop_options())
    finally:
        writer.finish(args.tap, reason)
    return 0


def _fmt(bound: list[tuple[str, int]]) -> str:
    return ", ".join(f"{h}:{p}" for h, p in bound)
