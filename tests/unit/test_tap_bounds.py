"""The tap's request-head parser is bounded: a header flood is not parsed header by
header, newlines in a body are not head lines."""

from __future__ import annotations


def _observer(events: list[object]) -> object:
    from tracer.observe.wire import ConnectionObserver

    return ConnectionObserver(tap="t", conn=1, emit=events.append, wall_offset=0.0, opened_m=0.0)


def test_a_header_flood_is_not_parsed_header_by_header() -> None:
    """20,000 header lines in one head: the observer stops at MAX_HEADER_LINES, records an
    anomaly and follows the connection no further (the relay forwards it regardless)."""
    from tracer import events as ev
    from tracer.observe.wire import MAX_HEADER_LINES

    events: list[object] = []
    obs = _observer(events)
    flood = b"GET / HTTP/1.1\r\nHost: r\r\n" + b"a: b\r\n" * 20_000 + b"\r\n"
    for i in range(0, len(flood), 4096):
        obs.client_data(flood[i : i + 4096], 1.0)  # type: ignore[attr-defined]
    (anomaly,) = [e for e in events if isinstance(e, ev.Anomaly)]
    assert f"over {MAX_HEADER_LINES} lines" in anomaly.error and obs.blind  # type: ignore[attr-defined]
    assert not [e for e in events if isinstance(e, ev.RequestHead)]


def test_newlines_in_a_body_are_not_head_lines() -> None:
    """A prompt with thousands of newlines, in the same read as its head: parsed as usual."""
    from tracer import events as ev

    events: list[object] = []
    obs = _observer(events)
    body = b'{"messages": "' + b"\\n" * 10 + b'"}' + b"\n" * 5000
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\ncontent-length: %d\r\n\r\n" % len(
        body
    )
    obs.client_data(head + body + head[:20], 1.0)  # type: ignore[attr-defined]
    obs.client_data(head[20:] + body, 1.5)  # type: ignore[attr-defined]
    assert not [e for e in events if isinstance(e, ev.Anomaly)]
    ends = [e for e in events if isinstance(e, ev.RequestEnd)]
    assert len(ends) == 2 and all(e.complete and e.body_bytes == len(body) for e in ends)
