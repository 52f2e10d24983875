"""Incremental Server-Sent Events splitter and OpenAI chunk classifier.

Chunk boundaries are not event boundaries: bytes are buffered until a blank line ends
an event (lines end with LF, CRLF or CR, as the SSE spec says; sizes count line ends as
one LF); extra blank lines are not events. An event still open after ``MAX_EVENT`` bytes
is not kept: the rest of it is only counted, and it is reported as ``other`` when its
blank line comes. Classification finds the keys of interest and the first byte of each
value (``_scan``: the matches of one regular expression, found with a ``bytes.find`` per
key); JSON is parsed only for the rare events that need a value (usage, error): a
content chunk costs no ``json.loads``. Once a stream's content chunk came as one piece,
the next ones of the same shape (the same bytes around a plain text) are known for
content chunks without being classified (``SseSplitter._learn``): one read of a paced
stream costs a few byte comparisons here.

``SseSplitter`` is the one splitter: the observers take its events, the fault layer
also where each ends in the bytes it passes on. The module is compiled with mypyc
(``tracer/compiled.py``): it is written for that (offsets instead of copies, byte
values as ints, ``Final`` constants), and means the same in pure Python.
"""

from __future__ import annotations

import json
import re
from types import FunctionType
from typing import Any, Final

MAX_EVENT: Final = 1 << 20  # bytes of one unfinished event kept in memory
# a payload that is an error object (it begins with ``{``: matched where it begins)
_ERROR: Final = re.compile(rb'\{\s*"(?:error"\s*:|object"\s*:\s*"error")')
# Every key the classifier cares about, each with the first byte of its value: the
# matches of ``"(content|text|reasoning_content|tool_calls|finish_reason|usage)"\s*:\s*(.)``
# (re.S), as ``re.finditer`` finds them, found by ``_scan`` with one ``bytes.find`` per key
# (a content chunk costs under a microsecond); ``_KIND`` says what each key is.
_KEYS: Final[tuple[bytes, ...]] = (
    b'"content"',
    b'"text"',
    b'"reasoning_content"',
    b'"tool_calls"',
    b'"finish_reason"',
    b'"usage"',
)
_TEXT: Final = 0  # generated text: a string with at least one character
_TOOLS: Final = 1  # tool calls: a list of objects
_FINISH: Final = 2
_USAGE: Final = 3
_KIND: Final[tuple[int, ...]] = (_TEXT, _TEXT, _TEXT, _TOOLS, _FINISH, _USAGE)
_LIST_OF_OBJECTS: Final = re.compile(rb"\s*\{")


def _is_space(byte: int) -> bool:
    r"""``\s`` of a bytes pattern: ASCII whitespace."""
    return byte == 32 or 9 <= byte <= 13


def _value_at(buf: bytes, at: int, stop: int) -> int:
    r"""Where ``\s*:\s*(.)`` (re.S) matched at ``at`` in ``buf[:stop]`` finds the value's
    first byte; -1 when it does not match there."""
    while at < stop and _is_space(buf[at]):
        at += 1
    if at >= stop or buf[at] != 58:  # ":"
        return -1
    at += 1
    colon = at
    while at < stop and _is_space(buf[at]):
        at += 1
    if at < stop:
        return at
    return at - 1 if at > colon else -1  # (the last space is the value's byte)


def _scan(buf: bytes, start: int, stop: int) -> tuple[bool, str | None, bool]:
    """(has generated text or a tool call, finish_reason, has a usage object) of the
    payload ``buf[start:stop]``."""
    hits: list[tuple[int, int, int]] = []  # (where the key starts, its kind, its value)
    for index in range(6):
        key = _KEYS[index]
        at = buf.find(key, start, stop)
        while at >= 0:
            value = _value_at(buf, at + len(key), stop)
            if value >= 0:
                hits.append((at, _KIND[index], value))
            at = buf.find(key, at + 1, stop)
    content = usage = False
    reason: str | None = None
    if not hits:
        return content, reason, usage
    if len(hits) > 1:
        hits.sort()
    after = start  # the end of the last match: matches do not overlap
    for at, kind, value in hits:
        if at < after:
            continue
        first = buf[value]
        end = after = value + 1
        if kind == _TEXT:
            if first == 34 and end < stop and buf[end] != 34:  # '"', then not '"'
                content = True
        elif kind == _FINISH:
            if first == 34:
                close = buf.find(b'"', end, stop)
                if close >= 0:
                    reason = buf[end:close].decode("utf-8", "replace")
        elif kind == _USAGE:
            usage = usage or first == 123  # "{"
        elif first == 91 and _LIST_OF_OBJECTS.match(buf, end, stop):  # "[" of tool calls
            content = True
    return content, reason, usage


class SseEvent:
    """One event: its size (line ends counted as one LF, its blank line included), its
    ``kind`` (role | content | finish | usage | error | done | comment | other) and what
    the observers count. Compared and shown as a dataclass would be (a plain class: a
    dataclass's ``__init__`` would not be compiled)."""

    __slots__ = ("content", "error", "finish_reason", "kind", "size", "usage")

    def __init__(
        self,
        size: int,
        kind: str,
        content: bool = False,
        finish_reason: str | None = None,
        usage: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        self.size = size
        self.kind = kind
        self.content = content
        self.finish_reason = finish_reason
        self.usage = usage
        self.error = error

    def _fields(self) -> tuple[int, str, bool, str | None, dict[str, Any] | None, str | None]:
        return self.size, self.kind, self.content, self.finish_reason, self.usage, self.error

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SseEvent):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # (mutable, compared by value)

    def __repr__(self) -> str:
        return (
            f"SseEvent(size={self.size!r}, kind={self.kind!r}, content={self.content!r}, "
            f"finish_reason={self.finish_reason!r}, usage={self.usage!r}, error={self.error!r})"
        )

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

    __slots__ = ("_buf", "_held", "_more", "_prefix", "_skipped", "_suffix")

    def __init__(self) -> None:
        self._buf = b""  # the event in progress (its line ends as they came, or as LF)
        # pieces of it that ended nothing, kept apart until one may: joined then, once,
        # so that a large event read in small pieces costs its size, not its size squared
        self._more: list[bytes] = []
        self._held = 0  # its size, line ends counted as one
        self._skipped = 0  # bytes dropped from an event over MAX_EVENT (line ends as one)
        # the shape of the stream's plain content chunks, once one is seen (``_plain``)
        self._prefix = self._suffix = b""

    @property
    def pending(self) -> int:
        return self._held + self._skipped

    def feed(self, data: bytes, ends: list[int] | None = None) -> list[SseEvent]:
        """The events ``data`` completes; ``ends``, when given, gets where each ends."""
        if self.whole_content(data):  # (nothing held: then nothing skipped either)
            if ends is not None:
                ends.append(len(data))
            return [SseEvent(len(data), "content", True)]
        if self._buf and self._ends_nothing(data):
            self._more.append(data)
            self._held += len(data)
            return []
        if self._more:
            self._buf = b"".join([self._buf, *self._more])
            self._more.clear()
        prev = len(self._buf)
        buf = self._buf + data if prev else data
        if 13 in buf:  # a CR (an int: a bytes operand would cost an exception here)
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
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            if self._skipped:
                events.append(SseEvent(size=self._skipped + end - start + 2, kind="other"))
                self._skipped = 0
            elif end > start:
                events.append(_classify(buf, start, end))
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
        if not prev and len(events) == 1 and events[0].kind == "content" and buf is data:
            self._learn(data, events[0])
        return events

    def _ends_nothing(self, data: bytes) -> bool:
        """Whether ``data``, after the held bytes, surely completes no event and keeps the
        event within ``MAX_EVENT``: no CR, no blank line in it nor across the seam."""
        if 13 in data or b"\n\n" in data or self._held + len(data) > MAX_EVENT:
            return False
        last = (self._more[-1] if self._more else self._buf)[-1:]
        # a held CR ends a line whatever follows; a held LF, with a LF first, a blank one
        return last != b"\r" and not (last == b"\n" and data[:1] == b"\n")

    def whole_content(self, data: bytes) -> bool:
        """Whether ``feed(data)`` would give exactly one plain content event, of
        ``len(data)`` bytes, and hold nothing: ``data`` is one such event of the stream's
        shape, with nothing held before it (the caller then need not build the event)."""
        return not self._buf and self._plain(data)

    def _plain(self, data: bytes) -> bool:
        """Whether ``data`` is one plain content chunk of the stream's shape (``_learn``)."""
        return fits_shape(data, self._prefix, self._suffix)

    def _learn(self, event: bytes, sse: SseEvent) -> None:
        """Learn the shape of plain content chunks from ``event``, one whole event as one
        piece that ``_classify`` called ``content`` (``content_shape``)."""
        shape = content_shape(event)
        if shape is not None:
            self._prefix, self._suffix = shape

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


_USAGE_OBJECT: Final = re.compile(rb'"usage"\s*:\s*\{')  # (a chunk no shape is learned from)
_NOT_IN_TEXT: Final = re.compile(rb'["\r\n]')  # (of a plain content chunk's text)


def content_shape(event: bytes) -> tuple[bytes, bytes] | None:
    """The shape of plain content chunks learned from ``event``, one whole event (its
    blank line included) that ``classify`` called ``content``: the bytes up to the text of
    its ``"content":"`` (the prefix) and from the quote that ends it (the suffix); None
    when no shape may be learned from it. One rule for both shortcuts: the splitter's
    (``SseSplitter._learn``) and the mitmproxy addon's (``flow_sse.ContentShape``).

    Any event made of the prefix, a text without ``"``, CR or LF, and the suffix
    (``fits_shape``) is then that event, classified alike (``tests/unit/test_compiled.py``
    holds it to ``classify``): it is one data line, whose payload starts in the prefix (so
    do the ``[DONE]``, ``{`` and error checks); no key can start in the text (no quote),
    and none that starts in the prefix reaches into it (the prefix ends with the
    ``"content":"`` whose value the text is; the text is not empty and starts with no
    quote, so that key counts it as content); none can start at the closing quote (a
    ``,`` or ``}`` follows it), so the keys of the suffix are the same ones, found after
    the same matches. And no ``"usage"`` with an object for its value, whose JSON
    (parsed) the text could change (a text ending in a backslash keeps it from parsing in
    one chunk and not in the next); ``"usage":null`` (every chunk of most engines) is the
    same in every event of the shape, and gives no usage."""
    if (
        event.count(b"\n") != 2
        or not event.endswith(b"\n\n")
        or 13 in event  # (a CR: an int, as in ``feed``)
        or _USAGE_OBJECT.search(event) is not None
    ):
        return None
    start = event.find(b'"content":"') + 11
    end = event.find(b'"', start)
    if start < 11 or end <= start or event[end + 1 : end + 2] not in (b",", b"}"):
        return None
    return event[:start], event[end:]


# up to how long a text ``fits_shape`` reads byte by byte rather than by a regular
# expression: compiled, a byte costs about one instruction, and a search about 1,400
# (per read of the bench's 20-byte texts: 16.5k instructions with the search, 15.1k with
# the loop); in pure Python the loop pays a few bytecodes a byte. (A compiled function
# is not a Python function.)
_LOOP_MAX: Final = 8 if isinstance(content_shape, FunctionType) else 64


def fits_shape(data: bytes, prefix: bytes, suffix: bytes) -> bool:
    """Whether ``data`` is one plain content chunk of the shape (``content_shape``): the
    prefix, a text of at least a byte without ``"``, CR or LF, the suffix."""
    at = len(prefix)
    end = len(data) - len(suffix)
    if not (0 < at < end and data.startswith(prefix) and data.endswith(suffix)):
        return False
    if end - at > _LOOP_MAX:
        return _NOT_IN_TEXT.search(data, at, end) is None
    while at < end:  # a few tokens: byte by byte costs less than a search
        byte = data[at]
        if byte == 34 or byte == 13 or byte == 10:  # '"', CR, LF
            return False
        at += 1
    return True


# two line ends (CRLF, LF or CR; a CRLF is one), the blank line that ends an event: a
# CRLF, a LF or a CR not before a LF, then any line end (a leading literal: scans fast)
_BLANK: Final = re.compile(rb"\r\n(?>\r\n|\n|\r)|\n(?>\r\n|\n|\r)|\r(?!\n)(?>\r\n|\n|\r)")


def is_event_stream(content_type: bytes) -> bool:
    """Whether a ``Content-Type`` value says SSE."""
    return content_type.lower().startswith(b"text/event-stream")


def classify(block: bytes) -> SseEvent:
    """Classify one SSE event (its lines, without the terminating blank line)."""
    return _classify(block, 0, len(block))


def _classify(buf: bytes, start: int, stop: int) -> SseEvent:
    """``classify(buf[start:stop])``, without copying the event when it is one data line."""
    size = stop - start + 2
    if buf.startswith(b"data:", start, stop) and buf.find(b"\n", start, stop) < 0:
        at = start + 5
    else:
        data_lines = []
        for line in buf[start:stop].split(b"\n"):
            if line.startswith(b"data:"):
                data_lines.append(line[5:])
        if not data_lines:
            comment = buf[start:stop].lstrip(b"\n").startswith(b":")  # after an odd blank line
            return SseEvent(size=size, kind="comment" if comment else "other")
        buf = b"\n".join(data_lines)
        at, stop = 0, len(buf)
    if at < stop and buf[at] == 32:  # " "
        at += 1
    if buf.startswith(b"[DONE]", at, stop):
        return SseEvent(size=size, kind="done")
    if at >= stop or buf[at] != 123:  # "{"
        return SseEvent(size=size, kind="other")
    if _is_error(buf, at, stop):
        return SseEvent(size=size, kind="error", error=_error_message(buf[at:stop]))
    content, reason, usage = _scan(buf, at, stop)
    ev = SseEvent(size=size, kind="content" if content else "role", content=content)
    if reason is not None:
        ev.kind = "finish"
        ev.finish_reason = reason
    if usage:
        ev.usage = _usage(buf[at:stop])
        if ev.usage is not None and ev.kind == "role":
            ev.kind = "usage"
    return ev


def _is_error(buf: bytes, at: int, stop: int) -> bool:
    """Whether the payload ``buf[at:stop]`` (it begins with ``{``) is an error object:
    ``_ERROR``, after a look at the byte after the key's quote (most say no)."""
    key = at + 1
    while key < stop and _is_space(buf[key]):
        key += 1
    if key + 1 >= stop or buf[key] != 34 or buf[key + 1] not in (101, 111):  # '"', then e o
        return False
    return _ERROR.match(buf, at, stop) is not None


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
