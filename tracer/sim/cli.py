"""``tracer sim engine`` and ``tracer sim harness``.

``register(sub)`` adds both subcommands to the ``sim`` subparser's subparsers object;
``run(args)`` runs the one chosen. ``python -m tracer.sim.cli engine|harness ...`` works on
its own as well.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

import anyio

ENGINE_EPILOG = """\
faults (--fault SPEC, repeatable; the first fault whose rules match a completion wins).
SPEC is NAME[:ARG...][@RULE,...], the spelling of tracer proxy --fault (docs/faults.md);
the arguments are named (after=N, for=S) and may be given by position (stall:3:10):
    stall[:after=N][:for=S]   after N tokens the request gets nothing for S seconds (running)
    wedge[:after=N][:for=S]   after N tokens the whole scheduler stops for S seconds
    lost                      read the request, never answer (neither running nor queued)
    close[:after=N]           after N content chunks close the connection (FIN), no end chunk
    reset[:after=N]           the same with RST
    500                       HTTP 500 before any stream
    error[:after=N]           after N chunks: data: {"error": ...}, then data: [DONE]
    ignore-disconnect         a client that leaves is not noticed: decode on to max_tokens
  defaults: after=1, for=30
  rules after @, joined by commas, on the completion counter (1, 2, 3 ...; none: every one):
    every=N (N, 2N, ...), nth=K (K only), from=K (K and later), times=N (at most N
    injections), prob=P[,seed=S] (drawn from a generator seeded by S, default 0)
  a request can choose its own with the header  x-sim-fault: SPEC  (no rules; or: none)

examples:
  tracer sim engine --listen 127.0.0.1:30000 --max-running 8 --fault stall:after=3:for=10@every=5
  tracer sim engine --engine-type decode --fault lost@nth=2 --fault reset:after=2@from=10

playback (--from CAPTURE): answer with a capture's responses and their pacing
  requests are matched by method, target and body SHA-256; one fingerprint captured
  several times is answered in captured order, then 404 (or again from the first with
  --repeat); an unmatched request gets a 404 JSON error naming its fingerprint.
  Captured endings are reproduced: a truncated response is cut the same way (FIN or
  RST), a request never answered is never answered, a response the client gave up on
  stops where it stopped and stays open. Response bodies are the captured bytes when
  the capture was made with --bodies all, else SSE events of the captured kinds and
  sizes in SGLang's format (header x-tracer-playback says "synthesised").
  GET /health, /v1/models, /metrics, /v1/loads ... answer live, as an idle engine.
  tracer sim engine --from incident.jsonl --listen 127.0.0.1:30000

The engine prints one line to stderr when ready:  sim engine listening on http://HOST:PORT
"""


def _hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def _fault(value: str) -> object:
    from .engine import FaultSpecError, parse_fault

    try:
        return parse_fault(value)
    except FaultSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare ``tracer sim engine`` and ``tracer sim harness``."""
    register(parser.add_subparsers(dest="sim_command", required=True))


def register(sub: argparse._SubParsersAction[Any]) -> None:
    se = sub.add_parser(
        "engine",
        help="a simulated SGLang engine (OpenAI API, batch scheduler, SGLang metrics)",
        epilog=ENGINE_EPILOG,
    )
    se.set_defaults(sim_action="engine")
    se.add_argument(
        "--listen",
        default="127.0.0.1:30000",
        type=_hostport,
        metavar="HOST:PORT",
        help="where it serves the OpenAI API, /metrics and /health",
    )
    se.add_argument("--model", default="sim-model", help="served model name")
    se.add_argument(
        "--tokens", type=int, default=16, help="output tokens when a request has no max_tokens"
    )
    se.add_argument(
        "--ttft", type=float, default=0.02, metavar="SECONDS", help="prefill time of a batch"
    )
    se.add_argument(
        "--prefill-per-token",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="extra prefill time per prompt token",
    )
    se.add_argument(
        "--itl", type=float, default=0.005, metavar="SECONDS", help="decode step, one request"
    )
    se.add_argument(
        "--batch-alpha",
        type=float,
        default=0.05,
        help="decode step = itl x (1 + alpha x (running - 1))",
    )
    se.add_argument("--max-running", type=int, default=64, help="running batch limit")
    se.add_argument(
        "--keepalive",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="close idle keep-alive connections after this (uvicorn: 5)",
    )
    se.add_argument(
        "--decode-log-interval",
        type=int,
        default=40,
        metavar="STEPS",
        help="decode steps between gauge writes (SGLang: 40)",
    )
    se.add_argument(
        "--idle-refresh",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="gauge refresh while idle (SGLang: 30)",
    )
    se.add_argument("--max-total-tokens", type=int, default=262144, help="KV pool, for token_usage")
    se.add_argument(
        "--context-length", type=int, default=32768, help="the model's, as /v1/models says"
    )
    se.add_argument(
        "--engine-type",
        choices=["unified", "prefill", "decode"],
        default="unified",
        help="the engine_type label and disaggregation_mode (prefill answers 1 token)",
    )
    se.add_argument(
        "--token-counters",
        choices=["live", "finish"],
        default="finish",
        help="count prompt/generation tokens when a request finishes (finish, as SGLang "
        "does) or as they are produced (live) (default: %(default)s)",
    )
    se.add_argument(
        "--startup", type=float, default=0.0, metavar="SECONDS", help="/health is 503 this long"
    )
    se.add_argument(
        "--health-timeout",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="a /health that takes longer than this is a 503 (as SGLang's)",
    )
    se.add_argument(
        "--early-headers",
        action="store_true",
        help="send the response head at once (vLLM) instead of with the first token (SGLang)",
    )
    se.add_argument(
        "--fault",
        action="append",
        type=_fault,
        default=[],
        metavar="SPEC",
        help="NAME[:ARG...][@RULE,...], e.g. stall:after=3:for=10@every=5 (see below)",
    )
    se.add_argument(
        "--export-request-metrics",
        metavar="FILE",
        help="write one line per finished request as SGLang's --export-metrics-to-file does "
        "(JSONL; for tracer analyze --engine-requests)",
    )
    se.add_argument(
        "--export-spans",
        metavar="FILE",
        help="write each finished request's vLLM-style llm_request span as OTLP JSON, as "
        "the OpenTelemetry Collector's file exporter does (for tracer analyze --engine-requests)",
    )
    se.add_argument(
        "--from",
        dest="from_capture",
        metavar="CAPTURE",
        help="play back the responses of this capture, at their captured pace (see below)",
    )
    se.add_argument(
        "--repeat",
        action="store_true",
        help="with --from: serve a fingerprint's captured responses again once all were served",
    )
    se.add_argument(
        "--speed",
        type=float,
        default=None,
        metavar="X",
        help="with --from: play time X times faster (default 1)",
    )

    sh = sub.add_parser(
        "harness",
        help="a multi-round streaming agent harness (openai SDK)",
        description="S sessions x R rounds of streaming chat completions; prints one line "
        "per round and exits 1 if any round did not complete.",
        epilog="example:\n  tracer sim harness --target http://127.0.0.1:8080 --sessions 4 "
        "--rounds 5\n",
    )
    sh.set_defaults(sim_action="harness")
    sh.add_argument("--target", required=True, metavar="URL", help="http://HOST:PORT")
    sh.add_argument("--sessions", type=int, default=2, help="agent sessions at once")
    sh.add_argument("--rounds", type=int, default=3, help="turns of each session")
    sh.add_argument(
        "--think", type=float, default=0.2, metavar="SECONDS", help="idle gap between rounds"
    )
    sh.add_argument(
        "--deadline",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a round not complete by then is hung",
    )
    sh.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each request")
    sh.add_argument("--model", default="sim-model", help="the model name sent")


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "sim_action", None) or getattr(args, "sim_command", None)
    if action == "engine":
        return _engine(args)
    if action == "harness":
        return _harness(args)
    raise ValueError(f"unknown sim command {action!r}")


def _engine(args: argparse.Namespace) -> int:
    from .engine import EngineConfig, SimEngine

    host, port = args.listen if isinstance(args.listen, tuple) else _hostport(args.listen)
    capture = getattr(args, "from_capture", None)
    speed = getattr(args, "speed", None)
    if capture is None and (getattr(args, "repeat", False) or speed is not None):
        raise ValueError("--repeat and --speed apply only with --from CAPTURE")
    if capture is not None and args.fault:
        raise ValueError("--fault does not apply with --from: the capture decides every answer")
    if speed is not None and not speed > 0:
        raise ValueError(f"--speed must be above 0 (got {speed})")
    config = EngineConfig(
        host=host,
        port=port,
        model=args.model,
        tokens=args.tokens,
        ttft=args.ttft,
        itl=args.itl,
        keepalive=args.keepalive,
        max_running=args.max_running,
        prefill_per_token=args.prefill_per_token,
        batch_alpha=args.batch_alpha,
        decode_log_interval=args.decode_log_interval,
        idle_refresh=args.idle_refresh,
        max_total_tokens=args.max_total_tokens,
        context_length=args.context_length,
        engine_type=args.engine_type,
        token_counters=args.token_counters,
        startup=args.startup,
        health_timeout=args.health_timeout,
        early_headers=args.early_headers,
        faults=list(args.fault),
        export_request_metrics=getattr(args, "export_request_metrics", None),
        export_spans=getattr(args, "export_spans", None),
    )
    from .playback import PlaybackEngine, load_playbook

    engine: SimEngine
    if capture is not None:
        playbook = load_playbook(capture, repeat=args.repeat)
        engine = PlaybackEngine(config, playbook, speed=speed or 1.0)
        print(f"sim engine playing back {playbook.summary()}", file=sys.stderr, flush=True)
        for note in playbook.skipped:
            print(f"  skipped {note}", file=sys.stderr)
    else:
        engine = SimEngine(config)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                bound = await tg.start(engine.serve)
                print(
                    f"sim engine listening on http://{bound[0]}:{bound[1]}",
                    file=sys.stderr,
                    flush=True,
                )
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

    anyio.run(main)
    if isinstance(engine, PlaybackEngine):
        print(
            f"sim engine played back {engine.served} responses; "
            f"unmatched requests (404): {engine.unmatched}",
            file=sys.stderr,
        )
    return 0


def _harness(args: argparse.Namespace) -> int:
    from .harness import HarnessConfig, HarnessReport, print_report, run_harness

    cfg = HarnessConfig(
        base_url=args.target,
        sessions=args.sessions,
        rounds=args.rounds,
        think=args.think,
        max_tokens=args.max_tokens,
        deadline=args.deadline,
        model=args.model,
    )

    async def main() -> int:
        report: HarnessReport | None = None
        async with anyio.create_task_group() as tg:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

                async def stop() -> None:
                    async for _ in signals:
                        tg.cancel_scope.cancel()
                        return

                tg.start_soon(stop)
                report = await run_harness(cfg)
                tg.cancel_scope.cancel()
        if report is None:
            print("interrupted", file=sys.stderr)
            return 130
        print_report(report, sys.stdout)
        sys.stdout.flush()
        return 1 if report.failed or report.not_run else 0

    return anyio.run(main)


def main(argv: list[str] | None = None) -> int:
    from ..arguments import TracerParser

    parser = TracerParser(prog="tracer sim", top=True)
    register(parser.add_subparsers(dest="sim_command", required=True))
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
