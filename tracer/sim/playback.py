"""Server-side playback: answer requests with the responses a capture recorded, at its pace.

``tracer sim engine --from CAPTURE`` is mitmproxy's server replay with timing: a client
(harness, router, SDK) that sends the requests it sent during an incident gets back what
it got then — the same status and headers, the same body, the same gaps between SSE
events, the same ending — so a client-side hang reproduces without any GPU.

Theory of operation
-------------------
``build_playbook`` is a pure function of capture events. Each captured exchange
(request head + request end + response head + body records + response end) becomes a
``CapturedResponse``: a head sent ``ttfb`` seconds after the request, body ``Step``\\ s
at their captured offsets from the request head, and an ``ending`` at ``end_at``:

==========  ===========================================================================
complete    the framing ends (terminal chunk / full Content-Length)
close       the connection is closed with FIN (a ``truncated`` response, cut the same way)
reset       the same with RST (the capture saw ``close: reset``)
hold        what was captured is sent, then nothing: the client gave up (``client_abort``)
            or the tap stopped (``in_flight``) with the response unfinished
never       no response head was ever captured: the request is read and never answered
==========  ===========================================================================

Requests are matched by fingerprint — method, target (with the query) and the body's
SHA-256 — which the capture has for every request whatever ``--bodies`` was. Several
captured exchanges with one fingerprint are served in captured order, one each;
after the last one a request gets a 404 unless ``repeat`` (then they are served again
from the first). Unmatched requests get a 404 JSON error naming the fingerprint.

Bodies: a capture made with ``--bodies all`` has the response bytes; they are sent read
by read, with a read that started several chunks split at SSE event boundaries (one
chunk per event, as SGLang sends them). Without them, the body is *synthesised*: one
SSE event per captured event, of its captured kind and size, in SGLang's chunk format
(or a compact OpenAI chunk when the captured event is smaller than SGLang's; an event
smaller than even that comes out longer), a cut inside an event as the first bytes of
one; other bodies are filler of the captured size. The ``x-tracer-playback`` header names the
captured exchange served (``tap/conn/seq``) and says ``synthesised`` when it was.

The server itself is the simulated engine (``SimEngine``) with its completion handling
replaced: the engine's GET endpoints (``/health``, ``/v1/models``, ``/metrics``,
``/v1/loads`` ...) answer live, as an idle engine, never from the capture.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any, Literal

import anyio
import h11
import orjson
from anyio.abc import SocketStream

from .. import events as ev
from ..capture.files import expand_captures, read_events
from .engine import EngineConfig, SimEngine
from .http1 import _SOCKET_ERRORS, _Hangup, _send_json, _watch_client
from .openai_bodies import _error_obj

Ending = Literal["complete", "close", "reset", "hold", "never"]

# Answered live by the simulated engine (GET only), never from the capture.
LIVE_PATHS = frozenset(
    {
        "/health",
        "/health_generate",
        "/v1/models",
        "/model_info",
        "/get_model_info",
        "/server_info",
        "/get_server_info",
        "/v1/loads",
        "/get_load",
        "/metrics",
    }
)
# Headers that describe the captured connection or framing, not the response: h11
# recomputes the framing, ``date`` is now; ``Connection: close`` is kept (it ends the
# connection after the response, as it did).
_RECOMPUTED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "date",
    }
)
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What identifies a request for playback: method, target and body hash."""

    method: str
    target: str
    body_sha256: str
    body_bytes: int

    @classmethod
    def of(cls, method: str, target: str, body: bytes) -> Fingerprint:
        return cls(method.upper(), target, hashlib.sha256(body).hexdigest(), len(body))

    def __str__(self) -> str:
        return (
            f"{self.method} {self.target} (body sha256 {self.body_sha256[:16]}…, "
            f"{self.body_bytes} bytes)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "target": self.target,
            "body_sha256": self.body_sha256,
            "body_bytes": self.body_bytes,
        }


@dataclass(slots=True)
class Step:
    at: float  # seconds from the request head
    data: bytes


@dataclass(slots=True)
class CapturedResponse:
    """One captured answer, as a schedule relative to the request head."""

    source: str  # "tap/conn/seq" of the captured exchange
    status: int | None  # None: no response head was captured
    reason: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    ttfb: float = 0.0
    steps: list[Step] = field(default_factory=list)
    end_at: float = 0.0
    ending: Ending = "complete"
    synthesised: bool = False  # body bytes made up: the capture did not keep them


@dataclass(slots=True)
class _Exchange:
    head: ev.RequestHead
    end: ev.RequestEnd | None = None
    response: ev.ResponseHead | None = None
    bodies: list[ev.BodyData] = field(default_factory=list)
    response_end: ev.ResponseEnd | None = None


def build_playbook(
    events: Iterable[ev.Event],
) -> tuple[dict[Fingerprint, list[CapturedResponse]], list[str]]:
    """Captured responses by fingerprint, in captured order; and what was skipped, why."""
    exchanges: dict[tuple[str, int, int], _Exchange] = {}
    for event in events:
        if isinstance(event, ev.RequestHead):
            exchanges[(event.tap, event.conn, event.seq)] = _Exchange(head=event)
            continue
        if not isinstance(event, ev.RequestEnd | ev.ResponseHead | ev.BodyData | ev.ResponseEnd):
            continue
        x = exchanges.get((event.tap, event.conn, event.seq))
        if x is None:
            continue
        if isinstance(event, ev.RequestEnd):
            x.end = event
        elif isinstance(event, ev.ResponseHead):
            x.response = event
        elif isinstance(event, ev.BodyData):
            x.bodies.append(event)
        else:
            x.response_end = event
    playbook: dict[Fingerprint, list[CapturedResponse]] = {}
    skipped: list[str] = []
    for x in sorted(exchanges.values(), key=lambda x: x.head.m):
        source = f"{x.head.tap}/{x.head.conn}/{x.head.seq}"
        if x.end is None or x.end.body_sha256 is None:
            why = "never ended" if x.end is None else "was kept undecodable"
            skipped.append(f"{source}: the request body {why}, so it has no hash")
            continue
        try:
            captured = _captured_response(x, source)
        except _NotReplayable as exc:
            skipped.append(f"{source}: {exc}")
            continue
        digest = x.end.body_sha256
        fp = Fingerprint(x.head.method.upper(), x.head.target, digest, x.end.body_bytes)
        playbook.setdefault(fp, []).append(captured)
    return playbook, skipped


def _captured_response(x: _Exchange, source: str) -> CapturedResponse:
    resp, end = x.response, x.response_end
    if resp is None:
        if end is not None and end.termination == "truncated":  # a zero-byte reply
            ending: Ending = "reset" if end.close == "reset" else "close"
            return CapturedResponse(source, None, end_at=end.duration, ending=ending)
        if end is None or end.termination in ("client_abort", "in_flight"):
            duration = end.duration if end is not None else 0.0
            return CapturedResponse(source, None, end_at=duration, ending="never")
        raise _NotReplayable(f"no response head and termination {end.termination}")
    steps, synthesised = _steps(x)
    last = steps[-1].at if steps else resp.ttfb
    if end is None:
        ending, end_at = "hold", last
    else:
        end_at = max(end.duration, last)
        if end.termination in ("complete", "tracer_response"):
            ending = "complete"
        elif end.termination in ("truncated", "unparsed"):
            ending = "reset" if end.close == "reset" else "close"
        else:
            ending = "hold"
    sent = sum(len(step.data) for step in steps)
    headers: list[tuple[str, str]] = []
    for name, value in resp.headers:
        lowered = name.lower()
        if lowered == "connection" and "close" in value.lower():
            headers.append((name, "close"))
        elif lowered == "content-length":
            length = resp.content_length
            if length is None or sent > length or (ending == "complete" and sent != length):
                continue  # synthesised bytes do not fit it: h11 chunks the body instead
            headers.append((name, value))
        elif lowered not in _RECOMPUTED:
            headers.append((name, value))
    headers.append(("x-tracer-playback", source + ("; synthesised" if synthesised else "")))
    try:
        _head(resp.status, headers, resp.reason)
    except h11.LocalProtocolError as exc:
        raise _NotReplayable(f"h11 refuses its response head ({exc})") from None
    return CapturedResponse(
        source,
        resp.status,
        reason=resp.reason,
        headers=headers,
        ttfb=resp.ttfb,
        steps=steps,
        end_at=end_at,
        ending=ending,
        synthesised=synthesised,
    )


class _NotReplayable(Exception):
    """A captured exchange that cannot be played back, and why."""


def _head(status: int, headers: list[tuple[str, str]], reason: str) -> h11.Response:
    return h11.Response(
        status_code=status,
        headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        reason=reason.encode("latin-1", "replace"),
    )


def _steps(x: _Exchange) -> tuple[list[Step], bool]:
    """The body as steps: captured bytes where kept, synthesised bytes elsewhere."""
    assert x.response is not None
    sse = x.response.sse
    request_m = x.head.m
    total = sum(int(read[1]) for body in x.bodies for read in body.reads)
    synth = _Synth(x, total)
    steps: list[Step] = []
    synthesised = False
    for body in x.bodies:
        base = body.m - request_m
        data = _kept(body)
        if data is None:
            synthesised = True
            steps.extend(synth.batch(body, base))
            continue
        pos = 0
        for dt, size, chunks, *_ in body.reads:
            piece = data[pos : pos + int(size)]
            pos += int(size)
            synth.read += len(piece)
            synth.sent += len(piece)
            parts = split_events(piece) if sse and int(chunks) > 1 else [piece]
            steps.extend(Step(base + float(dt), part) for part in parts if part)
    if synthesised and sse and x.response_end is not None:
        steps.extend(synth.tail(x.response_end))
    return steps, synthesised


def _kept(body: ev.BodyData) -> bytes | None:
    """The batch's bytes when the capture kept them (and they add up), else None."""
    if body.data is None:
        return None
    if body.data_encoding == "base64":
        data = base64.b64decode(body.data)
    else:
        data = body.data.encode("utf-8")
    return data if len(data) == body.size else None


def split_events(data: bytes) -> list[bytes]:
    """Cut bytes after each SSE event's blank line; a partial event is the last piece."""
    parts: list[bytes] = []
    start = 0
    for found in _EVENT_END.finditer(data):
        parts.append(data[start : found.end()])
        start = found.end()
    if start < len(data):
        parts.append(data[start:])
    return parts


class _Synth:
    """Made-up body bytes of the captured sizes and SSE kinds, in SGLang's format."""

    def __init__(self, x: _Exchange, total: int) -> None:
        assert x.response is not None
        self.sse = x.response.sse
        self.chat = not x.head.target.split("?", 1)[0].endswith("/v1/completions")
        self.model = (x.end.model if x.end is not None else None) or "sim-model"
        self.created = int(x.head.t)
        self.usage = x.response_end.usage if x.response_end is not None else None
        self.error = x.response_end.error if x.response_end is not None else None
        self.filler = _filler(total, _content_type(x.response.headers))
        self.read = 0  # body bytes the capture saw arrive
        self.sent = 0  # body bytes in steps so far
        self.last_read = 0.0  # when the last read arrived, from the request head

    def batch(self, body: ev.BodyData, base: float) -> list[Step]:
        steps: list[Step] = []
        if not self.sse:
            for dt, size, *_ in body.reads:
                piece = self.filler[self.read : self.read + int(size)]
                self.read += int(size)
                self.sent += len(piece)
                steps.append(Step(base + float(dt), piece))
            return steps
        self.read += sum(int(read[1]) for read in body.reads)
        if body.reads:
            self.last_read = base + float(body.reads[-1][0])
        for record in body.sse or []:
            dt, size, kind = float(record[0]), int(record[1]), str(record[2])
            reason = str(record[3]) if len(record) > 3 else None
            data = self.event(kind, size, reason)
            self.sent += size  # as captured: a synthesised event may come out longer
            steps.append(Step(base + dt, data))
        return steps

    def tail(self, end: ev.ResponseEnd) -> list[Step]:
        """A cut inside an event: the start of one, as many bytes as were cut off."""
        missing = self.read - self.sent
        if not end.mid_event or missing <= 0 or end.termination == "complete":
            return []
        return [Step(self.last_read, self.event("content", missing + 2, None)[:missing])]

    def event(self, kind: str, size: int, reason: str | None) -> bytes:
        if kind == "done":
            return b"data: [DONE]\n\n"
        if kind == "comment":
            return b":" + b" keepalive".ljust(max(size - 3, 0), b" ") + b"\n\n"
        if kind == "other":
            return b"data: " + b"x" * max(size - 8, 0) + b"\n\n"
        if kind == "error":
            message = self.error or "error (synthesised by tracer playback)"
            error = _error_obj(message, "INTERNAL_SERVER_ERROR", 500)
            event = _padded(lambda pad: {"error": error | {"pad": pad}}, size)
            return event if len(event) <= size else _spaced({"error": {"message": "error"}}, size)
        return self._chunk(kind, size, reason)

    def _chunk(self, kind: str, size: int, reason: str | None) -> bytes:
        """An OpenAI chunk of ``kind``: SGLang's full form, or a compact one when the
        captured event is smaller than that (another server's, or a router's rewrite)."""
        text = "tok " if kind == "content" else ""
        finish = (reason or "stop") if kind == "finish" else None
        if self.chat:
            role = "assistant" if kind == "role" else None
            delta = {"role": role, "content": text, "reasoning_content": None, "tool_calls": None}
            full: dict[str, Any] = {"index": 0, "delta": delta}
            short = {"role": role} if role else ({"content": text} if text else {})
            compact: dict[str, Any] = {"index": 0, "delta": short}
        else:
            full = {"index": 0, "text": text}
            compact = {"index": 0, "text": text}
        full |= {"logprobs": None, "finish_reason": finish, "matched_stop": None}
        if finish is not None:
            compact["finish_reason"] = finish
        usage_only = kind == "usage"
        usage = self.usage or {"prompt_tokens": 0, "completion_tokens": 0}
        sglang = {
            "id": "",
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [] if usage_only else [full],
            "usage": usage if usage_only else None,
        }
        prefix = "chatcmpl-playback-" if self.chat else "cmpl-playback-"
        event = _padded(lambda pad: sglang | {"id": prefix + pad}, size)
        if len(event) > size:
            small: dict[str, Any] = {"choices": [] if usage_only else [compact]}
            if usage_only:
                small["usage"] = usage
            event = min(event, _spaced(small, size), key=len)
        return event


def _padded(build: Callable[[str], dict[str, Any]], size: int) -> bytes:
    """``data: JSON\\n\\n`` of ``size`` bytes by growing a padding string (longer if it must)."""
    event = b"data: " + orjson.dumps(build("")) + b"\n\n"
    if len(event) < size:
        event = b"data: " + orjson.dumps(build("0" * (size - len(event)))) + b"\n\n"
    return event


def _spaced(obj: dict[str, Any], size: int) -> bytes:
    """``data: JSON\\n\\n`` of ``size`` bytes by trailing spaces (JSON allows them)."""
    payload = orjson.dumps(obj)
    return b"data: " + payload.ljust(size - 8, b" ") + b"\n\n"


def _content_type(headers: list[list[str]]) -> str:
    for name, value in headers:
        if name.lower() == "content-type":
            return value.lower()
    return ""


def _filler(size: int, content_type: str) -> bytes:
    """A body of ``size`` bytes standing for one the capture did not keep."""
    if "json" in content_type:
        note = b'{"tracer_playback":"response body not kept in the capture"}'
        if size >= len(note):
            return note + b" " * (size - len(note))
    return (b"[response body not kept in the capture] " * (size // 40 + 1))[:size]


# ---- the playbook: which captured response answers which request ----------------------


class Playbook:
    """Captured responses by fingerprint, each served once in captured order (or cycled)."""

    def __init__(
        self,
        responses: dict[Fingerprint, list[CapturedResponse]],
        *,
        repeat: bool = False,
        skipped: list[str] | None = None,
    ) -> None:
        self.responses = responses
        self.repeat = repeat
        self.skipped = skipped or []
        self._next: Counter[Fingerprint] = Counter()

    @property
    def size(self) -> int:
        return sum(len(queue) for queue in self.responses.values())

    def take(self, fp: Fingerprint) -> CapturedResponse | None:
        queue = self.responses.get(fp)
        if not queue:
            return None
        index = self._next[fp]
        if index >= len(queue):
            if not self.repeat:
                return None
            index = 0
        self._next[fp] = index + 1
        return queue[index]

    def miss(self, fp: Fingerprint) -> dict[str, Any]:
        """The 404 body for a request the playbook cannot answer, saying why."""
        queue = self.responses.get(fp)
        if queue:
            why = (
                f"all {len(queue)} captured responses for it were served "
                "(start the engine with --repeat to serve them again)"
            )
        else:
            same = sum(
                1
                for other in self.responses
                if (other.method, other.target) == (fp.method, fp.target)
            )
            why = "no captured request has this fingerprint"
            if same:
                why += f" ({same} captured {fp.method} {fp.target} with other bodies)"
        obj = _error_obj(f"tracer playback: {fp}: {why}", "NotFound", 404)
        obj["fingerprint"] = fp.as_dict()
        return obj

    def summary(self) -> str:
        synthesised = sum(1 for queue in self.responses.values() for r in queue if r.synthesised)
        endings = Counter(r.ending for queue in self.responses.values() for r in queue)
        parts = ", ".join(f"{n} {ending}" for ending, n in sorted(endings.items()))
        text = (
            f"{self.size} captured responses for {len(self.responses)} request fingerprints "
            f"({parts})"
        )
        if synthesised:
            text += f"; {synthesised} with synthesised bodies (not kept in the capture)"
        if self.skipped:
            text += f"; {len(self.skipped)} exchanges skipped"
        return text


def load_playbook(path: str | os.PathLike[str], *, repeat: bool = False) -> Playbook:
    """Read a capture (a file, or the folder of a rotated one) into a playbook; ValueError
    when it cannot be read or has nothing."""
    files = expand_captures([path])
    try:
        responses, skipped = build_playbook(e for f in files for e in read_events(f))
    except OSError as exc:
        raise ValueError(f"--from {path}: {exc.strerror or exc}") from None
    if not responses:
        raise ValueError(f"--from {path}: no request with a recorded body hash in this capture")
    return Playbook(responses, repeat=repeat, skipped=skipped)


# ---- the server -----------------------------------------------------------------------


class PlaybackEngine(SimEngine):
    """The simulated engine, answering everything but its GET endpoints from a capture."""

    def __init__(self, config: EngineConfig, playbook: Playbook, *, speed: float = 1.0) -> None:
        if not speed > 0:
            raise ValueError(f"--speed must be above 0 (got {speed})")
        super().__init__(config)
        self.playbook = playbook
        self.speed = speed
        self.served = 0
        self.unmatched = 0
        self.held = 0  # requests held open right now (hung as captured)

    async def _respond(
        self, conn: h11.Connection, stream: SocketStream, request: h11.Request, body: bytes
    ) -> None:
        start = time.monotonic()
        method = request.method.decode("latin-1")
        target = request.target.decode("latin-1")
        if method == "GET" and target.split("?", 1)[0] in LIVE_PATHS:
            await super()._respond(conn, stream, request, body)
            return
        self.hits[f"{method} {target.split('?', 1)[0]}"] += 1
        fp = Fingerprint.of(method, target, body)
        captured = self.playbook.take(fp)
        if captured is None:
            self.unmatched += 1
            await _send_json(conn, stream, 404, self.playbook.miss(fp))
            return
        self.served += 1
        outcome: str = "gone"
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_client, conn, stream, tg.cancel_scope)  # a close ends it
            try:
                outcome = await self._play(conn, stream, captured, start)
            except _SOCKET_ERRORS:
                outcome = "gone"
            tg.cancel_scope.cancel()
        if outcome != "complete":
            raise _Hangup(reset=outcome == "reset")

    async def _play(
        self, conn: h11.Connection, stream: SocketStream, captured: CapturedResponse, start: float
    ) -> Ending:
        async def at(offset: float) -> None:
            delay = start + offset / self.speed - time.monotonic()
            if delay > 0:
                await anyio.sleep(delay)

        if captured.status is not None:
            await at(captured.ttfb)
            headers = [("date", formatdate(usegmt=True)), *captured.headers]
            head = _head(captured.status, headers, captured.reason)
            await stream.send(conn.send(head) or b"")
            for step in captured.steps:
                await at(step.at)
                await stream.send(conn.send(h11.Data(data=step.data)) or b"")
        if captured.ending not in ("hold", "never"):
            await at(captured.end_at)
        if captured.ending == "complete":
            await stream.send(conn.send(h11.EndOfMessage()) or b"")
        elif captured.ending in ("hold", "never"):
            self.held += 1
            try:
                await anyio.sleep_forever()  # until the client closes (the watcher sees it)
            finally:
                self.held -= 1
        return captured.ending
