"""The addons (addons/trace.py, addons/faults.py) hook by hook, with mitmproxy's own test
helpers: flows made in this process, a capture on disk."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mitmproxy import connection, http

from tests.support.procs import load_addon
from tracer.capture.files import read_records

with warnings.catch_warnings():  # mitmproxy.master imports ldap3, which warns on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from mitmproxy.test import taddons, tflow, tutils

trace = load_addon("trace")
faults = load_addon("faults")


@contextlib.contextmanager
def addon_ctx(tmp_path: Path, **options: Any) -> Iterator[tuple[Any, Path]]:
    """The addon with a capture, its engine in this process (``tracer_sidecar=False``)
    unless the test asks for the capture process."""
    addon = trace.TraceAddon()
    path = tmp_path / f"cap-{time.monotonic_ns()}.jsonl"
    options.setdefault("tracer_sidecar", False)
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tracer_capture=str(path), **options)
        try:
            yield addon, path
        finally:
            addon.done()


def records(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return [r for r in read_records(path) if kind is None or r["type"] == kind]


# one SSE event of 64 KiB: a piece big enough to be handed on at once
BIG_EVENT = b'data: {"choices":[{"delta":{"content":"' + b"x" * 65500 + b'"}}]}\n\n'


SSE_CHUNKS = [
    b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"tok0 "}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"tok1 "}}]}\n\n',
    b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\n',
    b"data: [DONE]\n\n",
]


def a_flow(client: connection.Client | None = None, **req: Any) -> http.HTTPFlow:
    now = time.time()
    body = b'{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"x"}]}'
    headers = http.Headers(
        (
            (b"Host", b"up"),
            (b"Authorization", b"Bearer sk-secret"),
            (b"content-type", b"application/json"),
            (b"x-request-id", b"rid-1"),
            (b"content-length", str(len(body)).encode()),
        )
    )
    request = tutils.treq(
        method=b"POST",
        path=b"/v1/chat/completions",
        headers=headers,
        content=body,
        timestamp_start=now,
        timestamp_end=now,
        **req,
    )
    flow = tflow.tflow(client_conn=client, req=request)
    flow.client_conn.timestamp_start = now
    return flow


def sse_response() -> http.Response:
    now = time.time()
    return tutils.tresp(
        headers=http.Headers(
            ((b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked"))
        ),
        content=None,
        timestamp_start=now,
        timestamp_end=None,
    )


def start(addon: Any, flow: http.HTTPFlow) -> None:
    addon.client_connected(flow.client_conn)
    addon.requestheaders(flow)
    addon.request(flow)


def streaming_sse(addon: Any) -> tuple[http.HTTPFlow, Callable[[bytes], Any], Any]:
    """A request answered by an SSE head: the flow, its stream callable, the addon's state."""
    flow = a_flow()
    start(addon, flow)
    flow.response = sse_response()
    addon.responseheaders(flow)
    return flow, flow.response.stream, addon._flows[flow.id]


def fault_flow(client: Any, method: str = "POST", path: str = "/v1/chat/completions") -> Any:
    """A flow on ``client`` (a connection of mitmproxy's test helpers) for the faults addon."""
    flow = tflow.tflow(client_conn=client)
    flow.request.method = method
    flow.request.path = path
    return flow
