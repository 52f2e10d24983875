"""The tap's faults: their kinds (``KINDS``), one parsed ``--fault`` spec (``Fault``, with
the ``Rule`` that says which requests it applies to), ``parse_fault``, and the answer
the tap gives for ``status:CODE``.

The spelling (and its errors) is ``spec``'s, the same as the sim engine's faults;
``docs/faults.md`` documents both. ``plan`` decides, per request, which of a tap's
faults apply.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Literal

from .spec import Spec, counter_rules, fail, positional, rule_keys, split_spec, to_int, to_seconds

Acts = Literal["request", "response", "idle"]
Close = Literal["fin", "reset"]


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    usage: str
    acts: Acts
    summary: str
    example: str


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "hang-on-reuse",
            "hang-on-reuse:N",
            "request",
            "the N-th request on a keep-alive connection (N >= 2) is read and never forwarded "
            "nor answered; the connection stays open and silent",
            "hang-on-reuse:3",
        ),
        Kind(
            "drop-request",
            "drop-request",
            "request",
            "the request is read and never forwarded nor answered; the connection stays "
            "open and silent",
            "drop-request@prob=0.1,seed=7",
        ),
        Kind(
            "half-open",
            "half-open",
            "request",
            "at the request the tap stops reading and writing both sides, without closing",
            "half-open@pos=2",
        ),
        Kind(
            "status",
            "status:CODE",
            "request",
            "answer CODE (400-599) with a small JSON error body instead of forwarding",
            "status:503@every=4",
        ),
        Kind(
            "delay-first-byte",
            "delay-first-byte:S",
            "response",
            "hold the response's first byte S seconds",
            "delay-first-byte:2.5",
        ),
        Kind(
            "stall-after-events",
            "stall-after-events:K:S",
            "response",
            "stop relaying after K SSE events for S seconds (inf: for good)",
            "stall-after-events:5:10@path=/v1/chat/*",
        ),
        Kind(
            "truncate-after-events",
            "truncate-after-events:K[:fin|reset]",
            "response",
            "close the connection (FIN, or RST) after K SSE events, without the end of the body",
            "truncate-after-events:3:reset",
        ),
        Kind(
            "drop-done",
            "drop-done",
            "response",
            "remove the data: [DONE] event; the chunked body is re-framed and ends cleanly",
            "drop-done",
        ),
        Kind(
            "buffer-stream",
            "buffer-stream",
            "response",
            "hold the whole response and release it at its end (nginx proxy_buffering on)",
            "buffer-stream@path=/v1/chat/completions",
        ),
        Kind(
            "coalesce",
            "coalesce:S",
            "response",
            "deliver the stream in bunches: after each write, hold what follows S seconds "
            "and release it at once (a hop without TCP_NODELAY meeting delayed ACKs: 0.04)",
            "coalesce:0.04",
        ),
        Kind(
            "close-idle-after",
            "close-idle-after:S",
            "idle",
            "close a keep-alive connection idle S seconds after a response (the "
            "stale-connection race)",
            "close-idle-after:4",
        ),
    )
}

RULE_KEYS: dict[str, str] = rule_keys("proxy")  # the tap's rules (faultspec.RULES)


@dataclass(frozen=True, slots=True)
class Rule:
    """Which requests a fault applies to; every condition given must hold."""

    path: str | None = None
    method: str | None = None
    header: bytes | None = None  # its name, lower case
    header_value: str | None = None  # a glob its value must match
    pos: int | None = None
    pos_and_later: bool = False
    reuse: bool = False
    every: int | None = None
    prob: float | None = None
    seed: int = 0
    times: int | None = None

    def matches(
        self, method: str, path: str, pos: int, headers: Sequence[tuple[bytes, bytes]] = ()
    ) -> bool:
        """The static conditions (path, method, header, position); counters are the plan's.
        ``headers``: the request's, names in any case."""
        if self.method is not None and method.upper() != self.method:
            return False
        if self.pos is not None and (pos < self.pos if self.pos_and_later else pos != self.pos):
            return False
        if self.reuse and pos < 2:
            return False
        if self.header is not None and not self._has_header(headers):
            return False
        if self.path is not None:
            if any(c in self.path for c in "*?["):
                return fnmatch.fnmatchcase(path, self.path)
            return path.startswith(self.path)
        return True

    def _has_header(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        glob = self.header_value
        for name, value in headers:
            if name.lower() != self.header:
                continue
            text = value.decode("latin-1").strip()
            if glob is None or fnmatch.fnmatchcase(text, glob):
                return True
        return False


@dataclass(frozen=True, slots=True)
class Fault:
    """One parsed ``--fault`` spec."""

    name: str
    spec: str  # the text it was parsed from, as recorded in ``fault`` records
    rule: Rule = Rule()
    count: int = 0  # hang-on-reuse: N; *-after-events: K
    seconds: float = 0.0  # delay-first-byte, stall-after-events (inf), close-idle-after, coalesce
    how: Close = "fin"  # truncate-after-events
    status: int = 0  # status

    @property
    def acts(self) -> Acts:
        return KINDS[self.name].acts


def parse_fault(text: str) -> Fault:
    """``NAME[:ARG...][@RULE,...]`` to a ``Fault``; raises ``FaultSpecError``.

    The spelling is ``faultspec``'s, shared with the sim engine's faults."""
    parts = split_spec(text, KINDS, "proxy", bare=("reuse",))
    spec, name, args = parts.text, parts.name, parts.args
    kind = KINDS[name]
    rule = _parse_rule(parts) if parts.at else Rule()
    fault = Fault(name=name, spec=spec, rule=rule)
    n_min, n_max = {
        "hang-on-reuse": (1, 1),
        "status": (1, 1),
        "delay-first-byte": (1, 1),
        "coalesce": (1, 1),
        "stall-after-events": (2, 2),
        "truncate-after-events": (1, 2),
        "close-idle-after": (1, 1),
    }.get(name, (0, 0))
    positional(parts, n_min, n_max, kind.usage)
    if name == "hang-on-reuse":
        if rule.pos is not None or rule.reuse:
            raise fail(
                spec, "pos/reuse with hang-on-reuse", "hang-on-reuse:N sets the position itself"
            )
        n = to_int(spec, "N", args[0], 2)
        return replace(fault, count=n, rule=replace(rule, pos=n))
    if name == "status":
        code = to_int(spec, "CODE", args[0], 400)
        if code > 599:
            raise fail(spec, "CODE must be an HTTP error status (400-599)")
        return replace(fault, status=code)
    if name == "delay-first-byte":
        return replace(fault, seconds=to_seconds(spec, "S", args[0], finite=True))
    if name in ("close-idle-after", "coalesce"):
        seconds = to_seconds(spec, "S", args[0], finite=True)
        if seconds <= 0:
            raise fail(spec, f"S must be more than 0 seconds (got {args[0]!r})")
        return replace(fault, seconds=seconds)
    if name == "stall-after-events":
        count = to_int(spec, "K", args[0], 0)
        return replace(fault, count=count, seconds=to_seconds(spec, "S", args[1], finite=False))
    if name == "truncate-after-events":
        count = to_int(spec, "K", args[0], 0)
        how = args[1].lower() if len(args) == 2 else "fin"
        if how not in ("fin", "reset"):
            raise fail(spec, f"the close is fin or reset, not {args[1]!r}")
        return replace(fault, count=count, how="reset" if how == "reset" else "fin")
    return fault


def _parse_rule(parts: Spec) -> Rule:
    """The values of the tap's rules (the keys are checked by ``split_spec``)."""
    spec = parts.text
    rule = Rule()
    keys = {key for key, _ in parts.rules}
    if {"pos", "reuse"} <= keys:
        raise fail(
            spec,
            "the position given twice (or pos with reuse)",
            "pos and reuse both set it: give one",
        )
    counters = counter_rules(parts)
    for key, value in parts.rules:
        if value is None:  # a bare key: reuse
            rule = replace(rule, reuse=True)
        elif key == "path":
            if not value.startswith(("/", "*")):
                raise fail(spec, f"path must start with / or * (got {value!r})")
            rule = replace(rule, path=value)
        elif key == "header":
            name, colon, glob = value.partition(":")
            if not _TOKEN.fullmatch(name) or (colon and not glob):
                raise fail(
                    spec, f"header=NAME or header=NAME:GLOB, NAME a header name (got {value!r})"
                )
            rule = replace(rule, header=name.lower().encode(), header_value=glob or None)
        elif key == "method":
            if not re.fullmatch(r"[A-Za-z]+", value):
                raise fail(spec, f"method must be a word like POST (got {value!r})")
            rule = replace(rule, method=value.upper())
        elif key == "reuse":
            rule = replace(rule, pos=to_int(spec, "reuse", value, 2))
        elif key == "pos":
            later = value.endswith("+")
            rule = replace(rule, pos=to_int(spec, "pos", value.removesuffix("+"), 1))
            rule = replace(rule, pos_and_later=later)
    return replace(
        rule,
        every=_opt_int(counters.get("every")),
        times=_opt_int(counters.get("times")),
        seed=int(counters.get("seed", 0)),
        prob=None if "prob" not in counters else float(counters["prob"]),
    )


def _opt_int(value: float | None) -> int | None:
    return None if value is None else int(value)


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a header name (RFC 9110 token)


# ---- the answer of status:CODE -----------------------------------------------------


def status_body(fault: Fault) -> bytes:
    """The JSON body of the tap's answer for ``status:CODE``, in the OpenAI error shape."""
    error = {
        "message": f"injected by tracer: fault {fault.spec}",
        "type": "tracer_fault",
        "param": None,
        "code": fault.status,
    }
    return json.dumps({"error": error}, separators=(",", ":")).encode()


def status_response(fault: Fault) -> bytes:
    """The tap's whole answer for ``status:CODE`` (keep-alive, named by ``x-tracer-fault``)."""
    code = fault.status
    try:
        reason = HTTPStatus(code).phrase
    except ValueError:
        reason = "Error"
    body = status_body(fault)
    head = (
        f"HTTP/1.1 {code} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nx-tracer-fault: {fault.spec}\r\n\r\n"
    )
    return head.encode("latin-1") + body
