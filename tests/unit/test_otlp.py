"""`tracer proxy --otlp` in-process: the traces URL, the parent a request's span gets
from its ``traceparent`` (valid or not), the bounded queue's drops counted by reason,
the counters on /metrics, and docs/otel.md's Collector configuration."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest
from ruamel.yaml import YAML

from tests.support.docs import ROOT, argv, command_lines, fenced_blocks
from tracer import events as ev
from tracer.cli.commands import _parser
from tracer.present import otlp
from tracer.present.otlp import OtlpSink, traces_url

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{PARENT_ID}-01"


def test_traces_url() -> None:
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    for bad in ("c:4318", "ftp://c", "http://c:notaport"):
        with pytest.raises(ValueError, match="--otlp"):
            traces_url(bad)


# ---- a sink fed events by hand --------------------------------------------------------


@pytest.fixture
def sink() -> Iterator[tuple[OtlpSink, InMemorySpanExporter]]:
    memory = InMemorySpanExporter()
    s = OtlpSink("http://127.0.0.1:1", tap="t", wall_offset=1.7e9, exporter=memory)
    yield s, memory
    s.close()


def _request(sink: OtlpSink, seq: int, headers: list[list[str]]) -> None:
    base: dict[str, Any] = {"t": 1.7e9 + seq, "m": float(seq), "tap": "t", "conn": 1}
    if seq == 1:
        sink(ev.ConnOpen(**base, peer="127.0.0.1:5000", local="127.0.0.1:8080"))
    sink(
        ev.RequestHead(
            **base,
            seq=seq,
            idle_before=0.0,
            method="POST",
            target="/v1/chat/completions",
            version="1.1",
            headers=[["host", "127.0.0.1:8080"], *headers],
        )
    )
    sink(
        ev.ResponseEnd(
            **{**base, "m": seq + 0.5},
            seq=seq,
            termination="complete",
            status=200,
            body_bytes=10,
            duration=0.5,
        )
    )


def _spans(sink: OtlpSink, memory: InMemorySpanExporter) -> list[ReadableSpan]:
    sink.provider.force_flush()
    return list(memory.get_finished_spans())


def test_a_valid_traceparent_parents_the_span_and_tracestate_is_carried(
    sink: tuple[OtlpSink, InMemorySpanExporter],
) -> None:
    s, memory = sink
    # header names in any case; tracestate on two lines is one list (RFC 9110 5.3)
    _request(s, 1, [["TraceParent", VALID], ["tracestate", "a=1, b=2"], ["TraceState", "c=3"]])
    (span,) = _spans(s, memory)
    assert span.parent is not None and span.parent.is_remote
    assert f"{span.parent.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == PARENT_ID
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert span.context.span_id != span.parent.span_id
    # the SDK keeps tracestate in the span's context (exported as Span.trace_state)
    assert span.context.trace_state.to_header() == "a=1,b=2,c=3"
    assert span.attributes is not None
    assert "tracer.traceparent_invalid" not in span.attributes
    assert s.traceparent_invalid == 0


def test_an_unsampled_parent_still_gets_its_span_exported(
    sink: tuple[OtlpSink, InMemorySpanExporter],
) -> None:
    s, memory = sink
    _request(s, 1, [["traceparent", f"00-{TRACE_ID}-{PARENT_ID}-00"]])
    (span,) = _spans(s, memory)
    assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT_ID
    assert span.context.trace_flags.sampled  # every request is exported (docs/otel.md)


INVALID = {
    "short trace id": f"00-{TRACE_ID[:-2]}-{PARENT_ID}-01",
    "long parent id": f"00-{TRACE_ID}-{PARENT_ID}00-01",
    "all-zero trace id": f"00-{'0' * 32}-{PARENT_ID}-01",
    "all-zero parent id": f"00-{TRACE_ID}-{'0' * 16}-01",
    "version ff": f"ff-{TRACE_ID}-{PARENT_ID}-01",
    "uppercase hex": f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",
    "version 00 with more": f"{VALID}-extra",
    "not hex": f"00-{'z' * 32}-{PARENT_ID}-01",
    "empty": "",
    "garbage": "\x00\xff not a traceparent",
    "huge": "00-" + "a" * 5000,
}


@pytest.mark.parametrize("value", list(INVALID.values()), ids=list(INVALID))
def test_an_invalid_traceparent_makes_a_root_span_noted_and_counted(
    sink: tuple[OtlpSink, InMemorySpanExporter], value: str
) -> None:
    s, memory = sink
    _request(s, 1, [["traceparent", value], ["tracestate", "a=1"]])
    _request(s, 2, [])  # the next request on the connection: no parent, nothing noted
    first, second = _spans(s, memory)
    assert first.parent is None, "a root span"
    assert f"{first.context.trace_id:032x}" != TRACE_ID and first.context.is_valid
    assert first.attributes is not None and second.attributes is not None
    assert first.attributes["tracer.traceparent_invalid"] == value[: otlp.MAX_NOTED]
    assert first.attributes["http.response.status_code"] == 200  # the span is whole
    assert second.parent is None and "tracer.traceparent_invalid" not in second.attributes
    assert s.traceparent_invalid == 1
    assert not s._failed


def test_traceparent_sent_twice_is_not_valid(sink: tuple[OtlpSink, InMemorySpanExporter]) -> None:
    s, memory = sink
    other = f"00-{'1' * 32}-{'2' * 16}-01"
    _request(s, 1, [["traceparent", VALID], ["traceparent", other]])
    (span,) = _spans(s, memory)
    assert span.parent is None and span.attributes is not None
    assert span.attributes["tracer.traceparent_invalid"] == f"{VALID}, {other}"


def test_a_bad_tracestate_keeps_the_parent_and_is_noted(
    sink: tuple[OtlpSink, InMemorySpanExporter],
) -> None:
    s, memory = sink
    _request(s, 1, [["traceparent", VALID], ["tracestate", "not a member"]])
    (span,) = _spans(s, memory)
    assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT_ID
    assert not span.context.trace_state
    assert span.attributes is not None
    assert span.attributes["tracer.tracestate_invalid"] == "not a member"


# ---- the bounded queue and its drops --------------------------------------------------


class Blocking(SpanExporter):
    """Holds the first export until released; then answers ``result``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.result = SpanExportResult.SUCCESS
        self.got = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(10)
        self.got += len(spans)
        return self.result

    def shutdown(self) -> None:
        self.release.set()


def test_a_full_queue_drops_counted_never_waiting() -> None:
    blocking = Blocking()
    s = OtlpSink("http://127.0.0.1:1", tap="t", wall_offset=0.0, max_queue=2, exporter=blocking)
    try:
        _request(s, 1, [])
        _request(s, 2, [])  # a full batch (2): the export thread takes both, and hangs
        assert blocking.entered.wait(5)
        for seq in range(3, 11):  # 2 fit the queue again, 6 do not; none waits
            _request(s, seq, [])
        assert s.processor.queued == 2
        assert s.drops()["queue_full"] == 6
        assert s.processor.accepted == 4
    finally:
        blocking.release.set()
        s.close()
    assert blocking.got == 4 and s.exporter.exported == 4
    assert s.drops() == {"queue_full": 6, "export_failed": 0, "retry_wait": 0, "shutdown": 0}


def test_failed_exports_drop_counted_and_wait_before_trying_again() -> None:
    failing = Blocking()
    failing.release.set()
    failing.result = SpanExportResult.FAILURE
    s = OtlpSink("http://127.0.0.1:1", tap="t", wall_offset=0.0, exporter=failing)
    try:
        _request(s, 1, [])
        _request(s, 2, [])
        s.provider.force_flush()  # one batch of 2: tried, failed
        _request(s, 3, [])
        s.provider.force_flush()  # within RETRY_AFTER: dropped untried
        assert failing.got == 2
        assert s.drops() == {"queue_full": 0, "export_failed": 2, "retry_wait": 1, "shutdown": 0}
        assert s.exporter.failures == 1
    finally:
        s.close()


def test_the_counters_on_metrics(sink: tuple[OtlpSink, InMemorySpanExporter]) -> None:
    s, _ = sink
    _request(s, 1, [["traceparent", VALID]])
    _request(s, 2, [["traceparent", "00-bad"]])
    s.provider.force_flush()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(s.metrics())
    text = generate_latest(registry).decode()
    assert 'tracer_otlp_spans_exported_total{tap="t"} 2.0' in text
    for reason in otlp.DROP_REASONS:
        assert f'tracer_otlp_spans_dropped_total{{reason="{reason}",tap="t"}} 0.0' in text
    assert 'tracer_otlp_spans_queued{tap="t"} 0.0' in text
    assert 'tracer_otlp_traceparent_invalid_total{tap="t"} 1.0' in text


# ---- docs/otel.md ---------------------------------------------------------------------

OTEL_MD = ROOT / "docs" / "otel.md"


def _collector_config() -> dict[str, Any]:
    blocks = [b for b in fenced_blocks(OTEL_MD.read_text()) if "receivers:" in b]
    assert len(blocks) == 1, "one Collector configuration in docs/otel.md"
    config = YAML(typ="safe").load(io.StringIO(blocks[0]))
    assert isinstance(config, dict)
    return config


def test_the_collector_configuration_in_the_docs_is_whole() -> None:
    config = _collector_config()
    http = config["receivers"]["otlp"]["protocols"]["http"]
    assert http["endpoint"].endswith(":4318")
    assert "batch" in config["processors"]
    exporters = config["exporters"]
    assert "file" in exporters and exporters["file"]["path"]
    assert any(name.startswith(("otlp", "otlphttp")) for name in exporters)
    pipelines = config["service"]["pipelines"]
    traces = pipelines["traces"]
    assert traces["receivers"] == ["otlp"] and traces["processors"][-1] == "batch"
    # every component a pipeline names is defined, and every one defined is used
    for kind in ("receivers", "processors", "exporters"):
        used = {name for pipeline in pipelines.values() for name in pipeline.get(kind, [])}
        assert used == set(config[kind]), kind
    assert {"file", *[e for e in exporters if e.startswith("otlp")]} <= set(traces["exporters"])


def test_the_docs_point_tracer_at_that_collector() -> None:
    port = str(_collector_config()["receivers"]["otlp"]["protocols"]["http"]["endpoint"])
    port = port.rsplit(":", 1)[1]
    lines = [
        argv(line) for block in fenced_blocks(OTEL_MD.read_text()) for line in command_lines(block)
    ]
    proxies = [words for words in lines if words[1] == "proxy" and "--otlp" in words]
    assert proxies, "a tracer proxy --otlp command line"
    for words in proxies:
        args = _parser().parse_args(words[1:])
        assert traces_url(args.otlp).endswith(f":{port}/v1/traces"), args.otlp
    readme = (ROOT / "README.md").read_text()
    assert "(docs/otel.md)" in readme
