"""Errors the command line turns into one line for the user (``cli._exit_for``)."""

from __future__ import annotations

import os


class StartError(Exception):
    """A command could not start (a port in use, a folder it cannot make): shown as
    ``tracer: <what failed>: <why>``, exit 1."""


class RunError(Exception):
    """A command failed at run time for a reason that is not the user's arguments (a
    picture that could not be drawn): shown as ``tracer: <what failed>``, exit 1."""


def start_error(what: str, exc: OSError) -> StartError:
    """``what`` failed because of ``exc``: its reason without the errno noise."""
    why = os.strerror(exc.errno) if exc.errno else (exc.strerror or str(exc))
    return StartError(f"{what}: {why[:1].lower()}{why[1:]}")
