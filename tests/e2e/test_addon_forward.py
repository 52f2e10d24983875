"""The mitmproxy addon in mitmproxy's regular mode: a forward proxy that intercepts TLS.

The client asks the proxy for a tunnel (``CONNECT``), trusts mitmproxy's certificate
authority, and speaks HTTPS to the engine through it; mitmproxy opens the TLS connection
upstream itself. The requests inside the tunnel are the ones traced; the ``CONNECT`` is
not a request. A real mitmdump, a TLS front (``tls_front``) before the simulated engine,
and the openai SDK as the client.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import anyio
import anyio.abc
import httpx
import openai
import pytest
from anyio.streams.tls import TLSListener
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.analyze import analyze_json
from tests.support.engine import engine_running
from tests.support.net import wait_until
from tests.support.procs import count_records, mitmdump
from tracer.capture.files import read_records

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "through a forward proxy"}]
GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, ssl.SSLError)
OPTIONS = ("--set", "tracer_tap=mitm", "--set", "tracer_stall_after=0.5")


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key: the engine's TLS, which mitmproxy is told
    not to verify (``ssl_insecure``)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "engine-cert.pem", directory / "engine-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def _pump(
    source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream, end: Callable[[], Awaitable[None]]
) -> None:
    """Copy until the source ends, then ``end`` the sink (TLS has no half-close: the
    whole stream goes)."""
    with suppress(*GONE):
        async for chunk in source:
            await sink.send(chunk)
    with suppress(*GONE):
        await end()


@asynccontextmanager
async def tls_front(engine_port: int, directory: Path) -> AsyncIterator[int]:
    """HTTPS on a port of its own, relayed byte for byte to the engine's plain HTTP;
    yields the port."""
    cert, key = self_signed(directory)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["http/1.1"])
    tcp = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = tcp.extra(anyio.abc.SocketAttribute.local_port)
    listener = TLSListener(tcp, context, standard_compatible=False)

    async def relay(client: anyio.abc.ByteStream) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", engine_port) as engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_pump, client, engine, engine.send_eof)
                tg.start_soon(_pump, engine, client, client.aclose)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, relay)
        yield port
        tg.cancel_scope.cancel()


@asynccontextmanager
async def forward_proxy(tmp_path: Path) -> AsyncIterator[tuple[str, str, str, Path]]:
    """The engine behind a TLS front, and mitmdump in regular mode with the addon;
    yields the engine's HTTPS and HTTP URLs, the proxy's URL and the capture."""
    async with (
        engine_running(ttft=0.01, itl=0.01) as engine,
        tls_front(engine.bound[1], tmp_path) as port,
        mitmdump(None, tmp_path, *OPTIONS, "--set", "ssl_insecure=true") as (proxy, capture),
    ):
        yield f"https://127.0.0.1:{port}", engine.url, proxy, capture


def mitm_ca(tmp_path: Path) -> ssl.SSLContext:
    """A client context that trusts mitmproxy's certificate authority (and only it)."""
    return ssl.create_default_context(cafile=tmp_path / "mitmproxy" / "mitmproxy-ca-cert.pem")


async def _stream(client: openai.AsyncOpenAI, request_id: str, fault: str = "none") -> str:
    """One streamed chat completion; the text it carried."""
    stream = await client.chat.completions.create(
        model="sim-model",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=6,
        stream=True,
        extra_headers={"x-request-id": request_id, "x-sim-fault": fault},
    )
    text = ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text


@pytest.mark.anyio
async def test_requests_inside_the_tunnel_are_traced(tmp_path: Path) -> None:
    """The openai SDK through the proxy over HTTPS: one tunnel, its requests in order on it
    (a stall, a cut), then plain HTTP in absolute form; the CONNECT is not a request."""
    async with forward_proxy(tmp_path) as (https_url, http_url, proxy, capture):
        async with httpx.AsyncClient(proxy=proxy, verify=mitm_ca(tmp_path), timeout=10) as http:
            client = openai.AsyncOpenAI(
                base_url=f"{https_url}/v1", api_key="x", http_client=http, max_retries=0
            )
            assert await _stream(client, "tls-1")
            assert await _stream(client, "tls-2", "stall:after=2:for=1.2")
            with pytest.raises((openai.APIError, httpx.HTTPError)):
                await _stream(client, "tls-3", "close:after=2")
            assert await _stream(client, "tls-4")
        async with httpx.AsyncClient(proxy=proxy, timeout=10) as http:
            plain = openai.AsyncOpenAI(
                base_url=f"{http_url}/v1", api_key="x", http_client=http, max_retries=0
            )
            assert await _stream(plain, "plain-1")
        await wait_until(lambda: count_records(capture, "response_end") >= 5, 10)
    records = list(read_records(capture))

    (start,) = [r for r in records if r["type"] == "capture_start"]
    assert start["options"]["mode"] == ["regular"]
    heads = [r for r in records if r["type"] == "request"]
    assert all(r["method"] == "POST" for r in heads)  # no CONNECT among them
    on_conn: dict[int, list[tuple[int, str]]] = {}
    for r in heads:
        on_conn.setdefault(r["conn"], []).append((r["seq"], r["request_id"]))
    assert sorted(on_conn.values()) == [
        [(1, "plain-1")],
        [(1, "tls-1"), (2, "tls-2"), (3, "tls-3")],
        [(1, "tls-4")],  # the cut ended the tunnel's connection; the SDK opened another
    ]
    https_port = int(https_url.rsplit(":", 1)[1])
    upstreams = {r["conn"]: r for r in records if r["type"] == "upstream_connect"}
    tls_conns = [c for c, rows in on_conn.items() if rows[0][1].startswith("tls")]
    assert all(upstreams[c]["addr"] == f"127.0.0.1:{https_port}" for c in tls_conns)

    doc = analyze_json(capture)
    rows = {r["request_id"]: r for r in doc["requests"]}
    for rid in ("tls-1", "tls-2", "tls-4", "plain-1"):
        assert rows[rid]["termination"] == "complete" and rows[rid]["done"], rid
    assert rows["tls-2"]["reused"] and not rows["tls-1"]["reused"]
    assert [s["direction"] for s in rows["tls-2"]["stalls"]] == ["upstream_silent"]
    assert rows["tls-3"]["termination"] == "truncated" and not rows["tls-3"]["done"]
    kinds = {f["kind"] for f in doc["findings"]}
    assert {"upstream_silent", "stream_cut"} <= kinds
    assert "client_connection_failed" not in kinds


@pytest.mark.anyio
async def test_failed_tls_handshakes_are_named(tmp_path: Path) -> None:
    """A client that does not trust mitmproxy's certificate never sends a request: the
    connection's anomaly says the handshake failed, the finding blames the client. An
    HTTPS request to an engine that speaks plain HTTP gets mitmproxy's own 502."""
    async with forward_proxy(tmp_path) as (https_url, http_url, proxy, capture):
        async with httpx.AsyncClient(proxy=proxy, timeout=10) as http:  # system CAs only
            with pytest.raises(httpx.ConnectError):
                await http.get(f"{https_url}/v1/models")
        await wait_until(lambda: count_records(capture, "conn_close") >= 1, 10)
        async with httpx.AsyncClient(proxy=proxy, verify=mitm_ca(tmp_path), timeout=10) as http:
            wrong = http_url.replace("http://", "https://")
            answer = await http.get(f"{wrong}/v1/models", headers={"x-request-id": "no-tls"})
        assert answer.status_code == 502
        await wait_until(lambda: count_records(capture, "conn_close") >= 2, 10)
    records = list(read_records(capture))

    anomalies = [r for r in records if r["type"] == "anomaly"]
    untrusted = [a for a in anomalies if a["direction"] == "client"]
    assert len(untrusted) == 1 and untrusted[0]["error"].startswith("TLS handshake failed: ")
    assert untrusted[0].get("seq") is None
    assert any(a["direction"] == "upstream" for a in anomalies if a["conn"] != untrusted[0]["conn"])
    (ended,) = [r for r in records if r["type"] == "response_end"]
    assert ended["termination"] == "tracer_response"
    closes = {r["conn"]: r for r in records if r["type"] == "conn_close"}
    assert closes[untrusted[0]["conn"]]["requests"] == 0
    assert closes[ended["conn"]]["in_flight"] is False  # the 502 was the answer

    doc = analyze_json(capture)
    by_kind = {f["kind"]: f for f in doc["findings"]}
    failed = by_kind["client_connection_failed"]
    assert failed["party"] == "client"
    assert failed["connections"] == [f"mitm/{untrusted[0]['conn']}"]
    (quoted,) = failed["evidence"]
    assert quoted["figures"]["error"] == untrusted[0]["error"]  # the TLS handshake failed
    unreachable = by_kind["upstream_unreachable"]
    (connect,) = [e for e in unreachable["evidence"] if "connect_failed" in e["figures"]]
    assert connect["figures"]["tls"] is True  # the TLS handshake with its upstream
    assert unreachable["settle"]  # the question to settle it, worded after figures["tls"]
    (row,) = doc["requests"]
    assert (row["request_id"], row["status"]) == ("no-tls", 502)


@pytest.mark.anyio
async def test_an_untrusted_upstream_certificate_is_named(tmp_path: Path) -> None:
    """Reverse mode to an HTTPS engine whose certificate mitmproxy does not trust (no
    ``ssl_insecure``): mitmproxy answers 502, the capture says why, and the finding says
    that it was the TLS handshake with the upstream."""
    async with (
        engine_running(ttft=0.01, itl=0.01) as engine,
        tls_front(engine.bound[1], tmp_path) as port,
        mitmdump(f"https://127.0.0.1:{port}", tmp_path, *OPTIONS) as (url, capture),
    ):
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.get(f"{url}/v1/models", headers={"x-request-id": "untrusted"})
        assert answer.status_code == 502
        await wait_until(lambda: count_records(capture, "conn_close") >= 1, 10)
    records = list(read_records(capture))
    (anomaly,) = [r for r in records if r["type"] == "anomaly"]
    assert anomaly["direction"] == "upstream"
    assert anomaly["error"].startswith("TLS handshake failed: ")
    assert "certificate" in anomaly["error"].lower()
    doc = analyze_json(capture)
    (finding,) = doc["findings"]
    assert finding["kind"] == "upstream_unreachable"
    (connect,) = [e for e in finding["evidence"] if "connect_failed" in e["figures"]]
    assert connect["figures"]["tls"] is True  # the TLS handshake with its upstream
    assert doc["requests"][0]["termination"] == "tracer_response"


@pytest.mark.anyio
async def test_upstream_mode_chained_to_another_forward_proxy(tmp_path: Path) -> None:
    """``--mode upstream:`` sends every request on to another forward proxy (here a second
    mitmdump with the addon, in regular mode, in front of the engine). Traced as in
    regular mode; the header names no upstream (origin-form requests cannot be replayed
    to a forward proxy), its connections went to the next proxy, and the two captures
    join: the engine's stall is told once, by the tap nearer the engine."""
    front_dir, back_dir = tmp_path / "front", tmp_path / "back"
    front_dir.mkdir()
    back_dir.mkdir()
    async with (
        engine_running(ttft=0.01, itl=0.01) as engine,
        mitmdump(None, back_dir, "--set", "tracer_tap=back", "--set", "tracer_stall_after=0.5")
        as (back_url, back_capture),
        mitmdump(
            None,
            front_dir,
            "--mode",
            f"upstream:{back_url}",
            "--set",
            "tracer_tap=front",
            "--set",
            "tracer_stall_after=0.5",
        ) as (front_url, front_capture),
    ):  # fmt: skip
        async with httpx.AsyncClient(proxy=front_url, timeout=10) as http:
            client = openai.AsyncOpenAI(
                base_url=f"{engine.url}/v1", api_key="x", http_client=http, max_retries=0
            )
            assert await _stream(client, "up-1")
            assert await _stream(client, "up-2", "stall:after=2:for=1.2")
            assert await _stream(client, "up-3")
        for capture in (front_capture, back_capture):
            await wait_until(lambda c=capture: count_records(c, "response_end") >= 3, 10)
    front = list(read_records(front_capture))
    (start,) = [r for r in front if r["type"] == "capture_start"]
    assert start["options"]["mode"] == [f"upstream:{back_url}"]
    assert "upstream" not in start  # nothing to replay to
    back_port = back_url.rsplit(":", 1)[1]
    connects = [r for r in front if r["type"] == "upstream_connect" and r.get("addr")]
    assert connects and all(r["addr"] == f"127.0.0.1:{back_port}" for r in connects)
    assert [r["target"] for r in front if r["type"] == "request"] == [
        "/v1/chat/completions"
    ] * 3  # origin-form, as the engine gets it

    doc = analyze_json(front_capture, back_capture)
    assert [(p["from"], p["to"], p["shared"]) for p in doc["evidence"]["tap_pairs"]] == [
        ("front", "back", 3)
    ]
    stalled = [f for f in doc["findings"] if f["kind"] == "upstream_silent"]
    assert len(stalled) == 1, doc["findings"]
    assert stalled[0]["requests"][0].startswith("back/"), stalled[0]
    assert not [f for f in doc["findings"] if f["party"] == "proxy" and not f["note"]]
