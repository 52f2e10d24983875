"""The sans-I/O observer, fed recorded byte streams with no network.

As in h11's own tests, every scenario is fed whole, one byte at a time and in random
splits (fixed seeds); the events must be the same apart from how many ``body`` records
share a response body. Fixtures are raw bytes of one direction of one connection
(``tests/data/streams/*.client.bin`` / ``*.upstream.bin``, see the README there).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tracer import events as ev
from tracer.capture.files import event_from_record
from tracer.observe.wire import Bodies, ConnectionObserver

STREAMS = Path(__file__).parent.parent / "data" / "streams"
OPENED = 100.0
WALL = 1_700_000_000.0
SPLITS = ("whole", "bytes", "random:1", "random:2", "random:3")

# A step of a scenario: ("c" | "u", m, bytes) for data from the client / upstream;
# ("ceof" | "ueof", m, reset); ("close", m, shutdown); ("tick", m, stall_after, blocked, unsent);
# ("tracer", m, status, reason).
Step = tuple[Any, ...]


def load(name: str) -> bytes:
    return (STREAMS / name).read_bytes()


def pieces(data: bytes, split: str, rng: random.Random) -> list[bytes]:
    if split == "whole" or len(data) < 2:
        return [data]
    if split == "bytes":
        return [data[i : i + 1] for i in range(len(data))]
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 12))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def observer(events: list[ev.Event], bodies: Bodies = "requests", **kw: Any) -> ConnectionObserver:
    return ConnectionObserver(
        tap="t", conn=1, emit=events.append, wall_offset=WALL, opened_m=OPENED, bodies=bodies, **kw
    )


def apply(obs: ConnectionObserver, step: Step, split: str, rng: random.Random) -> None:
    kind, m = step[0], step[1]
    if kind in ("c", "u"):
        feed = obs.client_data if kind == "c" else obs.upstream_data
        for piece in pieces(step[2], split, rng):
            feed(piece, m)
    elif kind == "ceof":
        obs.client_eof(m, reset=step[2])
    elif kind == "ueof":
        obs.upstream_eof(m, reset=step[2])
    elif kind == "close":
        obs.close(m, shutdown=step[2])
    elif kind == "tick":
        obs.tick(m, stall_after=step[2], client_blocked=step[3], unsent=step[4])
    elif kind == "tracer":
        obs.tracer_response(m, step[2], step[3])
    else:  # pragma: no cover - a typo in a scenario
        raise AssertionError(kind)


def play(
    steps: list[Step], split: str = "whole", bodies: Bodies = "requests", **kw: Any
) -> tuple[list[ev.Event], ConnectionObserver]:
    events: list[ev.Event] = []
    obs = observer(events, bodies, **kw)
    rng = random.Random(int(split.split(":")[1]) if ":" in split else 0)
    for step in steps:
        apply(obs, step, split, rng)
    obs.flush(math.inf)  # body reads still batched when the script ends
    return events, obs


def as_read(events: list[ev.Event]) -> list[ev.Event]:
    """The events as a reader of the capture sees them (what the tap leaves to it done)."""
    read = [event_from_record(e.to_record()) for e in events]
    return [e for e in read if e is not None]


def norm(events: list[ev.Event]) -> list[dict[str, Any]]:
    """Records, with consecutive body records of one request merged into one.

    Body records are batches of reads; how reads are batched depends on how the bytes
    were cut, but every SSE event's arrival time (``m`` + its ``dt``) does not.
    """
    out: list[dict[str, Any]] = []
    for e in events:
        rec = e.to_record()
        if rec["type"] == "body":
            text, enc = rec.pop("data", None), rec.pop("data_encoding", None)
            raw = b"" if text is None else decode(text, enc)
            sse = [[round(rec["m"] + x[0], 6), *x[1:]] for x in rec.pop("sse", [])]
            for key in ("reads", "t", "m"):
                rec.pop(key, None)
            prev = out[-1] if out else None
            if prev and prev["type"] == "body" and prev["seq"] == rec["seq"]:
                prev["size"] += rec["size"]
                prev["chunks"] += rec["chunks"]
                prev["sse"] += sse
                prev["raw"] += raw
                continue
            rec["sse"] = sse
            rec["raw"] = raw
        out.append(rec)
    return out


def decode(text: str, encoding: str | None) -> bytes:
    return base64.b64decode(text) if encoding == "base64" else text.encode()


def of[E: ev.Event](events: list[ev.Event], cls: type[E]) -> list[E]:
    """The events of ``cls``, as a reader of the capture sees them."""
    return [e for e in as_read(events) if isinstance(e, cls)]


def one[E: ev.Event](events: list[ev.Event], cls: type[E]) -> E:
    found = of(events, cls)
    assert len(found) == 1, found
    return found[0]


def sse_kinds(events: list[ev.Event]) -> list[str]:
    return [rec[2] for b in of(events, ev.BodyData) for rec in (b.sse or [])]


def split_before(data: bytes, pattern: bytes) -> list[bytes]:
    """Cut a stream of messages before each match of ``pattern`` (a message start)."""
    starts = [mt.start() for mt in re.finditer(pattern, data)]
    assert starts and starts[0] == 0
    return [data[a:b] for a, b in zip(starts, [*starts[1:], len(data)], strict=True)]


def http_parts(response: bytes) -> list[bytes]:
    """A chunked response cut into its head and its chunks, each with its framing."""
    i = response.index(b"\r\n\r\n") + 4
    parts = [response[:i]]
    while i < len(response):
        eol = response.find(b"\r\n", i)
        if eol < 0 or not re.fullmatch(rb"[0-9a-fA-F]+", response[i:eol]):
            parts.append(response[i:])  # cut, or not chunked framing: the rest at once
            break
        size = int(response[i:eol], 16)
        end = min(len(response), eol + 4 + size)
        parts.append(response[i:end])
        i = end
    return parts


def stream_steps(
    upstream: bytes, *, t0: float = 100.1, gaps: dict[int, float] | None = None
) -> list[Step]:
    """Client request at t0; upstream head at t0+0.2, then one chunk each 0.1 s (plus gaps)."""
    steps: list[Step] = [("c", t0, load("chat_stream.client.bin"))]
    m = t0 + 0.2
    for i, part in enumerate(http_parts(upstream)):
        m += (gaps or {}).get(i, 0.0)
        steps.append(("u", round(m, 6), part))
        m += 0.1
    return steps


def request_body(raw: bytes) -> bytes:
    return raw[raw.index(b"\r\n\r\n") + 4 :]


MODELS = request_body(load("http10_close.upstream.bin"))  # the /v1/models JSON body
USAGE = {"prompt_tokens": 21, "total_tokens": 25, "completion_tokens": 4}
VLLM_KINDS = ["role", "content", "content", "content", "content", "finish", "usage", "done"]


# ---- scenarios shared by the split-invariance and fuzz tests ------------------------------


def keepalive_steps() -> list[Step]:
    reqs = split_before(load("keepalive3.client.bin"), rb"(?:GET|POST) /")
    resps = split_before(load("keepalive3.upstream.bin"), rb"HTTP/1\.1 ")
    stream = http_parts(resps[0])
    times = [100.7, 100.75, 101.25, 101.3, 101.35, 101.4, 101.45, 101.5, 101.55, 101.6]
    steps: list[Step] = [("c", 100.5, reqs[0])]
    steps += [("u", m, part) for m, part in zip(times, stream, strict=True)]
    steps += [("c", 103.6, reqs[1]), ("u", 104.0, resps[1])]
    steps += [("c", 109.0, reqs[2]), ("u", 109.01, resps[2]), ("ceof", 120.0, False)]
    return steps


def truncated_steps(reset: bool = False) -> list[Step]:
    return [*stream_steps(load("truncated.upstream.bin")), ("ueof", 105.0, reset)]


def pipelined_steps() -> list[Step]:
    resps = split_before(load("pipelined.upstream.bin"), rb"HTTP/1\.1 ")
    return [
        ("c", 100.1, load("pipelined.client.bin")),
        ("u", 100.2, resps[0]),
        ("u", 100.3, resps[1]),
    ]


def http10_steps() -> list[Step]:
    get = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    return [
        ("c", 100.1, get),
        ("u", 100.2, load("http10_close.upstream.bin")),
        ("ueof", 100.5, False),
    ]


SCENARIOS: dict[str, Callable[[], list[Step]]] = {
    "keepalive3": keepalive_steps,
    "vllm": lambda: stream_steps(load("vllm_stream.upstream.bin")),
    "spaced": lambda: stream_steps(load("spaced_stream.upstream.bin")),
    "router": lambda: stream_steps(load("router_rechunked.upstream.bin")),
    "error": lambda: stream_steps(load("error_stream.upstream.bin")),
    "no_done": lambda: stream_steps(load("no_done.upstream.bin")),
    "truncated": truncated_steps,
    "pipelined": pipelined_steps,
    "http10": http10_steps,
    "bad_chunked": lambda: [
        *stream_steps(load("bad_chunked.upstream.bin")),
        ("ueof", 105.0, False),
    ],
    "garbage": lambda: [("c", 100.1, load("garbage_request.client.bin")), ("ceof", 100.2, True)],
}


@pytest.mark.parametrize("bodies", ["requests", "all"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_events_do_not_depend_on_how_bytes_are_cut(name: str, bodies: Bodies) -> None:
    steps = SCENARIOS[name]()
    whole = norm(play(steps, "whole", bodies)[0])
    assert whole
    for split in SPLITS[1:]:
        assert norm(play(steps, split, bodies)[0]) == whole, split


# ---- keep-alive: three requests on one connection -----------------------------------------


def test_keepalive_three_requests() -> None:
    events, obs = play(keepalive_steps())
    heads = of(events, ev.RequestHead)
    assert [h.seq for h in heads] == [1, 2, 3]
    assert [h.idle_before for h in heads] == pytest.approx([0.5, 2.0, 5.0])
    assert [h.request_id for h in heads] == ["req-ka-1", "req-ka-2", None]
    assert [(h.method, h.target, h.version) for h in heads] == [
        ("POST", "/v1/chat/completions", "1.1"),
        ("POST", "/v1/chat/completions", "1.1"),
        ("GET", "/v1/models", "1.1"),
    ]
    assert not any(h.pipelined for h in heads)
    assert [h.m for h in heads] == [100.5, 103.6, 109.0]
    assert heads[0].t == pytest.approx(WALL + 100.5)

    ends = of(events, ev.RequestEnd)
    assert [(e.model, e.stream, e.max_tokens, e.messages) for e in ends] == [
        ("Qwen/Qwen2.5-7B-Instruct", True, 4, 2),
        ("Qwen/Qwen2.5-7B-Instruct", False, 64, 1),
        (None, None, None, None),
    ]
    bodies = [
        request_body(r) for r in split_before(load("keepalive3.client.bin"), rb"(?:GET|POST) /")
    ]
    assert [e.body_bytes for e in ends] == [len(b) for b in bodies]
    assert [e.body_sha256 for e in ends] == [hashlib.sha256(b).hexdigest() for b in bodies]
    assert all(e.complete for e in ends)
    assert b'"stream": false' in bodies[1]  # the json.dumps spacing of a Python client

    resp = of(events, ev.ResponseHead)
    assert [(r.status, r.sse, r.chunked, r.content_length) for r in resp] == [
        (200, True, True, None),
        (
            200,
            False,
            False,
            len(request_body(split_before(load("keepalive3.upstream.bin"), rb"HTTP/1\.1 ")[1])),
        ),
        (200, False, False, len(MODELS)),
    ]
    assert [r.ttfb for r in resp] == pytest.approx([0.2, 0.4, 0.01])

    done = of(events, ev.ResponseEnd)
    assert [d.termination for d in done] == ["complete"] * 3
    first = done[0]
    assert first.events == 8 and first.comments == 0
    assert first.done and first.finish_reason == "length" and first.usage == USAGE
    assert first.error is None and not first.mid_event and first.close is None
    assert first.first_token == pytest.approx(0.75)  # "Hello" at 101.25, request at 100.5
    assert first.max_gap == pytest.approx(0.5)
    assert first.duration == pytest.approx(1.1)
    assert sse_kinds(events) == VLLM_KINDS
    assert sum(b.size for b in of(events, ev.BodyData) if b.seq == 1) == first.body_bytes
    assert sum(b.chunks for b in of(events, ev.BodyData) if b.seq == 1) == 8
    assert [d.done for d in done] == [True, False, False]
    assert [d.first_token for d in done[1:]] == [None, None]
    assert obs.seq == 3 and not obs.in_flight and not obs.blind
    assert obs.client_bytes == len(load("keepalive3.client.bin"))
    assert obs.upstream_bytes == len(load("keepalive3.upstream.bin"))
    # the order of records per request
    kinds = [type(e).__name__ for e in events if getattr(e, "seq", None) == 2]
    assert kinds == ["RequestHead", "RequestEnd", "ResponseHead", "BodyData", "ResponseEnd"]


def test_secrets_are_redacted_before_events_are_emitted() -> None:
    events, _ = play(keepalive_steps(), bodies="all")
    req1, _, req3 = (dict((k.lower(), v) for k, v in h.headers) for h in of(events, ev.RequestHead))
    assert req1["authorization"] == "Bearer [redacted]"
    assert req1["cookie"] == "[redacted]"
    assert req1["x-api-key"] == "[redacted]"
    assert req1["x-request-id"] == "req-ka-1" and req1["content-type"] == "application/json"
    assert req3["authorization"] == "Basic [redacted]"
    resp2 = dict(of(events, ev.ResponseHead)[1].headers)
    assert resp2["set-cookie"] == "[redacted]"
    # header names keep their case as sent
    assert ["Authorization", "Bearer [redacted]"] in of(events, ev.RequestHead)[0].headers
    everything = json.dumps([e.to_record() for e in events])
    assert "SECRET" not in everything
    assert "sk-live" not in everything and "dXNlcjpTRUNSRVQ" not in everything


@pytest.mark.parametrize("bodies", ["none", "requests", "all"])
def test_bodies_kept_per_option(bodies: Bodies) -> None:
    events, _ = play(keepalive_steps(), bodies=bodies)
    ends = of(events, ev.RequestEnd)
    body1 = request_body(split_before(load("keepalive3.client.bin"), rb"(?:GET|POST) /")[0])
    if bodies == "none":
        assert [e.body for e in ends] == [None, None, None]
        assert [e.body_kept for e in ends] == [False, False, True]  # an empty body is kept
    else:
        assert ends[0].body == body1.decode() and ends[0].body_encoding == "utf-8"
        assert [e.body_kept for e in ends] == [True, True, True]
        assert ends[2].body is None
    # OpenAI fields are read whatever is kept
    assert ends[0].model == "Qwen/Qwen2.5-7B-Instruct" and ends[0].messages == 2
    data = [b.data for b in of(events, ev.BodyData)]
    if bodies == "all":
        upstream = load("keepalive3.upstream.bin")
        resp3 = split_before(upstream, rb"HTTP/1\.1 ")[2]
        assert data[-1] == request_body(resp3).decode()
        sse = "".join(
            d or "" for b, d in zip(of(events, ev.BodyData), data, strict=True) if b.seq == 1
        )
        assert sse.startswith("data: {") and sse.endswith("data: [DONE]\n\n")
    else:
        assert data == [None] * len(data)


def test_a_kept_body_leaves_its_hash_and_fields_to_the_reader() -> None:
    """What a reader derives from a kept body is what the tap measures when it keeps none."""
    kept, _ = play(keepalive_steps(), bodies="requests")
    measured, _ = play(keepalive_steps(), bodies="none")
    recs = [e.to_record() for e in kept if isinstance(e, ev.RequestEnd)]
    assert all("body_sha256" not in r and "model" not in r for r in recs if r["body_bytes"])
    assert all("body_sha256" in r for r in recs if not r["body_bytes"])  # nothing kept
    facts = ("body_sha256", "model", "stream", "max_tokens", "messages", "body_bytes")

    def read(events: list[ev.Event]) -> list[tuple[Any, ...]]:
        return [tuple(getattr(e, k) for k in facts) for e in of(events, ev.RequestEnd)]

    assert read(kept) == read(measured)
    assert read(kept)[0][1] == "Qwen/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize("split", ["whole", "bytes", "random:3"])
def test_body_over_keep_limit_is_hashed_not_kept(split: str) -> None:
    raw = load("chat_stream.client.bin")
    body = request_body(raw)
    events, _ = play([("c", 100.1, raw)], split, max_body_keep=100)
    end = one(events, ev.RequestEnd)
    assert end.body is None and not end.body_kept
    assert end.body_bytes == len(body) and end.body_sha256 == hashlib.sha256(body).hexdigest()
    assert end.model is None  # not parsed from a partial body


def test_binary_body_is_base64_and_bad_json_gives_no_fields() -> None:
    body = b"\xff\xfe{not json"
    head = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    events, _ = play([("c", 100.1, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)])
    end = one(events, ev.RequestEnd)
    assert end.body_encoding == "base64" and base64.b64decode(end.body or "") == body
    assert end.model is None and end.stream is None


def test_deeply_nested_json_body_does_not_raise() -> None:
    body = b"[" * 100_000
    head = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    events, _ = play([("c", 100.1, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)])
    assert one(events, ev.RequestEnd).model is None


def test_chunked_request_body() -> None:
    payload = json.dumps(
        {"model": "m", "stream": False, "max_completion_tokens": 7, "messages": []}
    )
    data = payload.encode()
    wire = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, data[:10], len(data) - 10, data[10:])
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    events, _ = play([("c", 100.1, head + wire)])
    assert one(events, ev.RequestHead).chunked
    end = one(events, ev.RequestEnd)
    assert end.body == payload and end.body_bytes == len(data)
    assert (end.model, end.stream, end.max_tokens, end.messages) == ("m", False, 7, 0)


# ---- SSE streams as SGLang / vLLM / a router send them ------------------------------------


@pytest.mark.parametrize(
    ("fixture", "token_part"),
    [("vllm_stream", 2), ("spaced_stream", 2), ("router_rechunked", 4)],
)
def test_clean_sse_stream(fixture: str, token_part: int) -> None:
    upstream = load(f"{fixture}.upstream.bin")
    steps = stream_steps(upstream, gaps={3: 1.0})
    events, obs = play(steps)
    head = one(events, ev.ResponseHead)
    assert head.sse and head.chunked and head.status == 200 and head.ttfb == pytest.approx(0.2)
    end = one(events, ev.ResponseEnd)
    assert end.termination == "complete" and end.status == 200
    assert end.done and end.finish_reason == "length" and end.usage == USAGE
    assert end.error is None and not end.mid_event and end.close is None
    assert end.events == 8
    # the first content event completes with the bytes of part `token_part`
    assert end.first_token == pytest.approx(steps[1 + token_part][1] - 100.1)
    assert end.max_gap == pytest.approx(1.1)
    body = sum(len(p) for p in http_parts(upstream)[1:])
    assert end.body_bytes < body and end.body_bytes == sum(b.size for b in of(events, ev.BodyData))
    chunks = len(http_parts(upstream)) - 2  # minus the head and the last-chunk
    assert sum(b.chunks for b in of(events, ev.BodyData)) == chunks
    kinds = [k for k in sse_kinds(events) if k != "comment"]
    assert kinds == VLLM_KINDS
    finish = [
        (b.m + rec[0], rec)
        for b in of(events, ev.BodyData)
        for rec in (b.sse or [])
        if rec[2] == "finish"
    ]
    assert len(finish) == 1 and finish[0][1][3] == "length" and finish[0][0] > 100
    assert not obs.in_flight


def test_router_stream_counts_heartbeats_and_splits_events() -> None:
    steps = stream_steps(load("router_rechunked.upstream.bin"))
    events, _ = play(steps)
    assert one(events, ev.ResponseEnd).comments == 2
    per_read = [
        [rec[2] for rec in (b.sse or []) if rec[0] == read[0]]
        for b in of(events, ev.BodyData)
        for read in b.reads
    ]
    # part 1 is a cut heartbeat, part 3 ends inside a CRLF pair: no event completes there
    assert per_read[0] == [] and per_read[1] == ["comment"] and per_read[2] == ["role"]
    # the "\n" that completes "Hello" and the rest of a chunk that holds several events
    assert per_read[3] == ["content", "comment", "content"]
    assert max(len(r) for r in per_read) >= 3


def test_sse_error_event_then_done() -> None:
    events, _ = play(stream_steps(load("error_stream.upstream.bin")))
    end = one(events, ev.ResponseEnd)
    assert end.termination == "complete" and end.done
    assert end.error == "The decoder prompt is longer than the maximum model length"
    assert end.finish_reason is None and end.usage is None
    assert end.events == 4 and sse_kinds(events) == ["role", "content", "error", "done"]


def test_clean_end_without_done_or_finish_reason() -> None:
    events, _ = play(stream_steps(load("no_done.upstream.bin")))
    end = one(events, ev.ResponseEnd)
    assert end.termination == "complete"  # the framing ended cleanly: analysis flags the rest
    assert not end.done and end.finish_reason is None and end.usage is None
    assert end.events == 3 and not end.mid_event


def test_last_chunk_late_after_done_counts_as_a_gap() -> None:
    steps = stream_steps(load("vllm_stream.upstream.bin"), gaps={9: 30.0})
    end = one(play(steps)[0], ev.ResponseEnd)
    assert end.termination == "complete" and end.done
    assert end.max_gap == pytest.approx(30.1)


def test_content_type_case_is_ignored() -> None:
    upstream = load("vllm_stream.upstream.bin").replace(b"text/event-stream", b"Text/Event-Stream")
    events, _ = play(stream_steps(upstream))
    assert one(events, ev.ResponseHead).sse and one(events, ev.ResponseEnd).events == 8


# ---- truncation ---------------------------------------------------------------------------


@pytest.mark.parametrize("reset", [False, True])
def test_upstream_cut_mid_chunk_mid_event(reset: bool) -> None:
    events, obs = play(truncated_steps(reset))
    end = one(events, ev.ResponseEnd)
    assert end.termination == "truncated"
    assert end.close == ("reset" if reset else "fin")
    assert end.mid_event and not end.done and end.finish_reason is None
    assert end.events == 3  # role, "Hello", "!"
    assert end.first_token is not None and end.duration == pytest.approx(105.0 - 100.1)
    assert end.body_bytes == sum(b.size for b in of(events, ev.BodyData)) > 0
    if not reset:
        assert "incomplete chunked read" in (end.detail or "")
    assert not of(events, ev.Anomaly) and not obs.in_flight
    assert obs.upstream_close == ("reset" if reset else "fin") and obs.upstream_closed_m == 105.0


def test_upstream_cut_between_events_is_not_mid_event() -> None:
    parts = http_parts(load("vllm_stream.upstream.bin"))
    steps = [("c", 100.1, load("chat_stream.client.bin")), ("u", 100.3, b"".join(parts[:4]))]
    end = one(play([*steps, ("ueof", 101.0, False)])[0], ev.ResponseEnd)
    assert end.termination == "truncated" and not end.mid_event and end.events == 3


@pytest.mark.parametrize("reset", [False, True])
def test_upstream_closes_with_zero_response_bytes(reset: bool) -> None:
    events, _ = play([("c", 100.1, load("chat_stream.client.bin")), ("ueof", 100.6, reset)])
    assert one(events, ev.RequestEnd).complete
    assert not of(events, ev.ResponseHead)
    end = one(events, ev.ResponseEnd)
    assert end.termination == "truncated" and end.body_bytes == 0
    assert end.status is None and end.ttfb is None and end.max_gap is None
    assert end.close == ("reset" if reset else "fin")
    assert end.duration == pytest.approx(0.5)


def test_request_after_upstream_idle_close_is_recorded_and_truncated() -> None:
    """The stale keep-alive race: the upstream closed the idle connection first."""
    first = [
        ("c", 100.1, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("u", 100.2, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
    ]
    steps = [*first, ("ueof", 105.2, False), ("c", 105.3, load("chat_stream.client.bin"))]
    events, obs = play(steps)
    assert not of(events, ev.Anomaly) and not obs.blind
    assert [h.seq for h in of(events, ev.RequestHead)] == [1, 2]
    ends = of(events, ev.ResponseEnd)
    assert [(e.seq, e.termination) for e in ends] == [(1, "complete"), (2, "truncated")]
    assert ends[1].body_bytes == 0 and ends[1].close == "fin"
    assert [(e.seq, e.complete) for e in of(events, ev.RequestEnd)] == [(1, True), (2, True)]
    assert of(events, ev.RequestEnd)[1].model == "Qwen/Qwen2.5-7B-Instruct"


def test_request_after_connection_close_response_is_still_parsed() -> None:
    get = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
    steps = [
        ("c", 100.1, get),
        ("u", 100.2, b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"),
        ("c", 100.3, get),
        ("ueof", 100.4, False),
    ]
    events, obs = play(steps)
    assert not of(events, ev.Anomaly) and not obs.blind
    assert not one(events, ev.ResponseHead).keep_alive
    heads = of(events, ev.RequestHead)
    assert [(h.seq, h.pipelined) for h in heads] == [(1, False), (2, False)]
    assert heads[1].idle_before == pytest.approx(0.1)
    ends = of(events, ev.ResponseEnd)
    assert [(e.seq, e.termination, e.body_bytes) for e in ends] == [
        (1, "complete", 2),
        (2, "truncated", 0),
    ]


def test_http10_keep_alive_upstream_keeps_being_observed() -> None:
    get = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
    resp = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"
    steps = [("c", 100.1, get), ("u", 100.2, resp), ("c", 100.3, get), ("u", 100.4, resp)]
    events, _ = play(steps)
    assert [h.keep_alive for h in of(events, ev.ResponseHead)] == [True, True]
    ends = of(events, ev.ResponseEnd)
    assert [(e.seq, e.termination, e.body_bytes) for e in ends] == [
        (1, "complete", 2),
        (2, "complete", 2),
    ]


def test_http10_keep_alive_upstream_answering_pipelined_requests_in_one_read() -> None:
    gets = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n"
    resp = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"
    events, obs = play([("c", 100.1, gets), ("u", 100.2, resp + resp)])
    assert not of(events, ev.Anomaly)
    assert [h.pipelined for h in of(events, ev.RequestHead)] == [False, True]
    ends = of(events, ev.ResponseEnd)
    assert [(e.seq, e.termination, e.body_bytes) for e in ends] == [
        (1, "complete", 2),
        (2, "complete", 2),
    ]
    assert not obs.in_flight


def test_pipelined_request_behind_a_connection_close_response() -> None:
    gets = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n"
    resp = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    events, _ = play([("c", 100.1, gets), ("u", 100.2, resp), ("ueof", 100.3, False)])
    assert not of(events, ev.Anomaly)
    heads = of(events, ev.RequestHead)
    assert [(h.seq, h.pipelined, h.m) for h in heads] == [(1, False, 100.1), (2, True, 100.1)]
    ends = of(events, ev.ResponseEnd)
    assert [(e.seq, e.termination, e.close) for e in ends] == [
        (1, "complete", None),
        (2, "truncated", "fin"),
    ]
    assert ends[1].body_bytes == 0


# ---- client abort and half-close ----------------------------------------------------------


def test_client_reset_mid_stream_is_client_abort() -> None:
    steps = stream_steps(load("vllm_stream.upstream.bin"))[:5]
    late = b"data: late bytes after the reset\n\n"
    steps += [("ceof", 100.9, True), ("u", 100.95, b"%x\r\n%s\r\n" % (len(late), late))]
    steps += [("ueof", 101.0, True), ("close", 101.0, False)]
    events, obs = play(steps)
    end = one(events, ev.ResponseEnd)
    assert end.termination == "client_abort" and end.close == "reset"
    assert events[-1] == end  # the late bytes made no events
    assert end.events == 3 and end.duration == pytest.approx(0.8)
    assert not of(events, ev.Anomaly) and not obs.in_flight
    assert obs.upstream_bytes == sum(len(s[2]) for s in steps if s[0] == "u")


def test_client_half_close_then_response_completes() -> None:
    steps = stream_steps(load("vllm_stream.upstream.bin"))
    steps.insert(1, ("ceof", 100.15, False))
    steps.append(("ueof", 102.0, False))
    events, obs = play(steps)
    end = one(events, ev.ResponseEnd)
    assert end.termination == "complete" and end.done and end.close is None
    assert obs.client_close == "fin" and obs.client_closed_m == 100.15
    assert not of(events, ev.Anomaly)


def test_client_half_close_then_upstream_cut_is_client_abort() -> None:
    steps = [*stream_steps(load("truncated.upstream.bin")), ("ueof", 105.0, False)]
    steps.insert(2, ("ceof", 100.35, False))
    end = one(play(steps)[0], ev.ResponseEnd)
    assert end.termination == "client_abort" and end.close == "fin"


def test_client_fin_mid_request_body() -> None:
    raw = load("chat_stream.client.bin")
    events, obs = play([("c", 100.1, raw[:-20]), ("ceof", 100.2, False), ("ueof", 100.3, False)])
    assert obs.client_close == "fin" and not obs.blind
    req_end = one(events, ev.RequestEnd)
    assert not req_end.complete and req_end.body_bytes == len(request_body(raw)) - 20
    assert not of(events, ev.Anomaly)
    assert one(events, ev.ResponseEnd).termination == "client_abort"


# ---- framing: HTTP/1.0, Content-Length, HEAD, 204/304, 100-continue, pipelining -----------


def test_http10_read_until_close_is_complete_at_eof() -> None:
    events, _ = play(http10_steps())
    head = one(events, ev.ResponseHead)
    assert head.version == "1.0" and not head.keep_alive
    assert head.content_length is None and not head.chunked
    end = one(events, ev.ResponseEnd)
    assert end.termination == "complete" and end.m == 100.5 and end.close is None
    assert end.body_bytes == len(request_body(load("http10_close.upstream.bin")))
    # no end before the EOF
    events, obs = play(http10_steps()[:2])
    assert not of(events, ev.ResponseEnd) and obs.in_flight


def test_http10_request() -> None:
    steps = [
        ("c", 100.1, b"GET /health HTTP/1.0\r\n\r\n"),
        ("u", 100.2, b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"),
        ("ueof", 100.3, False),
    ]
    events, _ = play(steps)
    assert one(events, ev.RequestHead).version == "1.0"
    assert one(events, ev.ResponseEnd).termination == "complete"


def test_content_length_body_over_several_reads() -> None:
    body = b'{"object":"list","data":[]}'
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(
        body
    )
    steps = [
        ("c", 100.0, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("u", 100.1, head + body[:5]),
    ]
    steps += [("u", 100.4, body[5:20]), ("u", 100.5, body[20:])]
    events, obs = play(steps)
    reads = [(b.m + r[0], r[1], r[2]) for b in of(events, ev.BodyData) for r in b.reads]
    assert reads == [(100.1, 5, 0), (100.4, 15, 0), (100.5, len(body) - 20, 0)]
    assert sum(b.size for b in of(events, ev.BodyData)) == len(body)
    end = one(events, ev.ResponseEnd)
    assert end.termination == "complete" and end.body_bytes == len(body)
    assert end.max_gap == pytest.approx(0.3) and end.m == 100.5
    assert one(events, ev.ResponseHead).content_length == len(body)
    assert not obs.in_flight


def test_head_request_with_content_length_has_no_body() -> None:
    steps = [
        ("c", 100.1, b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("u", 100.2, b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n"),
        ("c", 100.3, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("u", 100.4, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
    ]
    events, _ = play(steps)
    assert of(events, ev.ResponseHead)[0].content_length == 1234
    ends = of(events, ev.ResponseEnd)
    assert [(e.seq, e.termination, e.body_bytes) for e in ends] == [
        (1, "complete", 0),
        (2, "complete", 2),
    ]
    assert ends[0].m == 100.2


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b'HTTP/1.1 304 Not Modified\r\netag: "abc"\r\ncontent-length: 99\r\n\r\n',
    ],
)
def test_bodiless_statuses(head: bytes) -> None:
    get = b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n"
    steps = [("c", 100.1, get), ("u", 100.2, head), ("c", 100.3, get), ("u", 100.4, head)]
    events, _ = play(steps)
    ends = of(events, ev.ResponseEnd)
    assert [(e.seq, e.termination, e.body_bytes) for e in ends] == [
        (1, "complete", 0),
        (2, "complete", 0),
    ]
    assert not of(events, ev.BodyData)


def test_expect_100_continue() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    steps = [
        ("c", 100.1, head),
        ("u", 100.2, b"HTTP/1.1 100 Continue\r\n\r\n"),
        ("c", 100.3, body),
        ("u", 100.5, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
    ]
    events, _ = play(steps)
    assert [type(e).__name__ for e in events] == [
        "RequestHead",
        "Informational",
        "RequestEnd",
        "ResponseHead",
        "BodyData",
        "ResponseEnd",
    ]
    assert one(events, ev.RequestHead).expect_continue
    info = one(events, ev.Informational)
    assert info.status == 100 and info.seq == 1 and info.m == 100.2
    req_end = one(events, ev.RequestEnd)
    assert req_end.m == 100.3 and req_end.body_bytes == len(body) and req_end.messages == 1
    end = one(events, ev.ResponseEnd)
    assert end.termination == "complete" and end.status == 200 and end.ttfb == pytest.approx(0.4)


def test_pipelined_requests_in_one_read() -> None:
    events, obs = play(pipelined_steps())
    heads = of(events, ev.RequestHead)
    assert [(h.seq, h.pipelined, h.request_id, h.target) for h in heads] == [
        (1, False, "p-1", "/health"),
        (2, True, "p-2", "/v1/models"),
    ]
    assert [h.m for h in heads] == [100.1, 100.1] and heads[1].idle_before == 0.0
    resp = of(events, ev.ResponseHead)
    assert [(r.seq, r.ttfb) for r in resp] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    ends = of(events, ev.ResponseEnd)
    assert [(e.seq, e.termination) for e in ends] == [(1, "complete"), (2, "complete")]
    assert [e.body_bytes for e in ends] == [0, len(MODELS)]
    assert obs.seq == 2 and not obs.in_flight


def test_pipelined_responses_in_one_read() -> None:
    steps = pipelined_steps()
    steps = [steps[0], ("u", 100.2, steps[1][2] + steps[2][2])]
    events, _ = play(steps)
    assert [(e.seq, e.termination) for e in of(events, ev.ResponseEnd)] == [
        (1, "complete"),
        (2, "complete"),
    ]
    assert [h.pipelined for h in of(events, ev.RequestHead)] == [False, True]


def test_pipelined_request_sent_while_first_response_streams() -> None:
    steps = stream_steps(load("vllm_stream.upstream.bin"))
    steps.insert(4, ("c", 100.45, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
    steps.append(("u", 102.0, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"))
    events, _ = play(steps)
    second = of(events, ev.RequestHead)[1]
    assert second.pipelined and second.m == 100.45 and second.seq == 2
    ends = of(events, ev.ResponseEnd)
    assert [(e.seq, e.termination) for e in ends] == [(1, "complete"), (2, "complete")]
    assert ends[1].duration == pytest.approx(102.0 - 100.45)


def test_connect_tunnel_ends_its_response_and_counts_bytes() -> None:
    steps = [
        ("c", 100.1, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"),
        ("u", 100.2, b"HTTP/1.1 200 Connection established\r\n\r\n"),
        ("c", 100.3, b"\x16\x03\x01 tls bytes"),
        ("u", 100.4, b"\x16\x03\x03 more"),
        ("tick", 200.0, 5.0, False, None),
        ("close", 200.0, False),
    ]
    events, obs = play(steps)
    end = one(events, ev.ResponseEnd)
    assert end.termination == "complete" and end.m == 100.2
    assert not of(events, ev.Stall) and not of(events, ev.Anomaly)
    assert obs.tunnel and obs.client_bytes == sum(len(s[2]) for s in steps if s[0] == "c")


def test_upgrade_101_ends_the_request_as_a_tunnel() -> None:
    steps = [
        (
            "c",
            100.1,
            b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        ),
        (
            "u",
            100.2,
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n\x81\x05hello",
        ),
        ("c", 100.3, b"\x81\x85abcd1234"),
    ]
    events, obs = play(steps)
    assert one(events, ev.Informational).status == 101
    end = one(events, ev.ResponseEnd)
    assert end.termination == "complete" and end.status == 101
    assert obs.tunnel and not obs.in_flight and not of(events, ev.Anomaly)


# ---- malformed input: one anomaly, then blind, bytes still counted -------------------------


GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


def assert_blind_after_one_anomaly(
    events: list[ev.Event], obs: ConnectionObserver, direction: str
) -> ev.Anomaly:
    anomaly = one(events, ev.Anomaly)
    assert anomaly.direction == direction and anomaly.error
    assert obs.blind
    before = len(events)
    obs.client_data(GET, 200.0)
    obs.upstream_data(OK, 200.1)
    assert len(events) == before  # nothing parsed any more
    return anomaly


@pytest.mark.parametrize("split", SPLITS)
def test_garbage_request_line(split: str) -> None:
    raw = load("garbage_request.client.bin")
    events, obs = play([("c", 100.1, raw)], split)
    anomaly = assert_blind_after_one_anomaly(events, obs, "client")
    assert anomaly.seq is None and anomaly.offset == len(raw)
    assert "request line" in anomaly.error
    assert obs.client_bytes == len(raw) + len(GET) and obs.upstream_bytes == len(OK)


@pytest.mark.parametrize("split", SPLITS)
def test_tls_on_plain_listener_then_tracer_400(split: str) -> None:
    raw = load("tls_hello.client.bin")
    events, obs = play([("c", 100.1, raw), ("tracer", 100.1, 400, "Bad Request")], split)
    anomaly = one(events, ev.Anomaly)
    assert anomaly.direction == "client" and anomaly.offset == 0 and anomaly.seq is None
    assert anomaly.error.startswith("TLS handshake on a plain HTTP/1.1 listener")
    head = one(events, ev.ResponseHead)
    assert head.by_tracer and head.status == 400 and head.seq == 1
    end = one(events, ev.ResponseEnd)
    assert end.termination == "tracer_response" and end.detail == "Bad Request"
    assert obs.client_bytes == len(raw) and not obs.in_flight


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("where", ["request", "response"])
def test_oversized_head(split: str, where: str) -> None:
    big = b"X-Filler: " + b"a" * 3000 + b"\r\n"
    get = b"GET / HTTP/1.1\r\nHost: x\r\n"
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n"
    if where == "request":
        steps: list[Step] = [("c", 100.1, get + big + b"\r\n")]
    else:
        steps = [("c", 100.1, get + b"\r\n"), ("u", 100.2, ok + big + b"\r\n")]
    events, obs = play(steps, split, max_header_bytes=1024)
    anomaly = assert_blind_after_one_anomaly(
        events, obs, "client" if where == "request" else "upstream"
    )
    assert not of(events, ev.ResponseHead)
    if where == "request":
        assert not of(events, ev.RequestHead)
    assert obs.client_bytes == sum(len(s[2]) for s in steps if s[0] == "c") + len(GET)
    assert anomaly.m in (100.1, 100.2)


def test_head_within_limit_is_fine() -> None:
    get = b"GET / HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * 900 + b"\r\n\r\n"
    events, obs = play([("c", 100.1, get)], max_header_bytes=1024)
    assert one(events, ev.RequestHead) and not obs.blind


@pytest.mark.parametrize("split", SPLITS)
def test_invalid_chunked_framing_from_upstream(split: str) -> None:
    steps = [*stream_steps(load("bad_chunked.upstream.bin")), ("ueof", 105.0, False)]
    events, obs = play(steps, split)
    anomaly = one(events, ev.Anomaly)
    assert anomaly.direction == "upstream" and anomaly.seq == 1
    assert "chunk" in anomaly.error
    # the offset points at the start of the bad chunk-size line
    raw = load("bad_chunked.upstream.bin")
    assert anomaly.offset == raw.index(b"zz\r\n")
    end = one(events, ev.ResponseEnd)
    assert end.termination == "unparsed" and end.events == 1 and end.body_bytes > 0
    assert end.body_bytes == sum(b.size for b in of(events, ev.BodyData))
    assert obs.upstream_bytes == len(raw)


def test_response_with_no_request() -> None:
    raw = load("no_request.upstream.bin")
    events, obs = play([("u", 100.1, raw)])
    anomaly = assert_blind_after_one_anomaly(events, obs, "upstream")
    assert anomaly.seq is None
    assert obs.upstream_bytes == len(raw) + len(OK) and obs.client_bytes == len(GET)


def test_garbage_pipelined_behind_a_good_request_names_no_request() -> None:
    steps = [("c", 100.1, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n\x00\x01garbage\r\n\r\n")]
    steps += [("u", 100.2, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")]
    events, obs = play(steps)
    anomaly = one(events, ev.Anomaly)
    assert anomaly.direction == "client" and anomaly.seq is None
    assert anomaly.offset == obs.client_bytes  # just after the bad head
    # the first exchange was fully seen before the observer went blind
    assert one(events, ev.ResponseEnd).termination == "complete"
    assert obs.blind


# ---- the observer never raises -------------------------------------------------------------


def mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[min(pos, len(buf) - 1)] = rng.randrange(256)
        elif op == 1:
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 2:
            del buf[pos : pos + rng.randint(1, 16)]
        else:
            buf[pos:pos] = rng.choice(
                [b"\r\n", b"\r\n\r\n", b"0\r\n\r\n", b"HTTP/1.1 200 OK\r\n", b"data: [DONE]\n\n"]
            )
    return bytes(buf)


def test_fuzz_observer_never_raises() -> None:
    rng = random.Random(20241130)
    names = sorted(SCENARIOS)
    extra: list[Step] = [
        ("ceof", 0.0, False),
        ("ceof", 0.0, True),
        ("ueof", 0.0, False),
        ("ueof", 0.0, True),
        ("close", 0.0, False),
        ("close", 0.0, True),
        ("tick", 0.0, 0.5, True, 10),
        ("tick", 0.0, 0.5, False, None),
        ("tracer", 0.0, 502, "Bad Gateway"),
    ]
    for i in range(300):
        steps = list(SCENARIOS[names[i % len(names)]]())
        steps = [
            (s[0], s[1], mutate(s[2], rng)) if s[0] in "cu" and rng.random() < 0.3 else s
            for s in steps
        ]
        if rng.random() < 0.5:
            pos = rng.randrange(len(steps) + 1)
            steps.insert(pos, (rng.choice("cu"), 100.0, rng.randbytes(rng.randint(1, 64))))
        if rng.random() < 0.3:
            steps.insert(rng.randrange(len(steps) + 1), rng.choice(extra))
        if rng.random() < 0.2:
            rng.shuffle(steps)
        events, obs = play(
            steps, rng.choice(["whole", f"random:{i}"]), rng.choice(["none", "requests", "all"])
        )
        fed = [s for s in steps if s[0] in "cu"]
        assert obs.client_bytes == sum(len(s[2]) for s in fed if s[0] == "c")
        assert obs.upstream_bytes == sum(len(s[2]) for s in fed if s[0] == "u")
        assert len(of(events, ev.Anomaly)) <= 1
        ended = [e.seq for e in of(events, ev.ResponseEnd)]
        assert len(ended) == len(set(ended))  # each response ends once at most
        obs.close(300.0, shutdown=False)
        assert not obs.in_flight
        for e in events:
            json.dumps(e.to_record())


def test_fuzz_events_do_not_depend_on_cuts() -> None:
    """Mutated streams too, apart from h11's wording and offset of an anomaly."""

    def comparable(events: list[ev.Event]) -> list[dict[str, Any]]:
        out = norm(events)
        for rec in out:
            if rec["type"] == "anomaly":
                del rec["error"], rec["offset"]
        return out

    rng = random.Random(99)
    names = sorted(SCENARIOS)
    for i in range(200):
        steps = SCENARIOS[names[i % len(names)]]()
        steps = [(s[0], s[1], mutate(s[2], rng)) if s[0] in "cu" else s for s in steps]
        limit = rng.choice([200, 400, 65536])
        whole = comparable(play(steps, "whole", max_header_bytes=limit)[0])
        cut = rng.choice(["bytes", f"random:{i}"])
        assert comparable(play(steps, cut, max_header_bytes=limit)[0]) == whole, (i, cut)


def test_random_bytes_never_raise() -> None:
    rng = random.Random(7)
    for _ in range(200):
        events: list[ev.Event] = []
        obs = observer(events, max_header_bytes=256)
        for j in range(rng.randint(1, 6)):
            blob = rng.randbytes(rng.randint(0, 300))
            if rng.random() < 0.5:
                blob = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + blob
            (obs.client_data if rng.random() < 0.5 else obs.upstream_data)(blob, 100.0 + j)
        obs.upstream_eof(110.0, reset=rng.random() < 0.5)
        obs.client_eof(110.0, reset=rng.random() < 0.5)
        obs.close(111.0, shutdown=rng.random() < 0.5)
        assert len(of(events, ev.Anomaly)) <= 1 and not obs.in_flight


# ---- stalls --------------------------------------------------------------------------------


def test_upstream_silent_stall_start_and_end() -> None:
    steps = stream_steps(load("vllm_stream.upstream.bin"))  # parts at 100.3, 100.4, ...
    before, after = steps[:4], steps[4:]  # last byte at 100.5
    events, obs = play(before)
    obs.tick(101.0, stall_after=1.0, client_blocked=False, unsent=0)
    assert not of(events, ev.Stall)  # 0.5 s silent: below the threshold
    obs.tick(101.6, stall_after=1.0, client_blocked=False, unsent=0)
    obs.tick(102.0, stall_after=1.0, client_blocked=False, unsent=0)  # no second start
    (start,) = of(events, ev.Stall)
    assert (start.phase, start.direction, start.seq) == ("start", "upstream_silent", 1)
    assert start.silent_for == pytest.approx(1.1) and start.m == 101.6 and start.unsent_bytes == 0
    assert obs.in_flight_requests()[0]["stalled"] == "upstream_silent"
    obs.upstream_data(after[0][2], 103.5)
    end = of(events, ev.Stall)[1]
    assert (end.phase, end.direction, end.m) == ("end", "upstream_silent", 103.5)
    assert end.silent_for == pytest.approx(3.0)
    for _, _, data in after[1:]:
        obs.upstream_data(data, 103.6)
    response_end = one(events, ev.ResponseEnd)
    assert response_end.termination == "complete" and response_end.max_gap == pytest.approx(3.0)
    assert len(of(events, ev.Stall)) == 2


def test_client_not_reading_stall() -> None:
    events, obs = play(stream_steps(load("vllm_stream.upstream.bin"))[:4])
    obs.tick(110.0, stall_after=2.0, client_blocked=True, unsent=65536)
    start = one(events, ev.Stall)
    assert start.direction == "client_not_reading" and start.unsent_bytes == 65536
    # a full kernel send queue alone says the same
    events2, obs2 = play(stream_steps(load("vllm_stream.upstream.bin"))[:4])
    obs2.tick(110.0, stall_after=2.0, client_blocked=False, unsent=4096)
    assert one(events2, ev.Stall).direction == "client_not_reading"
    obs.upstream_eof(111.0, reset=True)
    stalls = of(events, ev.Stall)
    assert [s.phase for s in stalls] == ["start", "end"]
    assert stalls[1].silent_for == pytest.approx(111.0 - 100.5)
    # the stall ends before the response does
    assert events.index(stalls[1]) < events.index(one(events, ev.ResponseEnd))


def test_client_silent_stall_mid_request_body() -> None:
    raw = load("chat_stream.client.bin")
    events, obs = play([("c", 100.1, raw[:-10])])
    obs.tick(105.0, stall_after=1.0, client_blocked=False, unsent=None)
    assert one(events, ev.Stall).direction == "client_silent"
    obs.client_data(raw[-10:], 106.0)
    assert [s.phase for s in of(events, ev.Stall)] == ["start", "end"]
    assert of(events, ev.Stall)[1].silent_for == pytest.approx(5.9)
    assert one(events, ev.RequestEnd).complete


def test_tick_without_requests_does_nothing() -> None:
    events, obs = play(pipelined_steps())
    obs.tick(500.0, stall_after=1.0, client_blocked=True, unsent=1)
    assert not of(events, ev.Stall)


# ---- shutdown and the tap's own responses ------------------------------------------------


def test_shutdown_leaves_requests_in_flight() -> None:
    events, obs = play(stream_steps(load("vllm_stream.upstream.bin"))[:5])
    assert obs.in_flight
    (req,) = obs.in_flight_requests()
    assert (req["seq"], req["method"], req["status"], req["events"]) == (1, "POST", 200, 3)
    assert req["started_m"] == 100.1 and req["response_bytes"] > 0 and req["stalled"] is None
    obs.close(101.0, shutdown=True)
    end = one(events, ev.ResponseEnd)
    assert end.termination == "in_flight" and end.detail == "tap stopped" and end.close is None
    assert not obs.in_flight


def test_close_mid_request_body_ends_the_request_incomplete() -> None:
    raw = load("chat_stream.client.bin")
    events, _ = play([("c", 100.1, raw[:-5]), ("close", 100.5, True)])
    assert not one(events, ev.RequestEnd).complete
    assert one(events, ev.ResponseEnd).termination == "in_flight"


def test_tracer_response_when_upstream_unreachable() -> None:
    events, obs = play(
        [("c", 100.1, load("chat_stream.client.bin")), ("tracer", 100.4, 502, "Bad Gateway")]
    )
    head = one(events, ev.ResponseHead)
    assert head.by_tracer and head.status == 502 and head.reason == "Bad Gateway"
    assert head.seq == 1 and head.ttfb == pytest.approx(0.3) and not head.keep_alive
    end = one(events, ev.ResponseEnd)
    assert end.termination == "tracer_response" and end.status == 502 and end.seq == 1
    assert not obs.in_flight
    obs.close(100.5, shutdown=False)
    assert len(of(events, ev.ResponseEnd)) == 1


def test_pipelined_requests_are_parsed_as_they_arrive() -> None:
    """A client pipelining megabytes behind an open response: parsed at once, nothing held."""
    events: list[ev.Event] = []
    obs = ConnectionObserver(tap="t", conn=1, emit=events.append, wall_offset=0.0, opened_m=0.0)
    get = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n"
    obs.client_data(get, 1.0)
    head = b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999\r\n\r\n"
    obs.client_data(head, 2.0)
    for i in range(40):
        obs.client_data(b"x" * 65536, 3.0 + i)
    assert not [e for e in events if isinstance(e, ev.Anomaly)]
    heads = [e for e in events if isinstance(e, ev.RequestHead)]
    assert [(h.seq, h.pipelined, h.m) for h in heads] == [(1, False, 1.0), (2, True, 2.0)]
    # nothing buffered: the body is followed as it streams (by h11, or by the quick
    # path's decoder, which holds no bytes)
    assert obs._req is None or not obs._req.trailing_data[0]
    assert obs._receiving is not None and obs._receiving.body.size == 40 * 65536


def test_bytes_held_behind_an_upgrade_are_bounded() -> None:
    from tracer.observe.wire import MAX_HELD_BYTES

    events: list[ev.Event] = []
    obs = ConnectionObserver(tap="t", conn=1, emit=events.append, wall_offset=0.0, opened_m=0.0)
    obs.client_data(
        b"GET /ws HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: ws\r\n\r\n", 1.0
    )
    for i in range(20):
        obs.client_data(b"y" * 65536, 2.0 + i)
    anomalies = [e for e in events if isinstance(e, ev.Anomaly)]
    assert len(anomalies) == 1 and str(MAX_HELD_BYTES) in anomalies[0].error
    assert obs.blind and obs.client_bytes > MAX_HELD_BYTES
