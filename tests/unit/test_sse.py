"""SSE splitting (chunk boundaries are not event boundaries) and OpenAI chunk classification."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tracer.protocol.sse import MAX_EVENT, SseEvent, SseSplitter, classify

STREAMS = Path(__file__).parent.parent / "data" / "streams"


def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1732924800,
        "model": "m",
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    obj.update(extra)
    return obj


def compact(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode()


def spaced(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode()


@pytest.mark.parametrize("dump", [compact, spaced], ids=["pydantic", "json.dumps"])
def test_chat_chunks_in_both_json_spacings(dump: Any) -> None:
    role = classify(dump(chunk({"role": "assistant", "content": ""})))
    assert (role.kind, role.content, role.finish_reason) == ("role", False, None)
    token = classify(dump(chunk({"content": "Hi"})))
    assert (token.kind, token.content) == ("content", True)
    space = classify(dump(chunk({"content": " "})))
    assert space.content  # a lone space is a token
    quote = classify(dump(chunk({"content": '"quoted"'})))
    assert quote.content  # starts with an escaped quote
    empty = classify(dump(chunk({"content": ""})))
    assert (empty.kind, empty.content) == ("role", False)
    none = classify(dump(chunk({"content": None})))
    assert not none.content
    finish = classify(dump(chunk({"content": ""}, "stop")))
    assert (finish.kind, finish.finish_reason, finish.content) == ("finish", "stop", False)
    last_token = classify(dump(chunk({"content": "."}, "length")))
    assert (last_token.kind, last_token.finish_reason, last_token.content) == (
        "finish",
        "length",
        True,
    )
    usage = classify(
        dump(chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}))
    )
    assert usage.kind == "usage" and usage.usage == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
    }
    null_usage = classify(dump(chunk({"content": "x"}, usage=None)))
    assert null_usage.kind == "content" and null_usage.usage is None


def test_other_content_fields() -> None:
    assert classify(compact(chunk({"reasoning_content": "think"}))).content
    assert not classify(compact(chunk({"reasoning_content": ""}))).content
    tool = {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            }
        ]
    }
    assert classify(compact(chunk(tool))).kind == "content"
    assert not classify(compact(chunk({"tool_calls": []}))).content
    completion = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "Hello", "finish_reason": None}],
    }
    assert classify(compact(completion)).content
    # logprobs content is a list, not a token
    logprobs = chunk({"content": ""})
    logprobs["choices"][0]["logprobs"] = {"content": [{"token": "a", "logprob": -0.1}]}
    assert not classify(compact(logprobs)).content


def test_continuous_usage_on_a_content_chunk() -> None:
    event = classify(compact(chunk({"content": "x"}, usage={"total_tokens": 9})))
    assert event.kind == "content" and event.usage == {"total_tokens": 9}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            b'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}',
            "boom",
        ),
        (b'data: {"error":{"type":"BadRequestError","code":400}}', "BadRequestError"),
        (
            b'data: {"object": "error", "message": "Request aborted", "type": "Bad Request", "code": 400}',
            "Request aborted",
        ),
        (b'data: {"error": "plain text"}', "plain text"),
        (b'data: {"error": {"message": "cut', '{"error": {"message": "cut'),
    ],
)
def test_error_events(payload: bytes, message: str) -> None:
    event = classify(payload)
    assert event.kind == "error" and event.error == message and not event.content


def test_error_word_inside_content_is_not_an_error() -> None:
    event = classify(compact(chunk({"content": '{"error": 1}'})))
    assert event.kind == "content" and event.error is None


@pytest.mark.parametrize(
    ("block", "kind"),
    [
        (b"data: [DONE]", "done"),
        (b"data:[DONE]", "done"),
        (b": keepalive", "comment"),
        (b":", "comment"),
        (b"event: ping", "other"),
        (b"data: hello", "other"),
        (b"id: 7\nretry: 100", "other"),
        (b"event: message\ndata: [DONE]", "done"),
        (b': ping\ndata: {"choices":[{"delta":{"content":"x"}}]}', "content"),
    ],
)
def test_non_json_blocks(block: bytes, kind: str) -> None:
    assert classify(block).kind == kind


def test_multi_line_data_is_joined() -> None:
    event = classify(b'data: {"choices":[{"delta":\ndata: {"content":"x"}}]}')
    assert event.kind == "content"


def test_size_counts_the_blank_line_and_record_shape() -> None:
    event = classify(b"data: [DONE]")
    assert event.size == len(b"data: [DONE]\n\n")
    assert event.as_record() == [14, "done"]
    finish = SseEvent(size=10, kind="finish", finish_reason="stop")
    assert finish.as_record() == [10, "finish", "stop"]


# ---- splitting ---------------------------------------------------------------------------


def kinds(events: list[SseEvent]) -> list[str]:
    return [e.kind for e in events]


def test_several_events_in_one_feed_and_one_event_over_several() -> None:
    s = SseSplitter()
    first = s.feed(b'data: [DONE]\n\n: keepalive\n\ndata: {"choices":[{"delta":{"content":"h')
    assert kinds(first) == ["done", "comment"] and s.pending > 0
    assert s.feed(b'i"}}]}\n') == [] and s.pending > 0
    assert kinds(s.feed(b"\n")) == ["content"] and s.pending == 0


def test_crlf_endings_split_inside_the_pair() -> None:
    s = SseSplitter()
    out = s.feed(b"data: [DONE]\r\n\r")
    assert out == [] and s.pending
    out = s.feed(b"\n: keepalive\r")
    assert kinds(out) == ["done"]
    assert kinds(s.feed(b"\n\r\n")) == ["comment"] and s.pending == 0


def test_lone_cr_ends_a_line() -> None:
    s = SseSplitter()
    assert kinds(s.feed(b"data: [DONE]\r\r: keepalive\r\n\r")) == ["done"]
    assert s.pending  # the last CR may be half of a CRLF
    assert kinds(s.feed(b"\n")) == ["comment"] and s.pending == 0


def test_mixed_line_ends_do_not_depend_on_cuts() -> None:
    body = b'data: {"a"\r\n\r\r\n\r\n\n: x\r\rdata: [DONE]\n\r\n\r\r\n'
    whole = SseSplitter().feed(body)
    assert kinds(whole) == ["role", "comment", "done"]
    for cut in range(1, len(body)):
        s = SseSplitter()
        assert s.feed(body[:cut]) + s.feed(body[cut:]) == whole, cut
    s = SseSplitter()
    assert [e for i in range(len(body)) for e in s.feed(body[i : i + 1])] == whole


def test_extra_blank_lines_are_not_events() -> None:
    s = SseSplitter()
    assert kinds(s.feed(b"\n\ndata: [DONE]\n\n\n\n\r\n\r\n: x\n\n\n: y\n\n")) == [
        "done",
        "comment",
        "comment",
    ]
    assert s.pending == 0


@pytest.mark.parametrize(
    "fixture", ["vllm_stream", "spaced_stream", "router_rechunked", "error_stream"]
)
def test_any_cut_gives_the_same_events(fixture: str) -> None:
    raw = (STREAMS / f"{fixture}.upstream.bin").read_bytes()
    body = _dechunk(raw[raw.index(b"\r\n\r\n") + 4 :])
    whole = SseSplitter().feed(body)
    assert len(whole) >= 4 and whole[-1].kind == "done"
    rng = random.Random(fixture)
    for _ in range(20):
        s = SseSplitter()
        got: list[SseEvent] = []
        i = 0
        while i < len(body):
            n = rng.randint(1, 40)
            got += s.feed(body[i : i + n])
            i += n
        assert got == whole and s.pending == 0


def _dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        eol = data.index(b"\r\n")
        size = int(data[:eol], 16)
        if size == 0:
            return out
        out += data[eol + 2 : eol + 2 + size]
        data = data[eol + 4 + size :]


def test_an_endless_event_is_bounded() -> None:
    s = SseSplitter()
    piece = b"x" * 65536
    s.feed(b"data: ")
    for _ in range(40):
        assert s.feed(piece) == []
    total = 6 + 40 * len(piece)
    assert s.pending == total
    assert len(s._buf) <= MAX_EVENT + len(piece)  # memory stays bounded
    out = s.feed(b"\r\n\r\ndata: [DONE]\n\n")
    assert [(e.kind, e.size) for e in out] == [("other", total + 2), ("done", 14)]
    assert s.pending == 0


def test_deeply_nested_usage_does_not_raise() -> None:
    event = classify(b'data: {"usage":{"a":' + b"[" * 100_000 + b"}")
    assert event.usage is None
    error = classify(b'data: {"error":' + b"[" * 100_000)
    assert error.kind == "error" and error.error


def test_a_usage_object_the_text_kept_from_parsing_is_read_in_the_next_chunk() -> None:
    """The splitter's shortcut for chunks of a learned shape gives what ``classify`` gives:
    not learned from a chunk whose usage object did not parse (a text ending in a
    backslash), learned from ``"usage":null`` chunks."""
    template = b'data: {"choices":[{"delta":{"content":"@"}}],"usage":%s}\n\n'
    splitter = SseSplitter()
    for usage, texts in ((b'{"x":1}', (b"a\\", b"b", b"c")), (b"null", (b"a", b"b", b"c"))):
        for text in texts:
            event = template.replace(b"@", text) % usage
            (got,) = splitter.feed(event)
            assert got == classify(event[:-2]), event
    assert splitter.feed(template.replace(b"@", b"d") % b'{"x":2}')[0].usage == {"x": 2}
