"""tracer report: the Markdown to attach to an incident, its timeline picture, and JSON.

The reader is an engineer who was not there. The report gives the verdict first (party,
kind, why), what was ruled out and by which evidence, the timeline picture (SVG and
PNG beside the Markdown: one lane per connection, requests coloured by termination,
stalls, hang marks, the engine's load beneath), the requests that hung, failed or were
truncated, connection reuse, the engine's own figures around each finding, the exact
`tracer replay` commands that reproduce it (same connections, and fresh ones), and the
provenance needed to check it later (capture hashes, taps, time range, versions).
--json writes the same content for machines (schema tracer.report/2, documented in
captures/REPORT.md). The analysis is that of `tracer analyze` (Summary, findings.find):
the report decides nothing new.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from ..analysis.summary import Summary
from ..atomic import write_atomically
from ..errors import RunError
from ..times import parse_time
from .analyze import incident_arguments, packet_arguments, packet_options
from .report_document import build, load, to_json
from .report_markdown import _Clock as _Clock  # (re-exported: the tests' clock)
from .report_markdown import to_markdown


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare this command's options."""
    parser.epilog = (
        "example: tracer report front.jsonl back.jsonl -o incident.md --json incident.json\n"
        "writes incident.md, incident-timeline.svg and incident-timeline.png (and the JSON)"
    )
    parser.add_argument("captures", nargs="+", metavar="CAPTURE")
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE.md",
        help="the Markdown report; the picture is written beside it as "
        "<name>-timeline.svg and <name>-timeline.png",
    )
    parser.add_argument(
        "--json", metavar="FILE.json", help="also write the report as JSON (tracer.report/2)"
    )
    incident_arguments(parser)
    packet_arguments(parser)
    parser.add_argument(
        "--max-lanes",
        type=int,
        default=40,
        metavar="N",
        help="above N connections, each lane of the picture holds a group of connections "
        "(about N lanes in all; default 40)",
    )


def run(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if output.suffix.lower() != ".md":
        raise ValueError(f"-o {args.output}: the report is Markdown, give a .md file name")
    for option, name in (("-o", args.output), ("--json", args.json)):
        if name and not Path(name).parent.is_dir():
            raise ValueError(f"{option} {name}: directory {Path(name).parent} does not exist")
    if args.max_lanes < 1:
        raise ValueError(f"--max-lanes {args.max_lanes}: must be at least 1")
    summary, captures = load(args.captures, packet_options(args))
    with summary:  # its rows may spill to temporary files: removed at the end
        return _write(args, summary, captures)


def _write(args: argparse.Namespace, summary: Summary, captures: list[dict[str, Any]]) -> int:
    output = Path(args.output)
    marks = [parse_time(v, summary.first_t, summary.last_t) for v in args.hang_at]
    svg = output.with_name(f"{output.stem}-timeline.svg")
    png = output.with_name(f"{output.stem}-timeline.png")
    doc, timeline = build(
        summary,
        captures,
        hang_at=marks,
        client_facing=list(args.client_facing),
        picture=(svg.name, png.name),
        max_lanes=args.max_lanes,
        command=_command(args),
    )
    from .timeline_draw import draw

    try:
        draw(timeline, svg, png)
    except OSError:
        raise  # the disk's reason, said as such
    except Exception as exc:  # a bug in the picture, never the user's arguments
        raise RunError(
            f"{svg.name}: the timeline picture could not be drawn ({type(exc).__name__}; "
            "a bug: --log-level debug shows where)"
        ) from exc
    write_atomically(output, to_markdown(doc).encode())
    written = [str(output), str(svg), str(png)]
    if args.json:
        write_atomically(Path(args.json), to_json(doc).encode())
        written.append(args.json)
    v = doc["verdict"]
    print(
        f"tracer report: verdict {v['party']} — {v['kind']}; wrote {', '.join(written)}",
        file=sys.stderr,
    )
    return 0


def _command(args: argparse.Namespace) -> str:
    parts = ["tracer", "report", *args.captures, "-o", args.output]
    if args.json:
        parts += ["--json", args.json]
    for value in args.hang_at:
        parts += ["--hang-at", value]
    for tap in args.client_facing:
        parts += ["--client-facing", tap]
    if args.max_lanes != 40:
        parts += ["--max-lanes", str(args.max_lanes)]
    return shlex.join(parts)
