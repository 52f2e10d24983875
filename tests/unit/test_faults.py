"""Fault specs, rules and decisions, sans-I/O: bytes in, actions out, no sockets, no clocks."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests.support.http import SSE_HEAD, chunk
from tracer.faults.plan import (
    KINDS,
    ArmIdle,
    ConnectionFaults,
    Cut,
    Deliver,
    Fault,
    FaultPlan,
    FaultSpecError,
    Forward,
    Freeze,
    Hold,
    Injected,
    Rule,
    SseEvents,
    parse_fault,
    request_path,
    status_response,
)


def _event(text: str | None, finish: str | None = None) -> bytes:
    delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
    obj = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


EVENTS = [_event(None), _event("a"), _event("b"), _event("c", "stop"), b"data: [DONE]\n\n"]
STREAM = SSE_HEAD + b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
POST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: h\r\ncontent-length: 2\r\n\r\n{}"
GET = b"GET /v1/models HTTP/1.1\r\nhost: h\r\n\r\n"


# ---- specs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("hang-on-reuse:3", {"count": 3, "rule": Rule(pos=3)}),
        ("drop-request", {}),
        ("half-open", {}),
        ("status:503", {"status": 503}),
        ("delay-first-byte:2.5", {"seconds": 2.5}),
        ("stall-after-events:5:10", {"count": 5, "seconds": 10.0}),
        ("stall-after-events:0:inf", {"count": 0, "seconds": math.inf}),
        ("truncate-after-events:3", {"count": 3, "how": "fin"}),
        ("truncate-after-events:3:reset", {"count": 3, "how": "reset"}),
        ("drop-done", {}),
        ("buffer-stream", {}),
        ("close-idle-after:4", {"seconds": 4.0}),
        ("coalesce:0.04", {"seconds": 0.04}),
        ("  Status:429  ", {"status": 429}),
    ],
)
def test_every_fault_parses(spec: str, expected: dict[str, Any]) -> None:
    fault = parse_fault(spec)
    assert fault.name == spec.strip().split(":")[0].lower()
    assert fault.spec == spec.strip()
    for key, value in expected.items():
        assert getattr(fault, key) == value, key
    if "rule" not in expected:
        assert fault.rule == Rule()


def test_every_kind_has_a_parseable_example() -> None:
    for kind in KINDS.values():
        assert parse_fault(kind.example).name == kind.name


@pytest.mark.parametrize(
    ("rules", "rule"),
    [
        ("path=/v1/chat/", Rule(path="/v1/chat/")),
        ("path=/v1/*/completions", Rule(path="/v1/*/completions")),
        ("method=post", Rule(method="POST")),
        ("pos=2", Rule(pos=2)),
        ("pos=3+", Rule(pos=3, pos_and_later=True)),
        ("reuse", Rule(reuse=True)),
        ("reuse=4", Rule(pos=4)),
        ("every=4", Rule(every=4)),
        ("prob=0.25", Rule(prob=0.25)),
        ("prob=0.1,seed=7", Rule(prob=0.1, seed=7)),
        ("times=2", Rule(times=2)),
        ("header=X-Test-Fault", Rule(header=b"x-test-fault")),
        ("header=x-request-id:s1-*", Rule(header=b"x-request-id", header_value="s1-*")),
        (
            "path=/v1/chat/*, method=POST ,reuse,every=2,prob=1,seed=3,times=5",
            Rule(path="/v1/chat/*", method="POST", reuse=True, every=2, prob=1.0, seed=3, times=5),
        ),
    ],
)
def test_every_rule_parses(rules: str, rule: Rule) -> None:
    assert parse_fault(f"status:503@{rules}").rule == rule


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty fault spec"),
        ("hang-on-resue:3", "unknown fault 'hang-on-resue' (did you mean hang-on-reuse?)"),
        ("hang-on-reuse", "hang-on-reuse is written hang-on-reuse:N"),
        ("hang-on-reuse:1", "N must be an integer >= 2 (got '1')"),
        ("hang-on-reuse:3@pos=2", "sets the position itself"),
        ("drop-request:3", "drop-request is written drop-request"),
        ("status:200", "CODE must be an integer >= 400"),
        ("status:600", "CODE must be an HTTP error status (400-599)"),
        ("status:abc", "CODE must be an integer >= 400 (got 'abc')"),
        ("delay-first-byte:-1", "S must be seconds >= 0 (got '-1')"),
        ("delay-first-byte:inf", "S must be seconds >= 0 (got 'inf')"),
        ("stall-after-events:5", "stall-after-events is written stall-after-events:K:S"),
        ("stall-after-events:x:1", "K must be an integer >= 0"),
        ("stall-after-events:1:soon", "S must be seconds >= 0, or inf"),
        ("truncate-after-events:1:rst", "the close is fin or reset, not 'rst'"),
        ("close-idle-after:0", "S must be more than 0 seconds"),
        ("status:503@", "nothing after '@'"),
        ("status:503@evry=2", "unknown rule 'evry' (did you mean every?)"),
        ("status:503@every=0", "every must be an integer >= 1"),
        ("status:503@every", "every=N"),
        ("status:503@prob=1.5", "prob must be a number from 0 to 1"),
        ("status:503@seed=3", "seed is the seed of prob"),
        ("status:503@path=v1", "path must start with / or *"),
        ("status:503@method=P OST", "method must be a word"),
        ("status:503@pos=0", "pos must be an integer >= 1"),
        ("status:503@reuse=1", "reuse must be an integer >= 2"),
        ("status:503@pos=2,reuse", "given twice (or pos with reuse)"),
        ("status:503@times=1,times=2", "'times' given twice"),
        ("status:503@header=bad name", "header=NAME or header=NAME:GLOB"),
        ("status:503@header=x-a:", "header=NAME or header=NAME:GLOB"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError) as caught:
        parse_fault(spec)
    assert message in str(caught.value)


# ---- rules and decisions -------------------------------------------------------------


def test_rule_matching() -> None:
    assert Rule().matches("GET", "/", 1)
    assert Rule(path="/v1/chat").matches("POST", "/v1/chat/completions", 1)  # a prefix
    assert not Rule(path="/v1/chat").matches("POST", "/v1/completions", 1)
    glob = Rule(path="/v1/*/completions")
    assert glob.matches("POST", "/v1/chat/completions", 1)
    assert not glob.matches("POST", "/v1/completions", 1)
    assert Rule(path="*/models").matches("GET", "/a/b/models", 1)  # * also matches /
    assert Rule(method="POST").matches("post", "/", 1)
    assert not Rule(method="POST").matches("GET", "/", 1)
    assert [Rule(pos=2).matches("GET", "/", p) for p in (1, 2, 3)] == [False, True, False]
    later = Rule(pos=2, pos_and_later=True)
    assert [later.matches("GET", "/", p) for p in (1, 2, 3)] == [False, True, True]
    assert [Rule(reuse=True).matches("GET", "/", p) for p in (1, 2, 3)] == [False, True, True]
    # header: present, or with a value the glob matches (names in any case)
    marked = [(b"Host", b"h"), (b"X-Test-Fault", b" on ")]
    assert Rule(header=b"x-test-fault").matches("GET", "/", 1, marked)
    assert not Rule(header=b"x-test-fault").matches("GET", "/", 1, [(b"host", b"h")])
    session = Rule(header=b"x-request-id", header_value="s1-*")
    assert session.matches("GET", "/", 1, [(b"x-request-id", b"s1-4")])
    assert not session.matches("GET", "/", 1, [(b"x-request-id", b"s2-4")])
    assert Rule(header=b"x-test-fault", header_value="on").matches("GET", "/", 1, marked)


def test_request_path() -> None:
    assert request_path("/v1/chat/completions?x=1") == "/v1/chat/completions"
    assert request_path("http://router:8000/v1/models?a") == "/v1/models"
    assert request_path("http://router:8000") == "/"
    assert request_path("*") == "*"


def _decide(plan: FaultPlan, n: int, method: str = "POST", path: str = "/v1/x") -> list[Any]:
    out = []
    for pos in range(1, n + 1):
        d = plan.decide(method, path, pos)
        out.append(d.request.name if d.request else None)
    return out


def test_every_counts_matching_requests_only() -> None:
    plan = FaultPlan([parse_fault("status:503@method=POST,every=2")])
    seen = []
    for method in ["POST", "GET", "POST", "GET", "POST", "POST"]:
        d = plan.decide(method, "/", 1)
        seen.append(d.request is not None)
    assert seen == [False, False, True, False, False, True]


def test_prob_with_a_seed_is_deterministic() -> None:
    spec = "drop-request@prob=0.3,seed=7"
    first = _decide(FaultPlan([parse_fault(spec)]), 200)
    again = _decide(FaultPlan([parse_fault(spec)]), 200)
    other = _decide(FaultPlan([parse_fault("drop-request@prob=0.3,seed=8")]), 200)
    assert first == again != other
    assert 30 < first.count("drop-request") < 90
    assert _decide(FaultPlan([parse_fault("drop-request@prob=0")]), 50) == [None] * 50
    assert _decide(FaultPlan([parse_fault("drop-request@prob=1")]), 5) == ["drop-request"] * 5
    # the default seed is fixed too: the same draws every run
    assert _decide(FaultPlan([parse_fault("drop-request@prob=0.5")]), 50) == _decide(
        FaultPlan([parse_fault("drop-request@prob=0.5,seed=0")]), 50
    )


def test_times_limits_injections() -> None:
    plan = FaultPlan([parse_fault("status:500@times=2")])
    assert _decide(plan, 4) == ["status", "status", None, None]


def test_a_plan_changed_at_run_time() -> None:
    """``replace`` starts the counters afresh; ``add`` keeps those of the faults there."""
    plan = FaultPlan()
    assert plan.decide("POST", "/", 1).empty and plan.specs == []
    plan.add([parse_fault("status:500@times=1")])
    assert _decide(plan, 2) == ["status", None]
    plan.add([parse_fault("drop-request@every=2")])
    assert plan.specs == ["status:500@times=1", "drop-request@every=2"]
    assert _decide(plan, 4) == [None, "drop-request", None, "drop-request"]  # times=1 spent
    plan.replace([parse_fault("status:500@times=1")])
    assert _decide(plan, 2) == ["status", None]  # counted anew
    plan.replace([])
    assert plan.faults == () and _decide(plan, 2) == [None, None]


def test_request_faults_are_exclusive_response_faults_combine() -> None:
    plan = FaultPlan(
        [
            parse_fault("status:503@pos=2"),
            parse_fault("drop-request@reuse"),
            parse_fault("drop-done"),
            parse_fault("delay-first-byte:1"),
            parse_fault("close-idle-after:5"),
            parse_fault("close-idle-after:2"),
        ]
    )
    first = plan.decide("POST", "/", 1)
    assert first.request is None
    assert [f.name for f in first.response] == ["drop-done", "delay-first-byte"]
    assert first.idle is not None and first.idle.seconds == 2
    assert plan.decide("POST", "/", 2).request.name == "status"  # type: ignore[union-attr]
    assert plan.decide("POST", "/", 3).request.name == "drop-request"  # type: ignore[union-attr]
    assert FaultPlan([parse_fault("drop-done@method=GET")]).decide("POST", "/", 1).empty


def test_status_response_is_openai_shaped_and_keep_alive() -> None:
    raw = status_response(parse_fault("status:429@every=3"))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 429 Too Many Requests"
    assert b"content-length: %d" % len(body) in head and b"connection" not in head
    assert b"x-tracer-fault: status:429@every=3" in head
    error = json.loads(body)["error"]
    assert error["code"] == 429 and error["type"] == "tracer_fault"


# ---- SSE event boundaries -------------------------------------------------------------


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_sse_event_ends_whatever_the_line_ends(eol: bytes) -> None:
    body = (
        b"data: {}" + eol + eol + b": ping" + eol + eol + b"data: [DONE]" + eol + eol + b"data: x"
    )
    whole = SseEvents().feed(body)
    ends = [end for end, _ in whole]
    assert [kind for _, kind in whole] == ["role", "comment", "done"]
    assert body[: ends[0]].endswith(eol + eol) and body[ends[2] :] == b"data: x"
    split = SseEvents()  # byte by byte: the same ends
    found = []
    for i in range(len(body)):
        found += [(i + end, kind) for end, kind in split.feed(body[i : i + 1])]
    assert found == whole


# ---- a connection: bytes in, actions out ----------------------------------------------


def render(actions: list[Any]) -> list[Any]:
    """Actions as a canonical list: adjacent bytes joined, records by fault name."""
    out: list[Any] = []
    for a in actions:
        if isinstance(a, Forward | Deliver):
            tag = "up" if isinstance(a, Forward) else "down"
            if out and isinstance(out[-1], tuple) and out[-1][0] == tag:
                out[-1] = (tag, out[-1][1] + a.data)
            else:
                out.append((tag, a.data))
        elif isinstance(a, Injected):
            out.append(("fault", a.fault.name, a.seq))
        elif isinstance(a, ArmIdle):
            out.append(("idle", a.seq))
        else:
            out.append(a)
    return out


def run(specs: list[str], script: list[tuple[str, bytes]], step: int = 0) -> list[Any]:
    """Feed ("c", client bytes) / ("u", upstream bytes) / ("eof", b""), whole or cut."""
    conn = ConnectionFaults(FaultPlan([parse_fault(s) for s in specs]))
    actions: list[Any] = []
    for side, data in script:
        if side == "eof":
            actions += conn.upstream_eof()
            continue
        feed = conn.client_data if side == "c" else conn.upstream_data
        pieces = [data] if not step else [data[i : i + step] for i in range(0, len(data), step)]
        for piece in pieces:
            actions += feed(piece)
    return render(actions)


def same_for_any_cut(specs: list[str], script: list[tuple[str, bytes]]) -> list[Any]:
    """Whole reads, one byte at a time and odd cuts: the same actions at the same bytes."""
    whole = run(specs, script)
    for step in (1, 3, 7, 64):
        assert run(specs, script, step) == whole, step
    return whole


def test_no_fault_matching_is_byte_for_byte() -> None:
    script = [("c", POST), ("u", STREAM), ("c", GET), ("u", OK)]
    assert same_for_any_cut(["status:503@path=/nope"], script) == [
        ("up", POST),
        ("down", STREAM),
        ("up", GET),
        ("down", OK),
    ]


def test_unfaulted_chunked_bodies_are_followed_to_their_end() -> None:
    """Responses no fault applies to skip their chunks without cutting them up: several
    chunks to a read, extensions, a trailer, the next response in the same read, and
    every other cut; a malformed chunk line still turns the connection blind, its bytes
    unchanged."""
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    chunks = b"".join(chunk(b"x" * n) for n in (1, 15, 16, 255, 4096))
    body = chunks + b"5;ext=1\r\nhello\r\n0\r\nx-trailer: 1\r\n\r\n"
    script = [("c", GET), ("c", GET), ("u", head + body + head + chunks + b"0\r\n\r\n")]
    assert same_for_any_cut(["status:503@path=/nope"], script) == [
        ("up", GET + GET),
        ("down", head + body + head + chunks + b"0\r\n\r\n"),
    ]
    conn = ConnectionFaults(FaultPlan())
    conn.client_data(GET + GET)
    conn.upstream_data(head + body + head + chunks + b"0\r\n\r\n")
    assert not conn.busy and not conn.blind  # both responses ended where they do
    broken = head + chunk(b"ok") + b"zz\r\nwhat\r\n"
    conn = ConnectionFaults(FaultPlan())
    conn.client_data(GET)
    assert render(conn.upstream_data(broken)) == [("down", broken)] and conn.blind


def test_hang_on_reuse_swallows_the_request_and_everything_after() -> None:
    script = [("c", POST), ("u", STREAM), ("c", POST), ("c", POST), ("u", b"stray"), ("eof", b"")]
    assert same_for_any_cut(["hang-on-reuse:2"], script) == [
        ("up", POST),
        ("down", STREAM),
        ("fault", "hang-on-reuse", 2),
        ("fault", "hang-on-reuse", 3),  # a later request on the hung connection: recorded too
    ]
    conn = ConnectionFaults(FaultPlan([parse_fault("drop-request")]))
    assert [type(a) for a in conn.client_data(POST + POST[:20])] == [Injected]
    assert conn.hung and conn.silent
    [record] = conn.client_data(POST[20:])
    assert isinstance(record, Injected) and record.seq == 2
    assert record.detail == (
        "request 2 read and not forwarded: the connection hangs since request 1"
    )
    assert conn.client_data(b"\x16\x03 not HTTP") == []  # nothing goes upstream, ever
    assert conn.client_data(POST) == []


def test_half_open_freezes() -> None:
    assert same_for_any_cut(["half-open@pos=2"], [("c", GET), ("u", OK), ("c", POST)]) == [
        ("up", GET),
        ("down", OK),
        ("fault", "half-open", 2),
        Freeze(),
    ]


def test_status_answers_after_the_body_and_keeps_the_connection() -> None:
    answer = status_response(parse_fault("status:503@pos=1"))
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n"
    )
    script = [("c", chunked + GET), ("u", OK)]
    assert same_for_any_cut(["status:503@pos=1"], script) == [
        ("fault", "status", 1),
        ("down", answer),
        ("up", GET),
        ("down", OK),
    ]


def test_status_on_a_pipelined_request_waits_for_the_response_before_it() -> None:
    answer = status_response(parse_fault("status:500@pos=2"))
    script = [("c", GET + GET + GET), ("u", OK + OK)]
    assert run(["status:500@pos=2"], script) == [
        ("up", GET + GET),  # requests 1 and 3
        ("down", OK),
        ("fault", "status", 2),
        ("down", answer + OK),
    ]


def test_delay_first_byte() -> None:
    assert same_for_any_cut(["delay-first-byte:1.5"], [("c", GET), ("u", OK)]) == [
        ("up", GET),
        ("fault", "delay-first-byte", 1),
        Hold(1.5),
        ("down", OK),
    ]


def test_stall_after_events_cuts_after_the_chunk_of_the_kth_event() -> None:
    cut = len(SSE_HEAD + chunk(EVENTS[0]) + chunk(EVENTS[1]))
    assert same_for_any_cut(["stall-after-events:2:inf"], [("c", POST), ("u", STREAM)]) == [
        ("up", POST),
        ("down", STREAM[:cut]),
        ("fault", "stall-after-events", 1),
        Hold(math.inf),
        ("down", STREAM[cut:]),
    ]


def test_stall_after_zero_events_is_after_the_head() -> None:
    assert run(["stall-after-events:0:2"], [("c", POST), ("u", STREAM)])[1:4] == [
        ("down", SSE_HEAD),
        ("fault", "stall-after-events", 1),
        Hold(2.0),
    ]


def test_events_are_counted_as_the_observer_counts_them() -> None:
    """Heartbeat comments are not events; an event split over chunks is one event."""
    body = chunk(b": ping\n\n") + chunk(EVENTS[0][:10]) + chunk(EVENTS[0][10:] + EVENTS[1])
    stream = SSE_HEAD + body + chunk(EVENTS[2]) + b"0\r\n\r\n"
    cut = len(SSE_HEAD + body)
    actions = same_for_any_cut(["truncate-after-events:2"], [("c", POST), ("u", stream)])
    assert actions == [
        ("up", POST),
        ("down", stream[:cut]),
        ("fault", "truncate-after-events", 1),
        Cut("fin"),
    ]


def test_truncate_mid_chunk_when_the_event_does_not_end_it() -> None:
    stream = SSE_HEAD + chunk(EVENTS[0] + EVENTS[1]) + b"0\r\n\r\n"
    cut = len(SSE_HEAD) + len(b"%x\r\n" % len(EVENTS[0] + EVENTS[1])) + len(EVENTS[0])
    actions = same_for_any_cut(["truncate-after-events:1:reset"], [("c", POST), ("u", stream)])
    assert actions[1:] == [
        ("down", stream[:cut]),
        ("fault", "truncate-after-events", 1),
        Cut("reset"),
    ]
    conn = ConnectionFaults(FaultPlan([parse_fault("truncate-after-events:1")]))
    conn.client_data(POST)
    conn.upstream_data(stream)
    assert conn.stopped and conn.client_data(POST) == [] and conn.upstream_data(OK) == []


def test_drop_done_removes_its_chunk() -> None:
    no_done = SSE_HEAD + b"".join(chunk(e) for e in EVENTS[:-1]) + b"0\r\n\r\n"
    actions = same_for_any_cut(["drop-done"], [("c", POST), ("u", STREAM), ("c", GET), ("u", OK)])
    assert actions == [
        ("up", POST),
        ("down", no_done[: -len(b"0\r\n\r\n")]),
        ("fault", "drop-done", 1),
        ("down", b"0\r\n\r\n"),
        ("up", GET),
        ("down", OK),
    ]


def test_drop_done_reframes_a_shared_chunk_and_a_read_until_close_body() -> None:
    shared = SSE_HEAD + chunk(EVENTS[0]) + chunk(EVENTS[3] + EVENTS[4]) + b"0\r\n\r\n"
    expected = SSE_HEAD + chunk(EVENTS[0]) + chunk(EVENTS[3]) + b"0\r\n\r\n"
    down = b"".join(
        a[1]
        for a in same_for_any_cut(["drop-done"], [("c", POST), ("u", shared)])
        if a[0] == "down"
    )
    assert down == expected
    close_head = b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
    body = b"".join(EVENTS)
    actions = same_for_any_cut(["drop-done"], [("c", POST), ("u", close_head + body), ("eof", b"")])
    down = b"".join(a[1] for a in actions if a[0] == "down")
    assert down == close_head + b"".join(EVENTS[:-1])


def test_drop_done_leaves_other_framings_and_streams_without_done_alone() -> None:
    no_done = SSE_HEAD + b"".join(chunk(e) for e in EVENTS[:-1]) + b"0\r\n\r\n"
    assert run(["drop-done"], [("c", POST), ("u", no_done)]) == [("up", POST), ("down", no_done)]
    body = b"".join(EVENTS)
    length = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
    sized = length % len(body) + body
    assert run(["drop-done"], [("c", POST), ("u", sized)]) == [("up", POST), ("down", sized)]


def test_buffer_stream_releases_at_the_end_or_at_eof() -> None:
    assert same_for_any_cut(
        ["buffer-stream"], [("c", POST), ("u", STREAM), ("c", GET), ("u", OK)]
    ) == [
        ("up", POST),
        ("fault", "buffer-stream", 1),
        ("down", STREAM),
        ("up", GET),
        ("fault", "buffer-stream", 2),
        ("down", OK),
    ]
    cut = STREAM[:200]
    assert run(["buffer-stream"], [("c", POST), ("u", cut), ("eof", b"")]) == [
        ("up", POST),
        ("fault", "buffer-stream", 1),
        ("down", cut),
    ]


def test_coalesce_holds_after_each_chunk_and_not_after_the_end() -> None:
    hold = Hold(0.04, merge=True)
    chunks = [chunk(e) for e in EVENTS]
    assert same_for_any_cut(["coalesce:0.04"], [("c", POST), ("u", STREAM)]) == [
        ("up", POST),
        ("down", SSE_HEAD),
        ("fault", "coalesce", 1),
        ("down", chunks[0]),
        hold,
        *[x for c in chunks[1:] for x in (("down", c), hold)],
        ("down", b"0\r\n\r\n"),
    ]


def test_close_idle_after_arms_after_the_response() -> None:
    assert same_for_any_cut(
        ["close-idle-after:3@path=/v1/models"], [("c", GET), ("u", OK), ("c", POST), ("u", OK)]
    ) == [
        ("up", GET),
        ("down", OK),
        ("idle", 1),
        ("up", POST),
        ("down", OK),
    ]


def test_faults_combine_on_one_response() -> None:
    specs = ["drop-done", "stall-after-events:1:0.5", "delay-first-byte:1"]
    actions = same_for_any_cut(specs, [("c", POST), ("u", STREAM)])
    kinds = [a if not isinstance(a, tuple) else a[:2] if a[0] == "fault" else a[0] for a in actions]
    assert kinds == [
        "up",
        ("fault", "delay-first-byte"),
        Hold(1.0),
        "down",
        ("fault", "stall-after-events"),
        Hold(0.5),
        "down",
        ("fault", "drop-done"),
        "down",
    ]
    down = b"".join(a[1] for a in actions if isinstance(a, tuple) and a[0] == "down")
    assert down == SSE_HEAD + b"".join(chunk(e) for e in EVENTS[:-1]) + b"0\r\n\r\n"


@pytest.mark.parametrize(
    "first",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS handshake
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # an HTTP/2 preface
        b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        b"CONNECT h:443 HTTP/1.1\r\nhost: h:443\r\n\r\n",
        b"GET / HTTP/1.1\r\nbad header\r\n\r\n",
    ],
)
def test_what_cannot_be_followed_passes_unchanged(first: bytes) -> None:
    conn = ConnectionFaults(FaultPlan([parse_fault("status:503")]))
    assert conn.client_data(first) == [Forward(first)]
    assert conn.blind
    assert conn.upstream_data(b"anything") == [Deliver(b"anything")]
    assert conn.client_data(POST) == [Forward(POST)]


def test_a_malformed_response_goes_blind_releasing_what_was_held() -> None:
    bad = SSE_HEAD + chunk(EVENTS[0]) + b"ZZZ\r\nnot chunked\r\n"
    actions = run(["buffer-stream"], [("c", POST), ("u", bad), ("c", POST)])
    down = b"".join(a[1] for a in actions if isinstance(a, tuple) and a[0] == "down")
    assert down == bad and actions[-1] == ("up", POST)


def test_fault_dataclass_defaults() -> None:
    fault = Fault(name="drop-done", spec="drop-done")
    assert fault.acts == "response" and fault.rule == Rule()
