"""A response as the fault layer's stages see it: its raw bytes cut into segments, each
saying what it is and what ends at its end (a head, a chunk's data or CRLF, an SSE event,
the response).

``BodySegments`` cuts one body where ``protocol.framing.BodyDecoder`` finds its framing
and, when a fault needs them, where ``SseEvents`` finds its events end. Joined, the
segments are the bytes as they came.
"""

from __future__ import annotations

from typing import Literal

from ..protocol.framing import BodyDecoder, Framing, Part
from ..protocol.sse import SseSplitter
from .actions import Cut, Hold, Injected

SegKind = Literal["head", "size", "data", "crlf", "end"]
HEAD: SegKind = "head"
SIZE: SegKind = "size"  # a chunk-size line
DATA: SegKind = "data"
CRLF: SegKind = "crlf"  # after a chunk's data
END: SegKind = "end"  # the last chunk's line and the trailers


class Seg:
    """Raw bytes of one response, with what they are and what ends at their end."""

    __slots__ = ("chunk_end", "event", "head_end", "kind", "last", "raw")

    def __init__(
        self, raw: bytes, kind: SegKind, *, event: str | None = None, chunk_end: bool = False
    ) -> None:
        self.raw = raw
        self.kind = kind  # head | size (chunk-size line) | data | crlf (after data) | end
        self.event = event  # an SSE event of this kind ends here
        self.chunk_end = chunk_end  # data: the chunk's data ends here; crlf: its CRLF does
        self.head_end = False  # the final (non-1xx) head ends here
        self.last = False  # the response ends here


Item = Seg | Hold | Cut | Injected  # what the stages take and give


class SseEvents:
    """Where Server-Sent Events end in a body fed piece by piece, and their kinds:
    ``sse.SseSplitter`` (the observer's), for code that cuts bytes at event ends.

    ``feed`` returns, for each event completed, its end as an offset into the piece and
    its kind as ``sse.classify`` says (``comment`` for heartbeats, ``done`` for
    ``[DONE]`` ...).
    """

    __slots__ = ("_splitter",)

    def __init__(self) -> None:
        self._splitter = SseSplitter()

    def feed(self, piece: bytes) -> list[tuple[int, str]]:
        ends: list[int] = []
        events = self._splitter.feed(piece, ends)
        return [(end, event.kind) for end, event in zip(ends, events, strict=True)]


class BodySegments:
    """One body's bytes as segments, with chunk and (when ``events`` is given) event ends."""

    __slots__ = ("decoder", "events")

    def __init__(self, framing: Framing, length: int, events: SseEvents | None) -> None:
        self.decoder = BodyDecoder(framing, length)
        self.events = events

    @property
    def done(self) -> bool:
        return self.decoder.done

    def walk(self, data: bytes, pos: int, segs: list[Seg]) -> int:
        """Segments for ``data[pos:]`` up to the body's end; returns the position after.
        Raises ``FramingError``."""
        parts: list[Part] = []
        end = self.decoder.walk(data, pos, parts)
        start = pos
        events = self.events
        for stop, kind, ends_chunk in parts:
            if kind == "data" and events is not None:
                self._events(data[start:stop], ends_chunk, events, segs)
            else:
                segs.append(Seg(data[start:stop], kind, chunk_end=ends_chunk))
            start = stop
        if parts and self.decoder.done:
            segs[-1].last = True
        return end

    def skip(self, data: bytes, pos: int) -> int:
        """``walk`` for a body no fault applies to: only where it ends (``data``'s end if
        not there)."""
        return self.decoder.walk(data, pos)

    @staticmethod
    def _events(raw: bytes, chunk_end: bool, events: SseEvents, segs: list[Seg]) -> None:
        """Body bytes cut where events end."""
        start = 0
        for end, kind in events.feed(raw):
            segs.append(Seg(raw[start:end], DATA, event=kind))
            start = end
        if start < len(raw):
            segs.append(Seg(raw[start:], DATA))
        if segs and segs[-1].kind == DATA:
            segs[-1].chunk_end = chunk_end
