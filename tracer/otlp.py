"""OpenTelemetry export of the tap's requests (not built yet)."""

from __future__ import annotations

from . import events as ev


class OtlpSink:
    """A tap sink: one span per request, sent to an OTLP/HTTP collector."""

    def __init__(self, endpoint: str, *, tap: str, wall_offset: float) -> None:
        raise ValueError("--otlp is not built yet")

    def __call__(self, event: ev.Event) -> None:
        """Called with every event the tap records."""

    def close(self) -> None:
        """Send what is pending; called once when the tap stops."""
