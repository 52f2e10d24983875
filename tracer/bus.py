"""The event bus: every event of a tap (the relay's, the observers', the poller's, the
probes') reaches every sink that wants it: the capture, the counters and log lines, the
admin's live state, OTLP, a replay's clock. A sink that raises is switched off, counted
and logged once with its traceback; the sender never sees the error, so forwarding never
depends on every sink guarding itself."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from . import events as ev

Sink = Callable[[ev.Event], object]

log = structlog.get_logger(__name__)


class EventBus:
    """Sinks in the order they were added; ``publish`` never raises."""

    def __init__(self) -> None:
        self._sinks: list[tuple[str, Sink]] = []
        self.disabled: dict[str, str] = {}  # sink name -> what it raised

    def add(self, name: str, sink: Sink) -> None:
        self._sinks.append((name, sink))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._sinks]

    def publish(self, event: ev.Event) -> None:
        for name, sink in self._sinks:
            try:
                sink(event)
            except Exception as exc:  # a sink's bug is the sink's: it stops, nothing else
                self._disable(name, exc, event)

    def _disable(self, name: str, exc: Exception, event: ev.Event) -> None:
        self._sinks = [(n, s) for n, s in self._sinks if n != name]
        self.disabled[name] = f"{type(exc).__name__}: {exc}"
        log.error(
            "event sink failed and is switched off; traffic goes on",
            sink=name,
            record=event.TYPE,
            exc_info=exc,
        )
