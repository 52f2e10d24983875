"""HTTP/1.1 bytes as the relay tests write them by hand."""

from __future__ import annotations


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


GET = b"GET /v1/models HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer sk-secret\r\n\r\n"
OK_CL = (
    b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
POST_BODY = (
    b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
)
POST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\ncontent-type: application/json\r\n"
    b"x-request-id: rid-1\r\ncontent-length: %d\r\n\r\n%s" % (len(POST_BODY), POST_BODY)
)
