"""Command line: one table of commands, each a module with ``configure(parser)`` and
``run(args)``; every way out is an exit code and one line (``_exit_for``)."""

from __future__ import annotations

import argparse
import dis
import importlib
import os
import signal
import sys
from types import TracebackType
from typing import Any

from .. import __version__, logs
from ..arguments import TracerParser, leaf_exception
from ..capture.files import CaptureError
from ..errors import RunError, StartError

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

# Every command: its module (configure(parser), run(args)) and its line in --help.
COMMANDS = {
    "proxy": ("cli.proxy", "run the inline tap"),
    "watch": ("cli.watch", "record engine evidence alone (no proxy)"),
    "sniff": (
        "cli.sniff",
        "the passive tap: record an interface's packets to a port as a tap would (root)",
    ),
    "analyze": ("present.analyze", "the verdict, findings and tables from captures"),
    "info": ("present.info", "what a capture holds: tap, time range, records, losses, clean end"),
    "report": ("present.report", "a Markdown incident report with a timeline picture"),
    "top": ("present.top", "live terminal view of a running tap (through its admin endpoint)"),
    "replay": (
        "tools.replay",
        "replay a capture against a target (same connections and timing, or fresh)",
    ),
    "bench": (
        "tools.bench",
        "closed-loop streaming benchmark (tokens/s, TTFT, ITL, TPOT) per concurrency",
    ),
    "compare": (
        "tools.compare",
        "compare two bench results per concurrency, with the run-to-run spread",
    ),
    "demo": ("cli.demo", "reproduce the incident (or another scenario) on this machine"),
    "sim": ("sim.cli", "simulated engine and harness"),
}


def _command_module(name: str) -> Any:
    return importlib.import_module(f"tracer.{COMMANDS[name][0]}")


def _command_in(argv: list[str]) -> str | None:
    """The command ``argv`` names (its first word that is not a top-level option), or None."""
    words = iter(argv)
    for word in words:
        if word.startswith("--log-l") and "--log-level".startswith(word.split("=")[0]):
            if "=" not in word:
                next(words, None)  # (its value)
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def _parser(only: str | None = "*") -> argparse.ArgumentParser:
    """The whole command line; ``only``: the one command whose options are set up (each
    command's module is imported to set up its options: a tap or an analysis then does
    not pay for importing every other command's; ``"*"``: all of them)."""
    p = TracerParser(
        prog="tracer",
        description="Traffic-layer diagnostic proxy for LLM serving.",
        epilog=MAIN_EPILOG,
        top=True,
    )
    p.add_argument("--version", action="version", version=f"tracer {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        if only in ("*", name):
            module = _command_module(name)
            module.configure(sub.add_parser(name, help=help_text, description=module.__doc__))
        else:
            sub.add_parser(name, help=help_text)
    return p


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    args = _parser(_command_in(words)).parse_args(words)
    logs.configure(json=args.log_json, level=args.log_level)
    try:
        return _dispatch(args)
    except BaseException as exc:  # every way out is one line and an exit code
        return _exit_for(exc, args)


def _exit_for(exc: BaseException, args: argparse.Namespace) -> int:
    """What an exception becomes for the user: one line on stderr and an exit code
    (2 usage, 3 input that is not a capture, 1 anything else); never a traceback but at
    ``--log-level debug``, never a library's own message (``_internal``). Usage is a
    ``ValueError`` that tracer raised itself (``_ours``: its argument checks); one from a
    library (matplotlib's "Axis limits cannot be NaN or Inf") or from a conversion that
    failed in tracer's code is a failure at run time, exit 1."""
    leaf = leaf_exception(exc)
    if isinstance(leaf, SystemExit):
        raise leaf
    if isinstance(leaf, KeyboardInterrupt):
        return 130
    if isinstance(leaf, BrokenPipeError):  # the reader of our output went away (`| head`)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more to flush at exit
        return 128 + signal.SIGPIPE
    if isinstance(leaf, ValueError) and _ours(leaf):
        _say(str(leaf))
        return EXIT_USAGE
    if isinstance(leaf, CaptureError):
        _say(str(leaf))
        return EXIT_INPUT
    if isinstance(leaf, StartError | RunError):
        _say(str(leaf))
    elif isinstance(leaf, OSError):
        where = f"{leaf.filename}: " if leaf.filename else ""
        _say(f"{where}{leaf.strerror or leaf}")
    else:
        _say(f"internal error: {_internal(leaf)} (a bug; --log-level debug shows where)")
    if args.log_level == "debug":
        import traceback

        traceback.print_exception(leaf, file=sys.stderr)
    return EXIT_RUNTIME


def _raised_at(exc: BaseException) -> TracebackType | None:
    """The traceback entry where ``exc`` was raised (its innermost frame)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def _package(tb: TracebackType | None) -> str:
    """The top-level package of the code at ``tb`` ("" when unknown)."""
    if tb is None:
        return ""
    return str(tb.tb_frame.f_globals.get("__name__") or "").partition(".")[0]


_RAISE = dis.opmap["RAISE_VARARGS"]


def _ours(exc: BaseException) -> bool:
    """``exc`` came from a ``raise`` statement in tracer's own code: a check that said what
    is wrong (not a library's error, nor ``int("x")`` failing inside tracer)."""
    tb = _raised_at(exc)
    if tb is None or _package(tb) != "tracer":
        return False
    return tb.tb_frame.f_code.co_code[tb.tb_lasti] == _RAISE


def _internal(exc: BaseException) -> str:
    """An unexpected error in one line: tracer's own message, or for an error raised in
    a library its type and the library (its message is for its own developers)."""
    package = _package(_raised_at(exc))
    if package in ("tracer", ""):
        return f"{type(exc).__name__}: {exc}"
    return f"{type(exc).__name__} in {package}"


def _say(text: str) -> None:
    print(f"tracer: {text}", file=sys.stderr, flush=True)


def _dispatch(args: argparse.Namespace) -> int:
    return int(_command_module(args.command).run(args))
