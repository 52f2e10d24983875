"""Gaps in a packet capture (``tracer/observe/gaps.py``): the requests whose
bytes the capture lost are marked (an ``anomaly`` with their ``seq`` and ``gap``, never a
``complete`` response or request), and the connection is parsed again after the gap,
requests paired with their own responses (or with none, where that cannot be known).

The captures are crafted with ``tests/unit/test_pcap.py``'s ``Flow``: a segment left out
of the file that its peer acknowledged is a gap the capture lost (``not_captured``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_pcap import T0, Flow, Pkt, chunk, of, read, summarize, write_pcap
from tracer import events as ev
from tracer.observe.tcp import ACK, FIN


def post(n: int, body: bytes) -> bytes:
    return (
        f"POST /v1/completions?n={n} HTTP/1.1\r\nhost: engine\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


def chunked_post(n: int) -> bytes:
    return (
        f"POST /v1/completions?n={n} HTTP/1.1\r\nhost: engine\r\n"
        "content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    ).encode()


def get(n: int) -> bytes:
    return f"GET /v1/models?n={n} HTTP/1.1\r\nhost: engine\r\n\r\n".encode()


def answer(n: int, status: int = 200) -> bytes:
    """A whole response that says whose it is (its body, its size)."""
    body = json.dumps({"answer_to": n, "pad": "x" * n}).encode()
    return (
        f"HTTP/1.1 {status} OK\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


def answer_size(n: int) -> int:
    return len(json.dumps({"answer_to": n, "pad": "x" * n}).encode())


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENTS = [
    f'data: {{"choices":[{{"index":0,"delta":{{"content":"t{i}"}}}}]}}\n\n'.encode()
    for i in range(4)
] + [b"data: [DONE]\n\n"]


class Conn:
    """One keep-alive connection, its packets in time order; ``lose`` leaves the
    segments marked out of the file (their peer still acknowledges them)."""

    def __init__(self) -> None:
        self.flow = Flow()
        self.flow.handshake(T0)
        self.t = T0 + 0.001
        self.lost: list[Pkt] = []

    def client(self, payload: bytes, *, lose: bool = False, ack: bool = True) -> Pkt:
        return self._send(True, payload, lose=lose, ack=ack)

    def server(self, payload: bytes, *, lose: bool = False, ack: bool = True) -> Pkt:
        return self._send(False, payload, lose=lose, ack=ack)

    def _send(self, from_client: bool, payload: bytes, *, lose: bool, ack: bool) -> Pkt:
        self.t += 0.01
        pkt = self.flow.send(self.t, from_client, payload)
        if lose:
            self.lost.append(pkt)
        if ack:
            self.t += 0.0001
            self.flow.ack(self.t, not from_client)  # the peer got it, whatever the capture
        return pkt

    def close(self) -> None:
        self.t += 0.1
        self.flow.send(self.t, True, flags=FIN | ACK)
        self.flow.send(self.t + 0.0001, False, flags=FIN | ACK)
        self.flow.ack(self.t + 0.0002, True)

    def read(self, tmp_path: Path) -> list[ev.Event]:
        packets = [p for p in self.flow.packets if p not in self.lost]
        events, _ = read(write_pcap(tmp_path / "gap.pcap", packets))
        return events


def ends(events: list[ev.Event]) -> dict[int, ev.ResponseEnd]:
    return {e.seq: e for e in of(events, ev.ResponseEnd)}


def heads(events: list[ev.Event]) -> dict[int, ev.RequestHead]:
    return {e.seq: e for e in of(events, ev.RequestHead)}


def anomalies(events: list[ev.Event]) -> list[tuple[int | None, str, int | None]]:
    return [(a.seq, a.direction, a.gap) for a in of(events, ev.Anomaly)]


def assert_packet_wording(events: list[ev.Event]) -> None:
    """What a packet capture lost is said as the capture's, never as the writer's."""
    losses = of(events, ev.CaptureLoss)
    assert losses and all(e.reason.startswith("packet capture") for e in losses)
    for e in [*losses, *of(events, ev.Anomaly), *of(events, ev.ResponseEnd)]:
        text = " ".join(str(v) for v in e.to_record().values())
        assert "dropped by the writer" not in text and "disk" not in text


def assert_answered(events: list[ev.Event], seq: int, n: int) -> None:
    """Request ``seq`` has the response to request ``n`` (by its size), complete."""
    end = ends(events)[seq]
    assert (end.termination, end.status, end.body_bytes) == ("complete", 200, answer_size(n))
    assert not [a for a in of(events, ev.Anomaly) if a.seq == seq]


# ---- the server's stream ---------------------------------------------------------------


@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_a_lost_segment_of_the_second_response_marks_it_alone(tmp_path: Path, framing: str) -> None:
    c = Conn()
    c.client(get(1))
    c.server(answer(1))
    c.client(post(2, b'{"model":"m","stream":true}'))
    if framing == "chunked":  # where it ends is not known: parsed again at a status line
        c.server(SSE_HEAD)
        for i, e in enumerate(EVENTS):
            c.server(chunk(e), lose=i == 2)
        c.server(b"0\r\n\r\n")
        size = len(chunk(EVENTS[2]))
    else:  # its length says where it ends: parsed again right after it
        whole = answer(2222)
        head_end = whole.index(b"\r\n\r\n") + 4
        c.server(whole[: head_end + 100])
        c.server(whole[head_end + 100 : head_end + 1100], lose=True)
        c.server(whole[head_end + 1100 :])
        size = 1000
    c.client(get(3))
    c.server(answer(3))
    c.close()
    events = c.read(tmp_path)

    assert sorted(heads(events)) == [1, 2, 3]
    assert_answered(events, 1, 1)
    assert_answered(events, 3, 3)  # its own response, not what was left of the second's
    assert anomalies(events) == [(2, "upstream", size)]
    second = ends(events)[2]
    assert second.termination == "unparsed" and second.status == 200
    assert second.detail is not None and "missing" in second.detail
    assert of(events, ev.ConnClose)[0].requests == 3
    assert_packet_wording(events)


def test_a_gap_running_past_a_response_into_the_next_ones_head(tmp_path: Path) -> None:
    """Requests sent one after the other (pipelined): the gap takes the end of the first
    response and the head of the second: both are marked; the third is its own."""
    c = Conn()
    c.client(get(1) + get(2) + get(3))
    first, second = answer(1000), answer(2)
    cut = len(first) - 10
    c.server(first[:cut])
    c.server(first[cut:] + second[:20], lose=True)
    c.server(second[20:])
    c.server(answer(3))
    c.close()
    events = c.read(tmp_path)
    assert anomalies(events) == [(1, "upstream", 30), (2, "upstream", 30)]
    assert ends(events)[1].termination == ends(events)[2].termination == "unparsed"
    assert_answered(events, 3, 3)


def test_a_status_line_while_several_wait_is_not_paired(tmp_path: Path) -> None:
    """Part of a chunked response is lost while two more requests wait: which of them the
    next response answers cannot be known: both end unparsed, marked."""
    c = Conn()
    c.client(get(1) + get(2) + get(3))
    c.server(SSE_HEAD + chunk(EVENTS[0]))
    c.server(chunk(EVENTS[1]), lose=True)
    c.server(chunk(EVENTS[2]) + b"0\r\n\r\n" + answer(2) + answer(3))
    c.close()
    events = c.read(tmp_path)
    assert sorted(ends(events)) == [1, 2, 3]
    assert {e.termination for e in ends(events).values()} == {"unparsed"}
    assert [(a.seq, a.direction) for a in of(events, ev.Anomaly)] == [
        (1, "upstream"),
        (2, "upstream"),
        (3, "upstream"),
    ]
    assert all(a.gap == len(chunk(EVENTS[1])) for a in of(events, ev.Anomaly))


# ---- the client's stream ---------------------------------------------------------------


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_gap_inside_the_second_requests_body(tmp_path: Path, framing: str) -> None:
    c = Conn()
    c.client(get(1))
    c.server(answer(1))
    if framing == "length":
        whole = post(2, b'{"prompt":"' + b"p" * 3000 + b'"}')
        c.client(whole[:1000])
        c.client(whole[1000:2000], lose=True)
        c.client(whole[2000:])
    else:
        c.client(chunked_post(2))
        c.client(chunk(b"a" * 500))
        c.client(chunk(b"b" * 1000), lose=True)
        c.client(chunk(b"c" * 500) + b"0\r\n\r\n")
    c.server(answer(2))
    c.client(get(3))
    c.server(answer(3))
    c.close()
    events = c.read(tmp_path)

    size = 1000 if framing == "length" else len(chunk(b"b" * 1000))
    assert sorted(heads(events)) == [1, 2, 3]
    assert anomalies(events) == [(2, "client", size)]
    request_ends = {e.seq: e.complete for e in of(events, ev.RequestEnd)}
    assert request_ends == {1: True, 2: False, 3: True}
    assert_answered(events, 1, 1)
    assert_answered(events, 3, 3)
    # the second's response is whole in the capture: its own, and said as it came
    assert ends(events)[2].body_bytes == answer_size(2)
    assert_packet_wording(events)


def test_a_gap_that_swallows_a_whole_request_head(tmp_path: Path) -> None:
    """The second request is not in the capture, its response is: that response goes
    to nobody, and the third request (numbered 3, as the inline tap would) has its own."""
    c = Conn()
    c.client(get(1))
    c.server(answer(1))
    c.client(get(2), lose=True)
    c.server(answer(2))
    c.client(get(3))
    c.server(answer(3))
    c.close()
    events = c.read(tmp_path)

    assert sorted(heads(events)) == [1, 3]
    assert anomalies(events) == [(2, "client", len(get(2)))]
    assert sorted(ends(events)) == [1, 3]
    assert_answered(events, 1, 1)
    assert_answered(events, 3, 3)
    assert of(events, ev.ConnClose)[0].requests == 3
    assert_packet_wording(events)
    result = summarize(events)  # the analysis takes an anomaly of a request it never saw
    assert [r["seq"] for r in result["requests"]] == [1, 3]


def test_two_swallowed_requests_are_counted_by_their_responses(tmp_path: Path) -> None:
    c = Conn()
    c.client(get(1))
    c.server(answer(1))
    c.client(get(2), lose=True)
    c.server(answer(2))
    c.client(get(3), lose=True)
    c.server(answer(3))
    c.client(get(4))
    c.server(answer(4))
    c.close()
    events = c.read(tmp_path)
    assert sorted(heads(events)) == [1, 4]
    lost = len(get(2)) + len(get(3))
    assert anomalies(events) == [(2, "client", len(get(2))), (3, "client", lost)]
    assert_answered(events, 4, 4)
    assert of(events, ev.ConnClose)[0].requests == 4


def test_a_swallowed_request_whose_response_comes_after_the_next_one_is_not_paired(
    tmp_path: Path,
) -> None:
    """Sent back to back (pipelined), the lost second request and the third: the first
    response after the third's head may be the second's: nothing is paired."""
    c = Conn()
    c.client(get(1))
    c.server(answer(1))
    c.client(get(2), lose=True, ack=False)
    c.client(get(3))
    c.server(answer(2))
    c.server(answer(3))
    c.close()
    events = c.read(tmp_path)
    assert sorted(heads(events)) == [1, 3]
    assert_answered(events, 1, 1)
    third = ends(events)[3]
    assert third.termination == "unparsed" and third.status is None
    assert anomalies(events) == [(2, "client", len(get(2))), (3, "client", len(get(2)))]


# ---- at the very end -------------------------------------------------------------------


@pytest.mark.parametrize("side", ["upstream", "client"])
def test_a_gap_at_the_very_end(tmp_path: Path, side: str) -> None:
    c = Conn()
    c.client(get(1))
    c.server(answer(1))
    if side == "upstream":
        c.client(get(2))
        c.server(SSE_HEAD + chunk(EVENTS[0]))
        c.server(chunk(EVENTS[1]) + b"0\r\n\r\n", lose=True)  # its end: acknowledged
        size = len(chunk(EVENTS[1])) + 5
    else:
        whole = post(2, b'{"prompt":"' + b"p" * 500 + b'"}')
        c.client(whole[:-100])
        c.client(whole[-100:], lose=True)
        c.server(answer(2))
        size = 100
    events = c.read(tmp_path)  # the capture ends there, the connection open

    assert sorted(heads(events)) == [1, 2]
    assert_answered(events, 1, 1)
    assert anomalies(events) == [(2, side, size)]
    second = ends(events)[2]
    if side == "upstream":
        assert second.termination == "unparsed"
        assert second.events == 1 and not second.done  # what came before the gap
    else:
        assert {e.seq: e.complete for e in of(events, ev.RequestEnd)}[2] is False
        assert second.termination == "complete" and second.body_bytes == answer_size(2)
    assert_packet_wording(events)
