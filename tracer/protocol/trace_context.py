"""W3C Trace Context (level 1) as a request carries it: ``traceparent`` and ``tracestate``.

Read, never trusted: a value that breaks the grammar is an error said back (kept as an
anomaly of the request by the caller), never a trace id. The rules, from the
Recommendation (https://www.w3.org/TR/trace-context/, "traceparent Header"):

* ``version "-" trace-id "-" parent-id "-" trace-flags``, lowercase hex: 2, 32, 16, 2;
* version ``ff`` is invalid; a trace-id or parent-id of all zeros is invalid;
* a version above ``00`` may carry more fields after the flags (``-`` and more), which
  are ignored; version ``00`` has exactly four;
* ``tracestate`` is a list of up to 32 ``key=value`` members (kept as sent, if its
  length is sane: it is vendor data, nothing here reads inside it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
MAX_TRACESTATE = 512  # the Recommendation's own limit for what a vendor must propagate

_PARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A request's place in its client's trace: the trace, and the client's span."""

    trace_id: str
    parent_span_id: str
    sampled: bool
    tracestate: str | None = None


def parse_traceparent(value: str, tracestate: str | None = None) -> TraceContext | str:
    """The trace context, or why the value is not one (a short reason)."""
    m = _PARENT.fullmatch(value.strip(" \t"))
    if m is None:
        return "malformed traceparent"
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff":
        return "traceparent version ff is invalid"
    if version == "00" and rest:
        return "traceparent version 00 with extra fields"
    if trace_id == _ZERO_TRACE:
        return "traceparent trace-id is all zeros"
    if span_id == _ZERO_SPAN:
        return "traceparent parent-id is all zeros"
    state = tracestate.strip(" \t") if tracestate is not None else None
    if state is not None and (len(state) > MAX_TRACESTATE or state.count(",") >= 32):
        state = None  # too long to be one: not carried (the trace context still holds)
    return TraceContext(
        trace_id=trace_id,
        parent_span_id=span_id,
        sampled=bool(int(flags, 16) & 1),
        tracestate=state or None,
    )
