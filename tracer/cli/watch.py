"""``tracer watch``: scrape the engines' (and the router's) Prometheus metrics and health
into a capture, with no tap in the traffic: evidence to analyse beside another tap's
capture, or alone."""

from __future__ import annotations

import argparse
import signal
import sys

import anyio

from .. import __version__
from .. import events as ev
from ..arguments import positive_float
from ..capture.files import boot_id
from ..evidence.options import engine_arguments, engine_poller
from ..protocol.probe_mark import nonce_for
from ..proxy.relay import loop_options
from .proxy import capture_arguments, open_capture


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare this command's options."""
    parser.epilog = (
        "examples:\n"
        "  tracer watch --engine-metrics http://127.0.0.1:30000/metrics --capture engine.jsonl\n"
        "  tracer watch --engine-metrics http://router:29000/metrics \\\n"
        "               --health http://router:8000/readiness --capture router.jsonl "
        "--duration 600\n"
        "  tracer analyze front.jsonl engine.jsonl      (the tap's capture and this one)\n"
    )
    capture_arguments(parser, required=True)
    parser.add_argument(
        "--tap", default="watch", metavar="NAME", help="this recorder's name in the capture"
    )
    parser.add_argument(
        "--duration",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="stop after this long (default: until SIGINT/SIGTERM)",
    )
    engine_arguments(parser, required=True)


def run(args: argparse.Namespace) -> int:
    """Engine evidence alone: the poller writing its own capture."""
    import time as _time

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
            probe_nonce=nonce_for(args.tap),
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
