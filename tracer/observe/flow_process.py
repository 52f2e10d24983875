"""The capture process of the mitmproxy addon (``python -m tracer.observe.flow_process``):
facts arrive in frames on stdin from mitmproxy's process, and a ``FlowObserver`` turns
them into the capture, on a core mitmproxy is not pinned to (``flow_pipe``: the pipe
and its wire)."""

from __future__ import annotations

import logging
import os
import sys
import time
from itertools import chain
from pathlib import Path
from typing import IO, Any

from ..capture.files import CaptureWriter
from .facts import Close, Open
from .flow_pipe import read_frames
from .flows import FlowObserver, Settings

log = logging.getLogger("tracer.observe.flows")


def open_engine(path: str, settings: Settings, header: dict[str, Any]) -> FlowObserver:
    """The engine writing the capture at ``path``: the new (empty) file the addon made."""
    writer = CaptureWriter(Path(path).expanduser(), append=settings.tap)
    return FlowObserver(writer, settings, header)


def run_capture_process(stream: IO[bytes]) -> int:
    """The capture process: the first frame opens the capture, the facts that follow are
    applied; the stream's end without a ``close`` fact (mitmproxy killed) closes it."""
    frames = read_frames(stream)
    first = next(frames, None) or []
    opening = first[0] if first else None
    if not isinstance(opening, Open):
        log.error("tracer capture process: no capture to open")
        return 2
    path = opening.path
    try:
        engine = open_engine(path, Settings(**opening.settings), opening.header)
    except OSError as exc:
        log.error("tracer capture process: cannot open %s: %s", path, exc.strerror or exc)
        return 1
    apply = engine.apply
    for facts in chain([first[1:]], frames):
        for fact in facts:
            apply(fact)
        if engine.closed:
            return 0
    engine.apply(Close(time.monotonic(), "mitmproxy went away"))
    return 0


def _off_mitmproxys_cores() -> None:
    """Keep to the cores mitmproxy (the parent) is not pinned to, when there are any:
    the point of this process is to leave mitmproxy's core to mitmproxy."""
    try:
        ours = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(os.getppid())
        if others and others != ours:
            os.sched_setaffinity(0, others)
    except (OSError, AttributeError):  # (Linux only)
        pass


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[tracer capture] %(message)s")
    _off_mitmproxys_cores()
    return run_capture_process(sys.stdin.buffer)


if __name__ == "__main__":
    raise SystemExit(main())
