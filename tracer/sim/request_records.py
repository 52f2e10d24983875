"""The simulated engine's own per-request records, in the two formats real engines write
(``tracer sim engine --export-request-metrics FILE --export-spans FILE``).

* SGLang's request metrics (``--export-metrics-to-file``): one JSON object per line, the
  request's parameters as a JSON string and its ``meta_info`` (``id``, ``finish_reason``,
  token counts, ``e2e_latency``, ``request_received_ts``, ``forward_entry_time``,
  ``prefill_finished_time``, ``queue_time``, ``request_finished_ts`` ...);
* vLLM's ``llm_request`` span as the OpenTelemetry Collector's file exporter writes it:
  one ``ExportTraceServiceRequest`` per line in protobuf JSON, with the ``gen_ai.*``
  attributes (``gen_ai.request.id`` is ``chatcmpl-`` or ``cmpl-`` and the client's
  ``x-request-id``, as vLLM names it; the trace is the client's ``traceparent``'s when it
  sent one).

The formats, and where they come from, are ``tracer/evidence/engine_requests.py``'s
docstring. A record is written when a request finishes or is aborted (a client that went
away), as the engines write theirs; a request the engine never admitted to its scheduler
(a ``lost`` or ``500`` fault) has none. The sim names a request by its body's ``rid``,
else the client's ``x-request-id``, else its own id.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

from ..protocol.trace_context import parse_traceparent
from .scheduler import SimRequest


@dataclass
class RecordWriter:
    """Appends one line per finished request to each file asked for (flushed at once: a
    killed engine has written every record it made)."""

    request_metrics: str | None = None
    spans: str | None = None

    @property
    def active(self) -> bool:
        return bool(self.request_metrics or self.spans)

    def write(
        self,
        req: SimRequest,
        *,
        chat: bool,
        payload: dict[str, Any],
        headers: dict[str, str],
        finish: str,
    ) -> None:
        if req.internal or req.state not in ("finished", "aborted"):
            return
        now_m, now_w = time.monotonic(), time.time()

        def wall(m: float | None) -> float | None:
            return None if m is None else now_w - (now_m - m)

        aborted = req.state == "aborted"
        reason = "abort" if aborted else finish
        rid = str(payload.get("rid") or headers.get("x-request-id") or req.rid)
        received = wall(req.arrival)
        queued = (req.admitted_at - req.arrival) if req.admitted_at is not None else None
        if self.request_metrics:
            self._append(
                self.request_metrics,
                _sglang_line(req, rid, payload, reason, received, wall, queued, now_w),
            )
        if self.spans:
            base = headers.get("x-request-id") or req.rid.split("-", 1)[-1]
            vllm_id = ("chatcmpl-" if chat else "cmpl-") + base
            self._append(
                self.spans,
                _span_line(req, vllm_id, headers, reason, received, wall, queued, now_w),
            )

    @staticmethod
    def _append(path: str, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def _sglang_line(
    req: SimRequest,
    rid: str,
    payload: dict[str, Any],
    reason: str,
    received: float | None,
    wall: Any,
    queued: float | None,
    now: float,
) -> dict[str, Any]:
    finish: dict[str, Any] = {"type": reason}
    if reason == "length":
        finish["length"] = req.generated
    elif reason == "abort":
        finish["message"] = "The client disconnected."
    params = {
        "rid": rid,
        "stream": bool(payload.get("stream")),
        "sampling_params": {"max_new_tokens": req.max_tokens},
    }
    out: dict[str, Any] = {
        "request_parameters": json.dumps(params),
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": req.generated,
        "cached_tokens": 0,
        "e2e_latency": now - received if received is not None else None,
        "request_received_ts": received,
        "request_finished_ts": now,
        "response_sent_to_client_ts": now,
        "queue_time": queued,
    }
    if req.admitted_at is not None:
        out["forward_entry_time"] = wall(req.admitted_at)
    if req.first_token_at is not None:
        out["prefill_finished_time"] = wall(req.first_token_at)
    return out


def _attr(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        v: dict[str, Any] = {"boolValue": value}
    elif isinstance(value, int):
        v = {"intValue": str(value)}  # protobuf JSON: 64-bit integers as strings
    elif isinstance(value, float):
        v = {"doubleValue": value}
    else:
        v = {"stringValue": str(value)}
    return {"key": key, "value": v}


def _span_line(
    req: SimRequest,
    vllm_id: str,
    headers: dict[str, str],
    reason: str,
    received: float | None,
    wall: Any,
    queued: float | None,
    now: float,
) -> dict[str, Any]:
    trace, parent = secrets.token_hex(16), None
    got = parse_traceparent(headers["traceparent"]) if "traceparent" in headers else None
    if got is not None and not isinstance(got, str):
        trace, parent = got.trace_id, got.parent_span_id
    start = received if received is not None else now
    first = wall(req.first_token_at)
    attrs = [
        _attr("gen_ai.response.model", "sim-model"),
        _attr("gen_ai.request.id", vllm_id),
        _attr("gen_ai.request.max_tokens", req.max_tokens),
        _attr("gen_ai.usage.prompt_tokens", req.prompt_tokens),
        _attr("gen_ai.usage.completion_tokens", req.generated),
        _attr("gen_ai.latency.time_in_queue", float(queued or 0.0)),
        _attr("gen_ai.latency.e2e", now - start),
        _attr("gen_ai.response.finish_reasons", json.dumps([reason])),
    ]
    if first is not None:
        attrs.append(_attr("gen_ai.latency.time_to_first_token", first - start))
    span: dict[str, Any] = {
        "traceId": trace,
        "spanId": secrets.token_hex(8),
        "name": "llm_request",
        "kind": 2,  # SPAN_KIND_SERVER
        "startTimeUnixNano": str(int(start * 1e9)),
        "endTimeUnixNano": str(int(now * 1e9)),
        "attributes": attrs,
        "status": {},
    }
    if parent:
        span["parentSpanId"] = parent
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [_attr("service.name", "vllm")]},
                "scopeSpans": [{"scope": {"name": "vllm.llm_engine"}, "spans": [span]}],
            }
        ]
    }
