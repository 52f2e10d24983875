"""A streamed token's read (one whole chunk holding one plain content event) takes the
observer's shortcut (``BodyDecoder.whole_chunk``, ``SseSplitter.whole_content``,
``ExchangeTracker.add_content_read``). Its records must be the records of the full walk,
which an observer keeping response bytes (``bodies="all"``) always takes: the same
reads, events, gaps, first token and end, whatever the stream mixes in."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tracer import compiled
from tracer import events as ev
from tracer.observe.wire import ConnectionObserver

REQ = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 2\r\n\r\n{}"
)
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
PREFIXES = [
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"delta":{"content":"',
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"',
]
SUFFIXES = [b'"}}]}\n\n', b'"},"finish_reason":null}],"usage":null}\n\n']
TEXTS = [b"hi", b" world", b"t0__________________", b"x" * 70, b'a\\"b', b"\xc3\xa9", b"a\\"]


def _chunk(payload: bytes, ext: bytes = b"") -> bytes:
    return b"%x%s\r\n" % (len(payload), ext) + payload + b"\r\n"


def _reads(rnd: random.Random) -> list[bytes]:
    """A stream's response, cut into reads the way a socket would give it: mostly one
    chunk a read, sometimes two glued, a chunk cut, a chunk extension, other events."""
    prefix, suffix = rnd.choice(PREFIXES), rnd.choice(SUFFIXES)
    chunks = []
    for _ in range(rnd.randint(1, 90)):
        roll = rnd.random()
        if roll < 0.05:
            payload = b": keep-alive\n\n"
        elif roll < 0.08:
            payload = b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
        else:
            payload = prefix + rnd.choice(TEXTS) + suffix
        chunks.append(_chunk(payload, b";x=1" if rnd.random() < 0.03 else b""))
    chunks.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    reads = [HEAD + chunks[0]] if rnd.random() < 0.3 else [HEAD, chunks[0]]
    for chunk in chunks[1:]:
        roll = rnd.random()
        if roll < 0.06:
            reads[-1] += chunk  # two in one read
        elif roll < 0.1:
            cut = rnd.randint(1, len(chunk) - 1)
            reads += [chunk[:cut], chunk[cut:]]
        else:
            reads.append(chunk)
    return reads


def _records(reads: list[bytes], bodies: Any) -> list[dict[str, Any]]:
    out: list[ev.Event] = []
    obs = ConnectionObserver(
        tap="t", conn=1, emit=out.append, wall_offset=0.0, opened_m=0.0, bodies=bodies
    )
    m = 1.0
    obs.client_data(REQ, m)
    for data in reads:
        m += 0.0021
        obs.upstream_data(data, m)
    obs.close(m + 0.01, shutdown=False)
    records = [e.to_record() for e in out]
    for record in records:
        record.pop("data", None)
        record.pop("data_encoding", None)
    return records


@pytest.mark.parametrize("seed", range(40))
def test_token_reads_give_the_records_of_the_full_walk(seed: int) -> None:
    reads = _reads(random.Random(seed))
    fast, walked = _records(reads, "requests"), _records(reads, "all")
    assert fast == walked
    end = [r for r in fast if r["type"] == "response_end"]
    assert end and end[0]["termination"] == "complete" and end[0]["done"]


def test_a_stream_of_token_reads_is_counted_read_by_read() -> None:
    prefix, suffix = PREFIXES[0], SUFFIXES[1]
    payloads = [prefix + b"tok%d" % i + suffix for i in range(50)]
    reads = [HEAD] + [_chunk(p) for p in payloads] + [_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"]
    records = _records(reads, "requests")
    bodies = [r for r in records if r["type"] == "body"]
    entries = [e for b in bodies for e in b["sse"]]
    assert [e[1:] for e in entries[:50]] == [[len(p), "content"] for p in payloads]
    assert sum(b["chunks"] for b in bodies) == 51
    assert [list(r[1:]) for b in bodies for r in b["reads"]][:50] == [[len(p), 1] for p in payloads]
    (end,) = [r for r in records if r["type"] == "response_end"]
    assert end["events"] == 51 and end["first_token"] is not None


def test_the_shortcut_is_what_token_reads_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """(Pure Python only: a compiled class cannot be patched.) Else the test above could
    pass with the shortcut never taken."""
    if "tracer.observe.wire" in compiled.active():
        pytest.skip("the observer is compiled in this process")
    taken: list[int] = []
    original = ConnectionObserver.add_content_read

    def counting(self: Any, st: Any, m: float, size: int) -> None:
        taken.append(size)
        original(self, st, m, size)

    monkeypatch.setattr(ConnectionObserver, "add_content_read", counting)
    payload = PREFIXES[0] + b"tok" + SUFFIXES[0]
    _records([HEAD, _chunk(payload), _chunk(payload), _chunk(payload) + b"0\r\n\r\n"], "requests")
    assert taken == [len(payload)]  # the first is learned from, the glued last is walked
