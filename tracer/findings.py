"""Attribution: whose fault is it — client, proxy or engine — from evidence only.

Theory of operation
-------------------
``find(evidence)`` is a pure function of the analysis rows (requests, connections) and
the evidence timelines (engine samples, probes, health, injected faults, hang marks). It
runs a list of analyzers, each a small function from the evidence to findings, the
shape structlog gives its processors. Every finding names:

* ``party``: client | proxy | engine | unknown — *proxy* is any hop between the client
  and the serving stack; *engine* is the serving stack (router, prefill, decode);
* ``kind``: a stable name (documented in ``captures/ANALYSIS.md``);
* ``requests`` / ``connections``: the ids it concerns;
* ``evidence``: quoted observations with their times;
* ``ruled_out``: the parties the evidence excludes, each with why;
* ``confidence``: high | medium | low; ``settle``: for ``unknown``, the observation that
  would decide it;
* ``note``: true for a finding that is not a fault (load) — it never becomes the verdict.

Rules of evidence: the engine is "idle" only when its own samples say running=0 and
queued=0 *and* its token counters did not move (SGLang's gauges can be 30 s old; the
counters cannot); the engine is "wedged" when something runs and the counters are flat;
"busy" when running/queued are high and counters rise — which is load, reported with the
figures, never as a fault and never as "cold start". A hop is blamed only when the
evidence places the fault there: between two taps (a request seen by one and not the
next), or in front of an idle engine whose fresh connections answer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from statistics import median
from typing import Any
from urllib.parse import urlsplit

from .analysis import ConnectionRow, RequestRow

CONFIDENCE = {"high": 0, "medium": 1, "low": 2}
ENGINE_PROFILES = {"sglang", "vllm", "llamacpp"}
ROUTER_PROFILES = {"smg", "sgl_router"}
SLOW_FIRST_TOKEN = 2.0  # seconds: below this a first token is never "slow"
IDLE_REUSE_RACE = 1.0  # seconds idle before a request for a stale-connection race
UPSTREAM_GONE = "upstream already closed"  # the observer's detail for such a request


@dataclass
class Evidence:
    taps: dict[str, dict[str, Any]]
    connections: list[ConnectionRow]
    requests: list[RequestRow]
    engine: list[dict[str, Any]]
    probes: list[dict[str, Any]]
    health: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    marks: list[float]
    client_facing: set[str] = field(default_factory=set)
    end: float | None = None


@dataclass
class EngineView:
    """What the serving stack's own metrics said during a time window."""

    samples: int = 0
    urls: int = 0
    failures: int = 0
    running_max: int | None = None
    queued_max: int | None = None
    tokens: float | None = None  # generation tokens produced in the window (counters)
    router_in_flight: int | None = None
    start: float = 0.0
    end: float = 0.0

    @property
    def known(self) -> bool:
        return self.samples > 0

    @property
    def idle(self) -> bool:
        return (
            self.known and self.running_max == 0 and (self.queued_max or 0) == 0 and not self.tokens
        )

    @property
    def wedged(self) -> bool:
        return self.known and (self.running_max or 0) >= 1 and self.tokens == 0

    @property
    def busy(self) -> bool:
        return (
            self.known
            and ((self.running_max or 0) + (self.queued_max or 0)) >= 1
            and bool(self.tokens)
        )

    def quote(self) -> str:
        tokens = "unknown" if self.tokens is None else f"+{self.tokens:g}"
        text = (
            f"engine metrics {_ts(self.start)} to {_ts(self.end)}: running≤{self.running_max}, "
            f"queued≤{self.queued_max}, generation tokens {tokens} "
            f"({self.samples} samples from {self.urls} URL(s))"
        )
        if self.router_in_flight is not None:
            text += f"; router in flight≤{self.router_in_flight}"
        if self.failures:
            text += f"; {self.failures} failed scrapes"
        return text


def _ts(t: float) -> str:
    return f"t={t:.3f}"


def _base(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc


class Context:
    """Indexes over the evidence shared by the analyzers."""

    def __init__(self, e: Evidence) -> None:
        self.e = e
        self.by_tap: dict[str, list[RequestRow]] = defaultdict(list)
        for r in e.requests:
            if r.method:
                self.by_tap[r.tap].append(r)
        self.conns = {(c.tap, c.conn): c for c in e.connections}
        self.serving_hosts = {_base(s["url"]) for s in e.engine} | {
            _base(h["url"]) for h in e.health
        }
        self.order = self._tap_order()

    def join_keys(self) -> list[tuple[str, RequestRow]]:
        """A key per request that is the same at every tap that saw it.

        ``x-request-id`` when the client sent one; otherwise a fingerprint (method,
        target, body hash) and its occurrence number at that tap, in time order.
        """
        keys: list[tuple[str, RequestRow]] = []
        seen: dict[tuple[str, str], int] = defaultdict(int)
        for r in sorted(self.e.requests, key=lambda x: (x.tap, x.start)):
            if not r.method:
                continue
            if r.request_id:
                keys.append((f"id:{r.request_id}", r))
                continue
            fingerprint = f"{r.method} {r.target} {r.body_sha256}"
            seen[(r.tap, fingerprint)] += 1
            keys.append((f"fp:{fingerprint}#{seen[(r.tap, fingerprint)]}", r))
        return keys

    def _tap_order(self) -> list[str]:
        """Taps from the client side to the engine side (by when they saw shared requests)."""
        taps = sorted(self.by_tap)
        if len(taps) < 2:
            return taps
        ids: dict[str, dict[str, float]] = defaultdict(dict)
        for key, r in self.join_keys():
            ids[key].setdefault(r.tap, r.start)
        score = dict.fromkeys(taps, 0.0)
        for a in taps:
            for b in taps:
                if a >= b:
                    continue
                diffs = [t[b] - t[a] for t in ids.values() if a in t and b in t]
                if diffs:
                    d = median(diffs)
                    score[b] += 1 if d > 0 else -1
                    score[a] += -1 if d > 0 else 1
        return sorted(taps, key=lambda t: (score[t], t))

    def upstream_is_serving(self, tap: str) -> bool:
        upstream = self.e.taps.get(tap, {}).get("upstream")
        return bool(upstream) and _base(str(upstream)) in self.serving_hosts

    def engine_view(self, start: float, end: float) -> EngineView:
        """The engines' own figures over a window.

        running/queued come from SGLang's live ``/v1/loads`` samples when the capture has
        them (its gauges can be 30 s old), else from the metrics gauges; progress comes
        from the token counters' deltas inside the window.
        """
        view = EngineView(start=start, end=end)
        urls: set[str] = set()
        tokens: float | None = None
        gauges: list[tuple[float, dict[str, Any]]] = []
        live: list[tuple[float, dict[str, Any]]] = []
        for s in self.e.engine:
            if not (start - 1.5 <= s["t"] <= end + 1.5):
                continue
            if not s["ok"]:
                view.failures += 1
                continue
            state = s.get("state") or {}
            profile = s.get("profile")
            if profile in ROUTER_PROFILES:
                in_flight = state.get("in_flight")
                if in_flight is not None:
                    view.router_in_flight = max(view.router_in_flight or 0, int(in_flight))
                continue
            if profile not in ENGINE_PROFILES:
                continue
            view.samples += 1
            urls.add(s["url"])
            (live if s.get("source") == "loads" else gauges).append((s["t"], state))
            deltas = s.get("deltas") or {}
            since = s["t"] - (s.get("interval") or 0.0)  # the delta covers (since, t]
            if since >= start and s["t"] <= end and "generation_tokens_total" in deltas:
                tokens = (tokens or 0.0) + float(deltas["generation_tokens_total"] or 0)
        chosen = live or gauges
        inside = [(t, st) for t, st in chosen if start <= t <= end]
        for _, state in inside or chosen:  # samples around it only when none fell inside
            running, queued = state.get("running"), state.get("queued")
            if running is not None:
                view.running_max = max(view.running_max or 0, int(running))
            if queued is not None:
                view.queued_max = max(view.queued_max or 0, int(queued))
        view.urls = len(urls)
        view.tokens = tokens
        return view

    def probes_during(self, start: float, end: float, r: RequestRow) -> list[dict[str, Any]]:
        return [
            p
            for p in self.e.probes
            if p["tap"] == r.tap
            and (start - 0.5 <= p["t"] <= end + 0.5 or p["trigger"] == [r.conn, r.seq])
        ]

    def fresh_completed(self, r: RequestRow, start: float, end: float) -> list[RequestRow]:
        """Requests on fresh connections of the same tap that completed during the window."""
        return [
            o
            for o in self.by_tap[r.tap]
            if o is not r
            and not o.reused
            and o.termination == "complete"
            and o.start >= start
            and o.end is not None
            and o.end <= end + 0.5
        ]


def _finding(
    kind: str,
    party: str,
    summary: str,
    requests: list[RequestRow],
    evidence: list[str],
    ruled_out: list[dict[str, str]],
    confidence: str,
    *,
    settle: str | None = None,
    note: bool = False,
    t: float | None = None,
) -> dict[str, Any]:
    return {
        "party": party,
        "kind": kind,
        "summary": summary,
        "requests": [r.id for r in requests],
        "connections": sorted({f"{r.tap}/{r.conn}" for r in requests}),
        "evidence": evidence,
        "ruled_out": ruled_out,
        "confidence": confidence,
        "settle": settle,
        "note": note,
        "t": t if t is not None else (requests[0].start if requests else None),
    }


def _req_quote(r: RequestRow) -> str:
    pos = f"request {r.seq} on connection {r.tap}/{r.conn}"
    if r.reused:
        pos += f" (keep-alive reuse after {r.idle_before:.3f} s idle)"
    else:
        pos += " (fresh connection)"
    rid = f" x-request-id={r.request_id}" if r.request_id else ""
    return f"{_ts(r.start)} {r.method} {r.target}{rid}: {pos}"


def _outcome_quote(r: RequestRow) -> str:
    parts = [f"termination={r.termination}"]
    if r.status is not None:
        parts.append(f"status={r.status}")
    parts.append(f"response bytes={r.response_bytes}")
    if r.sse:
        parts.append(f"events={r.events}, [DONE]={'yes' if r.done else 'no'}")
    if r.close:
        parts.append(f"upstream {r.close}")
    if r.end is not None:
        parts.append(f"ended {_ts(r.end)}")
    return ", ".join(parts)


def _hang_window(r: RequestRow, end: float | None) -> tuple[float, float] | None:
    """When the request sat with no bytes arriving from upstream, if it did."""
    if r.detail == UPSTREAM_GONE:
        return None  # sent after the upstream closed: the client's reuse, not a hang
    for stall in r.stalls:
        if stall["direction"] == "upstream_silent":
            return stall["start"], stall["end"] or r.end or end or stall["start"]
    if r.termination in ("in_flight", "truncated", "client_abort") and r.status is None:
        return r.start, r.end or end or r.start
    return None


# ---- analyzers ---------------------------------------------------------------------------


def _injected(ctx: Context, r: RequestRow) -> list[str]:
    if not r.injected:
        return []
    return [f"the tap injected this fault itself: {', '.join(r.injected)} (opt-in --fault)"]


def analyze_request_hangs(ctx: Context) -> list[dict[str, Any]]:
    """Requests that sat with nothing from upstream: engine wedge, lost, or a hop on reuse."""
    out: list[dict[str, Any]] = []
    for r in ctx.e.requests:
        if not r.method:
            continue
        window = _hang_window(r, ctx.e.end)
        if window is None:
            continue
        start, end = window
        view = ctx.engine_view(start, end)
        evidence = [_req_quote(r), _outcome_quote(r)]
        evidence += [
            f"stall {_ts(s['start'])} {s['direction']} for {s['duration'] or 'ever'} s"
            for s in r.stalls
        ]
        evidence += _injected(ctx, r)
        if view.known:
            evidence.append(view.quote())
        probes = ctx.probes_during(start, end, r)
        fresh_ok = [p for p in probes if p["outcome"] == "ok"]
        evidence += [
            f"probe {_ts(p['t'])} {p['target']} {p['url']} over a fresh connection: "
            f"{p['outcome']}"
            + (f" in {p['latency']:.3f} s" if p.get("latency") is not None else "")
            + (f" ({p['reason']})" if p.get("reason") else "")
            for p in probes
        ]
        fresh = ctx.fresh_completed(r, start, end)
        if fresh:
            evidence.append(
                f"{len(fresh)} request(s) on fresh connections completed meanwhile "
                f"(e.g. {fresh[0].id}, {fresh[0].duration or 0:.3f} s)"
            )
        mid_stream = r.status is not None and (r.events > 0 or r.response_bytes > 0)
        client_ok = {
            "party": "client",
            "why": "the request reached the tap complete and the tap forwarded it; the client "
            "was waiting for the answer",
        }
        if view.wedged:
            kind = "engine_stall_mid_stream" if mid_stream else "engine_stall"
            out.append(
                _finding(
                    kind,
                    "engine",
                    "The engine held the request running while its token counters stayed flat.",
                    [r],
                    evidence,
                    [
                        client_ok,
                        {
                            "party": "proxy",
                            "why": "the engine reports the request running yet produced no tokens",
                        },
                    ],
                    "high",
                    t=start,
                )
            )
            continue
        if view.idle and not mid_stream:
            if view.router_in_flight:
                out.append(
                    _finding(
                        "engine_lost_request",
                        "engine",
                        "The router counts the request in flight while no engine runs or "
                        "queues anything: it was lost in the serving stack.",
                        [r],
                        evidence,
                        [client_ok, {"party": "proxy", "why": "the router received it"}],
                        "high",
                        t=start,
                    )
                )
                continue
            serving = ctx.upstream_is_serving(r.tap)
            answered = bool(fresh_ok or fresh)
            kind = "proxy_hung_on_reuse" if r.reused else "proxy_swallowed_request"
            party = "engine" if serving else "proxy"
            if serving:  # the tap's upstream is the serving stack: it lost the request
                kind = "engine_lost_request"
            what = "held the reused keep-alive connection" if r.reused else "swallowed the request"
            summary = f"The hop after tap {r.tap} {what}: the engine was idle the whole time" + (
                " and fresh connections answered." if answered else "."
            )
            ruled = [
                client_ok,
                {
                    "party": "engine" if party == "proxy" else "proxy",
                    "why": view.quote()
                    if party == "proxy"
                    else "the tap's upstream is the serving stack itself",
                },
            ]
            out.append(
                _finding(
                    kind,
                    party,
                    summary,
                    [r],
                    evidence,
                    ruled,
                    "high" if answered else "medium",
                    t=start,
                    settle=None
                    if answered
                    else "probes on fresh connections "
                    "(--probe-on-stall) would show whether the hop answers at all",
                )
            )
            continue
        if view.busy and not mid_stream and r.termination == "complete":
            continue  # it was answered, late: queued under load (the load analyzer's note)
        if mid_stream and view.known and view.tokens:
            out.append(
                _finding(
                    "proxy_held_stream"
                    if not ctx.upstream_is_serving(r.tap)
                    else "engine_stall_mid_stream",
                    "proxy" if not ctx.upstream_is_serving(r.tap) else "engine",
                    "Tokens were generated while none reached the tap.",
                    [r],
                    evidence,
                    [client_ok],
                    "medium",
                    t=start,
                )
            )
            continue
        settle = (
            "give --engine-metrics (and --probe-on-stall) so the engine's own state during "
            "the silence can decide between the engine and a hop in between"
            if not view.known
            else "place a second tap between the proxy and the router"
        )
        out.append(
            _finding(
                "upstream_silent",
                "unknown",
                "Nothing came back from upstream; the evidence does not say which hop held it.",
                [r],
                evidence,
                [client_ok],
                "low",
                settle=settle,
                t=start,
            )
        )
    return out


def analyze_client(ctx: Context) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in ctx.e.requests:
        if not r.method:
            continue
        blocked = [s for s in r.stalls if s["direction"] == "client_not_reading"]
        if blocked:
            s = blocked[0]
            out.append(
                _finding(
                    "client_not_reading",
                    "client",
                    "The client stopped reading: writes to it backed up while data waited.",
                    [r],
                    [
                        _req_quote(r),
                        f"stall {_ts(s['start'])} client_not_reading "
                        f"for {s['duration'] or 'ever'} s",
                        _outcome_quote(r),
                    ],
                    [
                        {"party": "engine", "why": "upstream data was waiting to be written"},
                        {"party": "proxy", "why": "the tap's writes to the client were blocked"},
                    ],
                    "high",
                    t=s["start"],
                )
            )
        if r.termination == "client_abort" and _hang_window(r, ctx.e.end) is None:
            out.append(
                _finding(
                    "client_abort",
                    "client",
                    "The client closed the connection while the response was still flowing.",
                    [r],
                    [_req_quote(r), _outcome_quote(r)],
                    [{"party": "engine", "why": "bytes were arriving until the client closed"}],
                    "medium",
                    t=r.end,
                )
            )
        if r.after_close or r.detail == UPSTREAM_GONE:
            out.append(
                _finding(
                    "client_reused_closed_connection",
                    "client",
                    "The client sent a request on a connection the server had said it would "
                    "close (Connection: close)."
                    if r.after_close
                    else "The client sent a request on a connection the upstream had already "
                    "closed (its FIN had been passed on to the client).",
                    [r],
                    [_req_quote(r), _outcome_quote(r)],
                    [],
                    "high",
                    t=r.start,
                )
            )
    return out


def analyze_upstream_endings(ctx: Context) -> list[dict[str, Any]]:
    """Truncations, errors, unreachable upstreams, stale-connection races."""
    out: list[dict[str, Any]] = []
    for r in ctx.e.requests:
        if not r.method:
            continue
        serving = ctx.upstream_is_serving(r.tap)
        hop = "engine" if serving else "unknown"
        evidence = [_req_quote(r), _outcome_quote(r), *_injected(ctx, r)]
        if r.by_tracer and r.status == 502:
            out.append(
                _finding(
                    "upstream_unreachable",
                    "engine" if serving else "unknown",
                    "The tap could not connect to its upstream.",
                    [r],
                    evidence,
                    [{"party": "client", "why": "the request reached the tap"}],
                    "high",
                    settle=None if serving else "is the tap's upstream a proxy or the router?",
                )
            )
            continue
        if r.error:
            out.append(
                _finding(
                    "engine_error_event",
                    "engine",
                    f"The stream carried an error event: {r.error}",
                    [r],
                    evidence,
                    [
                        {"party": "client", "why": "the error came from upstream"},
                        {"party": "proxy", "why": "proxies do not write OpenAI error events"},
                    ],
                    "high",
                    t=r.end,
                )
            )
        elif r.status is not None and r.status >= 500 and not r.by_tracer:
            out.append(
                _finding(
                    "engine_error_status",
                    hop,
                    f"Upstream answered {r.status}.",
                    [r],
                    evidence,
                    [{"party": "client", "why": "the error came from upstream"}],
                    "high" if serving else "medium",
                    settle=None
                    if serving
                    else "a tap in front of the router would show whether the router sent it",
                    t=r.end,
                )
            )
        if (
            r.termination == "truncated"
            and r.response_bytes == 0
            and r.status is None
            and (
                r.reused
                and r.idle_before >= IDLE_REUSE_RACE
                and _hang_window(r, ctx.e.end) is not None
            )
            and r.end is not None
            and (r.end - r.start) < 1.0
        ):
            out.append(
                _finding(
                    "stale_connection_race",
                    "proxy" if not serving else "engine",
                    "The hop after the tap closed an idle keep-alive connection just as a "
                    "request was written on it (keep-alive timeouts do not match).",
                    [r],
                    evidence,
                    [{"party": "client", "why": "the connection was open when it wrote"}],
                    "medium",
                    t=r.start,
                )
            )
        elif (
            r.termination == "truncated"
            and (r.response_bytes > 0 or r.status is not None)
            and not any(s["direction"] == "upstream_silent" for s in r.stalls)
        ):  # (a cut after a silence: the silence is the finding)
            out.append(
                _finding(
                    "engine_truncated" if serving else "stream_cut",
                    hop,
                    "Upstream closed the response before its end.",
                    [r],
                    evidence,
                    [{"party": "client", "why": "upstream closed first"}],
                    "high" if serving else "medium",
                    settle=None
                    if serving
                    else "a tap in front of the router would show which hop cut it",
                    t=r.end,
                )
            )
        elif (
            r.termination == "complete"
            and r.sse
            and r.events
            and not r.done
            and r.finish_reason is None
            and not r.error
        ):
            out.append(
                _finding(
                    "logical_truncation",
                    hop,
                    "The body ended cleanly but without [DONE] or a finish_reason.",
                    [r],
                    evidence,
                    [{"party": "client", "why": "upstream ended the body"}],
                    "medium",
                    t=r.end,
                )
            )
    return out


def analyze_delivery(ctx: Context) -> list[dict[str, Any]]:
    """Coalesced (≈40 ms bunches) and buffered (all at the end) streams."""
    out: list[dict[str, Any]] = []
    for r in ctx.e.requests:
        if not r.sse or r.event_gaps < 8 or r.first_event is None or r.last_event is None:
            continue
        zero = r.zero_gaps / r.event_gaps
        spread = r.last_event - r.first_event
        duration = (r.end or r.last_event) - r.start
        if zero >= 0.5 and r.bunch_gaps >= 2 and spread > 0.05:
            out.append(
                _finding(
                    "delivery_coalesced",
                    "proxy" if not ctx.upstream_is_serving(r.tap) else "engine",
                    f"Events arrived in bunches about 40 ms apart (a hop upstream of tap "
                    f"{r.tap} without TCP_NODELAY meeting a delayed ACK).",
                    [r],
                    [
                        _req_quote(r),
                        f"{r.events} events: {zero:.0%} of gaps < 1 ms, "
                        f"{r.bunch_gaps} gaps of 30-60 ms",
                    ],
                    [{"party": "client", "why": "bunching is seen before the client"}],
                    "medium",
                    t=r.first_event,
                )
            )
        elif (
            duration > 1.0
            and spread < 0.05
            and r.events >= 5
            and zero >= 0.8
            and (r.first_event - r.start > 0.8 * duration)
        ):
            view = ctx.engine_view(r.start, r.end or r.last_event)
            party = "proxy" if view.tokens and not ctx.upstream_is_serving(r.tap) else "unknown"
            out.append(
                _finding(
                    "buffered_response",
                    party,
                    "The whole stream arrived in one burst at the end: a hop upstream held it "
                    "(as nginx with proxy_buffering on does).",
                    [r],
                    [
                        _req_quote(r),
                        f"{r.events} events within {spread * 1000:.1f} ms, "
                        f"{duration:.3f} s after the request",
                        *([view.quote()] if view.known else []),
                    ],
                    [{"party": "client", "why": "the burst is seen before the client"}],
                    "medium" if party != "unknown" else "low",
                    settle=None
                    if party != "unknown"
                    else "engine metrics showing tokens "
                    "generated steadily would place it on the hop in between",
                    t=r.first_event,
                )
            )
    return out


def analyze_load(ctx: Context) -> list[dict[str, Any]]:
    """Slow first tokens while the engine was busy: load, with the figures — not a fault."""
    out: list[dict[str, Any]] = []
    slow = [
        r for r in ctx.e.requests if r.first_token is not None and r.first_token >= SLOW_FIRST_TOKEN
    ]
    for r in slow:
        view = ctx.engine_view(r.start, r.start + r.first_token)  # type: ignore[operator]
        if view.busy:
            out.append(
                _finding(
                    "engine_queueing",
                    "engine",
                    f"Slow first token ({r.first_token:.2f} s) because the engine was busy — "
                    "load, not a fault, and not a cold start.",
                    [r],
                    [_req_quote(r), view.quote()],
                    [],
                    "high",
                    note=True,
                    t=r.start,
                )
            )
    return out


def analyze_marks(ctx: Context) -> list[dict[str, Any]]:
    """A hang reported at a time when no request was in flight at the front-most tap."""
    out: list[dict[str, Any]] = []
    if not ctx.order:
        return out
    front = ctx.order[0]
    for mark in ctx.e.marks:
        in_flight = [
            r for r in ctx.by_tap[front] if r.start <= mark and (r.end is None or r.end >= mark)
        ]
        if in_flight:
            continue
        before = [r for r in ctx.by_tap[front] if r.start <= mark]
        complete = all(r.termination == "complete" for r in before)
        view = ctx.engine_view(mark - 5.0, mark)
        evidence = [
            f"hang reported at {_ts(mark)}: no request in flight at tap {front}",
            f"{len(before)} request(s) before it, "
            + ("all delivered completely" if complete else "not all complete"),
        ]
        if view.known:
            evidence.append(view.quote())
        ruled = [{"party": "engine", "why": "nothing was outstanding at the serving side"}]
        if front in ctx.e.client_facing:
            out.append(
                _finding(
                    "client_idle_hang",
                    "client",
                    "Every response had been delivered and the client sent nothing: the "
                    "client itself was stuck.",
                    [],
                    evidence,
                    ruled,
                    "high" if complete else "medium",
                    t=mark,
                )
            )
        else:
            out.append(
                _finding(
                    "idle_at_hang",
                    "unknown",
                    "Nothing was outstanding at this tap when the hang was seen: client or a "
                    "proxy in front of the tap; the engine is ruled out.",
                    [],
                    evidence,
                    ruled,
                    "medium",
                    t=mark,
                    settle=f"place a tap on the client side of the proxy, or, if the harness "
                    f"talks to tap {front} directly, pass --client-facing {front}",
                )
            )
    return out


ANALYZERS = [
    analyze_request_hangs,
    analyze_client,
    analyze_upstream_endings,
    analyze_delivery,
    analyze_load,
    analyze_marks,
]


def _join_taps(ctx: Context, findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """With several taps: a request that stopped between two of them blames the hop there."""
    if len(ctx.order) < 2:
        return findings
    by_id: dict[str, dict[str, RequestRow]] = defaultdict(dict)
    for key, r in ctx.join_keys():
        by_id[key].setdefault(r.tap, r)
    rank = {tap: i for i, tap in enumerate(ctx.order)}
    replaced: set[str] = set()
    extra: list[dict[str, Any]] = []
    for seen in by_id.values():
        taps = sorted(seen, key=lambda t: rank.get(t, 0))
        front = seen[taps[0]]
        window = _hang_window(front, ctx.e.end)
        if window is None and front.termination == "complete":
            continue
        last = taps[-1]
        if len(taps) < len(ctx.order):  # never reached the taps behind
            missing = [t for t in ctx.order if t not in seen]
            after = missing[0]
            if rank[after] > rank[last]:
                view = ctx.engine_view(*(window or (front.start, front.end or front.start)))
                kind = "proxy_hung_on_reuse" if seen[last].reused else "proxy_swallowed_request"
                evidence = [_req_quote(seen[t]) for t in taps] + [
                    f"never seen at tap {after}, which saw "
                    f"{len(ctx.by_tap[after])} other request(s)",
                    _outcome_quote(front),
                ]
                if view.known:
                    evidence.append(view.quote())
                ruled = [
                    {"party": "client", "why": f"the request reached tap {last} complete"},
                    {
                        "party": "engine",
                        "why": f"the request never reached tap {after}, in "
                        "front of the serving stack" + (f"; {view.quote()}" if view.known else ""),
                    },
                ]
                extra.append(
                    _finding(
                        kind,
                        "proxy",
                        f"The hop between tap {last} and tap {after} "
                        + (
                            "held the reused keep-alive connection"
                            if seen[last].reused
                            else "swallowed the request"
                        )
                        + ": it never reached the next tap.",
                        [seen[t] for t in taps],
                        evidence,
                        ruled,
                        "high",
                        t=window[0] if window else front.start,
                    )
                )
                replaced.update(seen[t].id for t in taps)
                continue
        back = seen[taps[-1]]
        # the stream was whole (or still flowing: the hop then closed that side too) behind
        # the hop, and cut in front of it
        if back.termination in ("complete", "client_abort") and front.termination == "truncated":
            extra.append(
                _finding(
                    "proxy_cut_stream",
                    "proxy",
                    f"The stream ended complete at tap {back.tap} but was cut at tap {front.tap}.",
                    [front, back],
                    [_req_quote(front), _outcome_quote(front), _outcome_quote(back)],
                    [{"party": "engine", "why": f"the stream was complete at tap {back.tap}"}],
                    "high",
                    t=front.end,
                )
            )
            replaced.update({front.id, back.id})
    kept = [f for f in findings if not (set(f["requests"]) & replaced)]
    return kept + extra


def find(e: Evidence) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """All findings (sorted, numbered) and the verdict."""
    ctx = Context(e)
    findings: list[dict[str, Any]] = []
    for analyzer in ANALYZERS:
        findings += analyzer(ctx)
    findings = _join_taps(ctx, findings)
    findings.sort(
        key=lambda f: (
            f["note"],
            CONFIDENCE[f["confidence"]],
            f["party"] == "unknown",
            f["t"] if f["t"] is not None else 0.0,
            f["kind"],
        )
    )
    for i, f in enumerate(findings, 1):
        f["id"] = f"F{i}"
    faults = [f for f in findings if not f["note"]]
    if not faults:
        notes = [f for f in findings if f["note"]]
        verdict = {
            "party": "none",
            "kind": "healthy",
            "summary": "No fault found in the captures."
            + (f" {len(notes)} note(s) about load." if notes else ""),
            "finding": None,
            "confidence": "high" if e.requests else "low",
        }
    else:
        top = faults[0]
        verdict = {
            "party": top["party"],
            "kind": top["kind"],
            "summary": top["summary"],
            "finding": top["id"],
            "confidence": top["confidence"],
            "ruled_out": top["ruled_out"],
        }
    return findings, verdict
