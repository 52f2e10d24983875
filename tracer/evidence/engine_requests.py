"""The engines' own per-request records: SGLang's request metrics and vLLM's spans.

``tracer analyze CAPTURE... --engine-requests FILE...`` reads what an engine wrote about
each request it served, so that a finding can quote the engine's own account (queued for,
first token at, finished how) and decide busy against broken per request
(``tracer/analysis/findings/engine_records.py``). Two formats, both read as the engines
write them; none of their code is here:

**SGLang** — ``--export-metrics-to-file`` (with ``--export-metrics-to-file-dir DIR``): one
JSON object per line, in ``DIR/sglang-request-metrics-YYYYMMDD_HH.log``
(``FileRequestMetricsExporter.write_record``, sgl-project/sglang
``python/sglang/srt/observability/request_metrics_exporter.py`` at 0f6cc999956c). A line
is ``{"request_parameters": <the GenerateReqInput's fields, as a JSON string>,
**meta_info}``; ``meta_info`` is the tokenizer manager's: ``id`` (the request's ``rid``),
``finish_reason`` (``{"type": "stop"|"length"|"abort", ...}``), ``prompt_tokens``,
``completion_tokens``, ``e2e_latency``, and the time stats of
``python/sglang/srt/observability/req_time_stats.py`` (at 00ce49e05c17):
``request_received_ts``, ``request_finished_ts``, ``response_sent_to_client_ts`` (wall
clock), ``forward_entry_time`` and ``prefill_finished_time`` (wall clock: when it left the
queue, and when its prefill, hence its first token, was done) and ``queue_time`` (seconds
from entering the wait queue to the forward batch). A record is written when the request
finishes (or is aborted), never while it runs.

**vLLM** — its ``llm_request`` span (``OutputProcessor.do_tracing``, vllm-project/vllm
``vllm/v1/engine/output_processor.py`` at d07822605346; attribute names in
``vllm/tracing/utils.py`` at 0bf3270fe123, earlier ``vllm/tracing.py`` at 03b8a674ec7e),
exported over OTLP (``--otlp-traces-endpoint``) and written to a file by the OpenTelemetry
Collector's ``file`` exporter (open-telemetry/opentelemetry-collector-contrib
``exporter/fileexporter``: by default one ``ExportTraceServiceRequest`` per line in
protobuf JSON — ``resourceSpans[].scopeSpans[].spans[]`` with ``traceId`` in hex,
``startTimeUnixNano``/``endTimeUnixNano`` as decimal strings, attributes as
``{"key", "value": {"stringValue"|"intValue"|"doubleValue"|...}}``). The span starts at
the request's arrival and ends when it finished; its attributes: ``gen_ai.request.id``
(the request id: ``chatcmpl-`` or ``cmpl-`` and the client's ``X-Request-Id`` when it sent
one, ``_base_request_id`` of vLLM's OpenAI server), ``gen_ai.latency.time_in_queue``,
``gen_ai.latency.time_to_first_token``, ``gen_ai.latency.e2e``,
``gen_ai.usage.prompt_tokens``, ``gen_ai.usage.completion_tokens``,
``gen_ai.response.finish_reasons`` (a JSON list as a string, e.g. ``["stop"]``). Its
trace id is the client's when the request carried a W3C ``traceparent`` (vLLM extracts it
and makes the span its child). Spans of other names (no ``gen_ai.request.id``) are skipped.

Reading is tolerant: a line that is not JSON, or not a record of the file's format, is
counted (and the first one named), never a traceback. A file whose lines are neither
format is an ``EngineRequestsError`` (a ``CaptureError``: exit 3). A folder is read as
SGLang's export folder (its ``sglang-request-metrics-*.log`` files, in name order).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..capture.files import CaptureError
from ..protocol.trace_context import TraceContext, parse_traceparent

SGLANG = "sglang"
VLLM = "vllm"
SGLANG_KEYS = ("request_received_ts", "e2e_latency", "request_parameters", "queue_time")
ID_PREFIXES = ("chatcmpl-", "cmpl-")  # vLLM's, before the client's X-Request-Id
_HEX_TRACE = re.compile(r"[0-9a-f]{32}")
MAX_LINE = 16 * 1024 * 1024  # a longer line is not a record (counted bad)


class EngineRequestsError(CaptureError):
    """The file is neither SGLang's request metrics nor OTLP JSON spans."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as an engine accounts for it. Times are wall clock (seconds since the
    epoch); durations in seconds; None where the record does not say."""

    engine: str  # sglang | vllm
    source: str  # FILE:LINE
    request_id: str | None
    trace_id: str | None = None
    received: float | None = None
    queued: float | None = None  # seconds in the wait queue
    first_token: float | None = None  # when its first token was made
    finished: float | None = None
    e2e: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish: str | None = None  # stop, length, abort, error ...
    status: str | None = None  # a span's status: ok | error (None: unset, or SGLang)
    service: str | None = None  # the span's resource service.name

    @property
    def ttft(self) -> float | None:
        if self.first_token is None or self.received is None:
            return None
        return self.first_token - self.received

    def ids(self) -> list[str]:
        """The request ids it answers to: its own, and without vLLM's prefix."""
        if not self.request_id:
            return []
        out = [self.request_id]
        for prefix in ID_PREFIXES:
            if self.request_id.startswith(prefix) and len(self.request_id) > len(prefix):
                out.append(self.request_id[len(prefix) :])
        return out

    def answered(self) -> bool:
        """The engine says it finished the request (not aborted, not an error)."""
        return self.finish in ("stop", "length", "tool_calls", "eos") and self.status != "error"

    def figures(self) -> dict[str, Any]:
        """The figures a finding quotes of it."""
        out: dict[str, Any] = {"engine": self.engine, "finish": self.finish}
        for name, value in (
            ("queue_s", self.queued),
            ("ttft_s", self.ttft),
            ("e2e_s", self.e2e),
            ("received", self.received),
            ("finished", self.finished),
            ("prompt_tokens", self.prompt_tokens),
            ("output_tokens", self.output_tokens),
        ):
            if value is not None:
                out[name] = round(value, 6) if isinstance(value, float) else value
        if self.status is not None:
            out["status"] = self.status
        return out


@dataclass
class EngineRequests:
    """What one file held: its format, its records, its bad lines."""

    path: str
    format: str | None = None  # sglang | vllm (None: no record at all)
    records: list[EngineRequest] = field(default_factory=list)
    bad_lines: int = 0
    first_bad: str | None = None  # "line N: why"
    spans_skipped: int = 0  # spans that are not a request's (other names)

    def describe(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "records": len(self.records),
            "bad_lines": self.bad_lines,
            **({"first_bad": self.first_bad} if self.first_bad else {}),
        }


def read_engine_requests(path: str | Path) -> EngineRequests:
    """The records of one file (or of SGLang's export folder)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("sglang-request-metrics-*.log"))
        if not files:
            raise EngineRequestsError(f"{p}: no sglang-request-metrics-*.log in this folder")
        out = EngineRequests(path=str(p))
        for f in files:
            one = _read_file(f)
            _merge(out, one)
        return out
    return _read_file(p)


def read_all(paths: Iterable[str | Path]) -> tuple[list[EngineRequest], list[dict[str, Any]]]:
    """Every file's records, and what each file held (``EngineRequests.describe``)."""
    records: list[EngineRequest] = []
    described: list[dict[str, Any]] = []
    for path in paths:
        got = read_engine_requests(path)
        records += got.records
        described.append(got.describe())
    return records, described


def _merge(into: EngineRequests, one: EngineRequests) -> None:
    if one.format is not None:
        if into.format not in (None, one.format):
            raise EngineRequestsError(f"{into.path}: files of two formats in one folder")
        into.format = one.format
    into.records += one.records
    into.bad_lines += one.bad_lines
    into.first_bad = into.first_bad or one.first_bad
    into.spans_skipped += one.spans_skipped


def _lines(p: Path) -> Iterator[tuple[int, bytes]]:
    try:
        with p.open("rb") as fh:
            yield from enumerate(fh, 1)
    except OSError as exc:
        raise EngineRequestsError(f"{p}: {exc.strerror or exc}") from None


def _read_file(p: Path) -> EngineRequests:
    out = EngineRequests(path=str(p))
    seen_json = 0
    for n, raw in _lines(p):
        if not raw.strip():
            continue
        where = f"{p.name}:{n}"
        why: str | None
        try:
            if len(raw) > MAX_LINE:
                raise ValueError("line too long")
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            why = "not JSON"
        else:
            seen_json += 1
            why = _take(out, obj, where)
        if why is not None:
            out.bad_lines += 1
            if out.first_bad is None:
                out.first_bad = f"line {n}: {why}"
    if out.format is None and (out.bad_lines or seen_json):
        raise EngineRequestsError(
            f"{p}: neither SGLang's request metrics (JSONL, --export-metrics-to-file) nor "
            f"OTLP JSON spans (the OpenTelemetry Collector's file exporter)"
            + (f"; {out.first_bad}" if out.first_bad else "")
        )
    return out


def _take(out: EngineRequests, obj: Any, where: str) -> str | None:
    """Read one line's object into ``out``; why it is not a record, or None."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    kind = VLLM if "resourceSpans" in obj else SGLANG if _sglang_like(obj) else None
    if kind is None:
        return "neither an SGLang record nor OTLP spans"
    if out.format is None:
        out.format = kind
    elif kind != out.format:
        return f"a {kind} record in a {out.format} file"
    try:
        if kind == SGLANG:
            out.records.append(_sglang(obj, where))
        else:
            spans, skipped = _otlp(obj, where)
            out.records += spans
            out.spans_skipped += skipped
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        return f"unreadable {kind} record ({type(exc).__name__})"
    return None


def _sglang_like(obj: dict[str, Any]) -> bool:
    return any(k in obj for k in SGLANG_KEYS)


# -- figures, checked ---------------------------------------------------------------------


def _num(value: Any) -> float | None:
    """A finite, non-negative number, or None (a string of digits, as protobuf JSON writes
    64-bit integers, counts)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) and f >= 0 else None


def _int(value: Any) -> int | None:
    f = _num(value)
    return int(f) if f is not None and f == int(f) else None


def _wall(value: Any) -> float | None:
    """A wall-clock time: seconds since the epoch, after 2001 (SGLang's perf-counter times
    converted; a raw monotonic value would not pass)."""
    f = _num(value)
    return f if f is not None and 1e9 <= f < 1e10 else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


# -- SGLang -------------------------------------------------------------------------------


def _sglang(obj: dict[str, Any], where: str) -> EngineRequest:
    params: dict[str, Any] = {}
    raw = obj.get("request_parameters")
    if isinstance(raw, str):
        try:
            loaded = json.loads(raw)
        except ValueError:
            loaded = None
        if isinstance(loaded, dict):
            params = loaded
    elif isinstance(raw, dict):
        params = raw
    rid = _text(obj.get("id")) or _text(params.get("rid"))
    finish_obj = obj.get("finish_reason")
    finish = (
        _text(finish_obj.get("type"))
        if isinstance(finish_obj, dict)
        else _text(finish_obj)
        if finish_obj is not None
        else None
    )
    received = _wall(obj.get("request_received_ts"))
    e2e = _num(obj.get("e2e_latency"))
    finished = _wall(obj.get("request_finished_ts"))
    if finished is None and received is not None and e2e is not None:
        finished = received + e2e
    if e2e is None and finished is not None and received is not None and finished >= received:
        e2e = finished - received
    trace = None
    header = params.get("external_trace_header")
    if isinstance(header, dict):
        trace = _trace_of(header.get("traceparent"))
    return EngineRequest(
        engine=SGLANG,
        source=where,
        request_id=rid,
        trace_id=trace,
        received=received,
        queued=_num(obj.get("queue_time")),
        first_token=_wall(obj.get("prefill_finished_time")),
        finished=finished,
        e2e=e2e,
        prompt_tokens=_int(obj.get("prompt_tokens")),
        output_tokens=_int(obj.get("completion_tokens")),
        finish=finish,
    )


def _trace_of(traceparent: Any) -> str | None:
    """The trace id of a ``traceparent`` the engine recorded, if it is a valid one."""
    if not isinstance(traceparent, str):
        return None
    got = parse_traceparent(traceparent)
    return got.trace_id if isinstance(got, TraceContext) else None


# -- OTLP JSON (vLLM's spans) -------------------------------------------------------------


def _value(v: Any) -> Any:
    """An OTLP ``AnyValue`` in protobuf JSON."""
    if not isinstance(v, dict):
        return None
    for key in ("stringValue", "doubleValue", "boolValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return _int(v["intValue"]) if not isinstance(v["intValue"], bool) else None
    if "arrayValue" in v:
        values = (v["arrayValue"] or {}).get("values") or []
        return [_value(x) for x in values]
    return None


def _attrs(items: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if isinstance(item, dict) and isinstance(item.get("key"), str):
            out[item["key"]] = _value(item.get("value"))
    return out


def _trace_id(value: Any) -> str | None:
    """Hex, as OTLP JSON writes it; base64 of the 16 bytes, as a plain protobuf-to-JSON
    mapping would, is read too."""
    if not isinstance(value, str) or not value:
        return None
    low = value.lower()
    if _HEX_TRACE.fullmatch(low):
        return None if low == "0" * 32 else low
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 16 and any(raw) else None


def _nanos(value: Any) -> float | None:
    f = _num(value)
    return _wall(f / 1e9) if f is not None else None


def _finish_of(value: Any) -> str | None:
    if isinstance(value, list):
        return _text(value[0]) if value else None
    if isinstance(value, str):
        try:
            loaded = json.loads(value)
        except ValueError:
            return _text(value)
        if isinstance(loaded, list):
            return _text(loaded[0]) if loaded else None
        return _text(loaded) if isinstance(loaded, str) else None
    return None


STATUS = {"STATUS_CODE_OK": "ok", "STATUS_CODE_ERROR": "error", 1: "ok", 2: "error"}


def _otlp(obj: dict[str, Any], where: str) -> tuple[list[EngineRequest], int]:
    records: list[EngineRequest] = []
    skipped = 0
    for rs in obj["resourceSpans"] or []:
        resource = _attrs((rs.get("resource") or {}).get("attributes"))
        service = _text(resource.get("service.name"))
        for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []:
            for span in ss.get("spans") or []:
                attrs = _attrs(span.get("attributes"))
                rid = attrs.get("gen_ai.request.id")
                if not isinstance(rid, str):
                    skipped += 1
                    continue
                start, end = (
                    _nanos(span.get("startTimeUnixNano")),
                    _nanos(span.get("endTimeUnixNano")),
                )
                e2e = _num(attrs.get("gen_ai.latency.e2e"))
                ttft = _num(attrs.get("gen_ai.latency.time_to_first_token"))
                if e2e is None and start is not None and end is not None and end >= start:
                    e2e = end - start
                code = (span.get("status") or {}).get("code")
                records.append(
                    EngineRequest(
                        engine=VLLM,
                        source=where,
                        request_id=rid or None,
                        trace_id=_trace_id(span.get("traceId")),
                        received=start,
                        queued=_num(attrs.get("gen_ai.latency.time_in_queue")),
                        first_token=start + ttft if start is not None and ttft else None,
                        finished=end
                        if end is not None
                        else (start + e2e if start and e2e else None),
                        e2e=e2e,
                        prompt_tokens=_int(attrs.get("gen_ai.usage.prompt_tokens")),
                        output_tokens=_int(attrs.get("gen_ai.usage.completion_tokens")),
                        finish=_finish_of(attrs.get("gen_ai.response.finish_reasons")),
                        status=STATUS.get(code) if isinstance(code, str | int) else None,
                        service=service,
                    )
                )
    return records, skipped
