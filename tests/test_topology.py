"""What a tap's upstream is: classification of recorded answers, the order of the
fingerprint's questions, its I/O, and the `topology` record of a real tap."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import h11
import httpx
import pytest
from anyio.abc import SocketStream

from tracer import events as ev
from tracer.capture.files import read_records
from tracer.evidence import topology as T

from .conftest import RawUpstream, UpConn, running_tap, wait_until
from .test_cli_proxy import _free_port, tracer_proxy
from .test_sim_engine import SMG, engine_running, smg_router

DATA = Path(__file__).parent / "data" / "topology"
METRICS = Path(__file__).parent / "data" / "metrics"

SIM_PORT = 31771  # the port the recorded sim engine reported in its /get_server_info
# where the user reads the upstream's metrics or health: what places it at the upstream
AT = {"upstream_host": "127.0.0.1", "upstream_port": 8000}
URLS = ["http://127.0.0.1:30000/metrics", "http://localhost:8000/readiness"]


def answer(name: str, path: str) -> T.Answer:
    return T.answer_from_bytes(path, (DATA / name).read_bytes())


# a server as the fingerprint sees it: path -> recorded answer (anything else: its 404)
SERVERS: dict[str, tuple[dict[str, str], str]] = {
    "sglang": (
        {"/get_server_info": "sim-sglang_get_server_info.http"},
        "sim-sglang_not_found.http",
    ),
    "smg": (
        {"/get_server_info": "smg_get_server_info.http", "/readiness": "smg_readiness.http"},
        "smg_not_found.http",
    ),
    "smg-no-workers": (
        {
            "/get_server_info": "smg-no-workers_get_server_info.http",
            "/readiness": "smg-no-workers_readiness.http",
        },
        "smg_not_found.http",
    ),
    "vllm": ({"/version": "vllm_version.http"}, "vllm_not_found.http"),
    "llamacpp": ({"/props": "llamacpp_props.http"}, "llamacpp_not_found.http"),
    "nginx-sglang": (
        {"/get_server_info": "nginx-sglang_get_server_info.http"},
        "sim-sglang_not_found.http",
    ),
    "nothing": ({}, "smg_not_found.http"),
}


def converse(server: str) -> list[T.Answer]:
    """The fingerprint's questions as ``next_path`` asks them, answered from recordings."""
    known, missing = SERVERS[server]
    answers: list[T.Answer] = []
    while (path := T.next_path(answers)) is not None:
        answers.append(answer(known.get(path, missing), path))
        assert len(answers) <= len(T.PATHS)
    return answers


# ---- classification of recorded answers -------------------------------------------------


def test_sglang_engine_is_an_engine_and_readiness_rules_out_a_router() -> None:
    answers = converse("sglang")
    assert [a.path for a in answers] == ["/get_server_info", "/readiness"]
    verdict = T.classify(answers, upstream_port=SIM_PORT)
    assert (verdict.role, verdict.basis) == ("engine", "inferred")
    assert verdict.server is not None
    assert verdict.server["kind"] == "sglang"
    assert verdict.server["version"] == "0.5.6"
    assert verdict.server["max_running_requests"] == 64
    assert verdict.evidence == [
        "GET /get_server_info: SGLang engine (version 0.5.6, max_running_requests 64)",
        "GET /readiness: 404",
        f"the engine reports port {SIM_PORT}, the one the tap connects to",
    ]


def test_an_engine_reporting_another_port_is_behind_something() -> None:
    verdict = T.classify(converse("sglang"), upstream_port=8080)
    assert (verdict.role, verdict.basis) == ("unknown", "unknown")
    assert verdict.server is not None and verdict.server["kind"] == "sglang"
    assert f"reports port {SIM_PORT}, the tap connects to port 8080" in verdict.evidence[-1]


def test_the_sglang_router_answers_as_itself() -> None:
    answers = converse("smg")
    assert [a.path for a in answers] == ["/get_server_info", "/readiness"]
    assert answers[0].json() == {"router_manager": True, "routers_count": 1, "workers_count": 1}
    verdict = T.classify(answers, **AT, urls=URLS)
    assert (verdict.role, verdict.basis) == ("router", "inferred")
    assert verdict.evidence[-1] == (
        "the upstream's host:port is that of http://localhost:8000/readiness"
    )
    assert verdict.server == {
        "kind": "smg",
        "workers_count": 1,
        "routers_count": 1,
        "ready": True,
        "healthy_workers": 1,
        "total_workers": 1,
    }


def test_what_answers_is_not_yet_where_it_is() -> None:
    # no URL at the upstream, and the router never says its address: behind a hop or not?
    alone = T.classify(converse("smg"), **AT)
    assert (alone.role, alone.basis) == ("unknown", "unknown")
    assert alone.server is not None and alone.server["kind"] == "smg"
    assert "declare --upstream-role" in alone.evidence[-1]
    # the router's readiness given at another host:port: the upstream forwards to it
    urls = ["http://127.0.0.1:8001/readiness", "http://127.0.0.1:29000/metrics"]
    elsewhere = T.classify(converse("smg"), **AT, urls=urls)
    assert (elsewhere.role, elsewhere.basis) == ("unknown", "unknown")
    assert elsewhere.evidence[-1] == (
        "the router answers at http://127.0.0.1:8001/readiness, not at the upstream's "
        "host:port: something forwards to it (a proxy)"
    )
    # vLLM and llama.cpp name no address either
    for server in ("vllm", "llamacpp"):
        verdict = T.classify(converse(server), **AT, urls=["http://127.0.0.1:9/metrics"])
        assert verdict.role == "unknown" and verdict.server is not None, server
        assert verdict.server["kind"] == server


def test_a_router_without_workers_is_still_a_router() -> None:
    verdict = T.classify(converse("smg-no-workers"), **AT, urls=URLS)
    assert (verdict.role, verdict.basis) == ("router", "inferred")
    assert verdict.server is not None and verdict.server["ready"] is False
    assert "not ready (insufficient healthy workers)" in verdict.evidence[1]


def test_router_readiness_alone_wins_over_an_engine_like_server_info() -> None:
    # an older router forwarded /get_server_info to a worker: /readiness tells it apart
    answers = [
        answer("sim-sglang_get_server_info.http", "/get_server_info"),
        answer("smg_readiness.http", "/readiness"),
    ]
    verdict = T.classify(answers, **AT, urls=URLS)
    assert verdict.role == "router" and verdict.server is not None
    assert verdict.server["kind"] == "smg"


def test_the_router_workers_list_is_recorded_json() -> None:
    workers = answer("smg_workers.http", "/workers").json()
    assert workers["total"] == 1 and workers["workers"][0]["worker_type"] == "regular"


def test_vllm_by_its_version_endpoint() -> None:
    answers = converse("vllm")
    assert [a.path for a in answers] == ["/get_server_info", "/version"]
    verdict = T.classify(answers, **AT, urls=["http://127.0.0.1:8000/metrics"])
    assert (verdict.role, verdict.basis) == ("engine", "inferred")
    assert verdict.server == {"kind": "vllm", "version": "0.11.0"}


def test_llamacpp_by_its_props() -> None:
    answers = converse("llamacpp")
    assert [a.path for a in answers] == ["/get_server_info", "/version", "/props"]
    verdict = T.classify(answers, **AT, urls=["http://localhost:8000/metrics"])
    assert verdict.role == "engine"
    assert verdict.server == {
        "kind": "llamacpp",
        "version": "b6670-d5fcb2a",
        "total_slots": 4,
        "n_ctx": 8192,
    }


def test_a_proxy_that_names_itself_is_a_proxy_with_what_is_behind_it() -> None:
    verdict = T.classify(converse("nginx-sglang"), upstream_port=SIM_PORT)
    assert (verdict.role, verdict.basis) == ("proxy", "inferred")
    assert verdict.server is not None
    assert verdict.server["kind"] == "sglang"
    assert verdict.server["through"] == "server: nginx/1.24.0 (Ubuntu)"


def test_nothing_recognisable_is_unknown_after_every_question() -> None:
    answers = converse("nothing")
    assert [a.path for a in answers] == list(T.PATHS)
    verdict = T.classify(answers, upstream_port=8000)
    assert (verdict.role, verdict.basis, verdict.server) == ("unknown", "unknown", None)
    assert len(verdict.evidence) == len(T.PATHS)


def test_the_serving_urls_make_an_unrecognised_upstream_an_engine() -> None:
    serving = T.serving_match(
        "localhost",
        30000,
        [
            "http://127.0.0.1:30000/metrics",
            "http://127.0.0.1:30001/metrics",
            "http://127.0.0.1:8000/readiness",
        ],
    )
    assert serving == ["the upstream's host:port is that of http://127.0.0.1:30000/metrics"]
    verdict = T.classify(
        converse("nothing"), upstream_host="localhost", upstream_port=30000, urls=URLS
    )
    assert (verdict.role, verdict.basis) == ("engine", "inferred")
    assert verdict.evidence[-1] == serving[0]
    assert T.serving_match("10.0.0.1", 80, ["http://10.0.0.1/metrics"])  # default port
    assert not T.serving_match("10.0.0.1", 80, ["http://10.0.0.2/metrics", "http://[::1"])


@pytest.mark.parametrize(
    ("prom", "kind", "role"),
    [
        ("vllm_docs_design_metrics.prom", "vllm", "engine"),
        ("sglang_docs_production_metrics.prom", "sglang", "engine"),
        ("synthetic_llamacpp.prom", "llamacpp", "engine"),
        ("synthetic_smg_router.prom", "smg", "router"),
    ],
)
def test_metric_names_as_the_last_resort(prom: str, kind: str, role: str) -> None:
    body = (METRICS / prom).read_bytes()
    answers = [answer("smg_not_found.http", p) for p in T.PATHS if p != "/metrics"] + [
        T.Answer(path="/metrics", status=200, body=body)
    ]
    verdict = T.classify(answers, **AT, urls=URLS)
    assert verdict.role == role and verdict.server is not None
    assert verdict.server["kind"] == kind


def test_declared_wins_and_is_checked() -> None:
    verdict = T.declared("proxy")
    assert (verdict.role, verdict.basis) == ("proxy", "declared")
    with pytest.raises(ValueError, match="upstream role"):
        T.declared("gateway")


# ---- the sans-I/O exchange on bytes ------------------------------------------------------


def test_an_answer_fed_one_byte_at_a_time_is_the_same() -> None:
    raw = (DATA / "smg_readiness.http").read_bytes()
    exchange = T.Exchange(h11.Connection(h11.CLIENT), "/readiness", "h:1")
    request = exchange.request()
    assert request.startswith(b"GET /readiness HTTP/1.1\r\n") and b"topology-fingerprint" in request
    assert b"\r\nx-tracer-probe: topology; tap=tap\r\n" in request
    got = [exchange.feed(raw[i : i + 1]) for i in range(len(raw))]
    assert all(a is None for a in got[:-1])
    assert got[-1] == T.answer_from_bytes("/readiness", raw)
    assert got[-1] is not None and got[-1].header("content-type") == "application/json"


def test_a_long_body_is_cut_and_ends_the_fingerprint() -> None:
    raw = (DATA / "sim-sglang_get_server_info.http").read_bytes()
    cut = T.answer_from_bytes("/get_server_info", raw, max_body=100)
    assert cut.truncated and len(cut.body) == 100 and cut.json() is None
    assert T.next_path([cut]) is None
    assert "(more than 100 bytes, not read)" in T.classify([cut]).evidence[0]


def test_bytes_that_are_not_http_are_an_error_not_an_exception() -> None:
    bad = T.answer_from_bytes("/get_server_info", b"\x16\x03\x01\x02\x00garbage\r\n\r\n")
    assert bad.status is None and bad.error is not None and "not HTTP/1.1" in bad.error
    closed = T.answer_from_bytes("/get_server_info", b"")
    assert closed.error == "connection closed without an answer"
    assert T.classify([bad]).role == "unknown"


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
async def test_a_refused_connect_is_evidence() -> None:
    verdict = await T.probe("127.0.0.1", await _free_port(), timeout=1)
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
    # the hop passes the engine's answers through; the engine's own port gives it away
    assert (record.upstream_role, record.basis) == ("unknown", "unknown")
    assert record.server["kind"] == "sglang"
    assert f"the tap connects to port {back.port}" in record.evidence[-1]
    # the tap behind sees the fingerprint, marked as the front tap's own requests
    assert [r.target for r in seen] == ["/get_server_info", "/readiness"]
    for r in seen:
        assert [v for k, v in r.headers if k == T.PROBE_HEADER] == ["topology; tap=front"]


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
        smg_router(tmp_path, "--worker-urls", worker.url) as (url, log_path, ready),
    ):
        assert ready, log_path.read_text(errors="replace")
        async with tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", url, "--capture", str(capture),
            "--health", f"{url}/readiness",
        ):  # fmt: skip
            [record] = await _topology_of(capture)
    assert (record["upstream_role"], record["basis"]) == ("router", "inferred")
    assert record["server"]["kind"] == "smg" and record["server"]["healthy_workers"] == 1
