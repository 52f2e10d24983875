"""structlog, configured once: console lines for people, JSON lines for machines.

Every line logged inside a connection carries its ``conn`` (and ``tap``) through
contextvars, bound by the relay when the connection's task starts.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from .redact import scrub_text


def scrub(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """The redaction policy on every log line: a field may quote the wire."""
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = scrub_text(value)
    return event_dict


def tidy(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Lines for people at 3 a.m.: no empty fields (``reason=None``), and durations and
    other floats to the millisecond, not 17 digits."""
    for key in [k for k, v in event_dict.items() if v is None or v == ""]:
        del event_dict[key]
    for key, value in event_dict.items():
        if isinstance(value, float):
            event_dict[key] = round(value, 3)
    return event_dict


_json = False  # configure(json=True): every line this process writes to stderr is JSON


def configure(*, json: bool = False, level: str = "info", stream: Any = None) -> None:
    global _json
    _json = json
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        scrub,
        tidy,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=_factory(stream),
        cache_logger_on_first_use=False,
    )


def _factory(stream: Any) -> Any:
    """A logger on ``stream``, or on whatever ``sys.stderr`` is when a line is logged
    (not the one at configure time: in-process callers such as tests swap it)."""
    if stream is not None:
        return structlog.PrintLoggerFactory(file=stream)
    return lambda *args: structlog.PrintLogger(sys.stderr)


def announce(text: str, event: str, **fields: Any) -> None:
    """A line the user waits for (``listening on ...``): as written for people, or as one
    JSON log line (``event`` and ``fields``) under ``--log-json``."""
    if _json:
        structlog.get_logger("tracer").info(event, **fields)
    else:
        print(text, file=sys.stderr, flush=True)
