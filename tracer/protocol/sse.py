"""Incremental Server-Sent Events splitter and OpenAI chunk classifier.

Chunk boundaries are not event boundaries: bytes are buffered until a blank line ends
an event (lines end with LF, CRLF or CR, as the SSE spec says; sizes count line ends as
one LF); extra blank lines are not events. An event still open after ``MAX_EVENT`` bytes
is not kept: the rest of it is only counted, and it is reported as ``other`` when its
blank line comes. Classification is one pass of one regular expression that finds the
keys of interest and the first byte of each value; JSON is parsed only for the rare
events that need a value (usage, error): a content chunk costs no ``json.loads``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_EVENT = 1 << 20  # bytes of one unfinished event kept in memory
_ERROR = re.compile(rb'^\s*\{\s*"(?:error"\s*:|object"\s*:\s*"error")')
# Every key the classifier cares about, with the first byte of its value: one pass of
# one regular expression over the payload (a content chunk costs about a microsecond).
_KEYS = re.compile(
    rb'"(content|text|reasoning_content|tool_calls|finish_reason|usage)"\s*:\s*(.)', re.S
)
_LIST_OF_OBJECTS = re.compile(rb"\s*\{")
_TEXT = frozenset((b"content", b"text", b"reasoning_content"))


def _scan(payload: bytes) -> tuple[bool, str | None, bool]:
    """(has generated text or a tool call, finish_reason, has a usage object)."""
    content = usage = False
    reason: str | None = None
    for found in _KEYS.finditer(payload):
        key, first = found.group(1), found.group(2)
        end = found.end()
        if key in _TEXT:
            # a string with at least one character: generated text
            if first == b'"' and payload[end : end + 1] not in (b'"', b""):
                content = True
        elif key == b"finish_reason":
            if first == b'"':
                close = payload.find(b'"', end)
                if close >= 0:
                    reason = payload[end:close].decode("utf-8", "replace")
        elif key == b"usage":
            usage = usage or first == b"{"
        elif first == b"[" and _LIST_OF_OBJECTS.match(payload, end):  # tool_calls
            content = True
    return content, reason, usage


@dataclass(slots=True)
class SseEvent:
    size: int
    kind: str  # role | content | finish | usage | error | done | comment | other
    content: bool = False
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None

    def as_record(self) -> list[Any]:
        if self.finish_reason is not None:
            return [self.size, self.kind, self.finish_reason]
        return [self.size, self.kind]


class SseSplitter:
    """Feed body bytes, get completed events; ``pending`` says whether an event is cut."""

    __slots__ = ("_buf", "_skipped")

    def __init__(self) -> None:
        self._buf = b""
        self._skipped = 0  # bytes dropped from an event over MAX_EVENT

    @property
    def pending(self) -> int:
        return len(self._buf) + self._skipped

    def feed(self, data: bytes) -> list[SseEvent]:
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:  # CRLF and a lone CR end a line too; a last CR waits for its LF
            cr = buf.endswith(b"\r")
            buf = (buf[:-1] if cr else buf).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if cr:
                buf += b"\r"
        events: list[SseEvent] = []
        start = 0
        find = buf.find
        while True:
            end = find(b"\n\n", start)
            if end < 0:
                break
            if self._skipped:
                events.append(SseEvent(size=self._skipped + end - start + 2, kind="other"))
                self._skipped = 0
            elif end > start:
                events.append(classify(buf[start:end]))
            start = end + 2
        rest = buf[start:]
        if len(rest) > MAX_EVENT:  # keep 2 bytes: they may begin the blank line
            self._skipped += len(rest) - 2
            rest = rest[-2:]
        self._buf = rest
        return events


def is_event_stream(content_type: bytes) -> bool:
    """Whether a ``Content-Type`` value says SSE."""
    return content_type.lower().startswith(b"text/event-stream")


def classify(block: bytes) -> SseEvent:
    """Classify one SSE event (its lines, without the terminating blank line)."""
    size = len(block) + 2
    if block.startswith(b"data:") and b"\n" not in block:
        payload = block[5:]
    else:
        data_lines = []
        for line in block.split(b"\n"):
            if line.startswith(b"data:"):
                data_lines.append(line[5:])
        if not data_lines:
            comment = block.lstrip(b"\n").startswith(b":")  # after an odd blank line
            return SseEvent(size=size, kind="comment" if comment else "other")
        payload = b"\n".join(data_lines)
    if payload.startswith(b" "):
        payload = payload[1:]
    if payload.startswith(b"[DONE]"):
        return SseEvent(size=size, kind="done")
    if not payload.startswith(b"{"):
        return SseEvent(size=size, kind="other")
    if _ERROR.match(payload):
        return SseEvent(size=size, kind="error", error=_error_message(payload))
    content, reason, usage = _scan(payload)
    ev = SseEvent(size=size, kind="content" if content else "role", content=content)
    if reason is not None:
        ev.kind = "finish"
        ev.finish_reason = reason
    if usage:
        ev.usage = _usage(payload)
        if ev.usage is not None and ev.kind == "role":
            ev.kind = "usage"
    return ev


def _usage(payload: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


def _error_message(payload: bytes) -> str:
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError):
        return payload[:200].decode("utf-8", "replace")
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("type") or err)[:500]
        return str(err)[:500]
    return str(obj)[:500]
