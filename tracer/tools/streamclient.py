"""The load generator's client: anyio + h11 streaming, stamped per socket read.

No HTTP library on the hot path: against the simulated engine this costs ~14 µs of CPU
per SSE event, about half of httpx.AsyncClient (``python -m bench.loadgen_ceiling``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio
import h11
import orjson
from anyio.abc import ByteStream

from .workload import RequestSpec, as_int


@dataclass(frozen=True, slots=True)
class Target:
    scheme: str
    host: str
    port: int
    prefix: str  # path prefix before /v1/...

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--target {url!r}: expected http://HOST:PORT or https://HOST:PORT")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"--target {url!r}: bad port") from None
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[: -len("/v1")]
        return cls(parts.scheme, parts.hostname, port, prefix)

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.prefix}"

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(slots=True)
class Sample:
    """One request's outcome. Times are ``perf_counter`` seconds."""

    start: float
    end: float = 0.0
    ttft: float | None = None
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    chunks: int = 0  # SSE chunks with text
    itl: list[float] = field(default_factory=list)
    error: str | None = None


class SSEReader:
    """The lines of one streaming response, as bench_serving reads them."""

    __slots__ = ("buf", "done", "error", "recent", "sample", "usage")

    def __init__(self, sample: Sample) -> None:
        self.sample = sample
        self.buf = b""
        self.recent = sample.start
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.error: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        buf = self.buf + data if self.buf else data
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if line.startswith(b"data:"):
                self._data(line[5:].strip(), now)
        self.buf = buf[start:]

    def _data(self, payload: bytes, now: float) -> None:
        s = self.sample
        s.end = now
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        if obj.get("error"):
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = obj.get("choices")
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        text = choice.get("text")
        if not text:
            delta = choice.get("delta")
            if isinstance(delta, dict):
                text = (
                    delta.get("content")
                    or delta.get("reasoning_content")
                    or delta.get("reasoning")
                    or delta.get("tool_calls")
                )
        if not text:
            return
        if s.ttft is None:
            s.ttft = now - s.start
        else:
            s.itl.append(now - self.recent)
        self.recent = now
        s.chunks += 1


class _Failed(Exception):
    pass


_NET_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)


class StreamClient:
    """One keep-alive connection, one request at a time; reopened when the server closes it."""

    def __init__(
        self, target: Target, *, timeout: float, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.headers = [("host", target.host_header), *headers]
        self.stream: ByteStream | None = None
        self.conn = h11.Connection(h11.CLIENT)
        self.connects = 0

    async def _connect(self) -> None:
        await self.aclose()
        with anyio.fail_after(min(self.timeout, 10.0)):
            if self.target.scheme == "https":
                self.stream = await anyio.connect_tcp(
                    self.target.host, self.target.port, tls=True, tls_hostname=self.target.host
                )
            else:
                self.stream = await anyio.connect_tcp(self.target.host, self.target.port)
        self.conn = h11.Connection(h11.CLIENT)
        self.connects += 1

    async def aclose(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(*_NET_ERRORS):
                    await stream.aclose()

    async def exchange(self, spec: RequestSpec) -> Sample:
        """Send one streaming request and read the response to its end."""
        reused = self.stream is not None and self.conn.our_state is h11.IDLE
        sample = Sample(start=time.perf_counter())
        try:
            if not reused:
                await self._connect()
            try:
                await self._send(spec, sample)
            except _Failed as exc:
                # the server closed an idle keep-alive connection before reading: once more
                if not reused or sample.end or str(exc) != "closed before the response":
                    raise
                await self._connect()
                sample = Sample(start=time.perf_counter())
                await self._send(spec, sample)
        except _Failed as exc:
            sample.error = str(exc)
        except TimeoutError:
            sample.error = f"connect timeout to {self.target.host_header}"
        except OSError as exc:
            sample.error = f"connect failed: {exc.strerror or exc}"
        if sample.error is not None:
            await self.aclose()
            sample.end = sample.end or time.perf_counter()
        elif self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        else:
            await self.aclose()
        sample.latency = sample.end - sample.start
        return sample

    async def _send(self, spec: RequestSpec, sample: Sample) -> None:
        assert self.stream is not None
        stream, conn = self.stream, self.conn
        head = h11.Request(
            method="POST",
            target=self.target.prefix + spec.path,
            headers=[
                *self.headers,
                ("content-type", "application/json"),
                ("accept", "text/event-stream"),
                ("content-length", str(len(spec.body))),
            ],
        )
        data = (conn.send(head) or b"") + (conn.send(h11.Data(data=spec.body)) or b"")
        data += conn.send(h11.EndOfMessage()) or b""
        sample.start = time.perf_counter()
        try:
            await stream.send(data)
        except _NET_ERRORS:
            raise _Failed("closed before the response") from None
        sse = SSEReader(sample)
        status, error_body, now = 0, b"", sample.start
        with anyio.CancelScope() as scope:
            status, error_body, now = await self._read(stream, conn, sse, scope)
        if scope.cancelled_caught:
            raise _Failed(f"no bytes for {self.timeout:g}s")
        if not sample.end:
            sample.end = now
        if status != 200:
            text = error_body[:200].decode("utf-8", errors="replace").strip()
            raise _Failed(f"HTTP {status}" + (f": {text}" if text else ""))
        if sse.error is not None:
            raise _Failed(f"stream error: {sse.error}")
        if sample.ttft is None:
            raise _Failed("the stream carried no content")
        usage = sse.usage or {}
        sample.output_tokens = as_int(usage.get("completion_tokens")) or sample.chunks
        sample.prompt_tokens = as_int(usage.get("prompt_tokens")) or spec.prompt_len

    async def _read(
        self, stream: ByteStream, conn: h11.Connection, sse: SSEReader, scope: anyio.CancelScope
    ) -> tuple[int, bytes, float]:
        """The response: (status, start of an error body, time of the last read).

        One cancel scope whose deadline moves with every read: cheaper than a timeout per
        read, and the same rule (no bytes for ``timeout`` seconds).
        """
        status = 0
        error_body = b""
        now = sse.sample.start
        got_bytes = False
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise _Failed(f"protocol error: {exc}") from None
            if event is h11.NEED_DATA:
                scope.deadline = anyio.current_time() + self.timeout
                try:
                    data = await stream.receive()
                except anyio.EndOfStream:
                    data = b""
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    if not got_bytes:
                        raise _Failed("closed before the response") from None
                    raise _Failed("connection reset mid-response") from None
                now = time.perf_counter()
                if not data and not got_bytes:
                    raise _Failed("closed before the response")
                got_bytes = True
                conn.receive_data(data)
            elif type(event) is h11.Data:
                if status == 200:
                    sse.feed(event.data, now)
                elif len(error_body) < 400:
                    error_body += event.data
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.EndOfMessage):
                return status, error_body, now
            elif isinstance(event, h11.ConnectionClosed):
                raise _Failed("closed before the response ended")
