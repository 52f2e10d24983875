"""`--fault` end to end: each fault gives the client exactly its symptom, and nothing else.

An in-process tap with faults sits in front of a deterministic OpenAI-shaped upstream
(fixed ids and timestamps, so that a response is known to the byte). Each fault is driven
by a raw socket client (the bytes and their timing) and by the openai SDK (what a harness
sees). Requests the rule does not match, and fresh connections, get exactly the bytes the
upstream sent; the capture holds the `fault` record and, around it, what the client got.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
from anyio.abc import SocketAttribute, SocketStream

from tests.support.analyze import analyze_async
from tests.support.http import SSE_HEAD, chunk
from tests.support.net import nothing_for, recv_all, recv_until, wait_until
from tests.support.procs import tracer_proxy
from tests.support.tap import RawUpstream, TapHandle, UpConn, running_tap
from tracer import events as ev
from tracer.capture.files import read_records
from tracer.faults.plan import parse_fault, status_response

pytestmark = pytest.mark.anyio

# the raw-socket tests of the faults that act on connections run on uvloop too (what
# `tracer proxy` uses); the rest on the default loop
both_loops = pytest.mark.parametrize(
    "anyio_backend", ["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)

# ---- a deterministic upstream --------------------------------------------------------


def _event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    obj = {
        "id": "chatcmpl-fixed",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


TOKENS = 4


def events(tokens: int = TOKENS) -> list[bytes]:
    """role, one content event per token, finish, [DONE]: one event per chunk."""
    content = [_event({"content": f"t{i} "}) for i in range(tokens)]
    return [_event({"role": "assistant", "content": ""}), *content, _event({}, "stop"), DONE]


def stream_bytes(tokens: int = TOKENS) -> bytes:
    return SSE_HEAD + b"".join(chunk(e) for e in events(tokens)) + b"0\r\n\r\n"


def json_response(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return head % len(body) + body


MODELS = json_response({"object": "list", "data": [{"id": "m", "object": "model", "created": 1}]})


STREAM = stream_bytes()


TEXT = "".join(f"t{i} " for i in range(TOKENS))


BODY = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})


CHAT = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: up\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY.encode())
)


GET_MODELS = b"GET /v1/models HTTP/1.1\r\nhost: up\r\n\r\n"


@dataclass
class Upstream:
    """Answers every request on a keep-alive connection; ``x-itl`` paces the events."""

    port: int = 0
    requests: list[tuple[int, bytes]] = field(default_factory=list)  # (connection, raw)
    connections: int = 0

    def received(self, conn: int | None = None) -> list[bytes]:
        return [raw for c, raw in self.requests if conn is None or c == conn]

    async def serve(self, stream: SocketStream) -> None:
        self.connections += 1
        conn = self.connections
        buf = b""
        async with stream:
            try:
                while True:
                    while b"\r\n\r\n" not in buf:
                        buf += await stream.receive()
                    head, _, rest = buf.partition(b"\r\n\r\n")
                    found = re.search(rb"(?i)content-length: *(\d+)", head)
                    length = int(found.group(1)) if found else 0
                    while len(rest) < length:
                        rest += await stream.receive()
                    body, buf = rest[:length], rest[length:]
                    self.requests.append((conn, head + b"\r\n\r\n" + body))
                    await self.respond(stream, head, body)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return

    async def respond(self, stream: SocketStream, head: bytes, body: bytes) -> None:
        if head.startswith(b"GET /v1/models"):
            await stream.send(MODELS)
            return
        request = json.loads(body)
        tokens = int(request.get("max_tokens") or TOKENS)
        if not request.get("stream"):
            message = {"role": "assistant", "content": "".join(f"t{i} " for i in range(tokens))}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            obj = {"id": "c", "object": "chat.completion", "created": 1, "model": "m"}
            await stream.send(json_response({**obj, "choices": [choice]}))
            return
        found = re.search(rb"(?i)x-itl: *([0-9.]+)", head)
        itl = float(found.group(1)) if found else 0.0
        if not itl:  # all at once: the client's timing is the tap's doing
            await stream.send(stream_bytes(tokens))
            return
        await stream.send(SSE_HEAD)
        for event in events(tokens):
            await anyio.sleep(itl)  # (a paced stream: sleeping is the upstream's job)
            await stream.send(chunk(event))
        await stream.send(b"0\r\n\r\n")


@asynccontextmanager
async def faulty_tap(tmp_path: Path, *specs: str, **config: Any) -> AsyncIterator[Any]:
    """The upstream and an in-process tap with these faults: yields (upstream, tap)."""
    upstream = Upstream()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    upstream.port = int(listener.extra(SocketAttribute.local_port))
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, upstream.serve)
        faults = [parse_fault(s) for s in specs]
        config.setdefault("stall_after", 0.2)
        async with running_tap(upstream.port, tmp_path, faults=faults, **config) as tap:
            yield upstream, tap
        tg.cancel_scope.cancel()


def sdk(tap: TapHandle, timeout: float = 5.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=tap.url + "/v1", api_key="sk-test", max_retries=0, timeout=timeout
    )


async def chat(client: openai.AsyncOpenAI, **extra: Any) -> list[tuple[float, str]]:
    """A streaming chat call; returns (arrival, text) for each chunk, from the call."""
    start = time.monotonic()
    out: list[tuple[float, str]] = []
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, **extra
    )
    async for part in stream:
        text = part.choices[0].delta.content or "" if part.choices else ""
        out.append((time.monotonic() - start, text))
    return out


def text_of(chunks: list[tuple[float, str]]) -> str:
    return "".join(text for _, text in chunks)


async def connect(tap: TapHandle) -> SocketStream:
    return await anyio.connect_tcp("127.0.0.1", tap.port)


async def exchange(s: SocketStream, request: bytes, expected: bytes) -> bytes:
    await s.send(request)
    return await recv_until(s, lambda b: len(b) >= len(expected))


async def timed(s: SocketStream, size: int, timeout: float = 5.0) -> list[tuple[float, bytes]]:
    """Reads until ``size`` bytes came: each read with its arrival time."""
    start = time.monotonic()
    reads: list[tuple[float, bytes]] = []
    with anyio.fail_after(timeout):
        while sum(len(d) for _, d in reads) < size:
            data = await s.receive()
            reads.append((time.monotonic() - start, data))
    return reads


def faults_of(tap: TapHandle) -> list[ev.FaultInjected]:
    return [e for e in tap.events() if isinstance(e, ev.FaultInjected)]


def of(tap: TapHandle, cls: type[Any], **match: Any) -> list[Any]:
    return [
        e
        for e in tap.events()
        if isinstance(e, cls) and all(getattr(e, k) == v for k, v in match.items())
    ]


# ---- hang-on-reuse --------------------------------------------------------------------


@both_loops
async def test_hang_on_reuse_raw(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "hang-on-reuse:3") as (upstream, tap):
        async with await connect(tap) as s:
            assert await exchange(s, CHAT, STREAM) == STREAM
            assert await exchange(s, GET_MODELS, MODELS) == MODELS
            await s.send(CHAT)
            await nothing_for(s, 0.5)  # read, never forwarded, never answered, never closed
            await s.send(GET_MODELS)  # a client that tries again on it: the same
            await tap.wait_for(ev.FaultInjected, count=2)
            await nothing_for(s, 0.1)
            async with await connect(tap) as fresh:  # a fresh connection is untouched
                assert await exchange(fresh, CHAT, STREAM) == STREAM
                assert await exchange(fresh, CHAT, STREAM) == STREAM
            await tap.wait_for(ev.Stall, conn=1, seq=3)
        await tap.wait_for(ev.ConnClose, count=2)
    assert upstream.received(1) == [CHAT, GET_MODELS]
    assert upstream.received(2) == [CHAT, CHAT]
    fault, again = faults_of(tap)
    assert (fault.conn, fault.seq, fault.fault, fault.spec) == (
        1,
        3,
        "hang-on-reuse",
        "hang-on-reuse:3",
    )
    assert "not forwarded" in (fault.detail or "")
    assert (again.conn, again.seq, again.spec) == (1, 4, "hang-on-reuse:3")
    assert again.detail == "request 4 read and not forwarded: the connection hangs since request 3"
    # the capture: the request head, then a stall; no response for it
    assert [e.seq for e in of(tap, ev.RequestHead, conn=1)] == [1, 2, 3, 4]
    assert [e.seq for e in of(tap, ev.ResponseHead, conn=1)] == [1, 2]
    stall = of(tap, ev.Stall, conn=1, seq=3, phase="start")[0]
    assert stall.direction == "upstream_silent" and stall.m > fault.m
    assert of(tap, ev.ConnClose, conn=1)[0].closed_by == "client"


async def test_hang_on_reuse_sdk(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "hang-on-reuse:3") as (upstream, tap):
        async with sdk(tap, timeout=0.6) as client:
            assert text_of(await chat(client)) == TEXT
            assert text_of(await chat(client)) == TEXT
            start = time.monotonic()
            with pytest.raises(openai.APITimeoutError):
                await chat(client)
            assert time.monotonic() - start >= 0.55
        async with sdk(tap) as fresh:
            assert text_of(await chat(fresh)) == TEXT
        await tap.wait_for(ev.ConnClose, count=2)
    heads = [(e.conn, e.seq) for e in of(tap, ev.RequestHead)]
    assert heads == [(1, 1), (1, 2), (1, 3), (2, 1)]  # the SDK reused its connection
    assert len(upstream.received(1)) == 2
    assert [(f.conn, f.seq) for f in faults_of(tap)] == [(1, 3)]


@both_loops
async def test_a_hung_connection_stays_silent_when_the_upstream_closes(tmp_path: Path) -> None:
    """The upstream's own idle timeout closes its side: the client still sees nothing."""
    closed = anyio.Event()

    async def keepalive_then_close(stream: SocketStream, conn: UpConn) -> None:
        for n in (1, 2):
            await conn.wait_for(lambda c, n=n: c.received.count(b"POST ") >= n)
            await stream.send(STREAM)
        await anyio.sleep(0.1)  # (the upstream's idle timeout)
        await stream.aclose()
        closed.set()

    upstream = RawUpstream(keepalive_then_close)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        faults = [parse_fault("hang-on-reuse:3")]
        async with running_tap(port, tmp_path, faults=faults) as tap:
            async with await connect(tap) as s:
                assert await exchange(s, CHAT, STREAM) == STREAM
                assert await exchange(s, CHAT, STREAM) == STREAM
                await s.send(CHAT)
                with anyio.fail_after(5):
                    await closed.wait()
                await nothing_for(s, 0.4)  # no FIN, no reset: open and silent
            close = (await tap.wait_for(ev.ConnClose))[0]
        tg.cancel_scope.cancel()
    assert close.closed_by == "client" and close.requests == 3
    assert upstream.conns[0].received == CHAT + CHAT


# ---- drop-request ---------------------------------------------------------------------


async def test_drop_request_raw_and_sdk(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "drop-request@method=POST,pos=2") as (upstream, tap):
        async with await connect(tap) as s:
            assert await exchange(s, GET_MODELS, MODELS) == MODELS
            await s.send(CHAT)
            await nothing_for(s, 0.4)
        async with await connect(tap) as s:  # a POST first on a fresh connection: untouched
            assert await exchange(s, CHAT, STREAM) == STREAM
        async with sdk(tap, timeout=0.5) as client:
            assert [m.id for m in (await client.models.list()).data] == ["m"]
            with pytest.raises(openai.APITimeoutError):
                await chat(client)
        await tap.wait_for(ev.ConnClose, count=3)
    assert upstream.received(1) == [GET_MODELS]
    assert upstream.received(2) == [CHAT]
    assert [(f.conn, f.seq, f.fault) for f in faults_of(tap)] == [
        (1, 2, "drop-request"),
        (3, 2, "drop-request"),
    ]


# ---- delay-first-byte -----------------------------------------------------------------


async def test_delay_first_byte_raw(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "delay-first-byte:0.4@path=/v1/chat/*") as (_, tap):
        async with await connect(tap) as s:
            await s.send(GET_MODELS)
            reads = await timed(s, len(MODELS))
            assert reads[0][0] < 0.3 and b"".join(d for _, d in reads) == MODELS
            await s.send(CHAT)
            reads = await timed(s, len(STREAM))
            assert reads[0][0] >= 0.38
            assert b"".join(d for _, d in reads) == STREAM
    [fault] = faults_of(tap)
    assert (fault.conn, fault.seq) == (1, 2)
    head = of(tap, ev.ResponseHead, seq=2)[0]
    assert head.ttfb >= 0.38  # the capture shows what the client got


async def test_delay_first_byte_sdk(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "delay-first-byte:0.4") as (_, tap):
        async with sdk(tap) as client:
            chunks = await chat(client)
    assert text_of(chunks) == TEXT
    assert chunks[0][0] >= 0.38


# ---- stall-after-events ---------------------------------------------------------------


@both_loops
async def test_stall_after_events_raw(tmp_path: Path) -> None:
    first_two = SSE_HEAD + b"".join(chunk(e) for e in events()[:2])
    async with faulty_tap(tmp_path, "stall-after-events:2:0.5") as (upstream, tap):
        async with await connect(tap) as s:
            await s.send(CHAT)
            reads = await timed(s, len(STREAM))
            early = b"".join(d for t, d in reads if t < 0.3)
            assert early == first_two  # the head and two events, then nothing
            late = [t for t, d in reads if t >= 0.3]
            assert late and min(late) >= 0.48
            assert b"".join(d for _, d in reads) == STREAM  # then the rest, unchanged
            assert await exchange(s, CHAT, STREAM) == STREAM  # the next one stalls too...
        async with await connect(tap) as s:
            await s.send(GET_MODELS)  # ...but a response without events does not
            assert (await timed(s, len(MODELS)))[0][0] < 0.3
    assert len(faults_of(tap)) == 2
    assert faults_of(tap)[0].detail == "relaying stopped after 2 events for 0.5s"
    end = of(tap, ev.ResponseEnd, conn=1, seq=1)[0]
    assert end.termination == "complete" and end.done and end.max_gap >= 0.48
    assert len(upstream.requests) == 3


async def test_stall_after_events_sdk(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "stall-after-events:2:0.5") as (_, tap):
        async with sdk(tap) as client:
            chunks = await chat(client)
    assert text_of(chunks) == TEXT
    times = [t for t, _ in chunks]
    assert times[1] < 0.3 and times[2] - times[1] >= 0.45  # role, t0 | stall | t1 ...


async def test_stall_for_good(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "stall-after-events:3:inf") as (_, tap):
        async with await connect(tap) as s:
            await s.send(CHAT)
            got = await recv_until(s, lambda b: b.count(b"data:") >= 3)
            assert got == SSE_HEAD + b"".join(chunk(e) for e in events()[:3])
            await nothing_for(s, 0.4)
        async with sdk(tap, timeout=0.5) as client:
            received: list[str] = []
            with pytest.raises(openai.APITimeoutError):
                stream = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], stream=True
                )
                async for part in stream:
                    received.append(part.choices[0].delta.content or "")
            assert received == ["", "t0 ", "t1 "]
    assert [f.detail for f in faults_of(tap)] == ["relaying stopped after 3 events for good"] * 2
    assert of(tap, ev.Stall, conn=1, seq=1, phase="start")


async def test_a_hold_reads_the_upstream_only_up_to_a_bound(tmp_path: Path) -> None:
    """While a stall holds the stream, the tap stops reading a fast upstream at ~1 MiB."""
    big = [_event({"content": "x" * 65536})] * 48  # about 3 MiB of events
    body = SSE_HEAD + b"".join(chunk(e) for e in big) + b"0\r\n\r\n"

    async def fast(stream: SocketStream, head: bytes, request: bytes) -> None:
        await stream.send(body)

    async with faulty_tap(tmp_path, "stall-after-events:1:0.5") as (upstream, tap):
        upstream.respond = fast  # type: ignore[method-assign]
        async with await connect(tap) as s:
            await s.send(CHAT)
            await tap.wait_for(ev.FaultInjected)
            relay = tap.tap.live[1]
            queued = []
            with anyio.move_on_after(0.4):
                while True:
                    queued.append(relay._queued)  # type: ignore[attr-defined]
                    await anyio.sleep(0.02)  # (samples the queue during the hold)
            got = await recv_until(s, lambda b: len(b) >= len(body))
    assert got == body
    assert 0 < max(queued) <= (1 << 20) + 2 * 262144  # the limit, plus a read or two


# ---- truncate-after-events ------------------------------------------------------------


@both_loops
@pytest.mark.parametrize("how", ["fin", "reset"])
async def test_truncate_after_events_raw(how: str, tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, f"truncate-after-events:2:{how}") as (upstream, tap):
        async with await connect(tap) as s:
            await s.send(CHAT)
            got, end = await recv_all(s)
        await tap.wait_for(ev.ConnClose)
        async with await connect(tap) as s:
            await s.send(GET_MODELS)  # no events: nothing to cut
            assert await recv_until(s, lambda b: len(b) >= len(MODELS)) == MODELS
    assert got == SSE_HEAD + b"".join(chunk(e) for e in events()[:2])
    assert end == how
    assert upstream.received(1) == [CHAT]
    end_rec = of(tap, ev.ResponseEnd, conn=1)[0]
    assert end_rec.termination == "truncated" and end_rec.close == how and end_rec.events == 2
    assert of(tap, ev.ConnClose, conn=1)[0].closed_by == "tracer"
    [fault] = faults_of(tap)
    assert fault.seq == 1 and fault.m <= end_rec.m


async def test_truncate_after_events_sdk(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "truncate-after-events:2") as (_, tap):
        async with sdk(tap) as client:
            received: list[str] = []
            with pytest.raises(openai.APIConnectionError) as caught:
                stream = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], stream=True
                )
                async for part in stream:
                    received.append(part.choices[0].delta.content or "")
    assert received == ["", "t0 "]
    cause = caught.value.__cause__
    assert type(cause).__name__ == "RemoteProtocolError"  # (httpx's or httpcore's)
    assert "incomplete chunked read" in str(cause)  # the body was cut without its end


# ---- drop-done ------------------------------------------------------------------------


async def test_drop_done_raw(tmp_path: Path) -> None:
    no_done = SSE_HEAD + b"".join(chunk(e) for e in events()[:-1]) + b"0\r\n\r\n"
    async with faulty_tap(tmp_path, "drop-done@path=/v1/chat/completions") as (_, tap):
        async with await connect(tap) as s:
            assert await exchange(s, CHAT, no_done) == no_done  # ends cleanly, without [DONE]
            assert await exchange(s, GET_MODELS, MODELS) == MODELS  # the connection goes on
            assert await exchange(s, CHAT, no_done) == no_done
            await nothing_for(s, 0.1)  # nothing more: the [DONE] chunk is gone
    ends = of(tap, ev.ResponseEnd)
    assert [(e.termination, e.done) for e in ends] == [
        ("complete", False),
        ("complete", False),
        ("complete", False),
    ]
    assert [(f.seq, f.fault) for f in faults_of(tap)] == [(1, "drop-done"), (3, "drop-done")]


async def test_drop_done_rechunked(tmp_path: Path) -> None:
    """[DONE] in a chunk with another event (a router that re-chunks): that chunk is re-framed."""
    evs = events()
    body = chunk(evs[0] + evs[1]) + chunk(evs[2]) + chunk(b"".join(evs[3:]))
    upstream_bytes = SSE_HEAD + body + b"0\r\n\r\n"
    expected = (
        SSE_HEAD
        + chunk(evs[0] + evs[1])
        + chunk(evs[2])
        + chunk(b"".join(evs[3:-1]))
        + b"0\r\n\r\n"
    )

    async def rechunked(stream: SocketStream, head: bytes, body: bytes) -> None:
        await stream.send(upstream_bytes)

    async with faulty_tap(tmp_path, "drop-done") as (upstream, tap):
        upstream.respond = rechunked  # type: ignore[method-assign]
        async with await connect(tap) as s:
            assert await exchange(s, CHAT, expected) == expected
            await nothing_for(s, 0.1)


async def test_drop_done_sdk(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "drop-done") as (_, tap):
        async with sdk(tap) as client:
            assert text_of(await chat(client)) == TEXT  # the SDK does not notice
            assert text_of(await chat(client)) == TEXT
    assert len(faults_of(tap)) == 2


# ---- buffer-stream --------------------------------------------------------------------

PACED = 0.05  # x-itl: 7 events, about 0.35 s from the upstream


async def test_buffer_stream_raw(tmp_path: Path) -> None:
    paced = CHAT.replace(b"host: up\r\n", b"host: up\r\nx-itl: %g\r\n" % PACED)
    async with faulty_tap(tmp_path, "buffer-stream") as (_, tap):
        async with await connect(tap) as s:
            await s.send(paced)
            reads = await timed(s, len(STREAM))
    assert b"".join(d for _, d in reads) == STREAM
    assert len(reads) == 1 or reads[-1][0] - reads[0][0] < 0.05  # all at once...
    assert reads[0][0] >= 7 * PACED * 0.9  # ...when the upstream had finished
    [fault] = faults_of(tap)
    assert fault.fault == "buffer-stream"


async def test_buffer_stream_sdk(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "buffer-stream@path=/v1/chat/*") as (_, tap):
        async with sdk(tap) as client:
            chunks = await chat(client, extra_headers={"x-itl": str(PACED)})
            assert [m.id for m in (await client.models.list()).data] == ["m"]
    assert text_of(chunks) == TEXT
    times = [t for t, _ in chunks]
    assert times[0] >= 7 * PACED * 0.9 and times[-1] - times[0] < 0.05
    assert len(faults_of(tap)) == 1


async def test_unfaulted_stream_is_not_held(tmp_path: Path) -> None:
    """The same paced stream through a tap with a fault that does not match: as it comes."""
    paced = CHAT.replace(b"host: up\r\n", b"host: up\r\nx-itl: %g\r\n" % PACED)
    async with faulty_tap(tmp_path, "buffer-stream@method=GET") as (_, tap):
        async with await connect(tap) as s:
            await s.send(paced)
            reads = await timed(s, len(STREAM))
    assert b"".join(d for _, d in reads) == STREAM
    assert reads[0][0] < 2 * PACED and reads[-1][0] - reads[0][0] >= 5 * PACED
    assert faults_of(tap) == []


# ---- close-idle-after -----------------------------------------------------------------


@both_loops
async def test_close_idle_after_raw(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "close-idle-after:0.3") as (upstream, tap):
        async with await connect(tap) as s:
            assert await exchange(s, CHAT, STREAM) == STREAM
            done = time.monotonic()
            rest, how = await recv_all(s)  # the tap closes the idle connection
            assert rest == b"" and how == "fin"
            assert time.monotonic() - done >= 0.25
            # the race: a request sent on the stale connection gets no answer
            await s.send(CHAT)
            assert (await recv_all(s))[0] == b""
    [fault] = faults_of(tap)
    assert (fault.conn, fault.seq, fault.detail) == (1, 1, "connection closed after 0.3s idle")
    close = of(tap, ev.ConnClose, conn=1)[0]
    assert close.closed_by == "tracer" and not close.in_flight
    assert upstream.received() == [CHAT]


async def test_close_idle_after_sdk(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "close-idle-after:0.3") as (upstream, tap):
        async with sdk(tap) as client:
            assert text_of(await chat(client)) == TEXT
            await tap.wait_for(ev.FaultInjected)
            await tap.wait_for(ev.ConnClose)
            assert text_of(await chat(client)) == TEXT  # over a new connection
    assert [(e.conn, e.seq) for e in of(tap, ev.RequestHead)] == [(1, 1), (2, 1)]
    assert upstream.connections == 2


async def test_close_idle_after_behind_a_recording_tap(tmp_path: Path) -> None:
    """A recording tap in front of the faulting one: the request its client writes after
    the close never reaches the faulting tap. The analysis of both captures puts it down
    to the injected fault (the taps' connection is one TCP connection, linked by
    address), not to a hop that held it."""
    async with faulty_tap(tmp_path, "close-idle-after:0.3", name="back") as (upstream, back):
        async with running_tap(back.port, tmp_path, name="front") as front:
            async with await connect(front) as s:
                assert await exchange(s, CHAT, STREAM) == STREAM
                rest, how = await recv_all(s)  # the close, passed on
                assert rest == b"" and how == "fin"
                await s.send(CHAT)  # written anyway: nothing comes back
                assert (await recv_all(s))[0] == b""
            await front.wait_for(ev.ResponseEnd, seq=2)
            await front.wait_for(ev.ConnClose)
    assert upstream.received() == [CHAT]
    captures = [str(front.capture), str(back.capture)]
    result = await anyio.run_process(
        [sys.executable, "-m", "tracer", "analyze", *captures, "--format", "json"]
    )
    doc = json.loads(result.stdout)
    assert doc["verdict"]["kind"] == "healthy"
    (note,) = doc["findings"]
    assert note["kind"] == "injected_fault" and note["requests"] == ["back/1/1", "front/1/2"]
    assert "client_reused_closed_connection" in note["evidence"][0]["figures"]["read_as"]
    # written at tap front after tap back had closed the connection
    written = note["evidence"][1]
    assert (written["tap"], written["request"]) == ("front", "front/1/2")
    assert written["figures"]["found"] == "after_close"


@pytest.mark.parametrize("spec", ["half-open@pos=2", "coalesce:0.04"])
async def test_faults_behind_a_recording_tap_are_notes(tmp_path: Path, spec: str) -> None:
    """The faulting tap behind a recording one, both captures analysed: what the client got
    is the injection's doing, not the hop between them. ``half-open`` reads only the head
    of request 2 (no body to join the two copies by: found through the connection);
    ``coalesce`` leaves the request healthy at both taps (joined for the bunching only)."""
    async with faulty_tap(tmp_path, spec, name="back") as (_, back):
        async with running_tap(back.port, tmp_path, name="front", stall_after=0.2) as front:
            async with await connect(front) as s:
                if spec.startswith("half-open"):
                    assert await exchange(s, CHAT, STREAM) == STREAM
                    head, _, body = CHAT.partition(b"\r\n\r\n")
                    await s.send(head + b"\r\n\r\n")  # the tap behind stops at the head,
                    await back.wait_for(ev.FaultInjected)
                    await s.send(body)  # so it never reads the body
                    await front.wait_for(ev.Stall, seq=2)
                else:  # 25 events 10 ms apart, sent on in bunches
                    body = json.dumps({**json.loads(BODY), "max_tokens": 23}).encode()
                    head = CHAT.split(b"\r\n\r\n")[0].replace(
                        b"host: up", b"host: up\r\nx-itl: 0.01"
                    )
                    head = re.sub(rb"content-length: \d+", b"content-length: %d" % len(body), head)
                    await s.send(head + b"\r\n\r\n" + body)
                    await recv_until(s, lambda b: b.endswith(b"0\r\n\r\n"))
                    await front.wait_for(ev.ResponseEnd)
                    await back.wait_for(ev.ResponseEnd)
    doc = await analyze_async(front.capture, back.capture)
    assert doc["verdict"]["kind"] == "healthy", doc["findings"]
    (note,) = doc["findings"]
    injected = note["evidence"][0]["figures"]
    assert note["kind"] == "injected_fault" and injected["fault"] == spec
    if spec.startswith("half-open"):
        assert note["requests"] == ["back/1/2", "front/1/2"]
        assert "proxy_hung_on_reuse" in injected["read_as"]
    else:
        assert note["requests"] == ["back/1/1"]
        assert "delivery_coalesced" in injected["read_as"]
    alone = await analyze_async(front.capture)  # without the records: the symptom
    if spec.startswith("coalesce"):
        assert "delivery_coalesced" in {f["kind"] for f in alone["findings"]}, alone["findings"]
    # a verdict, unless the front tap was itself starved then (a loaded machine: its
    # event loop late): a starved tap's timings are a note, not a verdict, by design
    if not any(isinstance(e, ev.TapLag) for e in front.events()):
        assert alone["verdict"]["party"] != "none", alone["findings"]


async def test_half_open_behind_a_hop_is_matched_by_its_head(tmp_path: Path) -> None:
    """``half-open`` with a hop between the recording tap and the faulting one (a third
    tap, whose capture is left out, stands for nginx or the router): no shared
    connection, and no body at the faulting tap. The front tap's copy is matched by its
    head, so the hop is not blamed for what the faulting tap did."""
    async with faulty_tap(tmp_path, "half-open@pos=2", name="back") as (_, back):
        async with running_tap(back.port, tmp_path, name="hop") as hop:
            async with running_tap(hop.port, tmp_path, name="front", stall_after=0.2) as front:
                async with await connect(front) as s:
                    assert await exchange(s, CHAT, STREAM) == STREAM
                    head, _, body = CHAT.partition(b"\r\n\r\n")
                    await s.send(head + b"\r\n\r\n")
                    await back.wait_for(ev.FaultInjected)
                    await s.send(body)
                    await front.wait_for(ev.Stall, seq=2)
    doc = await analyze_async(front.capture, back.capture)
    assert doc["verdict"]["kind"] == "healthy", doc["findings"]
    (note,) = doc["findings"]
    assert note["requests"] == ["back/1/2", "front/1/2"]
    matched = note["evidence"][1]  # the same request at tap front, matched by its head
    assert (matched["tap"], matched["request"]) == ("front", "front/1/2")
    assert (matched["figures"]["found"], matched["figures"]["there"]) == ("by_head", "back/1/2")


# what the SDK gets from two calls on one connection, the fault acting on (at least) the
# second: "ok", or the exception's name
BEHIND = [
    ("hang-on-reuse:2", ["ok", "APITimeoutError"]),
    ("drop-request@pos=2", ["ok", "APITimeoutError"]),
    ("status:503@pos=2", ["ok", "InternalServerError"]),
    ("delay-first-byte:0.2", ["ok", "ok"]),
    ("stall-after-events:2:0.2", ["ok", "ok"]),
    ("stall-after-events:2:inf@pos=2", ["ok", "APITimeoutError"]),
    ("truncate-after-events:2@pos=2", ["ok", "APIConnectionError"]),
    ("drop-done", ["ok", "ok"]),
    ("buffer-stream", ["ok", "ok"]),
]


@pytest.mark.parametrize(("spec", "got"), BEHIND, ids=[spec for spec, _ in BEHIND])
async def test_every_fault_behind_a_recording_tap_is_a_note(
    tmp_path: Path, spec: str, got: list[str]
) -> None:
    """Each fault at a tap behind a recording one, through the openai SDK: with both
    captures the verdict is healthy and the fault is one note, never the hop between the
    taps, the engine or the client."""
    async with faulty_tap(tmp_path, spec, name="back") as (_, back):
        async with running_tap(back.port, tmp_path, name="front", stall_after=0.2) as front:
            results = []
            async with sdk(front, timeout=0.6) as client:
                for _ in range(2):
                    try:
                        await chat(client)
                        results.append("ok")
                    except openai.OpenAIError as exc:
                        results.append(type(exc).__name__)
            assert results == got
            await back.wait_for(ev.RequestHead, count=2)
    doc = await analyze_async(front.capture, back.capture)
    assert doc["verdict"]["kind"] == "healthy", doc["findings"]
    assert [f["kind"] for f in doc["findings"]] == ["injected_fault"]
    assert doc["findings"][0]["evidence"][0]["figures"]["fault"] == spec


# ---- half-open ------------------------------------------------------------------------


@both_loops
async def test_half_open_raw(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "half-open@pos=2") as (upstream, tap):
        async with await connect(tap) as s:
            assert await exchange(s, CHAT, STREAM) == STREAM
            await s.send(CHAT)
            await tap.wait_for(ev.FaultInjected)
            relay = tap.tap.live[1]
            seen = relay.obs.client_bytes
            await s.send(b"x" * 4096)  # the tap no longer reads
            await nothing_for(s, 0.4)
            assert relay.obs.client_bytes == seen
            assert 1 in tap.tap.live  # and it closed nothing
        async with await connect(tap) as fresh:
            assert await exchange(fresh, CHAT, STREAM) == STREAM
    assert upstream.received(1) == [CHAT]
    [fault] = faults_of(tap)
    assert (fault.conn, fault.seq, fault.fault) == (1, 2, "half-open")


async def test_half_open_sdk(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "half-open") as (upstream, tap):
        async with sdk(tap, timeout=0.5) as client:
            with pytest.raises(openai.APITimeoutError):
                await chat(client)
    assert upstream.requests == [] and upstream.connections == 0


# ---- status ---------------------------------------------------------------------------


@both_loops
async def test_status_raw(tmp_path: Path) -> None:
    answer = status_response(parse_fault("status:503@every=2"))
    async with faulty_tap(tmp_path, "status:503@every=2") as (upstream, tap):
        async with await connect(tap) as s:
            assert await exchange(s, CHAT, STREAM) == STREAM
            assert await exchange(s, CHAT, answer) == answer
            assert await exchange(s, CHAT, STREAM) == STREAM  # keep-alive goes on
            await nothing_for(s, 0.1)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"x-tracer-fault: status:503@every=2" in head
    assert json.loads(body)["error"]["code"] == 503
    assert upstream.received(1) == [CHAT, CHAT]  # the second one was never forwarded
    assert [e.status for e in of(tap, ev.ResponseHead)] == [200, 503, 200]
    assert [(f.seq, f.fault) for f in faults_of(tap)] == [(2, "status")]


async def test_status_sdk(tmp_path: Path) -> None:
    async with faulty_tap(tmp_path, "status:429@path=/v1/chat/*,times=1") as (upstream, tap):
        async with sdk(tap) as client:
            with pytest.raises(openai.RateLimitError) as caught:
                await chat(client)
            assert caught.value.status_code == 429
            assert "injected by tracer" in str(caught.value)
            assert text_of(await chat(client)) == TEXT  # times=1
    assert len(upstream.requests) == 1


async def test_a_header_marks_the_requests_to_fault(tmp_path: Path) -> None:
    """``header=NAME[:GLOB]``: a test harness marks the very request it wants faulted."""
    async with faulty_tap(tmp_path, "status:503@header=x-test-fault:on") as (upstream, tap):
        async with sdk(tap) as client:
            assert text_of(await chat(client)) == TEXT
            with pytest.raises(openai.InternalServerError):
                await chat(client, extra_headers={"X-Test-Fault": "on"})
            assert text_of(await chat(client, extra_headers={"X-Test-Fault": "off"})) == TEXT
    assert len(upstream.requests) == 2
    assert [(f.seq, f.fault) for f in faults_of(tap)] == [(2, "status")]


# ---- faults combine -------------------------------------------------------------------


async def test_faults_with_request_ids_injected(tmp_path: Path) -> None:
    """``--fault`` with ``--inject-request-id``: the id goes in first, so the upstream, the
    faults' rules and the capture all see the same request; the one the tap answers
    itself is recorded with its id too."""
    answer = status_response(parse_fault("status:503@pos=2"))
    async with faulty_tap(tmp_path, "status:503@pos=2", inject_request_id=True) as (up, tap):
        async with await connect(tap) as s:
            assert await exchange(s, CHAT, STREAM) == STREAM
            assert await exchange(s, CHAT, answer) == answer
            assert await exchange(s, GET_MODELS, MODELS) == MODELS
    sent = up.received(1)
    assert [re.findall(rb"x-request-id: ([^\r]+)", raw) for raw in sent] == [
        [b"tracer-t-1-1"],
        [b"tracer-t-1-3"],
    ]
    assert [e.request_id for e in of(tap, ev.RequestHead)] == [
        "tracer-t-1-1",
        "tracer-t-1-2",
        "tracer-t-1-3",
    ]
    assert [(f.seq, f.fault) for f in faults_of(tap)] == [(2, "status")]


async def test_faults_combine(tmp_path: Path) -> None:
    no_done = SSE_HEAD + b"".join(chunk(e) for e in events()[:-1]) + b"0\r\n\r\n"
    specs = ("drop-done", "stall-after-events:1:0.3@reuse", "delay-first-byte:0.3@pos=1")
    async with faulty_tap(tmp_path, *specs) as (_, tap):
        async with await connect(tap) as s:
            await s.send(CHAT)
            first = await timed(s, len(no_done))
            await s.send(CHAT)
            second = await timed(s, len(no_done))
    assert b"".join(d for _, d in first) == no_done and first[0][0] >= 0.28
    assert b"".join(d for _, d in second) == no_done
    assert second[0][0] < 0.2 and second[-1][0] >= 0.28
    assert sorted((f.seq, f.fault) for f in faults_of(tap)) == [
        (1, "delay-first-byte"),
        (1, "drop-done"),
        (2, "drop-done"),
        (2, "stall-after-events"),
    ]


# ---- the command line -----------------------------------------------------------------


async def test_cli_proxy_with_faults(tmp_path: Path) -> None:
    upstream = Upstream()
    capture = tmp_path / "faults.jsonl"
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    upstream.port = int(listener.extra(SocketAttribute.local_port))
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, upstream.serve)
        args = [
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            f"http://127.0.0.1:{upstream.port}",
            "--capture",
            str(capture),
            "--no-fingerprint",  # a scripted upstream: every request it gets is the test's
            "--fault",
            "status:503@pos=1",
            "--fault",
            "drop-done",
        ]
        async with tracer_proxy(*args) as proc:
            async with await anyio.connect_tcp("127.0.0.1", proc.port) as s:
                answer = status_response(parse_fault("status:503@pos=1"))
                assert await exchange(s, CHAT, answer) == answer
                no_done = STREAM.replace(chunk(DONE), b"")
                assert await exchange(s, CHAT, no_done) == no_done
            await wait_until(lambda: any("fault injected" in line for line in proc.lines))
        tg.cancel_scope.cancel()
    records = list(read_records(capture))
    assert records[0]["options"]["faults"] == ["status:503@pos=1", "drop-done"]
    assert [(r["seq"], r["fault"]) for r in records if r["type"] == "fault"] == [
        (1, "status"),
        (2, "drop-done"),
    ]


async def test_faults_changed_while_the_tap_runs(tmp_path: Path) -> None:
    """``--fault-control``: the admin's ``/faults`` changes the plan of a running
    ``tracer proxy``; open connections get the new plan at their next request, requests
    keep their positions, a bad spec changes nothing, and every change is in the capture."""
    import httpx

    upstream = Upstream()
    capture = tmp_path / "control.jsonl"
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    upstream.port = int(listener.extra(SocketAttribute.local_port))
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, upstream.serve)
        args = ["proxy", "--listen", "127.0.0.1:0", "--upstream"]
        args += [f"http://127.0.0.1:{upstream.port}", "--capture", str(capture), "--no-fingerprint"]
        token = tmp_path / "token"
        token.write_text("a-token-for-this-test-only")
        args += ["--admin", "127.0.0.1:0", "--fault-control", "--tap", "t"]
        args += ["--admin-token-file", str(token)]
        headers = {"authorization": "Bearer a-token-for-this-test-only"}
        async with (
            tracer_proxy(*args) as proc,
            httpx.AsyncClient(headers=headers) as admin,
        ):
            faults_url = f"{proc.admin}/faults"
            answer = status_response(parse_fault("status:503@path=/v1/chat/*"))
            async with await anyio.connect_tcp("127.0.0.1", proc.port) as s:
                assert await exchange(s, CHAT, STREAM) == STREAM  # no faults: byte for byte
                got = (await admin.get(faults_url)).json()
                assert got == {"faults": [], "control": True, "injected": {}}
                r = await admin.put(faults_url, json=["status:503@path=/v1/chat/*"])
                assert r.status_code == 200 and r.json()["faults"] == ["status:503@path=/v1/chat/*"]
                base_url = f"http://127.0.0.1:{proc.port}/v1"
                async with openai.AsyncOpenAI(
                    base_url=base_url, api_key="sk-test", max_retries=0, timeout=5
                ) as client:
                    with pytest.raises(openai.InternalServerError) as caught:
                        await chat(client)
                    assert caught.value.status_code == 503
                # the connection opened before the change: its next request gets the plan
                assert await exchange(s, CHAT, answer) == answer
                assert await exchange(s, GET_MODELS, MODELS) == MODELS  # not matched
                r = await admin.post(faults_url, json=["hang-on-reuse:4"])
                assert r.json()["faults"] == ["status:503@path=/v1/chat/*", "hang-on-reuse:4"]
                bad = await admin.put(faults_url, json=["drop-done", "hang-on-reuse:1"])
                assert bad.status_code == 400 and "integer >= 2" in bad.json()["error"]
                assert len((await admin.get(faults_url)).json()["faults"]) == 2  # unchanged
                await s.send(GET_MODELS)  # request 4 on this connection: held
                await nothing_for(s, 0.3)
                r = await admin.delete(faults_url)
                assert r.json()["faults"] == [] and r.json()["injected"] == {
                    "hang-on-reuse": 1,
                    "status": 2,
                }
                await nothing_for(s, 0.1)  # decided before the change: stays held
                async with await anyio.connect_tcp("127.0.0.1", proc.port) as fresh:
                    assert await exchange(fresh, CHAT, STREAM) == STREAM
                metrics = (await admin.get(f"{proc.admin}/metrics")).text
                assert 'tracer_faults_injected_total{fault="status",tap="t"} 2.0' in metrics
                assert 'tracer_faults_injected_total{fault="hang-on-reuse",tap="t"} 1.0' in metrics
                assert 'tracer_faults_planned{tap="t"} 0.0' in metrics
                status = (await admin.get(f"{proc.admin}/status")).json()
                assert status["faults"]["faults"] == [] and status["faults"]["control"]
                assert [e["kind"] for e in status["recent"]].count("fault_plan") == 3
        tg.cancel_scope.cancel()
    assert upstream.received(1) == [CHAT, GET_MODELS]
    records = list(read_records(capture))
    assert records[0]["options"]["fault_control"] is True
    plans = [(r["change"], r["faults"]) for r in records if r["type"] == "fault_plan"]
    assert plans == [
        ("replace", ["status:503@path=/v1/chat/*"]),
        ("add", ["status:503@path=/v1/chat/*", "hang-on-reuse:4"]),
        ("clear", []),
    ]
    injected = [(r["conn"], r["seq"], r["fault"]) for r in records if r["type"] == "fault"]
    assert injected == [(2, 1, "status"), (1, 2, "status"), (1, 4, "hang-on-reuse")]
    result = await anyio.run_process(
        [sys.executable, "-m", "tracer", "analyze", str(capture), "--format", "json"]
    )
    doc = json.loads(result.stdout)
    assert [p["change"] for p in doc["evidence"]["fault_plans"]] == ["replace", "add", "clear"]
    assert doc["evidence"]["injected_faults"] == 3
    # the tap's own doing: not the engine's 503s nor a hop's hang
    assert doc["verdict"]["kind"] == "healthy"
    notes = {f["evidence"][0]["figures"]["fault"]: f for f in doc["findings"]}
    assert sorted(notes) == ["hang-on-reuse:4", "status:503@path=/v1/chat/*"]
    assert {f["kind"] for f in doc["findings"]} == {"injected_fault"}
    assert notes["status:503@path=/v1/chat/*"]["requests"] == ["t/1/2", "t/2/1"]
    # the report: each change a line in the provenance and a dotted line in the picture
    out = tmp_path / "control.md"
    done = await anyio.run_process(
        [sys.executable, "-m", "tracer", "report", str(capture), "-o", str(out)], check=False
    )
    assert done.returncode == 0, done.stderr
    md = out.read_text()
    assert "- faults changed at tap t" in md and "(clear): none from then on" in md
    svg = (tmp_path / "control-timeline.svg").read_text()
    assert all(f'id="faults-{n}"' in svg for n in (1, 2, 3)) and 'id="faults-4"' not in svg


def test_fault_control_needs_the_admin_endpoint() -> None:
    cmd = [sys.executable, "-m", "tracer", "proxy", "--listen", "127.0.0.1:0"]
    cmd += ["--upstream", "http://127.0.0.1:9", "--fault-control"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2
    assert "--fault-control needs --admin" in proc.stderr


def test_cli_refuses_a_bad_fault_spec() -> None:
    cmd = [sys.executable, "-m", "tracer", "proxy", "--listen", "127.0.0.1:0"]
    cmd += ["--upstream", "http://127.0.0.1:9", "--fault", "stall-after-events:2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2
    assert "stall-after-events is written stall-after-events:K:S" in proc.stderr
