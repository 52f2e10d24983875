"""What a tap's upstream is, over the wire: the fingerprint's I/O (one connection, a refusal,
a silent upstream, a transparent hop) and the `topology` record of a real tap."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import SocketStream

from tests.support.engine import SMG, engine_running, smg_router
from tests.support.net import wait_until
from tests.support.procs import tracer_proxy
from tests.support.tap import RawUpstream, UpConn, running_tap
from tracer import events as ev
from tracer.capture.files import read_records
from tracer.evidence import topology as T
from tracer.protocol.probe_mark import ProbeClaim, nonce_for, parse_probe

DATA = Path(__file__).parent.parent / "data" / "topology"


# ---- the I/O half: one connection, bounded, never raising --------------------------------


def _serve(answers: dict[str, bytes], close_after: int | None = None) -> Callable[..., Any]:
    async def script(stream: SocketStream, conn: UpConn) -> None:
        served = 0
        while close_after is None or served < close_after:
            await conn.wait_for(lambda c, n=served: c.received.count(b"\r\n\r\n") > n)
            head = bytes(conn.received).split(b"\r\n\r\n")[served]
            path = head.split(b" ")[1].decode()
            await stream.send(answers.get(path, (DATA / "smg_not_found.http").read_bytes()))
            served += 1

    return script


async def _fingerprint_of(
    script: Callable[..., Any], **kw: Any
) -> tuple[list[T.Answer], RawUpstream]:
    upstream = RawUpstream(script)
    async with anyio.create_task_group() as tg:
        port = await tg.start(upstream.serve)
        answers = await T.fingerprint("127.0.0.1", port, **kw)
        tg.cancel_scope.cancel()
    return answers, upstream


@pytest.mark.anyio
async def test_fingerprint_asks_over_one_connection() -> None:
    raw = {"/version": (DATA / "vllm_version.http").read_bytes()}
    answers, upstream = await _fingerprint_of(_serve(raw))
    assert [a.path for a in answers] == ["/get_server_info", "/version"]
    assert len(upstream.conns) == 1
    assert T.classify(answers).server == {"kind": "vllm", "version": "0.11.0"}


@pytest.mark.anyio
async def test_fingerprint_stops_when_the_upstream_closes() -> None:
    answers, upstream = await _fingerprint_of(_serve({}, close_after=1))
    assert len(upstream.conns) == 1
    assert answers[0].status == 404
    assert len(answers) == 2 and answers[1].error is not None  # the next one got no answer


@pytest.mark.anyio
async def test_a_silent_upstream_costs_the_timeout_and_is_unknown() -> None:
    async def silent(stream: SocketStream, conn: UpConn) -> None:
        await anyio.sleep_forever()

    answers, _ = await _fingerprint_of(silent, timeout=0.3)
    assert [(a.path, a.error) for a in answers] == [("/get_server_info", "no answer within 0.3s")]
    assert T.classify(answers).role == "unknown"


@pytest.mark.anyio
async def test_a_refused_connect_is_evidence(refused_port: int) -> None:
    verdict = await T.probe("127.0.0.1", refused_port, timeout=1)
    assert (verdict.role, verdict.basis) == ("unknown", "unknown")
    assert "Connection refused" in verdict.evidence[0]


# ---- a tap records it ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_in_process_tap_fingerprints_beside_forwarding(tmp_path: Path) -> None:
    async with (
        engine_running(ttft=0.0, itl=0.0, tokens=2) as engine,
        running_tap(engine.bound[1], tmp_path, fingerprint=True, client_facing=True) as h,
    ):
        async with httpx.AsyncClient() as client:
            assert (await client.get(h.url + "/v1/models")).status_code == 200
        [record] = await h.wait_for(ev.Topology)
        hits = dict(engine.hits)
    assert (record.upstream_role, record.basis, record.client_facing) == (
        "engine",
        "inferred",
        True,
    )
    assert record.server["kind"] == "sglang" and record.elapsed is not None
    assert hits["GET /get_server_info"] == 1 and hits["GET /readiness"] == 1
    # the fingerprint went straight to the upstream: the capture has the client's request only
    requests = [e for e in h.events() if isinstance(e, ev.RequestHead)]
    assert [r.target for r in requests] == ["/v1/models"]
    header = h.events()[0]
    assert isinstance(header, ev.CaptureStart)
    assert header.client_facing is True and header.upstream_role is None
    assert header.options["fingerprint"] is True


@pytest.mark.anyio
async def test_a_transparent_hop_is_caught_by_the_port_and_sees_the_probe_header(
    tmp_path: Path,
) -> None:
    async with (
        engine_running(ttft=0.0, itl=0.0) as engine,
        running_tap(engine.bound[1], tmp_path, name="back") as back,
        running_tap(back.port, tmp_path, name="front", fingerprint=True) as front,
    ):
        [record] = await front.wait_for(ev.Topology)
        seen = await back.wait_for(ev.RequestHead, count=2)
        # clients sending the header themselves: a tap's marker, forged, and an empty one
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}") as client:
            for value in ("topology", "topology; tap=front", ""):
                reply = await client.get("/v1/models", headers={"X-Tracer-Probe": value})
                assert reply.status_code == 200
        await back.wait_for(ev.ResponseEnd, count=5)
    # the hop passes the engine's answers through; the engine's own port gives it away
    assert (record.upstream_role, record.basis) == ("unknown", "unknown")
    assert record.server["kind"] == "sglang"
    assert f"the tap connects to port {back.port}" in record.evidence[-1]
    # the tap behind sees the fingerprint, marked with the front tap's run nonce
    assert [r.target for r in seen] == ["/get_server_info", "/readiness"]
    for r in seen:
        [value] = [v for k, v in r.headers if k == T.PROBE_HEADER]
        assert parse_probe(value) == ProbeClaim("topology", "front", nonce_for("front"))
    # analysed together (the tap behind first: its probes are vouched for by the front
    # tap's capture whatever the order), the fingerprint is the front tap's own; the
    # clients' requests stay theirs at both taps, with a note
    argv = ["analyze", str(back.capture), str(front.capture), "--format", "json"]
    out = subprocess.run(
        [sys.executable, "-m", "tracer", *argv],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["totals"]["tap_own_requests"] == 2
    rows = [(r["tap"], r["target"]) for r in result["requests"]]
    assert rows.count(("front", "/v1/models")) == 3 and rows.count(("back", "/v1/models")) == 3
    assert ("back", "/readiness") not in rows
    [note] = [f for f in result["findings"] if f["kind"] == "probe_header_unvouched"]
    assert note["note"] and note["evidence"][0]["figures"]["requests"] == 6


async def _topology_of(capture: Path) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def topology() -> bool:
        found[:] = [r for r in read_records(capture) if r["type"] == "topology"]
        return bool(found)

    await wait_until(topology, timeout=10)
    return found


@pytest.mark.anyio
async def test_real_tap_in_front_of_the_sim_engine(tmp_path: Path) -> None:
    inferred, declared = tmp_path / "inferred.jsonl", tmp_path / "declared.jsonl"
    async with engine_running(ttft=0.0, itl=0.0) as engine:
        common = ("proxy", "--listen", "127.0.0.1:0", "--upstream", engine.url)
        async with tracer_proxy(*common, "--capture", str(inferred), "--tap", "front"):
            [record] = await _topology_of(inferred)
        args = ("--upstream-role", "proxy", "--client-facing")
        async with tracer_proxy(*common, "--capture", str(declared), *args):
            [declared_record] = await _topology_of(declared)
    assert record["upstream_role"] == "engine" and record["basis"] == "inferred"
    assert record["server"]["kind"] == "sglang" and record["client_facing"] is False
    assert record["upstream"] == engine.url
    header = next(read_records(inferred))
    assert "upstream_role" not in header and "client_facing" not in header
    assert header["options"]["fingerprint"] is True

    assert declared_record["upstream_role"] == "proxy" and declared_record["basis"] == "declared"
    assert declared_record["client_facing"] is True and "server" not in declared_record
    header = next(read_records(declared))
    assert header["upstream_role"] == "proxy" and header["client_facing"] is True
    assert "fingerprint" not in header["options"]
    # no request of the fingerprint is client traffic of either capture
    for path in (inferred, declared):
        assert not [r for r in read_records(path) if r["type"] == "request"]
    json.dumps(record)  # (plain JSON, as written)


@pytest.mark.anyio
@pytest.mark.skipif(not SMG.exists(), reason="smg (sglang-router) is not installed")
async def test_real_tap_in_front_of_the_real_router(tmp_path: Path) -> None:
    capture = tmp_path / "front.jsonl"
    async with (
        engine_running(ttft=0.0, itl=0.0) as worker,
        smg_router(tmp_path, "--worker-urls", worker.url) as smg,
    ):
        assert smg.ready, smg.log.read_text(errors="replace")
        url = smg.url
        async with tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", url, "--capture", str(capture),
            "--health", f"{url}/readiness",
        ):  # fmt: skip
            [record] = await _topology_of(capture)
    assert (record["upstream_role"], record["basis"]) == ("router", "inferred")
    assert record["server"]["kind"] == "smg" and record["server"]["healthy_workers"] == 1
