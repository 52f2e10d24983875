"""A simulated OpenAI-compatible engine that streams like SGLang/vLLM at the byte level.

Streaming responses are ``text/event-stream`` over chunked encoding, one SSE event per
chunk: a role chunk, content chunks, a chunk with ``finish_reason``, the usage chunk
when ``stream_options.include_usage`` is set, then ``data: [DONE]``. Idle keep-alive
connections are closed after ``keepalive`` seconds, as uvicorn does for both engines.
Per-request pacing can be set with headers (``x-sim-tokens``, ``x-sim-itl``,
``x-sim-ttft``) so tests can shape one request without restarting the engine.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import anyio
import h11
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

log = structlog.get_logger("tracer.sim.engine")


@dataclass
class EngineConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-model"
    tokens: int = 16  # output tokens when the request gives no max_tokens
    ttft: float = 0.02
    itl: float = 0.005
    keepalive: float = 5.0


class SimEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.bound: tuple[str, int] | None = None
        self.requests = 0
        self.connections = 0

    @property
    def url(self) -> str:
        assert self.bound is not None
        return f"http://{self.bound[0]}:{self.bound[1]}"

    async def serve(
        self, *, task_status: TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        listener = await anyio.create_tcp_listener(
            local_host=self.config.host, local_port=self.config.port
        )
        first = listener.listeners[0]
        self.bound = (
            str(first.extra(SocketAttribute.local_address)[0]),
            int(first.extra(SocketAttribute.local_port)),
        )
        task_status.started(self.bound)
        async with listener:
            await listener.serve(self._handle)

    async def _handle(self, stream: SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            async with stream:
                while True:
                    with anyio.move_on_after(self.config.keepalive):
                        got = await _read_request(conn, stream)
                    if got is None:
                        return
                    request, body = got
                    self.requests += 1
                    await self._respond(conn, stream, request, body)
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()
        except (
            anyio.BrokenResourceError,
            anyio.EndOfStream,
            anyio.ClosedResourceError,
            h11.ProtocolError,
            OSError,
        ):
            return

    async def _respond(
        self, conn: h11.Connection, stream: SocketStream, request: h11.Request, body: bytes
    ) -> None:
        path = request.target.decode().split("?", 1)[0]
        method = request.method.decode()
        hdrs = {k.decode().lower(): v.decode() for k, v in request.headers}
        if method == "GET" and path in ("/health", "/health_generate"):
            await _send_json(conn, stream, 200, {})
        elif method == "GET" and path == "/v1/models":
            await _send_json(
                conn,
                stream,
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.config.model,
                            "object": "model",
                            "owned_by": "sim",
                            "created": 0,
                        }
                    ],
                },
            )
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            try:
                payload = json.loads(body or b"{}")
            except ValueError:
                await _send_json(
                    conn, stream, 400, {"object": "error", "message": "invalid JSON body"}
                )
                return
            await self._completion(conn, stream, path, payload, hdrs)
        else:
            await _send_json(
                conn, stream, 404, {"object": "error", "message": f"no route {method} {path}"}
            )

    async def _completion(
        self,
        conn: h11.Connection,
        stream: SocketStream,
        path: str,
        payload: dict[str, Any],
        hdrs: dict[str, str],
    ) -> None:
        cfg = self.config
        chat = path.endswith("chat/completions")
        tokens = int(
            hdrs.get(
                "x-sim-tokens",
                payload.get("max_tokens") or payload.get("max_completion_tokens") or cfg.tokens,
            )
        )
        ttft = float(hdrs.get("x-sim-ttft", cfg.ttft))
        itl = float(hdrs.get("x-sim-itl", cfg.itl))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = str(payload.get("model") or cfg.model)
        prompt_tokens = _prompt_tokens(payload)
        finish = "length"
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens,
        }
        if not payload.get("stream"):
            await anyio.sleep(ttft + itl * max(0, tokens - 1))
            text = "".join(_token(i) for i in range(tokens))
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
                obj = "text_completion"
            await _send_json(
                conn,
                stream,
                200,
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                },
            )
            return
        head = h11.Response(
            status_code=200,
            headers=[("content-type", "text/event-stream"), ("cache-control", "no-cache")],
        )
        await stream.send(conn.send(head) or b"")
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(
            delta: dict[str, Any] | None, finish_reason: str | None, text: str | None = None
        ) -> bytes:
            if chat:
                choice = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            else:
                choice = {
                    "index": 0,
                    "text": text or "",
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
            }
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        async def send(data: bytes) -> None:
            await stream.send(conn.send(h11.Data(data=data)) or b"")

        await anyio.sleep(ttft)
        if chat:
            await send(chunk({"role": "assistant", "content": ""}, None))
        for i in range(tokens):
            if i:
                await anyio.sleep(itl)
            last = i == tokens - 1
            await send(chunk({"content": _token(i)}, finish if last else None, _token(i)))
        if tokens == 0:
            await send(chunk({}, finish))
        options = payload.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            await send(b"data: " + json.dumps(body).encode() + b"\n\n")
        await send(b"data: [DONE]\n\n")
        await stream.send(conn.send(h11.EndOfMessage()) or b"")


def _token(i: int) -> str:
    return f"tok{i} "


def _prompt_tokens(payload: dict[str, Any]) -> int:
    messages = payload.get("messages")
    if isinstance(messages, list):
        text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    else:
        text = str(payload.get("prompt", ""))
    return max(1, len(text) // 4)


async def _send_json(conn: h11.Connection, stream: SocketStream, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    head = h11.Response(
        status_code=status,
        headers=[("content-type", "application/json"), ("content-length", str(len(body)))],
    )
    await stream.send(conn.send(head) or b"")
    await stream.send(conn.send(h11.Data(data=body)) or b"")
    await stream.send(conn.send(h11.EndOfMessage()) or b"")


async def _read_request(
    conn: h11.Connection, stream: SocketStream
) -> tuple[h11.Request, bytes] | None:
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive()
            except anyio.EndOfStream:
                data = b""
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            request = event
            if conn.they_are_waiting_for_100_continue:
                await stream.send(
                    conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
                )
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return (request, bytes(body)) if request is not None else None
        else:
            return None
