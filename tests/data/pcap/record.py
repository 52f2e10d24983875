"""Record the real tcpdump captures beside this file (run as root, once; needs tcpdump):

    python tests/data/pcap/record.py

* ``sse_lo.pcap``: ``tcpdump -i lo`` (Ethernet link type) of one keep-alive connection
  to a small HTTP/1.1 server on 127.0.0.1:18000: a POST /v1/chat/completions answered
  by a chunked SSE stream (three content events 50 ms apart, a finish, ``data: [DONE]``),
  then a GET /v1/models on the same connection, then the client closes.
* ``hang_any.pcap``: ``tcpdump -i any`` (Linux cooked v2) of a stream that stops after
  two events; the client gives up 6 s later and closes (the server's FIN follows).

The client and the server are plain sockets so that what goes on the wire is exactly
what is written here, segment by segment (``TCP_NODELAY``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).parent
PORT = 18000
BODY = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}'
SSE = [
    b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"!"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]
MODELS = b'{"object":"list","data":[{"id":"m"}]}'


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def read_request(conn: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
    while b"\r\n\r\n" not in buf:
        more = conn.recv(65536)
        if not more:
            return b"", b""
        buf += more
    head, rest = buf.split(b"\r\n\r\n", 1)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        rest += conn.recv(65536)
    return head, rest[length:]


def serve(listener: socket.socket, hang: bool) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    while True:
        head, buf = read_request(conn, buf)
        if not head:
            break
        if head.startswith(b"POST"):
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            for i, event in enumerate(SSE):
                if hang and i == 2:
                    break  # the stream stops here; the client gives up
                time.sleep(0.05)
                conn.sendall(chunk(event))
            else:
                conn.sendall(b"0\r\n\r\n")
        else:
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(MODELS)).encode()
                + b"\r\n\r\n"
                + MODELS
            )
    conn.close()


def client(hang: bool) -> None:
    sock = socket.create_connection(("127.0.0.1", PORT))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: engine\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
    )
    got = b""
    sock.settimeout(6.0 if hang else 10.0)
    try:
        while not got.endswith(b"0\r\n\r\n"):
            more = sock.recv(65536)
            if not more:
                break
            got += more
    except TimeoutError:
        sock.close()  # gave up on the hung stream
        return
    time.sleep(0.2)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: engine\r\n\r\n")
    got = b""
    while MODELS not in got:
        got += sock.recv(65536)
    time.sleep(0.1)
    sock.close()


def record(name: str, iface: str, hang: bool) -> None:
    out = HERE / name
    dump = subprocess.Popen(
        ["tcpdump", "-i", iface, "--immediate-mode", "-U", "-w", str(out), f"tcp port {PORT}"],
        stderr=subprocess.PIPE,
    )
    assert dump.stderr is not None
    dump.stderr.readline()  # "listening on ..."
    time.sleep(0.5)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", PORT))
    listener.listen()
    server = threading.Thread(target=serve, args=(listener, hang))
    server.start()
    client(hang)
    server.join()
    listener.close()
    time.sleep(1.5)  # (the kernel hands packets over in blocks: let the last one come)
    dump.send_signal(2)
    dump.wait()
    print(name, out.stat().st_size, "bytes", file=sys.stderr)


if __name__ == "__main__":
    record("sse_lo.pcap", "lo", hang=False)
    record("hang_any.pcap", "any", hang=True)
