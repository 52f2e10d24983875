"""`tracer sim engine --from CAPTURE`: captured responses, their pace and their endings.

A capture is made of real traffic (simulated engine <- tap with --bodies all <- httpx),
then `tracer sim engine --from` runs as a subprocess with a second tap in front of it and
the same requests are sent again: the second tap's records must say what the first said.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from tests.support.shared import made_once
from tests.support.tap import RawUpstream, UpConn, running_tap
from tracer import events as ev
from tracer.capture.files import read_events
from tracer.cli import commands as cli
from tracer.sim.engine import EngineConfig, SimEngine
from tracer.sim.playback import PlaybackEngine, Playbook, build_playbook

pytestmark = pytest.mark.anyio

DEADLINE = 2.0  # a client gives up on a silent request after this long (the stalled
# request takes about 0.75 s: a loaded 2-core machine once took longer than 0.8 s)
STALL = 0.5  # the captured mid-stream silence

CHAT = {
    "model": "sim-model",
    "stream": True,
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "round one"}],
    "stream_options": {"include_usage": True},
}
SHORT = {**CHAT, "max_tokens": 3}
UNARY = {"model": "sim-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}

# (body, x-sim-fault for the capture, how the client saw it end)
SCRIPT: list[tuple[dict[str, Any], str, str]] = [
    (CHAT, f"stall:after=2:for={STALL}", "complete"),  # a long silence mid-stream
    (CHAT, "close:after=2", "cut"),  # the same request, truncated (FIN)
    (CHAT, "lost", "hung"),  # the same request, never answered
    (UNARY, "none", "complete"),
    (SHORT, "reset:after=1", "cut"),  # truncated with RST
]


def _content(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


async def exchange(client: httpx.AsyncClient, body: dict[str, Any], fault: str = "none") -> str:
    """Send one request; how it ended for the client: complete, cut or hung."""
    headers = {"content-type": "application/json", "x-sim-fault": fault}
    with anyio.move_on_after(DEADLINE):
        try:
            async with client.stream(
                "POST", "/v1/chat/completions", content=_content(body), headers=headers
            ) as response:
                async for _ in response.aiter_raw():
                    pass
            return "complete"
        except (httpx.RemoteProtocolError, httpx.ReadError):
            return "cut"
    return "hung"


async def _make_capture(tmp_path: Path) -> tuple[Path, list[str]]:
    engine = SimEngine(EngineConfig(ttft=0.05, itl=0.03))
    outcomes: list[str] = []
    async with anyio.create_task_group() as tg:
        _, port = await tg.start(engine.serve)
        async with running_tap(port, tmp_path, name="orig", bodies="all") as handle:
            async with httpx.AsyncClient(base_url=handle.url, timeout=10) as client:
                for body, fault, _ in SCRIPT:
                    outcomes.append(await exchange(client, body, fault))
        tg.cancel_scope.cancel()
    return handle.capture, outcomes


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One capture of the script, shared by the tests (they only read it), made once."""

    def make(folder: Path) -> tuple[str, list[str]]:
        path, outcomes = anyio.run(_make_capture, folder)
        return str(path), outcomes

    path, outcomes = made_once(tmp_path_factory, "sim-playback-capture", make)
    assert outcomes == [outcome for _, _, outcome in SCRIPT]
    return Path(path)


@dataclass
class Seen:
    """What a tap saw of one exchange."""

    status: int | None
    termination: str
    close: str | None
    ttfb: float | None
    max_gap: float | None
    events: list[list[Any]] = field(default_factory=list)  # [offset from head, size, kind]
    data: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def seen(events: list[ev.Event]) -> list[Seen]:
    """The exchanges of a capture, in request order."""
    rows: dict[tuple[int, int], Seen] = {}
    heads: dict[tuple[int, int], float] = {}
    for event in events:
        if isinstance(event, ev.RequestHead):
            rows[(event.conn, event.seq)] = Seen(None, "in_flight", None, None, None)
        elif isinstance(event, ev.ResponseHead):
            row = rows[(event.conn, event.seq)]
            row.status, row.ttfb = event.status, event.ttfb
            row.headers = {k.lower(): v for k, v in event.headers}
            heads[(event.conn, event.seq)] = event.m
        elif isinstance(event, ev.BodyData):
            row = rows[(event.conn, event.seq)]
            base = event.m - heads[(event.conn, event.seq)]
            row.events += [[base + e[0], *e[1:]] for e in event.sse or []]
            row.data += (event.data or "").encode()
        elif isinstance(event, ev.ResponseEnd):
            row = rows[(event.conn, event.seq)]
            row.termination, row.close, row.max_gap = event.termination, event.close, event.max_gap
    return list(rows.values())


@dataclass
class Engine:
    port: int
    lines: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@asynccontextmanager
async def playback(*args: str) -> AsyncIterator[Engine]:
    """`tracer sim engine --from ...` as a subprocess; its stderr lines in ``lines``."""
    cmd = [sys.executable, "-m", "tracer", "sim", "engine", "--listen", "127.0.0.1:0", *args]
    process = await anyio.open_process(cmd, stdin=None)
    assert process.stderr is not None
    reader = BufferedByteReceiveStream(process.stderr)
    lines: list[str] = []
    try:
        with anyio.fail_after(15):
            while True:
                lines.append((await reader.receive_until(b"\n", 65536)).decode())
                found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", lines[-1])
                if found:
                    break
        async with anyio.create_task_group() as tg:

            async def drain() -> None:
                try:
                    while True:
                        lines.append((await reader.receive_until(b"\n", 65536)).decode())
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
                    return

            tg.start_soon(drain)
            yield Engine(int(found.group(1)), lines)
            process.terminate()
            with anyio.fail_after(10):
                await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.CancelScope(shield=True):
            await process.aclose()


async def test_same_answers_pace_and_endings_through_a_tap(capture: Path, tmp_path: Path) -> None:
    original = seen(list(read_events(capture)))
    async with playback("--from", str(capture)) as engine:
        async with running_tap(engine.port, tmp_path, name="again", bodies="all") as tap:
            async with httpx.AsyncClient(base_url=tap.url, timeout=10) as client:
                outcomes = [await exchange(client, body, fault) for body, fault, _ in SCRIPT]
                # the capture had three answers for CHAT: all served, the next one is not
                extra = await client.post("/v1/chat/completions", content=_content(CHAT))
    again = seen(tap.events())
    assert outcomes == [outcome for _, _, outcome in SCRIPT]
    assert [(s.status, s.termination, s.close) for s in again[: len(SCRIPT)]] == [
        (s.status, s.termination, s.close) for s in original
    ]
    assert [s.termination for s in original] == [
        "complete",
        "truncated",
        "client_abort",  # never answered: the client gave up
        "complete",
        "truncated",
    ]
    assert [s.close for s in original] == [None, "fin", "fin", None, "reset"]
    for before, after in zip(original, again, strict=False):
        # the same bytes, the same SSE events (sizes and kinds), at about the same times
        assert after.data == before.data
        assert [e[1:] for e in after.events] == [e[1:] for e in before.events]
        for (t0, *_), (t1, *_) in zip(before.events, after.events, strict=True):
            assert t0 - 0.03 <= t1 <= t0 + 0.3, (before.events, after.events)
        if before.ttfb is not None:
            assert after.ttfb is not None and before.ttfb - 0.03 <= after.ttfb <= before.ttfb + 0.3
    stalled = again[0]
    assert original[0].max_gap is not None and original[0].max_gap >= STALL - 0.05
    assert stalled.max_gap is not None and STALL - 0.05 <= stalled.max_gap <= STALL + 0.3
    assert stalled.headers["x-tracer-playback"] == "orig/1/1"
    assert extra.status_code == 404
    assert "all 3 captured responses for it were served" in extra.json()["message"]
    assert any(
        "played back 5 responses; unmatched requests (404): 1" in line for line in engine.lines
    )


async def test_a_captured_hang_stays_hung(capture: Path) -> None:
    async with playback("--from", str(capture)) as engine:
        async with httpx.AsyncClient(base_url=engine.url, timeout=10) as client:
            assert await exchange(client, CHAT) == "complete"
            assert await exchange(client, CHAT) == "cut"
            # The third captured answer to CHAT never came: poll past the captured
            # deadline, well beyond any captured gap, and give up.
            headers = {"content-type": "application/json"}
            got: httpx.Response | None = None
            with anyio.move_on_after(2 * DEADLINE):
                got = await client.post(
                    "/v1/chat/completions", content=_content(CHAT), headers=headers
                )
            assert got is None
            health = await client.get("/health")  # the engine itself is fine
            assert health.status_code == 200


async def test_unmatched_requests_get_404_naming_the_fingerprint(capture: Path) -> None:
    other = {**CHAT, "messages": [{"role": "user", "content": "something else"}]}
    async with playback("--from", str(capture)) as engine:
        async with httpx.AsyncClient(base_url=engine.url, timeout=10) as client:
            miss = await client.post("/v1/chat/completions", content=_content(other))
            unknown = await client.get("/v2/whatever")
            live = {path: await client.get(path) for path in ("/health", "/v1/models", "/metrics")}
    assert miss.status_code == 404
    error = miss.json()
    assert error["fingerprint"] == {
        "method": "POST",
        "target": "/v1/chat/completions",
        "body_sha256": hashlib.sha256(_content(other)).hexdigest(),
        "body_bytes": len(_content(other)),
    }
    assert "no captured request has this fingerprint" in error["message"]
    assert "captured POST /v1/chat/completions with other bodies" in error["message"]
    assert unknown.status_code == 404 and unknown.json()["fingerprint"]["method"] == "GET"
    assert {path: r.status_code for path, r in live.items()} == {
        "/health": 200,
        "/v1/models": 200,
        "/metrics": 200,
    }
    assert live["/v1/models"].json()["data"][0]["id"] == "sim-model"
    assert "sglang:num_running_reqs" in live["/metrics"].text


async def test_repeat_serves_again_and_speed_shortens_the_gaps(capture: Path) -> None:
    async with playback("--from", str(capture), "--repeat", "--speed", "5") as engine:
        async with httpx.AsyncClient(base_url=engine.url, timeout=10) as client:
            first = await client.post("/v1/chat/completions", content=_content(UNARY))
            second = await client.post("/v1/chat/completions", content=_content(UNARY))
            times: list[float] = []
            async with client.stream(
                "POST", "/v1/chat/completions", content=_content(CHAT)
            ) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        times.append(anyio.current_time())
    assert first.status_code == second.status_code == 200
    assert first.content == second.content
    assert first.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert STALL / 5 - 0.02 <= max(gaps) <= STALL / 2, gaps


async def test_bodies_not_kept_are_synthesised_with_captured_kinds_and_sizes(
    capture: Path, tmp_path: Path
) -> None:
    # A capture without response bodies (--bodies requests) is the same records without
    # "data": strip it from the shared capture.
    stripped = tmp_path / "no-bodies.jsonl"
    with capture.open("rb") as src, stripped.open("wb") as dst:
        for line in src:
            record = orjson.loads(line)
            record.pop("data", None)
            record.pop("data_encoding", None)
            dst.write(orjson.dumps(record) + b"\n")
    original = seen(list(read_events(capture)))
    async with playback("--from", str(stripped)) as engine:
        async with running_tap(engine.port, tmp_path, name="synth", bodies="all") as tap:
            async with httpx.AsyncClient(base_url=tap.url, timeout=10) as client:
                outcomes = [await exchange(client, body) for body, _, _ in SCRIPT]
    again = seen(tap.events())
    assert outcomes == [outcome for _, _, outcome in SCRIPT]
    for before, after in zip(original, again, strict=True):
        assert (after.status, after.termination, after.close) == (
            before.status,
            before.termination,
            before.close,
        )
        assert [e[1:] for e in after.events] == [e[1:] for e in before.events]
        assert len(after.data) == len(before.data)
    assert again[0].headers["x-tracer-playback"] == "orig/1/1; synthesised"
    assert json.loads(again[3].data)["tracer_playback"]  # a JSON body of the captured size


def test_playbook_from_the_capture(capture: Path) -> None:
    playbook, skipped = build_playbook(read_events(capture))
    assert skipped == []
    by_body = {fp.body_sha256: answers for fp, answers in playbook.items()}
    chat = by_body[hashlib.sha256(_content(CHAT)).hexdigest()]
    assert [a.ending for a in chat] == ["complete", "close", "never"]
    assert [a.status for a in chat] == [200, 200, None]
    assert by_body[hashlib.sha256(_content(SHORT)).hexdigest()][0].ending == "reset"
    assert not any(a.synthesised for answers in playbook.values() for a in answers)
    # the truncated stream stops after the role and two content events
    kinds = [step.data[:40] for step in chat[1].steps]
    assert len(kinds) == 3 and all(k.startswith(b"data: {") for k in kinds)


async def test_a_cut_inside_an_event_is_cut_the_same_way(tmp_path: Path) -> None:
    """No response bodies kept, the stream cut mid-event: the same cut, synthesised."""
    event = b'data: {"choices":[{"index":0,"delta":{"content":"hello"}}]}\n\n'

    async def script(stream: SocketStream, conn: UpConn) -> None:
        await conn.wait_for(lambda c: c.received.endswith(_content(CHAT)))
        await stream.send(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        await stream.send(b"%x\r\n%s\r\n" % (len(event), event))
        await anyio.sleep(0.2)  # the captured gap before the cut, not synchronisation
        await stream.send(b"14\r\n" + event[:20] + b"\r\n")

    async def send(url: str) -> str:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            return await exchange(client, CHAT)

    upstream = RawUpstream(script)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        async with running_tap(port, tmp_path, name="cut") as tap:  # --bodies requests
            assert await send(tap.url) == "cut"
        tg.cancel_scope.cancel()
    playbook, _ = build_playbook(tap.events())
    [answer] = [a for answers in playbook.values() for a in answers]
    assert answer.synthesised and answer.ending == "close"
    assert [len(step.data) for step in answer.steps] == [len(event), 20]
    assert answer.steps[1].at - answer.steps[0].at >= 0.2
    engine = PlaybackEngine(EngineConfig(), Playbook(playbook))
    async with anyio.create_task_group() as tg:
        _, port = await tg.start(engine.serve)
        async with running_tap(port, tmp_path, name="again") as again:
            assert await send(again.url) == "cut"
        tg.cancel_scope.cancel()
    [before] = [e for e in tap.events() if isinstance(e, ev.ResponseEnd)]
    [after] = [e for e in again.events() if isinstance(e, ev.ResponseEnd)]
    assert (after.termination, after.close, after.mid_event) == ("truncated", "fin", True)
    assert (
        (after.body_bytes, after.events)
        == (before.body_bytes, before.events)
        == (
            len(event) + 20,
            1,
        )
    )
    # the gap is replayed on the head's clock: a first piece sent late (a loaded machine)
    # leaves it a little shorter, as in the stall above
    assert after.max_gap is not None and after.max_gap >= 0.2 - 0.05


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from", "/nonexistent/cap.jsonl"], "--from /nonexistent/cap.jsonl: No such file"),
        (["--from", "CAPTURE", "--fault", "lost"], "--fault does not apply with --from"),
        (["--from", "CAPTURE", "--speed", "0"], "--speed must be above 0"),
        (["--repeat"], "--repeat and --speed apply only with --from CAPTURE"),
    ],
)
def test_bad_options_are_named(
    capture: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [str(capture) if a == "CAPTURE" else a for a in args]
    code = cli.main(["sim", "engine", "--listen", "127.0.0.1:0", *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_playbook_from_a_folder_reads_the_captures_in_it(capture: Path, tmp_path: Path) -> None:
    """--from takes the folder of a rotated capture, as analyze and replay do."""
    from tracer.sim.playback import load_playbook

    folder = tmp_path / "rotated"
    folder.mkdir()
    (folder / "cap.jsonl").write_bytes(capture.read_bytes())
    from_file = load_playbook(capture)
    from_folder = load_playbook(folder)
    assert from_folder.summary() == from_file.summary()
