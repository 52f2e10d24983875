"""Incremental Server-Sent Events splitter and OpenAI chunk classifier.

Chunk boundaries are not event boundaries: bytes are buffered until a blank line ends
an event (lines end with LF, CRLF or CR, as the SSE spec says; sizes count line ends as
one LF); extra blank lines are not events. An event still open after ``MAX_EVENT`` bytes
is not kept: the rest of it is only counted, and it is reported as ``other`` when its
blank line comes. Classification is one pass of one regular expression that finds the
keys of interest and the first byte of each value; JSON is parsed only for the rare
events that need a value (usage, error): a content chunk costs no ``json.loads``.

``SseSplitter`` is the one splitter: the observers take its events, the fault layer
also where each ends in the bytes it passes on.
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
    """Feed body bytes, get completed events; ``pending`` says whether an event is cut.

    ``feed(data, ends)`` also says where in ``data`` each event ends, for code that cuts
    the bytes there (the fault layer): a position after the event's blank line (0 when
    that ended in an earlier piece: a CR is held until the next byte says whether a LF
    follows). Finding those positions needs the held bytes as they came, so with a CR
    among them a blank line is then any two line ends, read by one regular expression;
    without ``ends``, the bytes are rewritten with LF first and a blank line is ``\n\n``,
    as it is without a CR. Both ways give the same events."""

    __slots__ = ("_buf", "_held", "_skipped")

    def __init__(self) -> None:
        self._buf = b""  # the event in progress (its line ends as they came, or as LF)
        self._held = 0  # its size, line ends counted as one
        self._skipped = 0  # bytes dropped from an event over MAX_EVENT (line ends as one)

    @property
    def pending(self) -> int:
        return self._held + self._skipped

    def feed(self, data: bytes, ends: list[int] | None = None) -> list[SseEvent]:
        """The events ``data`` completes; ``ends``, when given, gets where each ends."""
        prev = len(self._buf)
        buf = self._buf + data if prev else data
        if b"\r" in buf:
            if ends is not None:
                return self._split_cr(buf, prev, ends)
            # CRLF and a lone CR end a line too; a last CR waits for its LF
            cr = buf.endswith(b"\r")
            buf = (buf[:-1] if cr else buf).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if cr:
                buf += b"\r"
            prev = 0  # (not used without ends)
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
            else:  # an extra blank line
                start = end + 2
                continue
            start = end + 2
            if ends is not None:
                ends.append(start - prev)
        rest = buf[start:]  # (no CRLF in it: line ends are LF, but for a last CR)
        if len(rest) > MAX_EVENT:  # keep 2 bytes: they may begin the blank line
            self._skipped += len(rest) - 2
            rest = rest[-2:]
        self._buf = rest
        self._held = len(rest)
        return events

    def _split_cr(self, buf: bytes, prev: int, ends: list[int]) -> list[SseEvent]:
        """``feed`` when the bytes have a CR and their positions are wanted."""
        events: list[SseEvent] = []
        start = 0
        at = max(0, prev - 3)  # a blank line cut by the last read starts there or later
        if at and buf[at - 1] == 13:  # never from the LF of a CRLF
            at -= 1
        n = len(buf)
        while (hit := _BLANK.search(buf, at)) is not None:
            stop = hit.end()
            if stop == n and buf[-1] == 13:
                break  # that CR may be the first half of a CRLF
            block = buf[start : hit.start()]
            if self._skipped:
                size = self._skipped + len(block) - block.count(b"\r\n") + 2
                events.append(SseEvent(size=size, kind="other"))
                self._skipped = 0
            elif block:
                events.append(classify(block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")))
            else:  # an extra blank line
                start = at = stop
                continue
            start = at = stop
            ends.append(stop - prev)
        rest = buf[start:]
        size = len(rest) - rest.count(b"\r\n")
        if size > MAX_EVENT:  # keep 2 line characters: they may begin the blank line
            cut = len(rest)
            for _ in range(2):
                cut -= 2 if rest[cut - 2 : cut] == b"\r\n" else 1
            self._skipped += size - 2
            rest = rest[cut:]
            size = 2
        self._buf = rest
        self._held = size
        return events


# two line ends (CRLF, LF or CR; a CRLF is one), the blank line that ends an event: a
# CRLF, a LF or a CR not before a LF, then any line end (a leading literal: scans fast)
_BLANK = re.compile(rb"\r\n(?>\r\n|\n|\r)|\n(?>\r\n|\n|\r)|\r(?!\n)(?>\r\n|\n|\r)")


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
