"""The mitmproxy addon (addons/trace.py): hook by hook, and in parity with the native tap.

The parity test drives one scenario — a multi-round openai-SDK harness on keep-alive
connections, a stall, a truncation and a client abort — through the native tap and
through ``mitmdump -s addons/trace.py --mode reverse:...`` (a real process), and asserts
that ``tracer analyze --format json`` gives the same per-request table once timing
fields (and the two things mitmproxy cannot show: FIN vs reset, its own error wording)
are dropped.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import httpx
import pytest
from mitmproxy import connection, exceptions, http
from mitmproxy.flow import Error
from mitmproxy.io import FlowReader
from mitmproxy.net.http.http1 import connection_close

from tracer import events as ev
from tracer.capture.files import read_events, read_records
from tracer.faults.plan import parse_fault
from tracer.observe import flows as mitm
from tracer.observe.flows import ContentShape, SseObserver, _client_closes
from tracer.protocol.sse import SseSplitter, classify
from tracer.sim.harness import HarnessConfig, run_harness

from .conftest import analyze_json, recv_all, recv_until, running_tap, wait_closed, wait_until
from .test_sim_engine import chat_request, engine_running

with warnings.catch_warnings():  # mitmproxy.master imports ldap3, which warns on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from mitmproxy.test import taddons, tflow, tutils

REPO = Path(__file__).resolve().parent.parent
ADDON = REPO / "addons" / "trace.py"
MITMDUMP = Path(sys.executable).parent / "mitmdump"


def _load_addon() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tracer_addon_trace", ADDON)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


trace = _load_addon()


# ---- hook by hook, no I/O (mitmproxy's own test helpers) ----------------------------------


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


def _chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
    """A chat.completion.chunk event as SGLang writes it (one per HTTP chunk)."""
    body: dict[str, Any] = {
        "id": "chatcmpl-7f3a",
        "object": "chat.completion.chunk",
        "created": 1796000000,
        "model": "sim-model",
        "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}],
        "usage": None,
    }
    body.update(extra)
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _corpus(rng: random.Random) -> list[bytes]:
    """Events of every shape the classifier knows, content chunks most of all."""
    texts = [
        "tok",
        "a b",
        'say \\"hi\\"',
        '"content":"x',
        "\u00e9t\u00e9",
        "data: ",
        "}",
        "x" * 300,
    ]
    out = [_chunk({"role": "assistant", "content": ""})]
    for _ in range(rng.randrange(20, 60)):
        r = rng.random()
        if r < 0.7:
            out.append(_chunk({"role": None, "content": rng.choice(texts), "tool_calls": None}))
        elif r < 0.75:
            out.append(_chunk({"reasoning_content": "think", "content": None}))
        elif r < 0.78:
            out.append(_chunk({"content": "", "tool_calls": [{"id": "t", "function": {}}]}))
        elif r < 0.8:
            out.append(b": keepalive\n\n")
        elif r < 0.82:  # the same content chunk, spelled with spaces
            out.append(
                b'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": null}]}\n\n'
            )
        elif r < 0.84:
            out.append(_chunk({"content": "late"}, "stop"))
        elif r < 0.86:
            out.append(b'data: {"choices":[{"delta":{"content":"x"},"finish_reason": "stop"}]}\n\n')
        elif r < 0.88:
            out.append(_chunk({"content": "u"}, None, usage={"total_tokens": 2}))
        elif r < 0.9:
            out.append(b'data:{"choices":[{"delta":{"content":"no space"}}]}\r\n\r\n')
        elif r < 0.92:
            out.append(b'data: {"choices":[{"delta":\ndata: {"content":"two lines"}}]}\n\n')
        elif r < 0.94:
            out.append(b'data: {"error":{"message":"boom","code":500}}\n\n')
        elif r < 0.96:
            out.append(
                b'data: {"choices":[{"delta":{"content":"y"}}],"usage":{"total_tokens":3}}\n\n'
            )
        elif r < 0.98:  # not JSON: raw quotes, CR or LF inside the text of a usual chunk
            usual = _chunk({"role": None, "content": "@", "tool_calls": None})
            raw = rng.choice(
                [b'x","finish_reason":"stop', b'x","usage":{"n":1},"y":"', b"a\rb", b"a\nb"]
            )
            out.append(usual.replace(b"@", raw))
        else:
            out.append(b"data: not json\n\n")
    out.append(_chunk({"content": ""}, "length"))
    body = json.loads(_chunk(None)[6:])
    body["usage"] = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    out.append(b"data: " + json.dumps(body).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return [e for e in out if e]


def _pieces(events: list[bytes], rng: random.Random) -> list[bytes]:
    """Mostly an event a piece; sometimes two in one, or one cut anywhere."""
    stream = b"".join(events)
    cuts, at = [], 0
    for e in events:
        at += len(e)
        r = rng.random()
        if r < 0.1 and len(e) > 2:
            cuts.append(at - rng.randrange(1, len(e)))
        if r < 0.9:
            cuts.append(at)
    cuts = sorted({*cuts, len(stream)})
    return [stream[a:b] for a, b in zip([0, *cuts[:-1]], cuts, strict=True) if b > a]


def _described(found: list[Any]) -> list[tuple[Any, ...]]:
    return [(e.size, e.kind, e.content, e.finish_reason, e.usage, e.error) for e in found]


@pytest.mark.parametrize("seed", range(40))
def test_the_sse_shortcut_gives_what_the_splitter_gives(seed: int) -> None:
    """Pieces in batches of any size: a piece the batch takes for a plain content chunk
    is one to the splitter; for the others it gives what the splitter says."""
    rng = random.Random(seed)
    shape = ContentShape()  # one per connection: it outlives a response
    for _ in range(3):
        observer = SseObserver(shape)
        pieces = _pieces(_corpus(rng), rng)
        reference = SseSplitter()
        expected, pending = [], []
        for piece in pieces:
            expected.append(_described(reference.feed(piece)))
            pending.append(reference.pending)
        at = 0
        while at < len(pieces):
            batch = pieces[at : at + rng.choice([1, 2, 3, 5, 8, 20, 60])]
            specials = dict(observer.batch(batch))
            for i, piece in enumerate(batch):
                if i in specials:
                    assert _described(specials[i]) == expected[at + i], piece
                else:
                    plain = [(len(piece), "content", True, None, None, None)]
                    assert expected[at + i] == plain, piece
            at += len(batch)
            assert observer.splitter.pending == pending[at - 1]
    assert shape.prefix  # the shortcut was taken


@pytest.mark.parametrize("seed", range(20))
def test_a_run_of_pieces_fits_when_each_piece_does(seed: int) -> None:
    """``ContentShape.all_fit`` (counts over the joined run) against ``fits`` piece by
    piece, on runs of usual chunks with one spoiled now and then."""
    rng = random.Random(seed)
    shape = ContentShape()
    learned = _chunk({"role": None, "content": "x", "tool_calls": None})
    shape.learn(learned, classify(learned[:-2]))
    assert shape.prefix_len
    spoilers = [b'"', b"\r", b"\n", b'","finish_reason":"stop', b"\n\ndata: {", b"\\"]
    for _ in range(200):
        run = []
        for _ in range(rng.randrange(1, 12)):
            text = rng.choice(["t", "a b", "\u00e9", "x" * 50, ""]).encode()
            piece = _chunk({"role": None, "content": "@", "tool_calls": None})
            r = rng.random()
            if r < 0.05:
                text += rng.choice(spoilers)
            elif r < 0.07:
                piece = piece[1:]
            elif r < 0.09:
                piece = piece[:-1]
            elif r < 0.1:
                piece = _chunk({"content": "y"}, "stop")
            run.append(piece.replace(b"@", text))
        assert shape.all_fit(run) == all(shape.fits(p) for p in run), run


@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0", "HTTP/2.0"])
@pytest.mark.parametrize(
    "values",
    [[], [b"close"], [b"keep-alive"], [b"Keep-Alive, Upgrade"], [b"upgrade", b" close "], [b"x"]],
)
def test_who_closes_is_what_mitmproxy_decides(version: str, values: list[bytes]) -> None:
    headers = http.Headers([(b"Connection", v) for v in values])
    expected = connection_close(version, headers)
    assert _client_closes(version, values) is expected


def test_options_are_validated(tmp_path: Path) -> None:
    addon = trace.TraceAddon()
    with taddons.context(addon) as tctx:
        for bad in ("0", "-1", "soon", "nan"):
            with pytest.raises(exceptions.OptionsError, match="tracer_stall_after"):
                tctx.configure(addon, tracer_stall_after=bad)
        with pytest.raises(exceptions.OptionsError):
            tctx.configure(addon, tracer_bodies="some")
        with pytest.raises(exceptions.OptionsError, match="tracer_tap"):
            tctx.configure(addon, tracer_tap=" ")
        for bad in ("-1", "lots"):
            with pytest.raises(exceptions.OptionsError, match="tracer_body_memory"):
                tctx.configure(addon, tracer_body_memory=bad)
        tctx.configure(addon, tracer_body_memory="0.5")
        assert addon.body_memory == 512 * 1024
        with pytest.raises(exceptions.OptionsError, match="cannot open"):
            tctx.configure(addon, tracer_capture=str(tmp_path / "no" / "such" / "dir.jsonl"))
        tctx.configure(addon, tracer_stall_after="0.25", tracer_bodies="all", tracer_tap="edge")
        assert (addon.stall_after, addon.bodies, addon.tap) == (0.25, "all", "edge")
        # tracing is off without a capture: hooks do nothing, nothing is streamed
        flow = a_flow()
        start(addon, flow)
        flow.response = sse_response()
        addon.responseheaders(flow)
        assert flow.response.stream is False


def test_sse_is_streamed_observed_unchanged_and_recorded(tmp_path: Path) -> None:
    with addon_ctx(tmp_path, tracer_tap="m1") as (addon, path):
        flow = a_flow()
        start(addon, flow)
        flow.response = sse_response()
        addon.responseheaders(flow)
        stream = flow.response.stream
        assert callable(stream)  # mitmproxy #4469: SSE must not be buffered
        for chunk in SSE_CHUNKS:
            assert stream(chunk) == chunk
        assert stream(b"") == b""
        addon.response(flow)
        # a plain response is left as mitmproxy has it (buffered), and recorded at its end
        plain = a_flow(client=flow.client_conn)
        addon.requestheaders(plain)
        addon.request(plain)
        plain.response = tutils.tresp(timestamp_start=time.time(), timestamp_end=time.time())
        addon.responseheaders(plain)
        assert plain.response.stream is False
        addon.response(plain)
        addon.client_disconnected(flow.client_conn)
    recs = records(path)
    assert recs[0]["type"] == "capture_start" and recs[0]["kind"] == "mitmproxy"
    assert recs[0]["tap"] == "m1" and recs[-1]["type"] == "capture_end"
    head = records(path, "request")[0]
    assert ["Authorization", "Bearer [redacted]"] in head["headers"]
    assert head["request_id"] == "rid-1" and head["seq"] == 1
    end = records(path, "request_end")[0]  # the body kept: its hash and fields left to readers
    assert end["body_kept"] and "body_sha256" not in end and "model" not in end
    read = next(e for e in read_events(path) if isinstance(e, ev.RequestEnd))
    assert read.model == "m" and read.max_tokens == 4
    assert read.body_sha256 == hashlib.sha256(end["body"].encode()).hexdigest()
    body = records(path, "body")[0]
    assert [e[2] for e in body["sse"]] == ["role", "content", "content", "finish", "done"]
    assert len(body["reads"]) == 5 and body["chunks"] == 0
    first, second = records(path, "response_end")
    assert first["termination"] == "complete" and first["events"] == 5 and first["done"]
    assert first["finish_reason"] == "length" and first["body_bytes"] == sum(map(len, SSE_CHUNKS))
    assert second["seq"] == 2 and second["body_bytes"] == len(b"message")
    close = records(path, "conn_close")[0]
    assert close["requests"] == 2 and close["closed_by"] == "client"
    assert close["how"] == "unknown"  # mitmproxy does not tell FIN from reset


def test_a_stream_set_by_another_addon_is_chained(tmp_path: Path) -> None:
    seen: list[bytes] = []

    def other(data: bytes) -> bytes:
        seen.append(data)
        return data.upper()

    with addon_ctx(tmp_path) as (addon, path):
        flow = a_flow()
        start(addon, flow)
        flow.response = sse_response()
        flow.response.stream = other
        addon.responseheaders(flow)
        stream = flow.response.stream
        assert stream is not other and callable(stream)
        assert stream(SSE_CHUNKS[1]) == SSE_CHUNKS[1].upper()
        assert seen == [SSE_CHUNKS[1]]
        # non-SSE bodies another addon streams (stream = True) are observed too
        plain = a_flow(client=flow.client_conn)
        addon.requestheaders(plain)
        addon.request(plain)
        plain.response = tutils.tresp(timestamp_start=time.time())
        plain.response.stream = True
        addon.responseheaders(plain)
        assert callable(plain.response.stream)
        assert plain.response.stream(b"abc") == b"abc"
    assert sum(r["size"] for r in records(path, "body")) == len(SSE_CHUNKS[1]) + 3


@pytest.mark.parametrize("bodies", ["none", "requests"])
@pytest.mark.parametrize("keep", [1 << 20, 40])  # kept whole; over the bound after a piece
def test_a_streamed_request_body_is_kept_or_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bodies: str, keep: int
) -> None:
    """A kept body goes into the record and its hash and fields are left to the reader; one
    not kept is hashed as it goes by, the pieces before the bound included."""
    monkeypatch.setattr(mitm, "MAX_BODY_KEEP", keep)
    with addon_ctx(tmp_path, tracer_bodies=bodies) as (addon, path):
        flow = a_flow()
        body = flow.request.raw_content or b""
        flow.request.stream = True  # another addon streams the request body
        addon.client_connected(flow.client_conn)
        addon.requestheaders(flow)
        observe = flow.request.stream
        assert callable(observe)
        for piece in (body[:30], body[30:60], body[60:]):
            assert observe(piece) == piece
        addon.request(flow)
    rec = records(path, "request_end")[0]
    kept = bodies == "requests" and keep > len(body)
    assert ("body" in rec) == kept and ("body_sha256" in rec) == (not kept)
    read = next(e for e in read_events(path) if isinstance(e, ev.RequestEnd))
    assert read.body_bytes == len(body) and read.body_kept == kept
    assert read.body_sha256 == hashlib.sha256(body).hexdigest()
    assert read.model == ("m" if keep > len(body) else None)  # never from a partial body


def test_an_agents_next_turn_is_written_as_its_shared_prefix_and_the_rest(
    tmp_path: Path,
) -> None:
    """Two turns of one conversation on one connection: the second record names the first
    and carries only its new tail (capture version 3); a reader gets both bodies whole."""
    history = b'{"model":"m","stream":true,"messages":[' + b'{"role":"user","content":"x"},' * 400
    turns = [history + b'{"role":"user","content":"turn %d"}]}' % k for k in (1, 2)]
    with addon_ctx(tmp_path) as (addon, path):
        client = None
        for body in turns:
            flow = a_flow(client)
            client = flow.client_conn
            flow.request.content = body
            start(addon, flow)
    recs = records(path, "request_end")
    shared = len(history) + len(b'{"role":"user","content":"turn ')
    assert "body_base" not in recs[0] and recs[1]["body_base"] == [1, 1, shared]
    assert len(recs[1]["body"]) < 20
    read = [e for e in read_events(path) if isinstance(e, ev.RequestEnd)]
    assert [e.body.encode() if e.body else b"" for e in read] == turns
    assert [e.messages for e in read] == [401, 401]


def test_the_observers_are_let_go_when_the_exchange_ends(tmp_path: Path) -> None:
    """The flow gets back the stream attributes it had, and keeps nothing of the addon's."""

    def other(data: bytes) -> bytes:
        return data

    with addon_ctx(tmp_path) as (addon, path):
        flow = a_flow()
        flow.request.stream = other
        start(addon, flow)
        assert flow.request.stream is not other
        flow.response = sse_response()
        flow.response.stream = True
        addon.responseheaders(flow)
        stream = flow.response.stream
        assert callable(stream) and stream(SSE_CHUNKS[1]) == SSE_CHUNKS[1]
        stream(b"")
        addon.response(flow)
        assert flow.request.stream is other and flow.response.stream is True
        assert flow.id not in addon._flows and not addon._clients[flow.client_conn.id].flows
        assert not addon.engine._conns[flow.client_conn.id].pending
    assert [r["termination"] for r in records(path, "response_end")] == ["complete"]


@pytest.mark.parametrize(
    ("message", "termination"),
    [
        ("Client disconnected.", "client_abort"),
        (
            "HTTP/1 protocol error: peer closed connection without sending complete message "
            "body (incomplete chunked read)",
            "truncated",
        ),
        ("HTTP/1 protocol error: illegal chunk header: b'ZZZ\\r\\n'", "unparsed"),
        (Error.KILLED_MESSAGE, "in_flight"),
    ],
)
def test_errors_become_terminations(tmp_path: Path, message: str, termination: str) -> None:
    with addon_ctx(tmp_path) as (addon, path):
        flow = a_flow()
        start(addon, flow)
        flow.response = sse_response()
        addon.responseheaders(flow)
        flow.response.stream(SSE_CHUNKS[0] + SSE_CHUNKS[1][:10])  # cut inside an event
        flow.error = Error(message)
        addon.error(flow)
        addon.client_disconnected(flow.client_conn)
    end = records(path, "response_end")[0]
    assert end["termination"] == termination and end["status"] == 200
    assert end["events"] == 1 and end["mid_event"] is True and message in end["detail"]
    assert bool(records(path, "anomaly")) == (termination == "unparsed")
    close = records(path, "conn_close")[0]
    expected = {"client_abort": "client", "truncated": "upstream", "unparsed": "upstream"}
    assert close["closed_by"] == expected.get(termination, "tracer")
    assert close["in_flight"] is True


def test_a_connection_close_response_ends_the_connection_by_the_upstream(
    tmp_path: Path,
) -> None:
    with addon_ctx(tmp_path) as (addon, path):
        flow = a_flow()
        start(addon, flow)
        flow.response = tutils.tresp(timestamp_start=time.time(), timestamp_end=time.time())
        flow.response.headers["connection"] = "close"
        addon.responseheaders(flow)
        addon.response(flow)
        addon.client_disconnected(flow.client_conn)
    assert records(path, "response")[0]["keep_alive"] is False
    close = records(path, "conn_close")[0]
    assert (close["closed_by"], close["in_flight"]) == ("upstream", False)


def test_unreachable_upstream_is_mitmproxys_own_502(tmp_path: Path) -> None:
    with addon_ctx(tmp_path) as (addon, path):
        flow = a_flow()
        flow.server_conn.peername = None
        flow.server_conn.error = "Connect call failed ('127.0.0.1', 9)"
        addon.client_connected(flow.client_conn)
        addon.requestheaders(flow)
        addon.request(flow)
        flow.error = Error(flow.server_conn.error)
        addon.error(flow)
        addon.client_disconnected(flow.client_conn)
    head = records(path, "response")[0]
    assert head["status"] == 502 and head["by_tracer"] is True
    end = records(path, "response_end")[0]
    assert end["termination"] == "tracer_response" and end["status"] == 502
    (close,) = records(path, "conn_close")
    assert close["closed_by"] == "tracer" and close["in_flight"] is False  # 502 answered it


def test_stalls_start_on_tick_and_end_with_the_next_bytes(tmp_path: Path) -> None:
    with addon_ctx(tmp_path, tracer_stall_after="0.5") as (addon, path):
        flow = a_flow()
        start(addon, flow)
        flow.response = sse_response()
        addon.responseheaders(flow)
        flow.response.stream(SSE_CHUNKS[0])
        now = time.monotonic()
        addon.tick(now + 0.2)  # flushes the body batch, no stall yet
        assert len(records_now(addon, path, "body")) == 1
        addon.tick(now + 0.6)
        addon.tick(now + 0.9)  # one start per stall
        flow.response.stream(SSE_CHUNKS[1])
        flow.response.stream(b"")
        addon.response(flow)
        # a request whose body never completes: the client is silent
        slow = a_flow(client=flow.client_conn)
        addon.requestheaders(slow)
        addon.tick(time.monotonic() + 1.0)
    stalls = records(path, "stall")
    assert [(s["phase"], s["direction"], s["seq"]) for s in stalls] == [
        ("start", "upstream_silent", 1),
        ("end", "upstream_silent", 1),
        ("start", "client_silent", 2),
        ("end", "client_silent", 2),  # settled at shutdown, with the request in flight
    ]
    assert stalls[0]["silent_for"] >= 0.5
    ends = records(path, "response_end")
    assert [e["termination"] for e in ends] == ["complete", "in_flight"]
    close = records(path, "conn_close")[0]  # mitmproxy stopped with a request in flight
    assert (close["closed_by"], close["how"], close["in_flight"]) == ("tracer", "tracer", True)
    assert records(path)[-1]["type"] == "capture_end"


def streaming_sse(addon: Any) -> tuple[http.HTTPFlow, Callable[[bytes], Any], Any]:
    """A request answered by an SSE head: the flow, its stream callable, the addon's state."""
    flow = a_flow()
    start(addon, flow)
    flow.response = sse_response()
    addon.responseheaders(flow)
    return flow, flow.response.stream, addon._flows[flow.id]


@pytest.mark.anyio
async def test_pieces_reach_the_engine_after_they_went_on(tmp_path: Path) -> None:
    """In mitmproxy's loop a piece goes on at once; the engine gets it with the next
    ship (``SHIP_INTERVAL``), or in the loop's next round once a flow holds a batch's
    worth; the engine's body records are batched as the tap's."""
    with addon_ctx(tmp_path) as (addon, path):
        flow, stream, state = streaming_sse(addon)
        engine_flow = addon.engine._flows[flow.id]
        assert stream(SSE_CHUNKS[1]) == SSE_CHUNKS[1]
        assert state.pieces == [SSE_CHUNKS[1]] and not engine_flow.times  # not yet
        await wait_until_async(lambda: not state.pieces, 5)  # the ship, 5 ms later
        assert len(engine_flow.times) == 1
        full = trace.BODY_BATCH_READS
        for _ in range(full):
            assert stream(SSE_CHUNKS[2]) == SSE_CHUNKS[2]
        assert len(state.pieces) == full  # handed on in the loop's next round, not here
        await anyio.lowlevel.checkpoint()
        assert not state.pieces and len(engine_flow.times) == 1  # the first batch written
        stream(SSE_CHUNKS[4])
        stream(b"")
        addon.response(flow)
    bodies = records(path, "body")
    assert [len(b["reads"]) for b in bodies] == [full, 2]
    assert bodies[1]["sse"][0][1:] == [len(SSE_CHUNKS[2]), "content"]
    end = records(path, "response_end")[0]
    assert (end["events"], end["done"], end["body_bytes"]) == (
        full + 2,
        True,
        len(SSE_CHUNKS[1]) + full * len(SSE_CHUNKS[2]) + len(SSE_CHUNKS[4]),
    )


async def wait_until_async(check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await anyio.sleep(0.001)


def test_pieces_reach_the_engine_at_once_when_there_is_no_loop(tmp_path: Path) -> None:
    """The stream callable must never raise: with no loop to ship in, the pieces are
    handed on at once and still go on."""
    with addon_ctx(tmp_path) as (addon, path):
        flow, stream, state = streaming_sse(addon)
        for _ in range(trace.BODY_BATCH_READS):
            assert stream(SSE_CHUNKS[1]) == SSE_CHUNKS[1]
        assert stream(SSE_CHUNKS[2]) == SSE_CHUNKS[2]
        assert not state.pieces and addon.engine._flows[flow.id].times  # the engine has them
        stream(b"")
        addon.response(flow)
    assert [len(b["reads"]) for b in records(path, "body")] == [trace.BODY_BATCH_READS, 1]


@pytest.mark.anyio
async def test_big_pieces_are_kept_for_a_round_of_the_loop_at_most(tmp_path: Path) -> None:
    """SSE pieces are kept until they are handed on, and the engine keeps them until their
    batch is written: big ones (an event of 64 KiB) must pile up in neither."""
    event = BIG_EVENT
    per_batch = trace.MAX_KEPT_BYTES // len(event)
    with addon_ctx(tmp_path) as (addon, path):
        flow, stream, state = streaming_sse(addon)
        engine_flow = addon.engine._flows[flow.id]
        for _ in range(2 * per_batch + 4):
            stream(event)
            assert len(state.pieces) == 1  # handed on in the loop's next round
            await anyio.lowlevel.checkpoint()
            assert not state.pieces
            assert engine_flow.kept <= trace.MAX_KEPT_BYTES
        stream(b"")
        addon.response(flow)
    bodies = records(path, "body")
    assert [len(b["reads"]) for b in bodies] == [per_batch, per_batch, 4]
    assert records(path, "response_end")[0]["events"] == 2 * per_batch + 4


def _scripted(addon: Any) -> None:
    """One connection: an SSE exchange, a silent one that stalls, then the client goes."""
    flow, stream, _ = streaming_sse(addon)
    for chunk in SSE_CHUNKS:
        stream(chunk)
    stream(b"")
    addon.response(flow)
    slow = a_flow(client=flow.client_conn)
    start(addon, slow)
    slow.response = sse_response()
    addon.responseheaders(slow)
    slow.response.stream(SSE_CHUNKS[0])
    addon.tick(time.monotonic() + 1.0)
    addon.client_disconnected(flow.client_conn)


def _untimed_records(path: Path) -> list[Any]:
    """The records but their times, at any depth (and the header, which names the mode)."""

    def untimed(value: Any) -> Any:
        if isinstance(value, float):
            return "time"
        if isinstance(value, list):
            return [untimed(v) for v in value]
        if isinstance(value, dict):
            return {k: untimed(v) for k, v in value.items()}
        return value

    return [untimed(r) for r in read_records(path) if r["type"] != "capture_start"]


def test_the_capture_process_writes_what_the_engine_in_process_writes(tmp_path: Path) -> None:
    with addon_ctx(tmp_path, tracer_stall_after="0.5") as (addon, inline):
        assert addon.engine is not None and addon.process is None
        _scripted(addon)
    with addon_ctx(tmp_path, tracer_stall_after="0.5", tracer_sidecar=True) as (addon, apart):
        assert addon.engine is None and addon.process is not None
        _scripted(addon)
    assert addon.process is None  # done() waited for it
    assert _untimed_records(apart) == _untimed_records(inline)
    kinds = [r["type"] for r in _untimed_records(apart)]
    assert kinds.count("body") == 2 and kinds.count("stall") == 2 and kinds[-1] == "capture_end"
    assert next(read_records(apart))["options"]["capture_process"] is True


def test_a_capture_file_changed_while_mitmproxy_runs(tmp_path: Path) -> None:
    """``tracer_capture`` set anew (mitmproxy's ``set`` command): the first capture ends
    with what was open settled, its process finishing beside the loop; the next capture
    gets what comes after."""
    addon = trace.TraceAddon()
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tracer_capture=str(first))
        one = a_flow()
        start(addon, one)
        tctx.configure(addon, tracer_capture=str(second))
        assert len(addon._closing) == 1
        two = a_flow()
        start(addon, two)
        addon.done()
        assert not addon._closing
    kinds = [r["type"] for r in records(first)]
    assert kinds == [
        "capture_start",
        "conn_open",
        "request",
        "request_end",
        "response_end",
        "conn_close",
        "capture_end",
    ]
    assert records(first, "capture_end")[0]["reason"] == "capture file changed"
    assert records(first, "response_end")[0]["termination"] == "in_flight"
    assert [r["type"] for r in records(second)] == kinds  # the second request only
    assert records(second, "capture_end")[0]["reason"] == "mitmproxy stopped"


def test_a_capture_process_that_falls_behind_costs_facts_not_traffic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipe is never waited for: with the capture process stopped, the pieces still go
    on at once, the backlog stays under its bound, and what did not fit is counted in a
    ``capture_loss`` record once the process reads again."""
    monkeypatch.setattr(trace, "MAX_BACKLOG", 256 << 10)
    event = BIG_EVENT
    with addon_ctx(tmp_path, tracer_sidecar=True) as (addon, path):
        process = addon.process
        flow, stream, _ = streaming_sse(addon)
        os.kill(process.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(40):  # 2.6 MB: more than the pipe (at most 1 MiB) and the bound
                assert stream(event) == event
            assert process.lost_facts > 0 and len(process.backlog) <= trace.MAX_BACKLOG
        finally:
            os.kill(process.proc.pid, signal.SIGCONT)
        stream(SSE_CHUNKS[4])
        stream(b"")
        addon.response(flow)
    (loss,) = records(path, "capture_loss")
    assert loss["dropped"] > 0 and "fell behind" in loss["reason"]
    end = records(path, "response_end")[0]
    assert end["termination"] == "complete" and end["done"] is True
    assert records(path)[-1]["type"] == "capture_end"


@pytest.mark.anyio
async def test_a_full_pipe_is_written_when_the_loop_says_it_drained(tmp_path: Path) -> None:
    """In mitmproxy's loop: with the capture process stopped the pipe fills, the rest
    waits in the backlog, and the loop's writer callback writes it once the process reads
    again. Nothing is lost under the bound."""
    event = BIG_EVENT
    with addon_ctx(tmp_path, tracer_sidecar=True) as (addon, path):
        process = addon.process
        flow, stream, _ = streaming_sse(addon)
        os.kill(process.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(48):  # 3.1 MB: three times the pipe
                assert stream(event) == event
                await anyio.lowlevel.checkpoint()  # the ship of a big piece
            assert process.backlog and process._waiting and not process.lost_facts
        finally:
            os.kill(process.proc.pid, signal.SIGCONT)
        await wait_until_async(lambda: not process.backlog, 10)
        assert not process._waiting
        stream(SSE_CHUNKS[4])
        stream(b"")
        addon.response(flow)
    assert not records(path, "capture_loss")
    end = records(path, "response_end")[0]
    assert end["events"] == 49 and end["done"] is True and end["termination"] == "complete"


def test_a_fact_that_cannot_be_sent_is_counted_and_the_rest_go(tmp_path: Path) -> None:
    """A value ``marshal`` refuses (not one mitmproxy gives today) costs that fact only."""
    with addon_ctx(tmp_path, tracer_sidecar=True) as (addon, path):
        flow = a_flow()
        flow.client_conn.peername = ("127.0.0.1", object())  # type: ignore[assignment]
        addon.client_connected(flow.client_conn)
        addon.requestheaders(flow)
        addon.request(flow)
        assert addon.process.lost_facts == 0  # reported with the next batch
        addon.record_fault_plan(["drop-request"], "replace")
    (loss,) = records(path, "capture_loss")
    assert loss["dropped"] == 1
    assert [r["type"] for r in records(path)][1:] == [
        "capture_loss",
        "conn_open",  # made up from the request's fact: its connection's was the one lost
        "request",
        "request_end",
        "fault_plan",
        "response_end",
        "conn_close",
        "capture_end",
    ]


def test_a_capture_process_that_dies_stops_tracing_not_traffic(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with addon_ctx(tmp_path, tracer_sidecar=True) as (addon, path):
        process = addon.process
        flow, stream, _ = streaming_sse(addon)
        process.proc.kill()
        process.proc.wait(5)
        for chunk in SSE_CHUNKS:
            assert stream(chunk) == chunk
        stream(b"")
        addon.response(flow)
        assert process.gone
    assert "the capture process is gone" in caplog.text
    assert "capture_end" not in [r["type"] for r in records(path)]  # it was killed


PINNED_PARENT = """\
import importlib.util, os, sys, time
os.sched_setaffinity(0, {{{core}}})
spec = importlib.util.spec_from_file_location("addon", {addon!r})
addon = importlib.util.module_from_spec(spec)
spec.loader.exec_module(addon)
header = dict(t=time.time(), m=time.monotonic(), tracer_version="0", kind="mitmproxy",
              listen="-", upstream=None, boot_id=None, options={{}})
process = addon._CaptureProcess({path!r}, addon.Settings(), header)
print(process.proc.pid, flush=True)
sys.stdin.readline()
process.close([("close", time.monotonic(), "test over")], wait=True)
"""


def _allowed_cores(pid: int) -> set[int]:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
    cores: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def test_the_capture_process_keeps_off_the_cores_mitmproxy_is_pinned_to(tmp_path: Path) -> None:
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip("one core: nowhere else to go")
    core = min(cores)
    capture = tmp_path / "pinned.jsonl"
    script = PINNED_PARENT.format(core=core, addon=str(ADDON), path=str(capture))
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO
    )
    try:
        assert parent.stdout is not None and parent.stdin is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while core in _allowed_cores(child):
            assert time.monotonic() < deadline, _allowed_cores(child)
            time.sleep(0.01)
        assert _allowed_cores(child) and core not in _allowed_cores(child)
        parent.stdin.write(b"\n")
        parent.stdin.close()
        assert parent.wait(20) == 0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)
        for pipe in (parent.stdin, parent.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
    assert [r["type"] for r in records(capture)] == ["capture_start", "capture_end"]


def records_now(addon: Any, path: Path, kind: str) -> list[dict[str, Any]]:
    """Records on disk so far (waits for the writer's background flush)."""
    deadline = time.monotonic() + 5
    while True:
        found = records(path, kind)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


# ---- parity with the native tap: real processes on 127.0.0.1 --------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def mitmdump(
    upstream: str | None, tmp_path: Path, *options: str, stop: int = signal.SIGTERM
) -> AsyncIterator[tuple[str, Path]]:
    """``mitmdump -s addons/trace.py --mode reverse:UPSTREAM`` (None: mitmproxy's regular
    mode, a forward proxy); yields its URL and capture, and ends it with ``stop``."""
    port = free_port()
    capture = tmp_path / "mitm.jsonl"
    log_path = tmp_path / "mitmdump.log"
    cmd = [
        str(MITMDUMP),
        "--set",
        "flow_detail=0",  # its log says when it listens; no line per flow
        "-s",
        "addons/trace.py",
        *(["--mode", f"reverse:{upstream}"] if upstream else []),
        "--listen-host",
        "127.0.0.1",
        "-p",
        str(port),
        "--set",
        f"confdir={tmp_path / 'mitmproxy'}",
        "--set",
        f"tracer_capture={capture}",
        *options,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        with anyio.fail_after(30):  # (a probe connection would be in the capture)
            while f"listening at 127.0.0.1:{port}" not in log_path.read_text(errors="replace"):
                assert proc.poll() is None, log_path.read_text()
                await anyio.sleep(0.05)
        yield f"http://127.0.0.1:{port}", capture
        proc.send_signal(stop)
        with anyio.fail_after(10):
            while proc.poll() is None:
                await anyio.sleep(0.02)
        assert proc.returncode == (0 if stop == signal.SIGTERM else -stop), log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def _count(path: Path, kind: str) -> int:
    try:
        return sum(1 for r in read_records(path) if r["type"] == kind)
    except (OSError, ValueError):
        return 0


CONNECTIONS = 5  # two harness sessions, one keep-alive client, a truncation, an abort


async def stream_chat(
    client: httpx.AsyncClient, body: dict[str, Any], rid: str, fault: str
) -> tuple[int, bytes]:
    """One streamed chat completion, with the simulated engine's fault switch; its status
    and body."""
    headers = {"x-request-id": rid, "x-sim-fault": fault}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        data = b"".join([chunk async for chunk in resp.aiter_bytes()])
    return resp.status_code, data


async def scenario(url: str, all_closed: Callable[[], Awaitable[None]]) -> None:
    """The same traffic for each tap; returns when the tap has seen every connection end."""
    report = await run_harness(
        HarnessConfig(base_url=url, sessions=2, rounds=3, think=0.05, max_tokens=6, deadline=10)
    )
    assert not report.failed and not report.not_run, report
    body = {
        "model": "sim-model",
        "max_tokens": 6,
        "stream": True,
        "messages": [{"role": "user", "content": "one connection, three requests"}],
    }
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        for rid, fault in (
            ("keep-1", "none"),
            ("keep-2", "stall:after=2:for=1.2"),
            ("keep-3", "none"),
        ):
            status, data = await stream_chat(client, body, rid, fault)
            assert status == 200 and data.endswith(b"data: [DONE]\n\n")
    port = int(url.rsplit(":", 1)[1])
    async with await anyio.connect_tcp("127.0.0.1", port) as s:  # the upstream cuts it
        await s.send(
            chat_request(6, headers={"x-request-id": "cut", "x-sim-fault": "close:after=2"})
        )
        data, _ = await recv_all(s, timeout=10)
    assert b"[DONE]" not in data and b"tok1" in data
    async with await anyio.connect_tcp("127.0.0.1", port) as s:  # the client gives up
        await s.send(chat_request(50, headers={"x-request-id": "abort", "x-sim-itl": "0.01"}))
        await recv_until(s, lambda b: b.count(b'"content":"tok') >= 2, timeout=10)
    await all_closed()


IDENTITY = {"id", "tap", "conn", "request_id"}
# counts that come from timing: how many gaps between events were under a threshold
TIMING_COUNTS = {"zero_gaps", "bunch_gaps"}
# what mitmproxy cannot show (FIN vs reset) and each tap's own wording of an end
NOT_COMPARABLE = {"close", "detail"}


def untimed(row: dict[str, Any]) -> dict[str, Any]:
    """A request row without timing (every float is a time or a duration), identities and
    tap-specific wording; stalls keep only their direction."""
    out = {
        k: v
        for k, v in row.items()
        if k not in IDENTITY | TIMING_COUNTS | NOT_COMPARABLE and not isinstance(v, float)
    }
    out["stalls"] = [s["direction"] for s in row["stalls"]]
    return out


def label(request_id: str) -> str:
    """``s1-r2-1a2b3c4d`` (the harness adds a random suffix) -> ``s1-r2``."""
    return request_id.rsplit("-", 1)[0] if request_id.startswith("s") else request_id


Tables = tuple[dict[str, Any], dict[tuple[str, ...], dict[str, Any]], list[tuple[Any, ...]]]


def tables(capture: Path) -> Tables:
    """Per-request rows by label, per-connection rows by the labels they carried, and the
    findings (kind, party, confidence, the labels they name), the verdict's first."""
    doc = analyze_json(capture)
    requests: dict[str, Any] = {}
    on_conn: dict[int, list[tuple[int, str]]] = defaultdict(list)
    labels: dict[str, str] = {}
    for row in doc["requests"]:
        key = label(row["request_id"])
        assert key not in requests
        requests[key] = untimed(row)
        on_conn[row["conn"]].append((row["seq"], key))
        labels[row["id"]] = key
    conns = {}
    for c in doc["connections"]:
        keys = tuple(k for _, k in sorted(on_conn[c["conn"]]))
        conns[keys] = {
            "requests": c["requests"],
            "closed_by": c["closed_by"],
            "in_flight_at_close": c["in_flight_at_close"],
        }
    findings = [
        (f["kind"], f["party"], f["confidence"], tuple(labels[i] for i in f["requests"]))
        for f in doc["findings"]
    ]
    return requests, conns, findings


@pytest.mark.anyio
async def test_parity_with_the_native_tap(tmp_path: Path) -> None:
    async with engine_running(ttft=0.01, itl=0.004) as engine:
        async with running_tap(engine.bound[1], tmp_path, name="native", stall_after=0.5) as tap:
            await scenario(tap.url, lambda: wait_closed(tap, CONNECTIONS, timeout=10))
        native_capture = tap.capture
        async with mitmdump(
            engine.url, tmp_path, "--set", "tracer_tap=mitm", "--set", "tracer_stall_after=0.5"
        ) as (url, mitm_capture):

            async def closed() -> None:
                await wait_until(lambda: _count(mitm_capture, "conn_close") >= CONNECTIONS, 10)

            await scenario(url, closed)
    native, native_conns, native_findings = tables(native_capture)
    mitm, mitm_conns, mitm_findings = tables(mitm_capture)
    assert mitm_findings == native_findings
    assert {f[0] for f in native_findings} >= {"upstream_silent", "stream_cut", "client_abort"}
    assert sorted(native) == sorted(mitm)
    for key in native:
        assert mitm[key] == native[key], key
    assert mitm_conns == native_conns
    # the scenario did what it says, in both
    assert [native[f"s1-r{n}"]["seq"] for n in (1, 2, 3)] == [1, 2, 3]
    assert native["keep-2"]["stalls"] == ["upstream_silent"] and native["keep-2"]["seq"] == 2
    assert native["keep-3"]["termination"] == "complete" and native["keep-3"]["seq"] == 3
    assert native["cut"]["termination"] == "truncated" and native["cut"]["events"] == 3
    assert native["abort"]["termination"] == "client_abort"
    assert all(r["done"] for k, r in native.items() if k not in ("cut", "abort"))
    header = next(read_records(mitm_capture))
    assert header["kind"] == "mitmproxy" and header["tap"] == "mitm"
    assert header["options"]["stall_after"] == 0.5
    assert _count(mitm_capture, "capture_end") == 1
    assert os.path.getsize(mitm_capture) > 0


@pytest.mark.anyio
async def test_a_killed_mitmdump_still_leaves_a_whole_capture(tmp_path: Path) -> None:
    """mitmproxy killed (SIGKILL: no ``done`` hook): its capture process reads the end
    of the pipe, ends what was open ``in_flight`` and writes ``capture_end``."""
    async with engine_running(ttft=0.01, itl=0.05) as engine:
        async with mitmdump(engine.url, tmp_path, stop=signal.SIGKILL) as (url, capture):
            client = await anyio.connect_tcp("127.0.0.1", int(url.rsplit(":", 1)[1]))
            await client.send(chat_request(200, headers={"x-request-id": "open"}))
            await recv_until(client, lambda b: b.count(b'"content":"tok') >= 2, timeout=10)
            await wait_until(lambda: _count(capture, "body") >= 1, 10)
        try:
            await wait_until(lambda: _count(capture, "capture_end") == 1, 10)
        finally:
            await client.aclose()
    (end,) = [r for r in read_records(capture) if r["type"] == "response_end"]
    assert end["termination"] == "in_flight" and end["events"] >= 2
    last = list(read_records(capture))[-1]
    assert last["type"] == "capture_end" and last["reason"] == "mitmproxy went away"


@pytest.mark.anyio
async def test_an_upstream_close_under_an_open_client_connection(tmp_path: Path) -> None:
    """mitmproxy keeps its own upstream connections: when the upstream closes an idle one
    (here a tap behind it with ``close-idle-after``) the client's stays open, and the
    next request gets a new upstream connection. The capture says so
    (``server_disconnected``: ``upstream_close``), and a client that closes its own
    connection gives no such record."""
    async with engine_running(ttft=0.005, itl=0.002) as engine:
        idle = [parse_fault("close-idle-after:0.5")]
        async with running_tap(engine.bound[1], tmp_path, name="back", faults=idle) as back:
            async with mitmdump(f"http://127.0.0.1:{back.port}", tmp_path) as (url, capture):
                port = int(url.rsplit(":", 1)[1])
                async with await anyio.connect_tcp("127.0.0.1", port) as s:
                    for n in (1, 2):
                        await s.send(chat_request(4, headers={"x-request-id": f"turn-{n}"}))
                        await recv_until(s, lambda b: b"data: [DONE]" in b, 10)
                        if n == 1:  # the back tap closes mitmproxy's idle upstream
                            await wait_until(lambda: _count(capture, "upstream_close") >= 1, 10)
                await wait_until(lambda: _count(capture, "conn_close") >= 1, 10)
    (closed,) = [r for r in read_records(capture) if r["type"] == "upstream_close"]
    assert closed["conn"] == 1 and closed["requests"] == 1 and closed["in_flight"] is False
    assert closed["idle"] >= 0.45 and closed["addr"] == f"127.0.0.1:{back.port}"
    phases = [r["phase"] for r in read_records(capture) if r["type"] == "upstream_connect"]
    assert phases == ["start", "done", "start", "done"]  # the second request's own
    (close,) = [r for r in read_records(capture) if r["type"] == "conn_close"]
    assert close["closed_by"] == "client" and close["requests"] == 2
    rows = analyze_json(capture)["requests"]
    assert [(r["seq"], r["termination"]) for r in rows] == [(1, "complete"), (2, "complete")]


@pytest.mark.anyio
async def test_flow_files_keep_streamed_bodies_when_asked(tmp_path: Path) -> None:
    """The addon streams event-stream responses, and mitmproxy keeps no streamed body
    (its web UI and flow files show them empty) unless ``store_streamed_bodies`` is set;
    then the flow holds what the client got, and the capture is the same."""
    flows = tmp_path / "flows"
    options = ("-w", str(flows), "--set", "store_streamed_bodies=true")
    async with engine_running(ttft=0.01, itl=0.004) as engine:
        async with mitmdump(engine.url, tmp_path, *options) as (url, capture):
            async with await anyio.connect_tcp("127.0.0.1", int(url.rsplit(":", 1)[1])) as s:
                await s.send(
                    chat_request(6, headers={"x-request-id": "kept", "connection": "close"})
                )
                data, _ = await recv_all(s, timeout=10)
            await wait_until(lambda: _count(capture, "conn_close") >= 1, 10)
    with open(flows, "rb") as f:
        (flow,) = list(FlowReader(f).stream())
    assert isinstance(flow, http.HTTPFlow) and flow.response is not None
    body = flow.response.raw_content or b""
    assert body.endswith(b"data: [DONE]\n\n") and data.count(b"data:") == body.count(b"data:")
    (row,) = analyze_json(capture)["requests"]
    assert (row["termination"], row["done"]) == ("complete", True)
    assert row["events"] == body.count(b"data:")


def test_the_header_names_the_reverse_upstream_and_each_listen_address(tmp_path: Path) -> None:
    """``reverse:URL@PORT`` is the URL and its own port (analysis matches the upstream's
    host:port against the engine's, the report replays to it); an upstream mode's next
    hop is a forward proxy, not an upstream to replay to."""
    modes = ["reverse:http://127.0.0.1:30000@8081", "upstream:http://127.0.0.1:3128@8082"]
    with addon_ctx(tmp_path, mode=modes, listen_host="127.0.0.1") as (_, path):
        pass
    (header,) = records(path, "capture_start")
    assert header["upstream"] == "http://127.0.0.1:30000"
    assert header["listen"] == "127.0.0.1:8081, 127.0.0.1:8082"
    assert header["options"]["mode"] == modes
    # two reverse proxies: no one upstream for the whole capture (each connection's
    # upstream_connect says where it went)
    modes = ["reverse:http://127.0.0.1:30000@8081", "reverse:http://127.0.0.1:30001@8082"]
    with addon_ctx(tmp_path, mode=modes, listen_host="127.0.0.1") as (_, path):
        pass
    (header,) = records(path, "capture_start")
    assert "upstream" not in header and header["options"]["mode"] == modes


@pytest.mark.anyio
async def test_the_addon_in_front_of_the_native_tap_tells_each_failure_once(tmp_path: Path) -> None:
    """mitmproxy with the addon in front of a native tap, in front of the engine: the two
    captures join request by request, and a stall and a cut by the engine, seen the same
    at both taps, are one finding each, the native tap's, naming both requests."""
    body = {
        "model": "sim-model",
        "max_tokens": 6,
        "stream": True,
        "messages": [{"role": "user", "content": "two taps"}],
    }
    async with engine_running(ttft=0.01, itl=0.004) as engine:
        async with running_tap(engine.bound[1], tmp_path, name="back", stall_after=0.5) as tap:
            options = ("--set", "tracer_tap=front", "--set", "tracer_stall_after=0.5")
            async with mitmdump(tap.url, tmp_path, *options) as (url, front):
                async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                    for rid, fault in (
                        ("ok", "none"),
                        ("stalled", "stall:after=2:for=1.2"),
                        ("cut", "close:after=2"),
                    ):
                        with contextlib.suppress(httpx.HTTPError):
                            await stream_chat(client, body, rid, fault)
                await wait_until(lambda: _count(front, "response_end") >= 3, 10)
            await wait_until(lambda: len(tap.of(ev.ResponseEnd)) >= 3, 10)
    doc = analyze_json(front, tap.capture)
    (pair,) = doc["evidence"]["tap_pairs"]
    assert (pair["from"], pair["to"], pair["shared"]) == ("front", "back", 3)
    rows = {(r["tap"], r["request_id"]): r for r in doc["requests"]}
    faults = [f for f in doc["findings"] if not f["note"]]
    by_id = {r["id"]: key for key, r in rows.items()}
    told = sorted(sorted(by_id[i] for i in f["requests"]) for f in faults)
    assert told == [
        [("back", "cut"), ("front", "cut")],
        [("back", "stalled"), ("front", "stalled")],
    ]
    for f in faults:
        assert f["requests"][0].startswith("back/")  # the tap nearest the engine tells it
        assert any(e["tap"] == "front" and e["figures"].get("same_failure") for e in f["evidence"])
