"""Tiny servers for the scenario recorder (``tests/scenarios/record_classes.py``).

    python -m tests.scenarios.upstreams gateway --listen 127.0.0.1:0 --upstream URL
    python -m tests.scenarios.upstreams sse --listen 127.0.0.1:0

Each logs ``listening on 127.0.0.1:PORT`` once it accepts connections (what ``Lab.start``
waits for) and runs until SIGTERM.

``gateway``: an HTTP/1.0 forwarding gateway built on Python's standard library alone
(``http.server.ThreadingHTTPServer`` + ``http.client``), the way small in-house gateways
and shims are written. ``BaseHTTPRequestHandler`` keeps its default ``protocol_version``
``HTTP/1.0``, and with it ``parse_request`` never answers ``Expect: 100-continue`` (it
calls ``handle_expect_100`` only when ``protocol_version >= "HTTP/1.1"``): the handler reads
the request body (``rfile.read(Content-Length)``), which a client waiting for ``100
Continue`` has not sent. Once it has the body, it sends the request on to its upstream
(HTTP/1.1) and relays the answer as it comes (HTTP/1.0: ended by its close).

``sse``: an OpenAI-compatible ``/v1/chat/completions`` that streams ``max_tokens`` content
events, ``--itl`` apart (chunked, keep-alive). A request with ``x-big-event: BYTES``
gets, after ``x-big-after`` events (default 10), one content event whose ``data:`` line
is about BYTES long (one long delta in a single event, as a provider sends a whole
reasoning block or tool-call arguments), then the rest of the stream. ``GET /health``
answers 200; it answers ``Expect: 100-continue``.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "host",
    "content-length",
}


def _hostport(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host or "127.0.0.1", int(port)


# ---- gateway: stdlib http.server, HTTP/1.0 -------------------------------------------------


def gateway(listen: str, upstream: str) -> None:
    up = urlsplit(upstream)
    up_host, up_port = up.hostname or "127.0.0.1", up.port or 80

    class Gateway(BaseHTTPRequestHandler):
        # protocol_version stays BaseHTTPRequestHandler's "HTTP/1.0" (not set here)

        def do_GET(self) -> None:
            self._forward()

        def do_POST(self) -> None:
            self._forward()

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None  # waits for the body
            if length and (body is None or len(body) < length):
                self.log_message(
                    "client went away after %d of %d body bytes", len(body or b""), length
                )
                self.close_connection = True
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            conn = http.client.HTTPConnection(up_host, up_port, timeout=120)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():  # (send_response wrote its own two)
                    if k.lower() not in HOP_BY_HOP | {"server", "date"}:
                        self.send_header(k, v)
                self.end_headers()
                while chunk := resp.read1(65536):
                    self.wfile.write(chunk)
            except (OSError, http.client.HTTPException) as exc:
                self.log_message("relay ended: %s: %s", type(exc).__name__, exc)
            finally:
                conn.close()
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            sys.stderr.write(f"{time.time():.3f} {self.address_string()} {format % args}\n")
            sys.stderr.flush()

    server = ThreadingHTTPServer(_hostport(listen), Gateway)
    server.daemon_threads = True
    host, port = _hostport(listen)[0], server.server_port
    print(
        f"gateway (python http.server, {Gateway.protocol_version}) listening on "
        f"{host}:{port} -> {upstream}",
        file=sys.stderr,
        flush=True,
    )

    def terminate(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


# ---- sse: an OpenAI-shaped stream with one oversized event ----------------------------------


def _event(
    rid: str, delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None
) -> bytes:
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": "sim-model",
        "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _sse_stream(
    writer: asyncio.StreamWriter, headers: dict[str, str], body: bytes, itl: float, log: Any
) -> None:
    try:
        payload = json.loads(body or b"{}")
    except ValueError:
        payload = {}
    tokens = int(payload.get("max_tokens") or 16)
    big = int(headers.get("x-big-event") or 0)
    big_after = int(headers.get("x-big-after") or 10)
    rid = "chatcmpl-" + (headers.get("x-request-id") or f"{time.monotonic_ns():x}")
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    writer.write(_chunk(_event(rid, {"role": "assistant", "content": ""})))
    await writer.drain()
    sent = 0
    for i in range(tokens):
        await asyncio.sleep(itl)
        if big and i == big_after:
            filler = ("lorem ipsum dolor sit amet " * (big // 27 + 1))[:big]
            event = _event(rid, {"content": filler})
            log(f"{rid}: event {i + 1}: one data line of {len(event) - 2} bytes")
            writer.write(_chunk(event))
        writer.write(_chunk(_event(rid, {"content": f" tok{i}"})))
        await writer.drain()
        sent += 1
    writer.write(_chunk(_event(rid, {}, finish="length")))
    writer.write(
        _chunk(
            _event(
                rid,
                {},
                usage={"prompt_tokens": 1, "completion_tokens": sent, "total_tokens": sent + 1},
            )
        )
    )
    writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()
    log(f"{rid}: complete, {sent} tokens")


def sse(listen: str, itl: float) -> None:
    def log(text: str) -> None:
        print(f"{time.time():.3f} {text}", file=sys.stderr, flush=True)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                if headers.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                length = int(headers.get("content-length") or 0)
                body = await reader.readexactly(length) if length else b""
                if method == "POST" and target.startswith("/v1/chat/completions"):
                    await _sse_stream(writer, headers, body, itl, log)
                    continue
                status, text = (
                    ("200 OK", b'{"status":"ok"}')
                    if target == "/health"
                    else ("404 Not Found", b'{"error":"not found"}')
                )
                writer.write(
                    f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(text)}\r\n\r\n".encode()
                    + text
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError) or exc.partial:
                log(f"connection ended: {type(exc).__name__}: {exc}")
        finally:
            writer.close()

    async def main() -> None:
        host, port = _hostport(listen)
        server = await asyncio.start_server(handle, host, port)
        bound = server.sockets[0].getsockname()
        log(f"sse upstream listening on {bound[0]}:{bound[1]} (itl {itl:g}s)")
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with server:
            await stop.wait()

    asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.scenarios.upstreams",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="what", required=True)
    g = sub.add_parser("gateway", help="HTTP/1.0 gateway on http.server")
    g.add_argument("--listen", default="127.0.0.1:0")
    g.add_argument("--upstream", required=True)
    s = sub.add_parser("sse", help="OpenAI-shaped SSE with one oversized event")
    s.add_argument("--listen", default="127.0.0.1:0")
    s.add_argument("--itl", type=float, default=0.05)
    args = parser.parse_args(argv)
    if args.what == "gateway":
        gateway(args.listen, args.upstream)
    else:
        sse(args.listen, args.itl)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
