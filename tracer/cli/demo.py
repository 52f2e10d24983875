"""``tracer demo``: the incident this project exists for (or another scenario), reproduced
on this machine with real processes: simulated engines behind the real SGLang router, a
faulty proxy, taps on both sides, the openai SDK harness; then the verdict, the report
and two replays. Named here so that parsing imports no SDK (``tools/demo.py`` runs it)."""

from __future__ import annotations

import argparse

# `tracer demo --scenario` (tracer/tools/demo.py; named here so that parsing imports no SDK)
DEMOS = {
    "hang-on-reuse": "a proxy hangs on the 3rd request of a reused keep-alive connection",
    "engine-stall": "the engine stops producing tokens mid-stream",
    "engine-queueing": "slow because busy, not a cold start: more sessions than the engine runs",
    "buffering-proxy": "a hop holds the stream and releases it at the end",
    "client-not-reading": "the client stops reading its answer",
    "healthy": "nothing wrong",
}


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare this command's options."""
    parser.epilog = (
        "scenarios:\n"
        + "\n".join(f"  {name:20} {text}" for name, text in DEMOS.items())
        + "\n\nexamples:\n"
        "  tracer demo                                   the incident, its report in demo-out/\n"
        "  tracer demo --scenario engine-stall --out /tmp/d\n"
    )
    parser.add_argument(
        "--out", default="demo-out", metavar="DIR", help="where the captures and report go"
    )
    parser.add_argument(
        "--scenario",
        default="hang-on-reuse",
        choices=list(DEMOS),
        help="which incident to reproduce (default hang-on-reuse; others go to DIR/NAME/)",
    )


def run(args: argparse.Namespace) -> int:
    from ..tools.demo import main

    return main(args.out, args.scenario)
