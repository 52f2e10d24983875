"""Times as people give them (``--hang-at``, ``--since``) and as output shows them:
relative to the capture's start in text, ISO 8601 beside epoch seconds in JSON."""

from __future__ import annotations

from datetime import UTC, datetime

# a mark this far outside the captures is still taken (clocks of two hosts, a rounded time)
MARGIN = 60.0


def iso(t: float) -> str:
    """Epoch seconds as ISO 8601 UTC to the millisecond (``2026-12-02T00:13:01.123Z``)."""
    stamp = datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def rel(t: float, origin: float | None) -> str:
    """``+12.345 s`` from the capture's start (absolute when there is no start)."""
    if origin is None:
        return iso(t)
    return f"{t - origin:+.3f} s"


def parse_time(
    value: str,
    origin: float | None,
    end: float | None = None,
    *,
    option: str = "--hang-at",
) -> float:
    """ISO 8601, epoch seconds, or ``+SECONDS`` from the capture's start, to epoch
    seconds; ValueError naming the captures' range when it falls outside it."""
    text = value.strip()
    if text.startswith("+"):
        if origin is None:
            raise ValueError(f"{option} {value}: the captures have no start time")
        try:
            t = origin + float(text[1:])
        except ValueError:
            raise ValueError(f"{option} {value}: +SECONDS must be a number") from None
    else:
        t = _absolute(text, option, value)
    if origin is not None and end is not None and not origin - MARGIN <= t <= end + MARGIN:
        raise ValueError(
            f"{option} {value} is outside the captures, which run from {iso(origin)} to "
            f"{iso(end)} (+0 to +{end - origin:.3f} s)"
        )
    return t


def _absolute(text: str, option: str, value: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{option} {value}: not ISO 8601, epoch seconds or +SECONDS") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()
