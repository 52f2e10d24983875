"""The mitmproxy addon (addons/trace.py) hook by hook, with mitmproxy's test helpers and
its engine in this process.

Its capture process (a real process): tests/integration/test_addon_trace.py; mitmdump,
and the parity with the native tap: tests/e2e/test_addon_trace.py."""

from __future__ import annotations

import hashlib
import json
import random
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest
from mitmproxy import exceptions, http
from mitmproxy.flow import Error
from mitmproxy.net.http.http1 import connection_close

from tests.support.addon import (
    BIG_EVENT,
    SSE_CHUNKS,
    a_flow,
    addon_ctx,
    records,
    sse_response,
    start,
    streaming_sse,
    trace,
)
from tests.support.net import wait_until
from tracer import events as ev
from tracer.capture.files import read_events
from tracer.observe import flows as mitm
from tracer.observe.flows import ContentShape, SseObserver, _client_closes
from tracer.protocol.sse import SseSplitter, classify

with warnings.catch_warnings():  # mitmproxy.master imports ldap3, which warns on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from mitmproxy.test import taddons, tutils


# ---- hook by hook, no I/O (mitmproxy's own test helpers) ----------------------------------


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


def test_no_shape_is_learned_from_a_chunk_with_a_usage_key() -> None:
    """A text ending in a backslash makes the learned chunk's JSON unparsable (no usage
    read from it); a chunk of the same shape with another text has a usage object."""
    template = b'data: {"choices":[{"delta":{"content":"@"}}],"usage":{"x":1}}\n\n'
    learned = template.replace(b"@", b"a\\")
    assert classify(learned[:-2]).usage is None
    shape = ContentShape()
    shape.learn(learned, classify(learned[:-2]))
    later = template.replace(b"@", b"b")
    assert classify(later[:-2]).usage == {"x": 1}
    assert not shape.fits(later)
    # "usage":null is the same in every chunk of a shape: learned
    plain = template.replace(b'{"x":1}', b"null")
    shape.learn(plain.replace(b"@", b"a"), classify(plain[:-2].replace(b"@", b"a")))
    assert shape.fits(plain.replace(b"@", b"b"))


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
        await wait_until(lambda: not state.pieces, 5, interval=0.001)  # the ship, 5 ms later
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
    # (the last two reads in one batch, or in two when a loaded machine took longer
    # than BODY_BATCH_SECONDS between them)
    assert [len(b["reads"]) for b in bodies] in ([full, 2], [full, 1, 1])
    assert bodies[1]["sse"][0][1:] == [len(SSE_CHUNKS[2]), "content"]
    end = records(path, "response_end")[0]
    assert (end["events"], end["done"], end["body_bytes"]) == (
        full + 2,
        True,
        len(SSE_CHUNKS[1]) + full * len(SSE_CHUNKS[2]) + len(SSE_CHUNKS[4]),
    )


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
            assert engine_flow.kept_bytes <= trace.MAX_KEPT_BYTES
        stream(b"")
        addon.response(flow)
    bodies = records(path, "body")
    assert [len(b["reads"]) for b in bodies] == [per_batch, per_batch, 4]
    assert records(path, "response_end")[0]["events"] == 2 * per_batch + 4


def records_now(addon: Any, path: Path, kind: str) -> list[dict[str, Any]]:
    """Records on disk so far (waits for the writer's background flush)."""
    deadline = time.monotonic() + 5
    while True:
        found = records(path, kind)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


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
