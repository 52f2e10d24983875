"""``tracer replay CAPTURE --target URL``: a captured session sent again, as an experiment.

By default every captured connection becomes one replay connection opened at the same
offset from the start, carrying its requests in the same order, each sent after the
same idle gap following the previous response (so keep-alive reuse happens exactly as
captured), and each response read no faster than the original client read it.
``--connections fresh`` sends every request on a connection of its own instead: the
differential test (a hang that follows reuse goes away). The replay runs its own tap
in-process (the target is its upstream), so the replay is a capture like any other and
``tracer analyze`` works on it; then it prints the original and the replay side by
side, request by request, and a verdict: reproduced or where the runs diverged.

The client is raw HTTP/1.1 over anyio sockets with h11: no pool, so the connection
structure is exactly the one planned. Bodies are sent as captured (``--bodies
requests`` on the tap, its default); headers as captured, except ``Host`` (set to the
target) and values the capture redacted (dropped, and listed; ``--header`` sets them).
Nothing cuts a stream that is flowing unless asked: ``--stall-timeout`` counts only
silence from the target, ``--timeout`` (total) is off by default.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from ..arguments import http_url, positive_float
from ..capture.files import CaptureWriter
from ..errors import start_error
from ..present.analyze import packet_arguments, packet_options
from ..protocol.addresses import parse_upstream
from ..proxy.relay import Tap, TapConfig
from ..wording import counted
from .replay_capture import CapturedRequest, load
from .replay_client import DEFAULT_STALL_TIMEOUT, Client, Options
from .replay_compare import compare, to_json, to_text
from .replay_plan import Job, missing_bodies
from .replay_plan import plan as plan  # (re-exported: the tests')
from .replay_select import ONLY_HELP, parse_only

EXIT_INPUT = 3
SETTLE = 2.0  # at most this long for the tap to record the last closes


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument(
        "capture",
        metavar="CAPTURE",
        help="a capture of `tracer proxy` (or of tcpdump: the one tap --port says)",
    )
    packet_arguments(parser)
    parser.add_argument(
        "--target",
        required=True,
        type=http_url,
        metavar="URL",
        help="http://HOST:PORT to send the requests to",
    )
    parser.add_argument(
        "--connections",
        choices=["original", "fresh"],
        default="original",
        help="original: the captured connections and reuse (default); fresh: every "
        "request on a new connection",
    )
    parser.add_argument(
        "--speed",
        type=positive_float,
        default=1.0,
        metavar="X",
        help="time runs X times faster: offsets, idle gaps and read pacing divided by X",
    )
    parser.add_argument("--only", action="append", default=[], metavar="KEY=VALUE", help=ONLY_HELP)
    parser.add_argument(
        "--stall-timeout",
        type=positive_float,
        default=DEFAULT_STALL_TIMEOUT,
        metavar="SECONDS",
        help="give up on a request after this long with no byte from the target; it is "
        f"reported hung (default {DEFAULT_STALL_TIMEOUT:g})",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="give up on a request this long after it was sent, even while it streams; "
        "reported hung (default: none)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="give up connecting to the target after this long",
    )
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="set this header on every request (repeatable), e.g. the Authorization the "
        "capture redacted",
    )
    parser.add_argument(
        "--capture",
        dest="out",
        metavar="FILE",
        help="write the replay's capture here (default: replay-YYYYmmdd-HHMMSS.jsonl in "
        "the current directory); an existing file is refused",
    )
    parser.add_argument("--tap", default="replay", metavar="NAME", help="the replay tap's name")
    parser.add_argument(
        "--bodies",
        choices=["none", "requests", "all"],
        default="requests",
        help="bodies kept in the replay's capture (default: requests)",
    )
    parser.add_argument(
        "--format", choices=["text", "json"], default="text", help="text for people, or json"
    )
    parser.add_argument(
        "--engine-metrics",
        action="append",
        default=[],
        metavar="URL",
        type=http_url,
        help="an engine's or the router's Prometheus /metrics URL (repeatable), scraped "
        "into the replay's capture",
    )
    parser.add_argument(
        "--metrics-interval",
        type=positive_float,
        default=1.0,
        metavar="SECONDS",
        help="how often the metrics and health URLs are read",
    )
    parser.add_argument(
        "--metrics-timeout",
        type=positive_float,
        default=2.0,
        metavar="SECONDS",
        help="a scrape slower than this is recorded as failed",
    )
    parser.add_argument(
        "--health",
        action="append",
        default=[],
        type=http_url,
        metavar="URL",
        help="a health URL to poll",
    )
    parser.add_argument(
        "--engine-profile",
        choices=["sglang", "vllm", "llamacpp", "smg", "sgl_router"],
        help="metric names to expect (default: detected)",
    )


EPILOG = """\
examples:
  tracer replay front.jsonl --target http://127.0.0.1:8000
  tracer replay front.jsonl --target http://127.0.0.1:8000 --connections fresh --stall-timeout 10
  tracer replay front.jsonl --target http://router:8000 --only conn=3 --only req=5:1-3 --format json

Outcomes per request: complete, error, truncated, hung, aborted, in_flight, unparsed,
not_sent. The verdict is "reproduced" when every replayed request ended as in the
original, else "not reproduced" with the first request whose outcome differs.
--stall-timeout defaults to 30 s: longer than the silences of a healthy stack (a long
prefill under load, the tap's own 5 s stall threshold), far shorter than the minutes a
harness sits on a hung connection. Raise it for targets slower than that to first byte.
Exit status: 0 whatever the verdict; 2 bad options; 3 a capture that cannot be replayed
(unreadable, or without the bodies of the selected requests).
"""


# ---- the run --------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    target_host, target_port = parse_upstream(args.target)
    headers = [_header(h) for h in args.header]
    selection = parse_only(args.only)
    out = Path(args.out or time.strftime("replay-%Y%m%d-%H%M%S.jsonl"))
    if out.exists():
        raise ValueError(f"--capture {out} exists; choose another file")
    try:
        original = load(args.capture, packet_options(args))
    except OSError as exc:
        print(f"tracer: cannot read {args.capture}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_INPUT
    selection.check(original)
    jobs = plan(original, selection, fresh=args.connections == "fresh")
    if not any(j.requests for j in jobs):
        print(f"tracer: {args.capture} has no requests to replay", file=sys.stderr)
        return EXIT_INPUT
    missing = missing_bodies(jobs)
    if missing:
        print(f"tracer: {_missing_text(args.capture, missing)}", file=sys.stderr)
        return EXIT_INPUT
    try:  # fail fast: a target that refuses is not a replay that "did not reproduce"
        socket.create_connection((target_host, target_port), timeout=args.connect_timeout).close()
    except OSError as exc:
        raise start_error(f"replay target {args.target} cannot be reached", exc) from None

    config = TapConfig(
        listen_host="127.0.0.1",
        listen_port=0,
        upstream_host=target_host,
        upstream_port=target_port,
        name=args.tap,
        stall_after=min(5.0, args.stall_timeout / 2),
        connect_timeout=args.connect_timeout,
        bodies=args.bodies,
    )
    try:
        writer = CaptureWriter(out)
    except FileExistsError:
        raise ValueError(f"capture {out} exists: give another --capture") from None
    except OSError as exc:
        raise ValueError(f"cannot open capture {out}: {exc.strerror or exc}") from exc
    tap = Tap(config, capture=writer)
    header = tap.header(
        engine_metrics=args.engine_metrics,
        replay_of=str(args.capture),
        connections=args.connections,
        speed=args.speed,
        stall_timeout=args.stall_timeout,
        timeout=args.timeout,
        only=args.only,
    )
    header.kind = "replay"
    writer.write(header)
    opts = Options(
        host="127.0.0.1",
        port=0,
        target_host=f"{target_host}:{target_port}",
        speed=args.speed,
        fresh=args.connections == "fresh",
        stall_timeout=args.stall_timeout,
        timeout=args.timeout,
        connect_timeout=args.connect_timeout,
        headers=headers,
    )
    client = Client(opts)
    print(
        f"tracer replay: {sum(len(j.requests) for j in jobs)} requests on {len(jobs)} "
        f"connections -> {args.target}; capture {out}",
        file=sys.stderr,
        flush=True,
    )
    reason = "interrupted"
    try:
        anyio.run(_run, tap, client, jobs, _poller(args, tap))
        reason = "replay finished"
    finally:
        writer.finish(config.name, reason)
    replayed = load(out)
    doc = compare(
        original,
        replayed,
        [(j.conn, j.requests) for j in jobs],
        client.sent,
        client.dropped,
        mode=args.connections,
        speed=args.speed,
    )
    document = doc.document(original=str(args.capture), target=args.target, capture=str(out))
    sys.stdout.write(to_json(document) if args.format == "json" else to_text(document))
    return 0


async def _run(tap: Tap, client: Client, jobs: list[Job], poller: Any) -> None:
    tap.bus.add("replay-clock", client.clock)
    async with anyio.create_task_group() as tg:
        bound = await tg.start(tap.serve)
        client.opts.port = bound[0][1]
        if poller is not None:  # a first sample of every URL before the replay starts
            tg.start_soon(poller.run)
            wanted = len(poller.config.urls) + len(poller.config.health_urls)
            with anyio.move_on_after(poller.config.timeout + 0.5):
                while len(poller.latest) + len(poller.latest_health) < wanted:
                    await anyio.sleep(0.01)
        await client.run(jobs)
        with anyio.move_on_after(SETTLE):  # let the tap see the last closes
            while tap.live:
                await anyio.sleep(0.01)
        tap.stop()
        tg.cancel_scope.cancel()


def _poller(args: argparse.Namespace, tap: Tap) -> Any:
    """The engine poller, as ``tracer proxy`` builds it."""
    from ..evidence.options import engine_poller

    return engine_poller(args, tap.config.name, tap.safe_emit, tap.wall_offset)


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--header {text!r}: expected 'NAME: VALUE'")
    return name.strip(), value.strip()


def _missing_text(path: str, missing: list[CapturedRequest]) -> str:
    by_problem: dict[str, list[str]] = {}
    for req in missing:
        by_problem.setdefault(req.body_problem or "no body", []).append(req.key)
    parts = [f"{', '.join(keys)}: {problem}" for problem, keys in by_problem.items()]
    return (
        f"cannot replay {counted(len(missing), 'request')} of {path} without their bodies: "
        + "; ".join(parts)
        + ". Capture with `tracer proxy --bodies requests` (the default), or leave them "
        "out with --only"
    )
