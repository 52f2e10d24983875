"""HTTP-aware fault injection, sans-I/O: fault specs, rules, and per-connection decisions.

Theory of operation
-------------------
A TCP-level fault injector (Toxiproxy) cannot say "the third request on a reused
keep-alive connection" or "after the fifth SSE event". This module can, because it
follows both directions of one HTTP/1.1 connection at message level. It has no sockets
and no clocks: the relay feeds it bytes and carries out the ``Action`` values it returns
(``Forward`` to the upstream, ``Deliver`` to the client, ``Hold`` the client-bound
stream for some seconds, ``Cut`` the connection, ``Freeze`` it, ``ArmIdle`` a timer) and
writes an ``Injected`` record for each injection, so that analysis never mistakes an
injected fault for an external one.

* **Specs** (``parse_fault``): ``NAME[:ARG...][@RULE,...]``, e.g. ``hang-on-reuse:3``,
  ``stall-after-events:5:10@path=/v1/chat/*``, ``status:503@every=4``,
  ``drop-request@prob=0.1,seed=7``. ``KINDS`` lists the faults, ``RULE_KEYS`` the rules.
  The spelling (and its errors) is ``faultspec``'s, the same as the sim engine's faults;
  ``docs/faults.md`` documents both.
* **Plan** (``FaultPlan``): the faults of one tap and their counters (``every``, ``prob``
  with its seeded generator, ``times``), shared by all its connections. ``decide`` is
  called once per request head, in arrival order, and is deterministic for a given
  sequence of requests.
* **Connection** (``ConnectionFaults``): client bytes are cut into requests (head, then
  body framing) and each head is decided before any of its bytes is forwarded; a request
  that is not faulted is forwarded byte for byte. Upstream bytes are cut into responses
  (head, body framing with the position of every chunk, SSE event boundaries when a
  fault needs them). A response no fault applies to is delivered byte for byte; one with
  faults goes through a short pipeline of stages, one per fault (``drop-done``,
  ``stall``/``truncate-after-events``, ``buffer-stream``, ``coalesce``,
  ``delay-first-byte``), each
  taking and giving segments of raw bytes annotated with where heads, chunks and events
  end. Of these only ``drop-done`` changes bytes: it removes the ``[DONE]`` event and
  re-frames the chunk that held it, so the body still ends cleanly.

Rules:

1. Faults act on whole messages: a request is faulted from its first byte or not at all;
   response faults cut at event and chunk boundaries.
2. Request faults (``hang-on-reuse``, ``drop-request``, ``half-open``, ``status``) are
   exclusive: the first matching one (in the order given) wins. Response faults all
   apply, combined. ``close-idle-after`` applies to the idle time after a response.
3. What cannot be followed (not HTTP/1.x, a malformed head or framing, a protocol
   switch) turns the connection *blind*: from then on every byte passes unchanged and no
   fault applies to it, as the observer does. A hung connection (a dropped request) is
   the exception: nothing goes upstream any more, and each later request is recorded.
4. Memory is bounded: request and response heads by ``MAX_HEAD``, an SSE event by
   ``sse.MAX_EVENT``, a ``buffer-stream`` response by ``BUFFER_LIMIT`` (beyond it the
   stage stops holding).
"""

from __future__ import annotations

import fnmatch
import json
import math
import random
import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Literal
from urllib.parse import urlsplit

from ..protocol.framing import (
    MAX_CHUNK_LINE,
    MAX_TRAILERS,
    BodyDecoder,
    Framing,
    FramingError,
    body_framing,
    chunk_size,
)
from ..protocol.sse import MAX_EVENT, classify, is_event_stream
from .spec import FaultSpecError as FaultSpecError  # (re-exported: callers catch it)
from .spec import Spec, counter_rules, fail, positional, rule_keys, split_spec, to_int, to_seconds

MAX_HEAD = 64 * 1024
BUFFER_LIMIT = 16 * 1024 * 1024

Acts = Literal["request", "response", "idle"]
Close = Literal["fin", "reset"]


# ---- specs ---------------------------------------------------------------------------


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


# ---- decisions -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Decision:
    """What happens to one request: at most one request fault, any response faults."""

    request: Fault | None = None
    response: tuple[Fault, ...] = ()
    idle: Fault | None = None

    @property
    def empty(self) -> bool:
        return self.request is None and not self.response and self.idle is None


NO_FAULT = Decision()


class FaultPlan:
    """The faults of one tap, with the counters their rules need, shared by its connections.

    It can change while connections use it (``tracer proxy --fault-control``): a change
    applies from the next request head on, and a request already decided keeps its
    faults. ``replace`` starts every counter afresh (``times=1`` given again injects once
    more); ``add`` leaves the counters of the faults already there alone."""

    def __init__(self, faults: Sequence[Fault] = ()) -> None:
        self.faults: tuple[Fault, ...] = ()
        self._matched: list[int] = []  # requests the static conditions matched
        self._applied: list[int] = []
        self._rng: list[random.Random] = []
        self.add(faults)

    def replace(self, faults: Sequence[Fault]) -> None:
        self.faults = ()
        self._matched, self._applied, self._rng = [], [], []
        self.add(faults)

    def add(self, faults: Sequence[Fault]) -> None:
        self.faults += tuple(faults)
        self._matched += [0] * len(faults)
        self._applied += [0] * len(faults)
        self._rng += [random.Random(f.rule.seed) for f in faults]

    @property
    def specs(self) -> list[str]:
        return [f.spec for f in self.faults]

    def decide(
        self, method: str, target: str, pos: int, headers: Sequence[tuple[bytes, bytes]] = ()
    ) -> Decision:
        """Called once per request head, in arrival order: deterministic for a sequence."""
        path = request_path(target)
        request: Fault | None = None
        response: list[Fault] = []
        idle: Fault | None = None
        for i, fault in enumerate(self.faults):
            rule = fault.rule
            if not rule.matches(method, path, pos, headers):
                continue
            self._matched[i] += 1
            if rule.every is not None and self._matched[i] % rule.every:
                continue
            if rule.prob is not None and self._rng[i].random() >= rule.prob:
                continue
            if rule.times is not None and self._applied[i] >= rule.times:
                continue
            acts = fault.acts
            if acts == "request":
                if request is not None:
                    continue
                request = fault
            elif acts == "idle":
                if idle is not None and idle.seconds <= fault.seconds:
                    continue
                idle = fault
            else:
                response.append(fault)
            self._applied[i] += 1
        if request is None and not response and idle is None:
            return NO_FAULT
        return Decision(request, tuple(response), idle)


def request_path(target: str) -> str:
    """The path of a request target (origin or absolute form), without the query."""
    if not target.startswith("/") and "://" in target:
        return urlsplit(target).path or "/"
    return target.split("?", 1)[0]


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


# ---- actions -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Forward:
    """Write these bytes to the upstream."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Deliver:
    """Write these bytes to the client."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Hold:
    """Deliver nothing more to the client for this long (inf: for good).

    ``merge``: a coalescing hold; when it ends, what queued behind it goes out at once, up
    to the last merging hold queued meanwhile (the holds in between are dropped).
    """

    seconds: float
    merge: bool = False


@dataclass(frozen=True, slots=True)
class Cut:
    """Close the client connection (FIN or RST) and the upstream one."""

    how: Close


@dataclass(frozen=True, slots=True)
class Freeze:
    """Stop reading and writing both sides, without closing (half-open)."""


@dataclass(frozen=True, slots=True)
class ArmIdle:
    """The connection is idle after a response: close it if it stays idle that long."""

    fault: Fault
    seq: int


@dataclass(frozen=True, slots=True)
class Injected:
    """A fault was injected: write a ``fault`` record. ``now``: at once, not in delivery order."""

    fault: Fault
    seq: int | None
    detail: str
    now: bool = False


Action = Forward | Deliver | Hold | Cut | Freeze | ArmIdle | Injected


# ---- segments of a response ----------------------------------------------------------

HEAD, SIZE, DATA, CRLF, END = "head", "size", "data", "crlf", "end"


class Seg:
    """Raw bytes of one response, with what they are and what ends at their end."""

    __slots__ = ("chunk_end", "event", "head_end", "kind", "last", "raw")

    def __init__(
        self, raw: bytes, kind: str, *, event: str | None = None, chunk_end: bool = False
    ) -> None:
        self.raw = raw
        self.kind = kind  # head | size (chunk-size line) | data | crlf (after data) | end
        self.event = event  # an SSE event of this kind ends here
        self.chunk_end = chunk_end  # data: the chunk's data ends here; crlf: its CRLF does
        self.head_end = False  # the final (non-1xx) head ends here
        self.last = False  # the response ends here


Item = Seg | Hold | Cut | Injected


_BLANK = re.compile(rb"(?>\r\n|\n|\r)(?>\r\n|\n|\r)")  # an empty line ends an SSE event
_HEAD_END = re.compile(rb"\n\r?\n")
_METHOD = re.compile(rb"(?:\r?\n)*([!#$%&'*+.^_`|~0-9A-Za-z-]*)")


class SseEvents:
    """Where Server-Sent Events end in a body fed piece by piece, and their kinds.

    Line ends are LF, CRLF or CR; an empty line ends an event. ``feed`` returns, for
    each event completed, its end as an offset into the piece and its kind as
    ``sse.classify`` says (``comment`` for heartbeats, ``done`` for ``[DONE]`` ...).
    """

    __slots__ = ("_buf", "_over")

    def __init__(self) -> None:
        self._buf = b""  # the event in progress
        self._over = False  # it grew past sse.MAX_EVENT: only its end is looked for

    def feed(self, piece: bytes) -> list[tuple[int, str]]:
        prev = len(self._buf)
        buf = self._buf + piece if prev else piece
        found: list[tuple[int, str]] = []
        start = 0
        at = max(0, prev - 2)
        while (hit := _BLANK.search(buf, at)) is not None:
            end = hit.end()
            if end == len(buf) and buf.endswith(b"\r"):
                break  # that CR may be the first half of a CRLF
            if hit.start() > start:
                kind = "other"
                if not self._over:
                    block = buf[start : hit.start()]
                    if b"\r" in block:
                        block = block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
                    kind = classify(block).kind
                found.append((end - prev, kind))
                self._over = False
            start = at = end
        rest = buf[start:]
        if len(rest) > MAX_EVENT:  # keep 2 bytes: they may begin the empty line
            self._over = True
            rest = rest[-2:]
        self._buf = rest
        return found


class _Broken(Exception):
    """Bytes the fault layer cannot follow: the connection goes blind."""


class _Walker:
    """Finds one body's framing in raw bytes, as segments, with chunk and event ends."""

    __slots__ = ("done", "events", "framing", "line", "remaining", "state")

    def __init__(self, framing: Framing, length: int, events: SseEvents | None) -> None:
        self.framing = framing
        self.remaining = length
        self.state = "size"  # chunked: size, data, crlf, trailer
        self.line = b""
        self.events = events
        self.done = framing == "none"

    def walk(self, data: bytes, pos: int, segs: list[Seg]) -> int:
        """Segments for ``data[pos:]`` up to the body's end; returns the position after."""
        n = len(data)
        if self.framing == "close":
            self._data(data[pos:], False, segs)
            return n
        if self.framing == "length":
            take = min(self.remaining, n - pos)
            self.remaining -= take
            self._data(data[pos : pos + take], False, segs)
            if self.remaining == 0:
                self.done = True
                segs[-1].last = True
            return pos + take
        while pos < n and not self.done:
            state = self.state
            if state == "data":
                take = min(self.remaining, n - pos)
                self.remaining -= take
                self._data(data[pos : pos + take], self.remaining == 0, segs)
                pos += take
                if self.remaining == 0:
                    self.state = "crlf"
                continue
            if state == "crlf":
                got = data[pos : pos + 2 - len(self.line)]
                pos += len(got)
                self.line += got
                if not b"\r\n".startswith(self.line):
                    raise _Broken("chunk data not followed by CRLF")
                done = len(self.line) == 2
                segs.append(Seg(got, CRLF, chunk_end=done))
                if done:
                    self.state, self.line = "size", b""
                continue
            nl = data.find(b"\n", pos)
            stop = n if nl < 0 else nl + 1
            piece = data[pos:stop]
            pos = stop
            line = self.line + piece
            kind = SIZE if state == "size" else END
            if nl < 0:
                if len(line) > (MAX_CHUNK_LINE if state == "size" else MAX_TRAILERS):
                    raise _Broken(f"chunk {state} line too long")
                self.line = line
                segs.append(Seg(piece, kind))
                break
            self.line = b""
            if not line.endswith(b"\r\n"):
                raise _Broken("chunk line without CRLF")
            if state == "size":
                size = chunk_size(line[:-2])
                if size is None:
                    raise _Broken(f"illegal chunk header: {line[:40]!r}")
                if size:
                    self.state, self.remaining = "data", size
                else:
                    self.state, kind = "trailer", END
            elif line == b"\r\n":
                self.done = True
            seg = Seg(piece, kind)
            seg.last = self.done
            segs.append(seg)
        return pos

    def skip(self, data: bytes, pos: int) -> int:
        """``walk`` for a body no fault applies to: only where it ends (``data``'s end if
        not there). Whole chunks go by in a few byte operations each, without segments;
        anything else (a chunk split across reads, the last chunk, a malformed line) is
        left to ``walk``, which raises on what it cannot follow."""
        if self.framing == "chunked":
            n = len(data)
            while pos < n and self.state == "size" and not self.line:
                eol = data.find(b"\r\n", pos, pos + MAX_CHUNK_LINE)
                if eol < 0:
                    break
                size = chunk_size(data[pos:eol])
                end = eol + 2 + (size or 0)
                if not size or data[end : end + 2] != b"\r\n":
                    break  # malformed, the last chunk, or a chunk not whole in this read
                pos = end + 2
        if pos < len(data) and not self.done:
            pos = self.walk(data, pos, [])
        return pos

    def _data(self, raw: bytes, chunk_end: bool, segs: list[Seg]) -> None:
        if self.events is None:
            segs.append(Seg(raw, DATA, chunk_end=chunk_end))
            return
        start = 0
        for end, kind in self.events.feed(raw):
            segs.append(Seg(raw[start:end], DATA, event=kind))
            start = end
        if start < len(raw):
            segs.append(Seg(raw[start:], DATA))
        if segs and segs[-1].kind == DATA:
            segs[-1].chunk_end = chunk_end


def _parse_head(head: bytes, request: bool) -> tuple[bytes, bytes, list[tuple[bytes, bytes]]]:
    """(method, target) or (status, reason) and lower-cased headers; raises _Broken."""
    lines = head.rstrip(b"\r\n").split(b"\n")
    first = lines[0].rstrip(b"\r")
    parts = first.split(b" ", 2)
    if len(parts) < (3 if request else 2):
        raise _Broken(f"bad start line {first[:60]!r}")
    version = parts[2] if request else parts[0]
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise _Broken(f"not HTTP/1.x: {first[:60]!r}")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, colon, value = line.rstrip(b"\r").partition(b":")
        if not colon or not name or name != name.strip():
            raise _Broken(f"bad header line {line[:60]!r}")
        headers.append((name.lower(), value.strip()))
    if request:
        return parts[0], parts[1], headers
    if not (parts[1].isdigit() and len(parts[1]) == 3):
        raise _Broken(f"bad status line {first[:60]!r}")
    return parts[1], parts[2] if len(parts) > 2 else b"", headers


# ---- response stages -----------------------------------------------------------------


class _Stage:
    """One fault acting on one response: items in, items out (``end``: upstream closed)."""

    def __init__(self, fault: Fault, seq: int) -> None:
        self.fault = fault
        self.seq = seq

    def head(self, framing: Framing, sse: bool) -> None:
        """The final response head was parsed."""

    def push(self, items: list[Item]) -> list[Item]:
        return items

    def end(self) -> list[Item]:
        return []

    def injected(self, detail: str) -> Injected:
        return Injected(self.fault, self.seq, detail)


class _DelayFirst(_Stage):
    fired = False

    def push(self, items: list[Item]) -> list[Item]:
        if self.fired or not items:
            return items
        self.fired = True
        seconds = self.fault.seconds
        record: Item = self.injected(f"response held {seconds:g}s before its first byte")
        return [record, Hold(seconds), *items]


class _Coalesce(_Stage):
    """coalesce: a merging hold after each write unit of the body (see ``Hold.merge``).

    A write unit is a whole chunk (its CRLF) of a chunked body, else an SSE event: what an
    upstream writes at once, and what Nagle holds whole.
    """

    fired = False
    chunked = True

    def head(self, framing: Framing, sse: bool) -> None:
        self.chunked = framing == "chunked"

    def push(self, items: list[Item]) -> list[Item]:
        out: list[Item] = []
        for item in items:
            if not self.fired and isinstance(item, Seg) and item.kind not in (HEAD, END):
                self.fired = True  # recorded before the first byte of the body
                seconds = self.fault.seconds
                out.append(self.injected(f"response delivered in bunches: held {seconds:g}s"))
            out.append(item)
            if not isinstance(item, Seg) or item.last:
                continue
            if (item.kind == CRLF and item.chunk_end) if self.chunked else item.event:
                out.append(Hold(self.fault.seconds, merge=True))
        return out


class _Buffer(_Stage):
    def __init__(self, fault: Fault, seq: int) -> None:
        super().__init__(fault, seq)
        self.held: list[Item] = []
        self.size = 0
        self.state = "waiting"  # holding, released

    def push(self, items: list[Item]) -> list[Item]:
        if self.state == "released":
            return items
        out: list[Item] = []
        for item in items:
            if self.state == "released":
                out.append(item)
                continue
            if self.state == "waiting":
                self.state = "holding"
                out.append(self.injected("response held until its end, then released at once"))
            self.held.append(item)
            if isinstance(item, Seg):
                self.size += len(item.raw)
                if item.last or self.size > BUFFER_LIMIT:
                    out.extend(self.end())
                    self.state = "released"
        return out

    def end(self) -> list[Item]:
        held, self.held = self.held, []
        return held  # adjacent segments become one write: the client gets it all at once


class _AfterEvents(_Stage):
    """stall-after-events and truncate-after-events: act after the K-th event."""

    def __init__(self, fault: Fault, seq: int) -> None:
        super().__init__(fault, seq)
        self.events = 0
        self.sse = False
        self.state = "counting"  # armed (wait for the chunk's CRLF), done, gone

    def head(self, framing: Framing, sse: bool) -> None:
        self.sse = sse

    def push(self, items: list[Item]) -> list[Item]:
        if self.state == "done":
            return items
        out: list[Item] = []
        for item in items:
            state = self.state
            if state == "gone":
                continue  # cut: nothing more
            if state == "done" or not isinstance(item, Seg):
                out.append(item)
            elif state == "armed":  # the K-th event ended its chunk's data: wait for the CRLF
                if item.kind == CRLF:
                    out.append(item)
                    if item.chunk_end:
                        out.extend(self._act())
                    continue
                out.extend(self._act())
                if self.state == "done":
                    out.append(item)
            else:
                out.append(item)
                if self.sse and not item.last and self._reached(item):
                    if item.kind == DATA and item.chunk_end:
                        self.state = "armed"
                    else:
                        out.extend(self._act())
        return out

    def _reached(self, seg: Seg) -> bool:
        if seg.head_end:
            return self.fault.count == 0
        if seg.kind == DATA and seg.event not in (None, "comment"):
            self.events += 1
            return self.events == self.fault.count
        return False

    def _act(self) -> list[Item]:
        fault = self.fault
        if fault.name == "stall-after-events":
            self.state = "done"
            span = "for good" if math.isinf(fault.seconds) else f"for {fault.seconds:g}s"
            detail = f"relaying stopped after {fault.count} events {span}"
            return [self.injected(detail), Hold(fault.seconds)]
        self.state = "gone"
        detail = f"connection closed ({fault.how}) after {fault.count} events, without the end of the body"
        return [self.injected(detail), Cut(fault.how)]


class _DropDone(_Stage):
    """Remove ``data: [DONE]``: hold each chunk until it ends on an event boundary."""

    def __init__(self, fault: Fault, seq: int) -> None:
        super().__init__(fault, seq)
        self.active = False
        self.chunked = False
        self.held: list[Seg] = []
        self.partial = False  # inside an event

    def head(self, framing: Framing, sse: bool) -> None:
        self.active = sse and framing in ("chunked", "close")
        self.chunked = framing == "chunked"

    def push(self, items: list[Item]) -> list[Item]:
        if not self.active:
            return items
        out: list[Item] = []
        for item in items:
            if not isinstance(item, Seg) or item.kind == HEAD:
                out.append(item)
                continue
            self.held.append(item)
            if item.kind == DATA:
                if item.event is not None:
                    self.partial = False
                elif item.raw:
                    self.partial = True
            # a chunk's end (chunked) or an event's end (read until close)
            boundary = item.kind == CRLF and item.chunk_end if self.chunked else item.kind == DATA
            if item.last or (boundary and not self.partial):
                out.extend(self._release())
        return out

    def end(self) -> list[Item]:
        return self._release() if self.held else []

    def _release(self) -> list[Item]:
        held, self.held = self.held, []
        if not any(s.event == "done" for s in held):
            return list(held)
        events: list[tuple[bytes, str | None]] = []
        current = b""
        dropped = 0
        for seg in held:
            if seg.kind != DATA:
                continue
            current += seg.raw
            if seg.event is not None:
                if seg.event == "done":
                    dropped += len(current)
                else:
                    events.append((current, seg.event))
                current = b""
        if current:
            events.append((current, None))
        out: list[Item] = [
            self.injected(
                f"removed data: [DONE] ({dropped} bytes)"
                + ("; chunk re-framed, the body still ends cleanly" if self.chunked else "")
            )
        ]
        body = b"".join(raw for raw, _ in events)
        if body and self.chunked:
            out.append(Seg(b"%x\r\n" % len(body), SIZE))
        for raw, kind in events:
            out.append(Seg(raw, DATA, event=kind))
        if body and self.chunked:
            out.append(Seg(b"\r\n", CRLF, chunk_end=True))
        out.extend(s for s in held if s.kind == END)  # (the last one carries ``last``)
        return out


_STAGE_ORDER = (
    ("drop-done", _DropDone),
    ("stall-after-events", _AfterEvents),
    ("truncate-after-events", _AfterEvents),
    ("buffer-stream", _Buffer),
    ("coalesce", _Coalesce),
    ("delay-first-byte", _DelayFirst),
)


_EVENT_FAULTS = frozenset(("drop-done", "stall-after-events", "truncate-after-events"))


def _pipeline(faults: Iterable[Fault], seq: int) -> list[_Stage]:
    faults = tuple(faults)
    return [cls(f, seq) for name, cls in _STAGE_ORDER for f in faults if f.name == name]


def _run(stages: list[_Stage], segs: Sequence[Item]) -> list[Item]:
    items = list(segs)
    for stage in stages:
        items = stage.push(items)
    return items


def _finish(stages: list[_Stage]) -> list[Item]:
    items: list[Item] = []
    for stage in stages:
        items = stage.push(items) + stage.end()
    return items


# ---- one connection ------------------------------------------------------------------


class _Response:
    """A request forwarded upstream: its response is parsed as it comes."""

    def __init__(self, seq: int, method: str, decision: Decision) -> None:
        self.seq = seq
        self.method = method
        self.idle = decision.idle
        self.stages = _pipeline(decision.response, seq)
        self.wants_events = any(f.name in _EVENT_FAULTS for f in decision.response)
        self.head = b""
        self.walker: _Walker | None = None
        self.done = False
        self.tunnel = False

    def feed(self, data: bytes, pos: int, segs: list[Seg]) -> int:
        """Segments of this response in ``data[pos:]``; returns where it ends there."""
        n = len(data)
        while pos < n and not self.done:
            walker = self.walker
            if walker is not None:
                pos = walker.walk(data, pos, segs) if self.stages else walker.skip(data, pos)
                self.done = walker.done
                continue
            old = len(self.head)
            buf = self.head + data[pos:] if old else data[pos:]
            hit = _HEAD_END.search(buf, max(0, old - 3))
            if hit is None:
                if len(buf) > MAX_HEAD:
                    raise _Broken("response head too long")
                self.head = buf
                segs.append(Seg(data[pos:], HEAD))
                return n
            take = hit.end() - old
            seg = Seg(data[pos : pos + take], HEAD)
            segs.append(seg)
            pos += take
            head, self.head = buf[: hit.end()], b""
            code, _, headers = _parse_head(head, request=False)
            status = int(code)
            if status == 101 or (self.method == "CONNECT" and 200 <= status < 300):
                self.tunnel = self.done = seg.last = True
                return pos
            if status < 200:
                continue  # 1xx: the final head follows
            framing, length = body_framing(self.method, status, headers)
            sse = any(name == b"content-type" and is_event_stream(value) for name, value in headers)
            events = SseEvents() if sse and self.wants_events else None
            self.walker = _Walker(framing, length, events)
            for stage in self.stages:
                stage.head(framing, sse)
            seg.head_end = True
            if self.walker.done:
                self.done = seg.last = True
        return pos


class _Answer:
    """A request the tap answers itself (status:CODE): delivered when it is its turn."""

    def __init__(self, seq: int, fault: Fault, idle: Fault | None) -> None:
        self.seq = seq
        self.fault = fault
        self.idle = idle
        self.ready = False  # the request has been read to its end


class ConnectionFaults:
    """The faults of one client connection: bytes in, ``Action`` values out."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.seq = 0
        self.blind = False  # not followable: every byte passes unchanged from now on
        self.stopped = False  # frozen or cut: nothing more either way
        self._hang: tuple[Fault, int] | None = None  # the fault and request that hung it
        self._deaf = False  # hung, and the client's bytes cannot be followed: just dropped
        self._head = b""  # a request head still incomplete
        self._body: BodyDecoder | None = None  # the current request's body
        self._swallow = False  # the current request is not forwarded
        self._answer: _Answer | None = None  # ... because the tap answers it (status)
        self._slots: deque[_Response | _Answer] = deque()  # answers due, in request order

    @property
    def hung(self) -> bool:
        """A request was dropped: nothing more goes upstream (later requests neither)."""
        return self._hang is not None

    @property
    def silent(self) -> bool:
        """A dropped request left the connection silent: nothing more reaches the client."""
        return self.hung and not self._slots

    @property
    def busy(self) -> bool:
        """A request is being read or answered."""
        return bool(self._head or self._body is not None or self._slots)

    # ---- client -> upstream ---------------------------------------------------------

    def client_data(self, data: bytes) -> list[Action]:
        if self.blind:
            return [Forward(data)]
        if self.stopped or self._deaf:
            return []
        out: list[Action] = []
        pos, n = 0, len(data)
        try:
            while pos < n and not (self.stopped or self.blind):
                body = self._body
                if body is not None:
                    _, _, used = body.feed(data[pos:] if pos else data)
                    if not self._swallow:
                        out.append(Forward(data[pos : pos + used]))
                    pos += used
                    if body.done:
                        self._request_done(out)
                    continue
                old = len(self._head)
                buf = self._head + data[pos:] if old else data[pos:]
                method = _METHOD.match(buf)
                assert method is not None  # (the pattern matches the empty string)
                after = method.end()
                if after < len(buf) and (buf[after : after + 1] != b" " or not method.group(1)):
                    raise _Broken("not an HTTP/1.x request")
                hit = _HEAD_END.search(buf, max(method.start(1), old - 3))
                if hit is None:
                    if len(buf) > MAX_HEAD:
                        raise _Broken("request head too long")
                    self._head = buf
                    pos = n
                    break
                self._request_head(buf[: hit.end()], buf[method.start(1) : hit.end()], out)
                pos += hit.end() - old
                self._head = b""
        except (_Broken, FramingError):
            if self.hung:  # nothing goes upstream any more, followable or not
                self._deaf = True
                return _merge(out)
            self._go_blind(out)
            rest = self._head + data[pos:]
            self._head = b""
            if rest:
                out.append(Forward(rest))
        return _merge(out)

    def _request_head(self, raw: bytes, head: bytes, out: list[Action]) -> None:
        method_b, target_b, headers = _parse_head(head, request=True)
        method, target = method_b.decode("latin-1"), target_b.decode("latin-1")
        self.seq += 1
        seq = self.seq
        framing: Framing = "none"
        length = 0
        for name, value in headers:
            if name == b"transfer-encoding":
                if value.lower().split(b",")[-1].strip() != b"chunked":
                    raise _Broken("request body without chunked framing")
                framing = "chunked"
            elif name == b"content-length" and framing != "chunked":
                if not value.isdigit():
                    raise _Broken("bad content-length")
                length = int(value)
                framing = "length" if length else "none"
            elif name == b"upgrade":
                raise _Broken("protocol upgrade")  # forwarded as is, blind from here
        if method == "CONNECT":
            raise _Broken("CONNECT")
        self._body = BodyDecoder(framing, length)
        if self._hang is not None:  # read, recorded, never forwarded: the hang goes on
            hang, first = self._hang
            detail = (
                f"request {seq} read and not forwarded: the connection hangs since request {first}"
            )
            out.append(Injected(hang, seq, detail, now=True))
            self._swallow = True
            if self._body.done:
                self._request_done(out)
            return
        decision = self.plan.decide(method, target, seq, headers)
        fault = decision.request
        self._swallow = fault is not None
        if fault is None:
            out.append(Forward(raw))
            self._slots.append(_Response(seq, method, decision))
        elif fault.name in ("hang-on-reuse", "drop-request"):
            where = (
                f"request {seq} on its connection" if fault.name == "hang-on-reuse" else "request"
            )
            detail = f"{where} read and not forwarded; the connection stays open and silent"
            out.append(Injected(fault, seq, detail, now=True))
            self._hang = (fault, seq)
        elif fault.name == "half-open":
            detail = "the tap stopped reading and writing both sides, without closing"
            out.append(Injected(fault, seq, detail, now=True))
            out.append(Freeze())
            self.stopped = True
            self._body = None
            return
        else:
            self._answer = _Answer(seq, fault, decision.idle)
            self._slots.append(self._answer)
        if self._body.done:
            self._request_done(out)

    def _request_done(self, out: list[Action]) -> None:
        self._body = None
        self._swallow = False
        answer, self._answer = self._answer, None
        if answer is not None:
            answer.ready = True
            self._next(out)

    def _next(self, out: list[Action]) -> None:
        """Deliver the tap's own answers that are due now (no response before them)."""
        while self._slots:
            slot = self._slots[0]
            if not isinstance(slot, _Answer) or not slot.ready:
                return
            self._slots.popleft()
            fault = slot.fault
            out.append(Injected(fault, slot.seq, f"answered {fault.status} without forwarding"))
            out.append(Deliver(status_response(fault)))
            self._idle(slot.idle, slot.seq, out)

    def _idle(self, fault: Fault | None, seq: int, out: list[Action]) -> None:
        if fault is not None and not self.busy:
            out.append(ArmIdle(fault, seq))

    # ---- upstream -> client ---------------------------------------------------------

    def upstream_data(self, data: bytes) -> list[Action]:
        if self.blind:
            return [Deliver(data)]
        if self.stopped:
            return []
        out: list[Action] = []
        pos, n = 0, len(data)
        while pos < n and not (self.stopped or self.blind):
            slot = self._slots[0] if self._slots else None
            if not isinstance(slot, _Response):
                if self.silent:
                    return out  # nothing was asked: nothing reaches the client
                self._go_blind(out)
                out.append(Deliver(data[pos:]))
                break
            segs: list[Seg] = []
            try:
                end = slot.feed(data, pos, segs)
            except (_Broken, FramingError):
                self._go_blind(out)
                out.append(Deliver(data[pos:]))
                break
            if slot.stages:
                self._items(_run(slot.stages, segs), out)
            else:
                out.append(Deliver(data[pos:end]))
            pos = end
            if slot.done and not self.stopped:
                self._slots.popleft()
                if slot.tunnel:
                    self._go_blind(out)
                    if pos < n:
                        out.append(Deliver(data[pos:]))
                    break
                self._next(out)
                self._idle(slot.idle, slot.seq, out)
        return _merge(out)

    def upstream_eof(self) -> list[Action]:
        """The upstream closed: what the front response's faults still hold goes out."""
        if self.blind or self.stopped or not self._slots:
            return []
        slot = self._slots[0]
        out: list[Action] = []
        if isinstance(slot, _Response) and slot.stages:
            self._items(_finish(slot.stages), out)
        return _merge(out)

    def _items(self, items: list[Item], out: list[Action]) -> None:
        raws: list[bytes] = []
        for item in items:
            if isinstance(item, Seg):
                if item.raw:
                    raws.append(item.raw)
                continue
            if raws:
                out.append(Deliver(b"".join(raws)))
                raws = []
            out.append(item)
            if isinstance(item, Cut):
                self.stopped = True
        if raws:
            out.append(Deliver(b"".join(raws)))

    def _go_blind(self, out: list[Action]) -> None:
        """Stop following: release whatever the faults hold, then pass everything through."""
        if self.blind:
            return
        self.blind = True
        for slot in self._slots:
            if isinstance(slot, _Response) and slot.stages:
                self._items(_finish(slot.stages), out)
        self._slots.clear()


def _merge(actions: list[Action]) -> list[Action]:
    """Adjacent writes to the same side become one (as they arrived in one read)."""
    if len(actions) < 2:
        return actions
    out: list[Action] = []
    for action in actions:
        prev = out[-1] if out else None
        if isinstance(action, Forward) and isinstance(prev, Forward):
            out[-1] = Forward(prev.data + action.data)
        elif isinstance(action, Deliver) and isinstance(prev, Deliver):
            out[-1] = Deliver(prev.data + action.data)
        else:
            out.append(action)
    return out
