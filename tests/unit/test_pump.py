"""The relay's per-read callbacks (``proxy/pump.py``, compiled when the build is used,
as in a tap): a read is written to the other side before it is observed, with the time
it came; an observer that fails loses its own read, is reported, and the bytes go on;
before its upstream is connected, a plain relay's client reads go to the relay, and a
relay that changes a side's bytes gets that side's reads."""

from __future__ import annotations

from typing import Any

from tracer import events as ev
from tracer.observe.wire import ConnectionObserver
from tracer.proxy.pump import ClientPump, UpstreamPump

REQ = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n"
RESP = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class Transport:
    """What a pump uses of a transport, and the order things happened in."""

    def __init__(self, log: list[str], closing: bool = False) -> None:
        self.log = log
        self.closing = closing
        self.written: list[bytes] = []

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.log.append("write")
        self.written.append(data)


class Relay:
    """The Python side of a relay, as far as the pumps call it."""

    upstream: Any = None

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.from_client_data: list[bytes] = []

    def observer_failed(self) -> None:
        self.calls.append("observer_failed")

    def from_client(self, data: bytes) -> None:
        self.from_client_data.append(data)

    def from_upstream(self, data: bytes) -> None:
        self.calls.append("from_upstream")

    def on_upstream_eof(self) -> None:
        self.calls.append("upstream_eof")

    def on_client_eof(self) -> None:
        self.calls.append("client_eof")


def _observer(log: list[str], conn: int = 1) -> ConnectionObserver:
    def emit(event: ev.Event) -> None:
        log.append(event.TYPE)

    return ConnectionObserver(tap="t", conn=conn, emit=emit, wall_offset=0.0, opened_m=0.0)


def test_each_read_is_forwarded_first_then_observed() -> None:
    log: list[str] = []
    relay, client, upstream = Relay(), Transport(log), Transport(log)
    obs = _observer(log)
    pump = ClientPump(lambda transport, pump: relay)
    pump.connection_made(client)
    pump.connected(upstream, obs)
    pump.data_received(REQ)
    UpstreamPump(relay, client, obs, True).data_received(RESP)
    assert upstream.written == [REQ] and client.written == [RESP]
    assert log[0] == "write" and log.index("request") > 0
    assert log.index("response") > log.index("write", log.index("request"))
    assert obs.client_bytes == len(REQ) and obs.upstream_bytes == len(RESP)
    assert relay.calls == []


def test_a_failing_observer_loses_its_read_and_forwarding_goes_on() -> None:
    log: list[str] = []

    def broken(event: ev.Event) -> None:
        raise ValueError("a sink bug")

    relay, client = Relay(), Transport(log)
    obs = ConnectionObserver(tap="t", conn=3, emit=broken, wall_offset=0.0, opened_m=0.0)
    pump = ClientPump(lambda transport, pump: relay)
    pump.connection_made(client)
    upstream = Transport(log)
    pump.connected(upstream, obs)
    pump.data_received(REQ)
    pump.data_received(REQ)
    assert upstream.written == [REQ, REQ]
    assert relay.calls.count("observer_failed") >= 1


def test_a_closing_side_is_not_written_but_the_read_is_observed() -> None:
    log: list[str] = []
    relay, client = Relay(), Transport(log, closing=True)
    obs = _observer(log)
    obs.client_data(REQ, 0.5)
    UpstreamPump(relay, client, obs, True).data_received(RESP)
    assert client.written == [] and obs.upstream_bytes == len(RESP)


def test_before_the_upstream_connects_client_reads_go_to_the_relay() -> None:
    log: list[str] = []
    relay = Relay()
    pump = ClientPump(lambda transport, pump: relay)
    pump.connection_made(Transport(log))
    pump.data_received(REQ)
    pump.eof_received()
    assert relay.from_client_data == [REQ] and relay.calls == ["client_eof"]
    turned_away = ClientPump(lambda transport, pump: None)
    turned_away.connection_made(Transport(log))
    turned_away.data_received(REQ)  # a refused client: nothing to do, nothing raised
    assert turned_away.eof_received() is True


def test_a_relay_that_changes_upstream_bytes_gets_the_reads() -> None:
    log: list[str] = []
    relay, client = Relay(), Transport(log)
    obs = _observer(log)
    UpstreamPump(relay, client, obs, False).data_received(RESP)
    assert relay.calls == ["from_upstream"]
    assert client.written == [] and obs.upstream_bytes == 0  # the relay's to do
