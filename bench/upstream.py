"""A fast fake OpenAI-style upstream on raw asyncio Protocols.

The mode is chosen by the request path:

- ``/plain``: a small ``chat.completion`` JSON body with Content-Length, one write.
- ``/stream``: ``text/event-stream``, chunked; 64 SSE events of 120 bytes, each written as
  its own HTTP chunk (its own ``send``), then ``data: [DONE]`` and ``0\\r\\n\\r\\n``, no delay.
- ``/paced``: the same, with 2 ms between writes (the first event 2 ms after the head),
  like a decode step.

Keep-alive, one request at a time per connection (a pipelined request waits until the
current response is finished), no idle timeout. asyncio sets TCP_NODELAY on its sockets.

Pacing: asyncio's own timers wake up to 1 ms late (epoll_wait counts milliseconds), which
would blur the 2 ms gaps the bench looks at. A pacer thread sleeps with microsecond
precision until the earliest deadline and hands what is due to the loop in one batch.
Run as ``python -m bench.upstream --port P``; it prints ``ready`` on stdout when bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import signal
import sys
import threading
import time
from collections.abc import Callable

EVENTS = 64
PACE = 0.002
EVENT_SIZE = 120

_PLAIN_BODY = (
    b'{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"Hello from the bench '
    b'upstream."},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":6,'
    b'"total_tokens":15}}'
)
PLAIN_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_PLAIN_BODY)).encode()
    + b"\r\n\r\n"
    + _PLAIN_BODY
)
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
NOT_FOUND = (
    b"HTTP/1.1 404 Not Found\r\ncontent-type: text/plain\r\ncontent-length: 10\r\n\r\nnot found\n"
)


def _event(i: int, finish: bool) -> bytes:
    head = b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"delta":'
    tail = b'},"finish_reason":"stop"}]}\n\n' if finish else b"}}]}\n\n"
    text = b"t%d" % i
    body = head + b'{"content":"' + text + b'"' + tail
    pad = EVENT_SIZE - len(body)
    if pad > 0:  # pad the token text so every event is EVENT_SIZE bytes
        body = head + b'{"content":"' + text + b"_" * pad + b'"' + tail
    return body


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n" % len(payload) + payload + b"\r\n"


SSE_EVENTS = [_event(i, i == EVENTS - 1) for i in range(EVENTS)]
CHUNKS = [_chunk(e) for e in SSE_EVENTS]
DONE_CHUNK = _chunk(b"data: [DONE]\n\n")
LAST_CHUNK = b"0\r\n\r\n"
STREAM_WRITES = [*CHUNKS, DONE_CHUNK + LAST_CHUNK]
"""What follows STREAM_HEAD: 64 events, then [DONE] and the last chunk in one write."""


class Pacer:
    """Calls functions on the loop at monotonic deadlines, to ~50 µs rather than 1 ms."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.cond = threading.Condition()
        self.seq = itertools.count()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="pacer", daemon=True)
        self.thread.start()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        with self.cond:
            first = not self.heap or when < self.heap[0][0]
            heapq.heappush(self.heap, (when, next(self.seq), fn))
            if first:
                self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def _run(self) -> None:
        heap = self.heap
        while True:
            with self.cond:
                while not self.stopped:
                    if not heap:
                        self.cond.wait()
                        continue
                    delay = heap[0][0] - time.monotonic()
                    if delay <= 0:
                        break
                    self.cond.wait(delay)
                if self.stopped:
                    return
                limit = time.monotonic() + 20e-6
                due = []
                while heap and heap[0][0] <= limit:
                    due.append(heapq.heappop(heap)[2])
            try:
                self.loop.call_soon_threadsafe(_run_all, due)
            except RuntimeError:  # loop closed
                return


def _run_all(fns: list[Callable[[], None]]) -> None:
    for fn in fns:
        fn()


class Handler(asyncio.Protocol):
    __slots__ = ("buf", "busy", "paced_i", "pacer", "transport")

    def __init__(self, pacer: Pacer) -> None:
        self.buf = bytearray()
        self.busy = False
        self.transport: asyncio.Transport | None = None
        self.paced_i = 0
        self.pacer = pacer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._serve()

    def _serve(self) -> None:
        buf = self.buf
        write = self.transport.write if self.transport is not None else None
        while write is not None and not self.busy:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end])
            length = 0
            idx = head.lower().find(b"\r\ncontent-length:")
            if idx >= 0:
                line_end = head.find(b"\r\n", idx + 2)
                length = int(head[idx + 17 : line_end if line_end > 0 else len(head)])
            if len(buf) < end + 4 + length:
                return
            del buf[: end + 4 + length]
            sp = head.find(b" ")
            path = head[sp + 1 : head.find(b" ", sp + 1)]
            if path.startswith(b"/plain"):
                write(PLAIN_RESPONSE)
            elif path.startswith(b"/stream"):
                write(STREAM_HEAD)
                for piece in STREAM_WRITES:
                    write(piece)
            elif path.startswith(b"/paced"):
                write(STREAM_HEAD)
                self.busy = True
                self.paced_i = 0
                self.pacer.at(time.monotonic() + PACE, self._paced)
            else:
                write(NOT_FOUND)

    def _paced(self) -> None:
        if self.transport is None:
            return
        i = self.paced_i
        self.transport.write(STREAM_WRITES[i])
        i += 1
        if i < len(STREAM_WRITES):
            self.paced_i = i
            self.pacer.at(time.monotonic() + PACE, self._paced)
        else:
            self.busy = False
            if self.buf:
                self._serve()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    pacer = Pacer(loop)
    server = await loop.create_server(
        lambda: Handler(pacer), host, port, backlog=4096, reuse_address=True
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    try:
        async with server:
            await stop.wait()
    finally:
        pacer.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fast fake OpenAI-style upstream for the bench")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    sys.setswitchinterval(0.0005)  # the pacer thread gets the GIL back quickly
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
