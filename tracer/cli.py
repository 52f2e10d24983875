"""Command line: parses arguments, maps errors to exit codes, calls the library."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import structlog

from . import __version__, logs
from .analysis import Summary
from .capture import CaptureError, CaptureWriter, ReadStats, read_events
from .relay import Tap, TapConfig, parse_hostport, parse_upstream
from .render import to_json, to_text

EXIT_USAGE = 2
EXIT_INPUT = 3

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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tracer", description="Traffic-layer diagnostic proxy for LLM serving."
    )
    p.add_argument("--version", action="version", version=f"tracer {__version__}")
    p.add_argument("--log-json", action="store_true", help="log JSON lines (for machines)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", required=True)

    px = sub.add_parser(
        "proxy",
        help="run the inline tap",
        epilog=PROXY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    px.add_argument("--listen", required=True, metavar="HOST:PORT")
    px.add_argument(
        "--upstream", required=True, metavar="URL", help="http://HOST:PORT of the router"
    )
    px.add_argument("--tap", default="tap", metavar="NAME", help="this tap's name in the capture")
    px.add_argument("--capture", metavar="FILE", help="write the event stream here (JSON Lines)")
    px.add_argument(
        "--stall-after",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="no bytes for this long on a request in flight is a stall (default 5)",
    )
    px.add_argument("--admin", metavar="HOST:PORT", help="serve /metrics and /status here")
    px.add_argument(
        "--admin-allow-remote", action="store_true", help="allow --admin on a non-loopback address"
    )
    px.add_argument(
        "--bodies",
        choices=["none", "requests", "all"],
        default="requests",
        help="bodies kept in the capture (default: requests, enough to replay)",
    )
    px.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS")
    px.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="close keep-alive connections idle this long (default: never)",
    )
    px.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 * 1024,
        help="the observer stops parsing a connection whose head exceeds this",
    )

    an = sub.add_parser("analyze", help="tables (and findings) from captures")
    an.add_argument("captures", nargs="+", metavar="CAPTURE")
    an.add_argument("--format", choices=["text", "json"], default="text")

    demo = sub.add_parser("demo", help="a real end-to-end run on this machine")
    demo.add_argument("--out", default="demo-out", metavar="DIR")

    sim = sub.add_parser("sim", help="simulated engine")
    sim_sub = sim.add_subparsers(dest="sim_command", required=True)
    se = sim_sub.add_parser("engine", help="an OpenAI-compatible simulated engine")
    se.add_argument("--listen", default="127.0.0.1:30000", metavar="HOST:PORT")
    se.add_argument("--tokens", type=int, default=16)
    se.add_argument("--ttft", type=float, default=0.02)
    se.add_argument("--itl", type=float, default=0.005)
    se.add_argument("--keepalive", type=float, default=5.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logs.configure(json=args.log_json, level=args.log_level)
    try:
        if args.command == "proxy":
            return _proxy(args)
        if args.command == "analyze":
            return _analyze(args)
        if args.command == "demo":
            from .demo import main as demo_main

            return demo_main(args.out)
        if args.command == "sim":
            return _sim(args)
    except ValueError as exc:
        print(f"tracer: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CaptureError as exc:
        print(f"tracer: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        return 130
    return EXIT_USAGE


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
    config = TapConfig(
        listen_host=host,
        listen_port=port,
        upstream_host=up_host,
        upstream_port=up_port,
        name=args.tap,
        stall_after=args.stall_after,
        connect_timeout=args.connect_timeout,
        idle_timeout=args.idle_timeout,
        bodies=args.bodies,
        max_header_bytes=args.max_header_bytes,
    )
    writer: CaptureWriter | None = None
    if args.capture:
        try:
            writer = CaptureWriter(args.capture)
        except OSError as exc:
            raise ValueError(f"cannot open capture {args.capture}: {exc.strerror or exc}") from exc
    tap = Tap(config, capture=writer)
    if writer is not None:
        writer.write(tap.header())
    reason = "stopped"
    try:
        reason = anyio.run(_run_proxy, tap, admin, backend_options=loop_options())
    except OSError as exc:
        print(f"tracer: cannot listen on {args.listen}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if writer is not None:
            writer.finish(config.name, reason)
    return 0


async def _run_proxy(tap: Tap, admin: tuple[str, int] | None) -> str:
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
        if admin is not None:
            from .admin import AdminServer

            await tg.start(AdminServer(tap, admin[0], admin[1]).serve)
        await tg.start(tap.serve)
        print(
            f"tracer proxy: listening on {_fmt(tap.bound)} -> {tap.config.upstream_url}",
            file=sys.stderr,
            flush=True,
        )
    return reason


def loop_options() -> dict[str, Any]:
    """uvloop where it is installed: the relay's callbacks then cost about half as much."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


def _fmt(bound: list[tuple[str, int]]) -> str:
    return ", ".join(f"{h}:{p}" for h, p in bound)


def _analyze(args: argparse.Namespace) -> int:
    summary = Summary()
    captures: list[dict[str, Any]] = []
    for path in args.captures:
        stats = ReadStats()
        try:
            for event in read_events(path, stats):
                summary.feed(event)
        except OSError as exc:
            print(f"tracer: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_INPUT
        captures.append(
            {
                "path": Path(path).name,
                "records": stats.records,
                "bad_lines": stats.bad_lines,
                "torn_tail": stats.torn_tail,
                "version": stats.version,
            }
        )
    result = summary.result(captures=captures)
    out = to_json(result) if args.format == "json" else to_text(result)
    sys.stdout.write(out)
    return 0


def _sim(args: argparse.Namespace) -> int:
    from .sim.engine import EngineConfig, SimEngine

    host, port = parse_hostport(args.listen)
    engine = SimEngine(
        EngineConfig(
            host=host,
            port=port,
            tokens=args.tokens,
            ttft=args.ttft,
            itl=args.itl,
            keepalive=args.keepalive,
        )
    )

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            bound = await tg.start(engine.serve)
            print(
                f"sim engine listening on http://{bound[0]}:{bound[1]}", file=sys.stderr, flush=True
            )
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

    anyio.run(run)
    return 0
