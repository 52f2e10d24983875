"""What a tap's upstream is: an engine, the router, or a hop we cannot identify.

Theory of operation
-------------------
A finding that blames "the engine" needs to know that the tap's upstream *is* the
serving stack. Each tap therefore records what its upstream is, and on what that rests:

* **declared** — ``tracer proxy --upstream-role engine|router|proxy``. Declared wins: no
  fingerprint is taken.
* **inferred** — from a fingerprint taken once at start, over ONE fresh connection of
  the tap's own (never through its listener, so it is never client traffic in its
  capture; the requests carry ``x-tracer-probe: topology; tap=NAME`` for the taps behind
  it), a few ``GET`` requests on it, 2 s in all: SGLang's ``/get_server_info`` (an
  engine's ``max_running_requests``, ``version`` and port; the SGLang router, ``smg``,
  answers its own ``{"router_manager": true, "workers_count": N}``), the router's
  ``/readiness`` (``healthy_workers``), vLLM's ``/version``, llama.cpp's ``/props``, then
  SGLang's ``/server_info`` and ``/v1/loads`` and the metric names of ``/metrics``.
* **unknown** — nothing recognisable answered, the fingerprint failed (the error is in
  the evidence), or what answered cannot be placed at the upstream itself (below).
  A hop we cannot identify: maybe a proxy, which is said only when declared or when
  the answers carry a hop's own mark (a ``Via`` header, a ``Server`` header naming
  nginx, Envoy, HAProxy ...: then ``proxy``, inferred).

What answered is not yet where it is: a hop that passes answers through unchanged
looks like what is behind it (the project's own incident: a tap in front of a hanging
proxy in front of the router gets the router's answers). Blaming the engine on that
would be a story, so ``engine`` and ``router`` are inferred only with a proof of place:
the SGLang engine reports the very port the tap connects to, or the upstream is at the
host:port of one of the tap's ``--engine-metrics`` or ``--health`` URLs (the user reads
that engine or router there; with no answer recognised, that alone makes ``engine``).
Against it: an engine reporting another port (a proxy or a port mapping forwards to
it), the router's ``/readiness`` given at another host:port. Without proof, or against
it, the role is ``unknown`` and ``server`` still says what answered: declare it.

The module has two halves. The sans-I/O half (``Answer``, ``Exchange``, ``next_path``,
``classify``, ``serving_match``) turns bytes and JSON into a ``Verdict`` and is tested
on recorded answers. The I/O half (``fingerprint``, ``probe``) is a tiny HTTP/1.1
client over anyio and h11 that never raises: every failure becomes evidence.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast
from urllib.parse import urlsplit

import anyio
import h11

from .. import __version__
from ..protocol.probe_mark import PROBE_HEADER, probe_value

Role = Literal["engine", "router", "proxy", "unknown"]
Basis = Literal["declared", "inferred", "unknown"]
DECLARABLE: tuple[str, ...] = ("engine", "router", "proxy")

# asked in this order; after an SGLang engine's or the router's answer only /readiness
# is asked (it tells a router that forwards /get_server_info from an engine), then done
PATHS: tuple[str, ...] = (
    "/get_server_info",
    "/version",
    "/props",
    "/server_info",
    "/v1/loads",
    "/readiness",
    "/metrics",
)
MAX_BODY = 1 << 20  # bytes kept of one answer; more ends the fingerprint
TIMEOUT = 2.0  # seconds for the whole fingerprint, connect included
# on every request of the fingerprint, naming the tap: the taps and proxies behind this one
# see these requests, and analysis keeps a tap's own requests out of the client's traffic

# Server header values that name a proxy product, not a serving stack
PROXY_SERVERS: tuple[str, ...] = (
    "nginx",
    "openresty",
    "tengine",
    "envoy",
    "haproxy",
    "caddy",
    "traefik",
    "apache",
    "squid",
    "varnish",
    "cloudflare",
    "awselb",
    "kong",
)


# ---- sans-I/O: answers, the order of questions, the verdict -----------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """One ``GET`` of the fingerprint and what came back (or the error instead)."""

    path: str
    status: int | None = None
    headers: tuple[tuple[str, str], ...] = ()  # names lower-cased
    body: bytes = b""
    truncated: bool = False  # the body went on past MAX_BODY
    error: str | None = None

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def json(self) -> Any:
        if self.status is None or self.truncated:
            return None
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser
            return None


@dataclass(frozen=True, slots=True)
class Verdict:
    role: Role
    basis: Basis
    evidence: list[str] = field(default_factory=list)
    server: dict[str, Any] | None = None


def declared(role: str) -> Verdict:
    if role not in DECLARABLE:
        raise ValueError(f"upstream role must be one of {', '.join(DECLARABLE)}, not {role!r}")
    return Verdict(cast(Role, role), "declared", [f"declared: --upstream-role {role}"])


class Exchange:
    """One ``GET`` on an h11 client connection: the request's bytes, then the answer's
    bytes fed in as they come (``b""`` for EOF) until ``feed`` returns the ``Answer``."""

    def __init__(
        self,
        conn: h11.Connection,
        path: str,
        host: str,
        *,
        tap: str = "tap",
        max_body: int = MAX_BODY,
    ) -> None:
        self.conn = conn
        self.path = path
        self.host = host
        self.tap = tap
        self.max_body = max_body
        self._status: int | None = None
        self._headers: tuple[tuple[str, str], ...] = ()
        self._body = bytearray()

    def request(self) -> bytes:
        headers = [
            ("Host", self.host),
            ("User-Agent", f"tracer/{__version__} topology-fingerprint"),
            ("Accept", "*/*"),
            (PROBE_HEADER, probe_value("topology", self.tap)),
        ]
        head = self.conn.send(h11.Request(method="GET", target=self.path, headers=headers))
        end = self.conn.send(h11.EndOfMessage())
        return (head or b"") + (end or b"")

    def feed(self, data: bytes) -> Answer | None:
        """The answer once it is complete (or broken), else None: feed more."""
        try:
            self.conn.receive_data(data)
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return None
                if isinstance(event, h11.Response):
                    self._status = event.status_code
                    self._headers = tuple(
                        (k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in event.headers
                    )
                elif isinstance(event, h11.Data):
                    room = self.max_body - len(self._body)
                    self._body += event.data[:room]
                    if len(event.data) > room:
                        return self._answer(truncated=True)
                elif isinstance(event, h11.EndOfMessage):
                    return self._answer()
                elif isinstance(event, h11.ConnectionClosed):
                    return self._answer(error="connection closed before the answer ended")
        except h11.RemoteProtocolError as exc:
            if not data:  # EOF where h11 wanted more
                return self._answer(error="connection closed before the answer ended")
            return self._answer(error=f"not HTTP/1.1: {exc}")

    def _answer(self, *, truncated: bool = False, error: str | None = None) -> Answer:
        if self._status is None and error is not None and "closed" in error:
            error = "connection closed without an answer"
        return Answer(
            path=self.path,
            status=self._status,
            headers=self._headers,
            body=bytes(self._body),
            truncated=truncated,
            error=error,
        )


def answer_from_bytes(path: str, raw: bytes, *, max_body: int = MAX_BODY) -> Answer:
    """A recorded response (the bytes the server sent for ``GET path``) as an ``Answer``."""
    exchange = Exchange(h11.Connection(h11.CLIENT), path, "upstream", max_body=max_body)
    exchange.request()
    answer = exchange.feed(raw)
    if answer is None:
        answer = exchange.feed(b"")
    assert answer is not None  # EOF always settles it
    return answer


@dataclass(frozen=True, slots=True)
class _Sign:
    """What one answer says the upstream is."""

    kind: str  # sglang | smg | vllm | llamacpp
    role: Literal["engine", "router"]
    what: str  # short, for the evidence
    server: dict[str, Any]


def _server_info(obj: dict[str, Any]) -> _Sign | None:
    if "router_manager" in obj or "workers_count" in obj:
        server = _pick(obj, "workers_count", "routers_count")
        return _Sign("smg", "router", "SGLang router (" + _kv(server) + ")", server)
    if "max_running_requests" in obj or ("version" in obj and "tp_size" in obj):
        server = _pick(
            obj,
            "version",
            "max_running_requests",
            "served_model_name",
            "disaggregation_mode",
            "tp_size",
            "dp_size",
            "port",
            "sim",
        )
        shown = _pick(server, "version", "max_running_requests")
        return _Sign("sglang", "engine", "SGLang engine (" + _kv(shown) + ")", server)
    return None


def _sign(answer: Answer) -> _Sign | None:
    path = answer.path
    if path == "/metrics":
        return _metrics_sign(answer)
    obj = answer.json()
    if not isinstance(obj, dict):
        return None
    status = answer.status
    if path in ("/get_server_info", "/server_info") and status == 200:
        return _server_info(obj)
    if path == "/readiness" and (
        "healthy_workers" in obj
        or "total_workers" in obj
        or obj.get("reason") == "insufficient healthy workers"
    ):
        server = {"ready": status == 200, **_pick(obj, "healthy_workers", "total_workers")}
        text = "ready" if status == 200 else f"not ready ({obj.get('reason', status)})"
        if "healthy_workers" in obj:
            text += f", healthy_workers {obj['healthy_workers']} of {obj.get('total_workers')}"
        return _Sign("smg", "router", f"SGLang router, {text}", server)
    if status != 200:
        return None
    if path == "/version" and set(obj) == {"version"} and isinstance(obj["version"], str):
        return _Sign(
            "vllm", "engine", f"vLLM (version {obj['version']})", {"version": obj["version"]}
        )
    if path == "/props" and isinstance(obj.get("default_generation_settings"), dict):
        settings = obj["default_generation_settings"]
        server = {
            "version": obj.get("build_info"),
            "total_slots": obj.get("total_slots"),
            "n_ctx": settings.get("n_ctx"),
        }
        server = {k: v for k, v in server.items() if v is not None}
        return _Sign("llamacpp", "engine", "llama.cpp server (" + _kv(server) + ")", server)
    if path == "/v1/loads" and isinstance(obj.get("loads"), list):
        loads = [x for x in obj["loads"] if isinstance(x, dict)]
        if loads and "num_running_reqs" in loads[0]:
            server = _pick(loads[0], "max_running_requests")
            return _Sign("sglang", "engine", f"SGLang engine ({len(loads)} DP rank(s))", server)
    return None


_METRIC_PREFIXES: tuple[tuple[str, str, Literal["engine", "router"]], ...] = (
    ("vllm:", "vllm", "engine"),
    ("sglang:", "sglang", "engine"),
    ("llamacpp:", "llamacpp", "engine"),
    ("smg_", "smg", "router"),
    ("sgl_router_", "smg", "router"),
)


def _metrics_sign(answer: Answer) -> _Sign | None:
    if answer.status != 200:
        return None
    names: set[str] = set()
    for line in answer.body.decode("utf-8", "replace").splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    for prefix, kind, role in _METRIC_PREFIXES:
        count = sum(1 for n in names if n.startswith(prefix))
        if count:
            return _Sign(kind, role, f"{count} metric name(s) starting {prefix}", {})
    return None


def _pick(obj: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: obj[k] for k in keys if obj.get(k) is not None}


def _kv(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items())


def next_path(answers: Sequence[Answer]) -> str | None:
    """The next ``GET`` of the fingerprint, or None when the answers settle it."""
    if answers and (answers[-1].error or answers[-1].truncated):
        return None
    asked = {a.path for a in answers}
    signs = [s for s in map(_sign, answers) if s is not None]
    if any(s.role == "router" or s.kind == "sglang" for s in signs):
        return None if "/readiness" in asked else "/readiness"
    if signs:
        return None
    return next((p for p in PATHS if p not in asked), None)


def proxy_marks(answers: Iterable[Answer]) -> list[str]:
    """Headers by which a hop names itself: ``Via``, or a proxy product in ``Server``."""
    marks: list[str] = []
    for answer in answers:
        via = answer.header("via")
        if via:
            marks.append(f"via: {via}")
        server = answer.header("server") or ""
        if any(p in server.lower() for p in PROXY_SERVERS):
            marks.append(f"server: {server}")
    return list(dict.fromkeys(marks))


def serving_match(host: str, port: int, urls: Iterable[str]) -> list[str]:
    """Evidence that the upstream is where the user reads an engine's (or the router's)
    metrics or health: the same host and port as one of those URLs."""
    return [
        f"the upstream's host:port is that of {url}"
        for url in urls
        if (at := _hostport(url)) is not None and _same(at, (host, port))
    ]


def _router_elsewhere(host: str, port: int, urls: Iterable[str]) -> list[str]:
    """``--health`` URLs of the router's own endpoints (``/readiness``, ``/liveness``: an
    engine has neither) at another host:port than the upstream."""
    found = []
    for url in urls:
        at = _hostport(url)
        path = urlsplit(url).path.rstrip("/") if at is not None else ""
        if at is not None and path in ("/readiness", "/liveness") and not _same(at, (host, port)):
            found.append(url)
    return found


def _hostport(url: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # not a URL: no evidence either way
        return None


def _same(a: tuple[str, int], b: tuple[str, int]) -> bool:
    loopback = {"localhost", "127.0.0.1", "::1"}
    ha, hb = a[0].lower().strip("[]"), b[0].lower().strip("[]")
    return a[1] == b[1] and (ha == hb or (ha in loopback and hb in loopback))


def classify(
    answers: Sequence[Answer],
    *,
    upstream_host: str | None = None,
    upstream_port: int | None = None,
    urls: Sequence[str] = (),
) -> Verdict:
    """The upstream's role from the fingerprint's answers and the URLs the tap was given
    (``--engine-metrics``, ``--health``).

    What answered is not yet where it is: a hop that passes answers through unchanged
    looks like what is behind it. So an engine or the router is the upstream itself
    only with a proof of place — the SGLang engine reports the port the tap connects to,
    or the upstream is at the host:port of one of ``urls`` — and ``unknown`` otherwise
    (``server`` still says what answered). Against it: an engine reporting another
    port, the router's ``/readiness`` given at another host:port than the upstream."""
    host, port = upstream_host or "", upstream_port
    at = serving_match(host, port, urls) if port is not None else []
    signs = [(a, s) for a in answers if (s := _sign(a)) is not None]
    evidence = [_describe_answer(a, s) for a, s in ((a, _sign(a)) for a in answers)]
    evidence += at
    marks = proxy_marks(answers)
    router = [s for _, s in signs if s.role == "router"]
    engine = [s for _, s in signs if s.role == "engine"]
    chosen = router or engine
    if not chosen:
        if marks:
            evidence += [f"answers carry {m}: a proxy" for m in marks]
            return Verdict("proxy", "inferred", evidence, None)
        if at:
            return Verdict("engine", "inferred", evidence, None)
        return Verdict("unknown", "unknown", evidence, None)
    kind = chosen[0].kind
    server: dict[str, Any] = {"kind": kind}
    for s in chosen:
        if s.kind == kind:
            server.update(s.server)
    if marks:
        evidence += [f"answers carry {m}: a proxy" for m in marks]
        server["through"] = marks[0]
        return Verdict("proxy", "inferred", evidence, server)
    reported = server.get("port") if kind == "sglang" else None
    elsewhere = _router_elsewhere(host, port, urls) if router and port is not None else []
    if isinstance(reported, int) and port is not None and reported != port:
        evidence.append(
            f"the engine reports port {reported}, the tap connects to port {port}: "
            "something forwards to it (a proxy or a port mapping)"
        )
    elif elsewhere and not at:
        evidence.append(
            f"the router answers at {elsewhere[0]}, not at the upstream's host:port: "
            "something forwards to it (a proxy)"
        )
    elif at or (reported is not None and reported == port):
        if reported is not None and reported == port:
            evidence.append(f"the engine reports port {reported}, the one the tap connects to")
        return Verdict(chosen[0].role, "inferred", evidence, server)
    else:
        evidence.append(
            "nothing places it at the upstream itself rather than behind a hop that passes "
            "answers through (no answer names its address, no --engine-metrics or --health "
            "URL is at the upstream's host:port): declare --upstream-role"
        )
    return Verdict("unknown", "unknown", evidence, server)


def _describe_answer(answer: Answer, sign: _Sign | None) -> str:
    text = f"GET {answer.path}: "
    if sign is not None:
        return text + sign.what
    if answer.status is None:
        return text + (answer.error or "no answer")
    text += str(answer.status)
    if answer.truncated:
        text += f" (more than {len(answer.body)} bytes, not read)"
    if answer.error:
        text += f" ({answer.error})"
    return text


# ---- I/O: one fresh connection, a few GETs, never raising ------------------------------


async def fingerprint(
    host: str,
    port: int,
    *,
    tap: str = "tap",
    timeout: float = TIMEOUT,
    max_body: int = MAX_BODY,
) -> list[Answer]:
    """Ask the upstream the questions of ``next_path`` over one fresh connection, within
    ``timeout`` seconds in all. Failures are answers with an ``error``; cancellation from
    outside (the tap stopping) is the only thing that leaves."""
    answers: list[Answer] = []
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    path = next_path(answers)
    connected = False
    with anyio.move_on_after(timeout) as scope:
        try:
            stream = await anyio.connect_tcp(host, port)
        except OSError as exc:
            return [Answer(path=path or "/", error=f"connect failed: {describe_error(exc)}")]
        connected = True
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            while path is not None:
                exchange = Exchange(conn, path, authority, tap=tap, max_body=max_body)
                answer: Answer | None = None
                try:
                    await stream.send(exchange.request())
                    while answer is None:
                        try:
                            data = await stream.receive(65536)
                        except anyio.EndOfStream:
                            data = b""
                        answer = exchange.feed(data)
                except (OSError, anyio.BrokenResourceError, h11.LocalProtocolError) as exc:
                    answer = Answer(path=path, error=describe_error(exc))
                answers.append(answer)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    break  # the connection cannot carry another request: done
                conn.start_next_cycle()
                path = next_path(answers)
    if scope.cancelled_caught and path is not None:
        what = "no answer" if connected else "connect not done"
        answers.append(Answer(path=path, error=f"{what} within {timeout:g}s"))
    return answers


async def probe(
    host: str,
    port: int,
    *,
    tap: str = "tap",
    urls: Sequence[str] = (),
    timeout: float = TIMEOUT,
) -> Verdict:
    """Fingerprint the upstream and classify it; never raises (but lets cancellation go)."""
    try:
        answers = await fingerprint(host, port, tap=tap, timeout=timeout)
    except Exception as exc:  # the fingerprint must never take the tap down
        answers = [Answer(path="/", error=f"fingerprint failed: {describe_error(exc)}")]
    return classify(answers, upstream_host=host, upstream_port=port, urls=urls)


def describe_error(exc: BaseException) -> str:
    """A plain reason: 'Connection refused (ECONNREFUSED)' rather than asyncio's wording."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            name = errno.errorcode.get(seen.errno, str(seen.errno))
            return f"{os.strerror(seen.errno)} ({name})"
        seen = seen.__cause__
    return str(exc) or type(exc).__name__
