"""What a tap's upstream is: classification of recorded answers and the order of the
fingerprint's questions. Its I/O and the `topology` record of a real tap:
tests/integration/test_topology.py."""

from __future__ import annotations

from pathlib import Path

import h11
import pytest

from tracer.evidence import topology as T
from tracer.protocol.probe_mark import probe_value

DATA = Path(__file__).parent.parent / "data" / "topology"


METRICS = Path(__file__).parent.parent / "data" / "metrics"

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
    assert f"\r\nx-tracer-probe: {probe_value('topology', 'tap')}\r\n".encode() in request
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
