"""The sim engine's ``ignore-disconnect`` fault: a client that goes away does not abort its
request, which decodes on to ``max_tokens`` in the running batch (vLLM #9428).

Sans-I/O: the scheduler runs in this process, and the engine's HTTP handler is given an
in-memory byte stream in place of a socket."""

from __future__ import annotations

import json
import time
from typing import Any, cast

import anyio
import pytest
from anyio.abc import SocketStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from anyio.streams.stapled import StapledObjectStream

from tracer.sim.engine import FAULT_KINDS, EngineConfig, Fault, SimEngine, parse_fault
from tracer.sim.scheduler import Scheduler, SchedulerConfig, SimRequest

pytestmark = pytest.mark.anyio


def test_ignore_disconnect_spec() -> None:
    assert "ignore-disconnect" in FAULT_KINDS
    assert parse_fault("ignore-disconnect") == Fault("ignore-disconnect")
    assert parse_fault("Ignore-Disconnect@nth=1") == Fault("ignore-disconnect", nth=1)
    assert str(parse_fault("ignore-disconnect@nth=1")) == "ignore-disconnect@nth=1"
    with pytest.raises(ValueError, match="unknown argument"):
        parse_fault("ignore-disconnect:after=3")


def state(req: SimRequest) -> str:
    return req.state  # (read afresh: the scheduler task changes it)


async def _until(check: Any, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not check():
            await anyio.sleep(0.005)


async def test_scheduler_decodes_on_for_a_request_nobody_reads() -> None:
    sched = Scheduler(SchedulerConfig(ttft=0.0, itl=0.002, decode_log_interval=5))
    zombie = SimRequest(rid="zombie", prompt_tokens=3, max_tokens=60, ignore_disconnect=True)
    plain = SimRequest(rid="plain", prompt_tokens=3, max_tokens=60)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sched.run)
        for req in (zombie, plain):
            sched.submit(req)
        await _until(lambda: zombie.generated >= 3 and plain.generated >= 3)
        zombie.receive.close()  # both handlers are gone
        plain.receive.close()
        left_at, progress_at = zombie.generated, sched.realtime_tokens["decode"]
        await _until(lambda: plain.state == "aborted")
        assert state(zombie) == "running" and sched.running == [zombie]
        await _until(lambda: state(zombie) == "finished")
        tg.cancel_scope.cancel()
    assert zombie.generated == 60 > left_at  # decoded on to max_tokens
    assert sched.num_aborted_requests_total == 1  # the plain one only
    assert sched.num_requests_total == 2
    assert sched.generation_tokens_total == 60 + plain.generated  # (counted at finish)
    # the live progress figure (written every 5 steps here) moved with it
    assert sched.realtime_tokens["decode"] - progress_at >= 60 - left_at - 5


def _request(max_tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": "sim-model",
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hi"}],
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@pytest.mark.parametrize("ignore", [True, False])
async def test_engine_keeps_generating_after_the_client_left(ignore: bool) -> None:
    faults = [parse_fault("ignore-disconnect@nth=1")] if ignore else []
    engine = SimEngine(EngineConfig(ttft=0.0, itl=0.003, max_running=1, faults=faults))
    sched = engine.scheduler
    to_engine: tuple[MemoryObjectSendStream[bytes], MemoryObjectReceiveStream[bytes]]
    to_engine = anyio.create_memory_object_stream[bytes](100)
    to_client = anyio.create_memory_object_stream[bytes](10000)
    server = StapledObjectStream(to_client[0], to_engine[1])
    async with anyio.create_task_group() as tg:
        tg.start_soon(sched.run)
        tg.start_soon(engine._handle, cast(SocketStream, server))
        await to_engine[0].send(_request(200))
        got = b""
        while got.count(b'"content":"tok') < 5:
            got += await to_client[1].receive()
        await to_engine[0].aclose()  # the client closes mid-stream
        to_client[1].close()
        left = time.monotonic()
        if not ignore:
            await _until(lambda: not sched.running)
            assert sched.num_aborted_requests_total == 1
            tg.cancel_scope.cancel()
            return
        await anyio.sleep(0.1)
        (zombie,) = sched.running  # still running, nobody reading
        moved = zombie.generated
        await anyio.sleep(0.1)
        assert zombie.generated > moved
        # a later request queues behind it (max_running 1)
        later = SimRequest(rid="later", prompt_tokens=1, max_tokens=2)
        sched.submit(later)
        await anyio.sleep(0.05)
        assert state(later) == "waiting" and sched.waiting[0] is later
        await _until(lambda: state(later) == "finished")
        later.receive.close()
        assert state(zombie) == "finished" and zombie.generated == 200
        assert time.monotonic() - left > 0.3
        tg.cancel_scope.cancel()
    assert sched.num_aborted_requests_total == 0
