"""The mitmproxy addon with HTTP/2 towards the client: streams, not keep-alive requests.

mitmproxy speaks HTTP/2 to a client that offers it (TLS, ALPN ``h2``) and HTTP/1.1 to
the upstream, one upstream connection per stream in flight. Several requests then run at
once on one client connection, and one of them ending (the client resets it, the upstream
cuts it) leaves the connection and the other streams going. A real mitmdump with the
addon, the simulated engine behind it, and a real HTTP/2 client (``tests/support/h2client.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.support.analyze import analyze_json
from tests.support.engine import engine_running
from tests.support.h2client import H2Client
from tests.support.net import wait_until
from tests.support.procs import count_records, mitmdump
from tracer.capture.files import read_records

pytestmark = pytest.mark.e2e

BODY = {
    "model": "sim-model",
    "max_tokens": 30,
    "stream": True,
    "messages": [{"role": "user", "content": "over HTTP/2"}],
}
PATH = "/v1/chat/completions"


@asynccontextmanager
async def through_mitmdump(
    tmp_path: Path, itl: float, *options: str
) -> AsyncIterator[tuple[Callable[[], Awaitable[H2Client]], Path]]:
    """The simulated engine behind mitmdump with the addon (stalls after 0.5 s); yields a
    way to open an HTTP/2 connection to it, and the capture."""
    async with engine_running(ttft=0.01, itl=itl) as engine:
        async with mitmdump(
            engine.url,
            tmp_path,
            "--set",
            "tracer_tap=mitm",
            "--set",
            "tracer_stall_after=0.5",
            *options,
        ) as (url, capture):
            port = int(url.rsplit(":", 1)[1])
            cafile = str(tmp_path / "mitmproxy" / "mitmproxy-ca-cert.pem")
            yield (lambda: H2Client.connect(port, cafile)), capture


@pytest.mark.anyio
async def test_streams_on_one_connection_end_and_stall_each_on_its_own(tmp_path: Path) -> None:
    async with through_mitmdump(tmp_path, itl=0.02) as (connect, capture):
        # one connection: four streams at once (one stalls 1.2 s, one is reset by the
        # client), then one the upstream cuts, one more, then a clean close (GOAWAY)
        client = await connect()
        faults = ["none", "stall:after=2:for=1.2", "none", "none"]
        ids = [
            await client.post(PATH, BODY, {"x-request-id": f"h2-{i}", "x-sim-fault": f})
            for i, f in enumerate(faults)
        ]
        reset = ids[2]
        await client.read_until(lambda: client.streams[reset].data.count(b"tok") >= 2)
        await client.reset(reset)
        others = [i for i in ids if i != reset]
        await client.read_until(lambda: all(client.streams[i].ended for i in others))
        upstream_cut = await client.post(
            PATH, BODY, {"x-request-id": "h2-4", "x-sim-fault": "close:after=2"}
        )
        await client.read_until(lambda: client.streams[upstream_cut].reset)
        last = await client.post(PATH, BODY, {"x-request-id": "h2-5"})
        await client.read_until(lambda: client.streams[last].ended)
        await client.close()
        # another: two streams, then the client's socket closes under them
        gone = await connect()
        cut = [await gone.post(PATH, BODY, {"x-request-id": f"gone-{i}"}) for i in (0, 1)]
        await gone.read_until(lambda: all(gone.streams[i].data.count(b"tok") for i in cut))
        await gone.sock.aclose()
        await wait_until(lambda: count_records(capture, "conn_close") >= 2, 10)
    for i in [*others, last]:
        stream = client.streams[i]
        assert stream.status == 200 and stream.data.endswith(b"data: [DONE]\n\n"), i

    records = list(read_records(capture))
    heads = [r for r in records if r["type"] == "request"]
    assert {r["version"] for r in heads} == {"2.0"}
    assert [(r["conn"], r["seq"]) for r in heads if r["conn"] == 1] == [(1, n) for n in range(1, 7)]
    closes = {r["conn"]: r for r in records if r["type"] == "conn_close"}
    assert closes[1]["closed_by"] == "client" and closes[1]["in_flight"] is False
    assert closes[1]["requests"] == 6
    assert closes[2]["closed_by"] == "client" and closes[2]["in_flight"] is True
    stalls = [r for r in records if r["type"] == "stall"]
    assert [(s["seq"], s["phase"], s["direction"]) for s in stalls] == [
        (2, "start", "upstream_silent"),
        (2, "end", "upstream_silent"),
    ]
    # the stalled stream's own silence, though the other streams went on meanwhile
    assert 0.5 <= stalls[0]["silent_for"] < 0.9 and stalls[1]["silent_for"] >= 1.0

    doc = analyze_json(capture)
    rows = {r["request_id"]: r for r in doc["requests"]}
    assert rows["h2-2"]["termination"] == "client_abort" and not rows["h2-2"]["done"]
    assert (rows["h2-4"]["termination"], rows["h2-4"]["events"]) == ("truncated", 3)
    for rid in ("h2-0", "h2-1", "h2-3", "h2-5"):
        assert rows[rid]["termination"] == "complete" and rows[rid]["done"], rid
        assert rows[rid]["events"] == rows["h2-0"]["events"], rid
    assert [s["direction"] for s in rows["h2-1"]["stalls"]] == ["upstream_silent"]
    assert all(not rows[r]["stalls"] for r in ("h2-0", "h2-2", "h2-3", "h2-4", "h2-5"))
    assert {rows[f"gone-{i}"]["termination"] for i in (0, 1)} == {"client_abort"}
    # a client's reset is not the upstream's cut, nor a closed connection; streams are
    # not keep-alive turns
    kinds = {f["requests"][0]: f["kind"] for f in doc["findings"]}
    assert kinds["mitm/1/5"] == "stream_cut" and kinds["mitm/1/2"] == "upstream_silent"
    (reset_finding,) = [f for f in doc["findings"] if "mitm/1/3" in f["requests"]]
    assert reset_finding["kind"] == "client_abort" and reset_finding["party"] == "client"
    reset_row = rows["h2-2"]  # the client reset the HTTP/2 stream
    assert reset_finding["requests"] == [f"mitm/{reset_row['conn']}/{reset_row['seq']}"]
    assert reset_row["detail"].startswith("stream reset by client")
    positions = [
        e["figures"] for f in doc["findings"] for e in f["evidence"] if "seq" in e["figures"]
    ]
    # streams on a connection already open, not keep-alive turns after an idle time
    assert any(p["reused"] and p["version"] == "2.0" for p in positions)
    assert not any("idle_before" in p for p in positions)
    assert {rows[r]["version"] for r in rows} == {"2.0"}


@pytest.mark.anyio
async def test_bytes_held_for_a_client_that_stops_reading_a_stream(tmp_path: Path) -> None:
    """HTTP/2 flow control: mitmproxy keeps reading the upstream and holds the stream's
    bytes itself. The stream stalls ``client_not_reading`` while the client takes none,
    and its response ends when the last bytes leave, or when the client resets it."""
    body = {**BODY, "max_tokens": 60}
    async with through_mitmdump(tmp_path, itl=0.005) as (connect, capture):
        client = await connect()
        await client.window(1000)
        held = await client.post(PATH, body, {"x-request-id": "held"})
        client.pause(held)
        read = await client.post(PATH, body, {"x-request-id": "read"})
        await client.read_until(lambda: client.streams[read].ended)

        def stall_of(seq: int) -> bool:
            return any(r["type"] == "stall" and r["seq"] == seq for r in read_records(capture))

        await wait_until(lambda: stall_of(1), 10)
        assert len(client.streams[held].data) <= 1000
        ends = [r["seq"] for r in read_records(capture) if r["type"] == "response_end"]
        assert ends == [2]  # the upstream has ended both; the client has one
        await client.resume(held)
        await client.read_until(lambda: client.streams[held].ended)
        await wait_until(lambda: count_records(capture, "response_end") >= 2, 10)
        # a third stream the client stops reading, then resets
        given_up = await client.post(PATH, body, {"x-request-id": "given-up"})
        client.pause(given_up)
        await wait_until(lambda: stall_of(3), 10)
        await client.reset(given_up)
        await wait_until(lambda: count_records(capture, "response_end") >= 3, 10)
        await client.close()
        await wait_until(lambda: count_records(capture, "conn_close") >= 1, 10)
    whole, ref = client.streams[held].data, client.streams[read].data
    assert whole.endswith(b"data: [DONE]\n\n") and whole.count(b"data:") == ref.count(b"data:")

    records = list(read_records(capture))
    stalls = [(r["seq"], r["phase"], r["direction"]) for r in records if r["type"] == "stall"]
    assert stalls == [
        (1, "start", "client_not_reading"),
        (1, "end", "client_not_reading"),
        (3, "start", "client_not_reading"),
        (3, "end", "client_not_reading"),
    ]
    starts = [r for r in records if r["type"] == "stall" and r["phase"] == "start"]
    assert all(r["unsent_bytes"] > 10_000 for r in starts)  # held by mitmproxy
    doc = analyze_json(capture)
    rows = {r["request_id"]: r for r in doc["requests"]}
    assert rows["read"]["termination"] == "complete" and not rows["read"]["stalls"]
    assert rows["held"]["termination"] == "complete" and rows["held"]["done"]
    assert "took the last bytes" in rows["held"]["detail"]
    # it ended when its last bytes left, after the stall, not at the upstream's end
    assert rows["held"]["duration"] > max(0.5, rows["read"]["duration"])
    assert rows["given-up"]["termination"] == "client_abort"
    kinds = {(f["kind"], f["party"]) for f in doc["findings"]}
    assert ("client_not_reading", "client") in kinds


@pytest.mark.anyio
async def test_faults_act_on_one_stream_of_the_connection(tmp_path: Path) -> None:
    """``addons/faults.py`` over HTTP/2: a request fault holds its stream, an event fault
    cuts its stream (mitmproxy resets it), and the connection's other streams go on."""
    faults = ("hang-on-reuse:2", "truncate-after-events:3@pos=3")
    options = ["-s", "addons/faults.py"]
    for spec in faults:
        options += ["--set", f"tracer_faults={spec}"]
    async with through_mitmdump(tmp_path, 0.01, *options) as (connect, capture):
        client = await connect()
        ids = [await client.post(PATH, BODY, {"x-request-id": f"f{n}"}) for n in (1, 2, 3, 4)]
        hung, cut = ids[1], ids[2]
        others = [ids[0], ids[3]]
        await client.read_until(
            lambda: client.streams[cut].reset and all(client.streams[i].ended for i in others)
        )
        assert client.streams[hung].status is None and not client.streams[hung].data
        assert client.streams[cut].data.count(b"data:") == 3
        assert not client.streams[cut].ended  # no END_STREAM: cut, not finished
        later = await client.post(PATH, BODY, {"x-request-id": "f5"})  # the connection lives
        await client.read_until(lambda: client.streams[later].ended)
        await client.close()
        await wait_until(lambda: count_records(capture, "conn_close") >= 1, 10)
    records = list(read_records(capture))
    injected = [(r["seq"], r["fault"]) for r in records if r["type"] == "fault"]
    assert injected == [(2, "hang-on-reuse"), (3, "truncate-after-events")]
    doc = analyze_json(capture)
    rows = {r["request_id"]: r for r in doc["requests"]}
    assert {rows[r]["termination"] for r in ("f1", "f4", "f5")} == {"complete"}
    assert rows["f2"]["injected"] == [faults[0]] and rows["f2"]["status"] is None
    assert rows["f3"]["injected"] == [faults[1]] and not rows["f3"]["done"]
    assert (rows["f3"]["termination"], rows["f3"]["events"]) == ("truncated", 3)
    assert doc["connections"][0]["closed_by"] == "client"
