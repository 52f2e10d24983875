"""Timers around the trace addon's hooks, for ``bench.addon_hooks``; runs inside mitmdump.

The script ``bench.addon_hooks`` has mitmdump load calls ``install``, which loads
``addons/trace.py`` (or a variant) with a ``perf_counter`` pair around each named hook and
each call of the two stream callables, and times every garbage collection of the process
(``gc, generation N``: a collection runs inside whatever code allocated when
it came due, so a full one, tens of ms, can land in a hook's time). SIGUSR1 zeroes the
timers, SIGUSR2 writes them out as JSON (``{name: [seconds, calls]}``). Only the standard
library: nothing else of the bench is imported into the proxy measured.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

STATS: dict[str, list[float]] = {}


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, adding its time and one call to ``STATS[name]`` each time it runs."""
    clock = time.perf_counter

    def call(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = clock() - start
            entry = STATS.get(name)
            if entry is None:
                entry = STATS[name] = [0.0, 0]
            entry[0] += spent
            entry[1] += 1

    return call


def _time_collections() -> None:
    clock = time.perf_counter
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = clock()
            return
        entry = STATS.setdefault(f"gc, generation {info['generation']}", [0.0, 0])
        entry[0] += clock() - started[0]
        entry[1] += 1

    gc.callbacks.append(on_gc)


def _observer(name: str, factory: Callable[..., Any]) -> Callable[..., Any]:
    def make(self: Any, st: Any, chain: Any) -> Any:
        return timed(name, factory(self, st, chain))

    return make


def install(addon: str, hooks: Iterable[str], stats_path: str) -> list[Any]:
    """Load the addon file ``addon`` with ``hooks`` (TraceAddon methods) and its stream
    callables timed; its ``addons`` list, for mitmdump."""
    spec = importlib.util.spec_from_file_location("timed_trace_addon", addon)
    assert spec is not None and spec.loader is not None
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)
    cls = trace.TraceAddon
    for hook in hooks:
        setattr(cls, hook, timed(hook, getattr(cls, hook)))
    cls._response_observer = _observer("response stream callable", cls._response_observer)
    cls._request_observer = _observer("request stream callable", cls._request_observer)
    _time_collections()
    signal.signal(signal.SIGUSR1, lambda *_: STATS.clear())
    signal.signal(signal.SIGUSR2, lambda *_: Path(stats_path).write_text(json.dumps(STATS)))
    addons: list[Any] = trace.addons
    return addons
