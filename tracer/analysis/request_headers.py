"""The request headers the analysis reads: the SDK's retry count (a tap's own probe
header is ``protocol/probe_mark``'s).

Apart from the fold (``summary``) because they are facts of the clients and the taps
(header names and their spelling), not of the rows.
"""

from __future__ import annotations

from typing import Any

from ..protocol.trace_context import TRACEPARENT, TRACESTATE, parse_traceparent

RETRY_HEADER = "x-stainless-retry-count"  # sent by the openai SDKs on every attempt
# (a tap's own request, x-tracer-probe: ``protocol/probe_mark.py``)


def _header(headers: list[Any], wanted: str) -> str | None:
    for name, value in headers:
        if len(name) == len(wanted) and name.lower() == wanted:
            return str(value)
    return None


def _trace_fields(headers: list[Any]) -> tuple[str | None, str | None, str | None]:
    """A row's trace context from the request's ``traceparent``/``tracestate``: (trace
    id, the client's span id, why the value is not trusted)."""
    value = _header(headers, TRACEPARENT)
    if value is None:
        return None, None, None
    got = parse_traceparent(value, _header(headers, TRACESTATE))
    if isinstance(got, str):
        return None, None, got
    return got.trace_id, got.parent_span_id, None


def _retry_count(headers: list[Any]) -> int | None:
    """The openai SDK's attempt number: a retry sends the same body again, and only this
    tells it from the first attempt when the client sends no ``x-request-id``."""
    value = _header(headers, RETRY_HEADER)
    try:
        return None if value is None else int(value)
    except ValueError:
        return None
