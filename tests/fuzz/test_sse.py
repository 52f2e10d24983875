"""The SSE splitter (``tracer/protocol/sse.py``): any bytes split into events without an
error (it has none); the same events, the same ends and the same bytes pending whether
the bytes come in one read or cut anywhere, with ends asked for or not, and whether or
not a stream's content chunks came one per read (the learned shape's shortcut)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tracer.protocol.sse import SseEvent, SseSplitter, classify

from .support import budget, cut_up, no_hang, ran

KINDS = ("role", "content", "finish", "usage", "error", "done", "comment", "other")
EOL = st.sampled_from([b"\n", b"\n", b"\r\n", b"\r"])
TEXT = st.text(max_size=8) | st.sampled_from(['"', "\\", "\n", "\r\n", "a\\", "é"])
PREFIX = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"'
)
SUFFIX = b'"},"finish_reason":null}],"usage":null}'


def _json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


PAYLOADS = st.one_of(
    TEXT.map(lambda t: {"choices": [{"delta": {"content": t}, "finish_reason": None}]}).map(_json),
    st.just(b'{"choices":[{"delta":{"role":"assistant"}}]}'),
    st.sampled_from(["stop", "length", ""]).map(
        lambda r: _json({"choices": [{"delta": {}, "finish_reason": r}]})
    ),
    st.integers(0, 99).map(lambda n: _json({"usage": {"prompt_tokens": n}, "choices": []})),
    TEXT.map(lambda t: _json({"error": {"message": t}})),
    st.just(b'{"object":"error","message":"x"}'),
    st.just(b'{"tool_calls":[{"id":"a"}]}'),
    st.just(b"[DONE]"),
    st.binary(max_size=24).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"")),
)
LINES = st.one_of(
    PAYLOADS.flatmap(lambda p: st.sampled_from([b"data: ", b"data:"]).map(lambda d: d + p)),
    st.sampled_from([b": keep-alive", b"event: message", b"id: 7", b"retry: 10", b"x"]),
)


@st.composite
def streams(draw: st.DrawFn) -> list[bytes]:
    """Events as a server writes them, each its own write; line ends of any kind."""
    eol = draw(EOL) if draw(st.booleans()) else None
    events: list[bytes] = []
    for _ in range(draw(st.integers(0, 8))):
        if draw(st.integers(0, 2)) == 0:  # a plain content chunk of the stream's shape
            text = draw(TEXT).encode()
            events.append(PREFIX + text + SUFFIX + b"\n\n")
            continue
        end = eol or draw(EOL)
        lines = draw(st.lists(LINES, min_size=1, max_size=3))
        events.append(end.join(lines) + end + (eol or draw(EOL)))
        if draw(st.integers(0, 5)) == 0:
            events.append(eol or draw(EOL))  # an extra blank line
    return events


def run(reads: list[bytes], *, ends: bool) -> tuple[list[SseEvent], list[int], int]:
    """The events, where each ends in the whole (``ends``), the bytes still pending."""
    splitter = SseSplitter()
    events: list[SseEvent] = []
    positions: list[int] = []
    consumed = 0
    for data in reads:
        at: list[int] | None = [] if ends else None
        got = splitter.feed(data, at)
        events += got
        if at is not None:
            assert len(at) == len(got)
            positions += [consumed + p for p in at]
        consumed += len(data)
    assert positions == sorted(positions) and all(0 <= p <= consumed for p in positions)
    return events, positions, splitter.pending


def same_events(reads: list[bytes]) -> None:
    whole = b"".join(reads)
    with no_hang():
        one, one_at, one_pending = run([whole], ends=True)
        many, many_at, many_pending = run(reads, ends=True)
        plain, _, plain_pending = run(reads, ends=False)
        plain_one, _, _ = run([whole], ends=False)
    assert one == many == plain == plain_one
    assert one_at == many_at
    assert one_pending == many_pending == plain_pending
    for event in one:
        assert event.kind in KINDS
        assert event.kind != "comment" or event.size > 0
        event.as_record()


@budget(1.0)
@given(reads=cut_up(streams().map(b"".join)))
def test_a_stream_cut_anywhere(reads: list[bytes]) -> None:
    ran("sse.split")
    same_events(reads)


@budget(0.7)
@given(events=streams(), more=st.lists(st.integers(0, 400), max_size=4))
def test_a_stream_one_event_per_read(events: list[bytes], more: list[int]) -> None:
    """Events one per read (where the splitter learns a shape), some reads cut further."""
    ran("sse.split")
    reads: list[bytes] = []
    for i, event in enumerate(events):
        cut = more[i % len(more)] if more else 0
        reads += [event[:cut], event[cut:]] if 0 < cut < len(event) else [event]
    same_events(reads)


@budget(0.5)
@given(reads=cut_up(st.binary(max_size=120)))
def test_arbitrary_bytes(reads: list[bytes]) -> None:
    ran("sse.split")
    same_events(reads)


@budget(0.2)
@given(block=st.binary(max_size=80) | streams().map(b"".join))
def test_classify_anything(block: bytes) -> None:
    ran("sse.classify")
    event = classify(block)
    assert event.size == len(block) + 2
