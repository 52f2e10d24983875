"""How the mitmproxy capture process reads a stream's SSE from mitmproxy's body pieces:
``ContentShape`` (a shortcut past ``sse.classify`` for an engine's plain content chunks),
``SseObserver`` (the splitter, per flow) and ``batch_sse`` (a batch's entries and counts,
when it is written)."""

from __future__ import annotations

import logging
from itertools import repeat
from typing import Any

from ..protocol.sse import SseEvent, SseSplitter, classify, content_shape, fits_shape
from .exchange_state import ResponseState, count_sse

log = logging.getLogger("tracer.observe.flows")


class ContentShape:
    """The shape of a stream's plain content chunks: a shortcut past ``sse.classify``.

    An engine writes its content chunks alike: the same bytes before the generated
    text (``data: {"id":"…",…"delta":{"content":"``) and after it (``"},…}`` and the
    blank line). Once ``sse.classify`` has called one such one-line event a plain
    ``content`` chunk (no finish_reason, usage or error), any event made of the same
    prefix, a non-empty text without ``"``, CR or LF, and the same suffix gets the same
    answer from it: the classifier's patterns all begin with a ``"``, so none can start
    inside the text, and the suffix (which must go on with ``,`` or ``}`` after the
    closing quote) cannot complete one that began before. ``SseObserver`` checks that in
    a few byte comparisons per piece, or for a run of pieces at once.
    """

    __slots__ = ("prefix", "prefix_len", "quotes", "suffix", "suffix_len")

    def __init__(self) -> None:
        self.prefix = self.suffix = b""
        self.prefix_len = self.suffix_len = self.quotes = 0

    def learn(self, event: bytes, sse: SseEvent) -> None:
        """``event``: one whole event (its blank line included), ``sse``: its class."""
        shape = content_shape(event) if sse.kind == "content" else None
        if shape is None:
            return
        # the event's only LFs are its last two bytes (it ends with its blank line): the
        # suffix holds both, and neither part holds a CR
        self.prefix, self.suffix = shape
        self.prefix_len, self.suffix_len = len(self.prefix), len(self.suffix)
        self.quotes = self.prefix.count(b'"') + self.suffix.count(b'"')

    def fits(self, piece: bytes) -> bool:
        """Whether ``piece`` is one plain content chunk of this shape."""
        return fits_shape(piece, self.prefix, self.suffix)

    def all_fit(self, pieces: list[bytes]) -> bool:
        """``fits`` for every piece, at C speed: each piece begins with the prefix, ends
        with the suffix and is longer than both, so the quotes and LFs of the joined
        pieces are the prefixes' and suffixes' exactly when no text holds one."""
        n = len(pieces)
        if not self.prefix_len or min(map(len, pieces)) <= self.prefix_len + self.suffix_len:
            return False
        if not all(map(bytes.startswith, pieces, repeat(self.prefix))):
            return False
        if not all(map(bytes.endswith, pieces, repeat(self.suffix))):
            return False
        joined = b"".join(pieces)
        return (
            joined.count(b'"') == n * self.quotes
            and joined.count(b"\n") == 2 * n
            and joined.find(b"\r") < 0
        )


class SseObserver:
    """The SSE events of a response, a batch of pieces at a time: ``sse.SseSplitter`` with
    shortcuts.

    ``batch`` gives the events of the pieces that are not plain content chunks of the
    connection's ``ContentShape`` (by index; each of the others is one ``content`` event
    with no finish_reason, usage or error), the same as ``SseSplitter.feed`` piece by
    piece would: a piece that is one whole event (an event per chunk: the usual) is
    classified alone and may teach the shape; anything else goes through the splitter.
    While the splitter holds the beginning of an event (``held``), every piece must go to
    it. The pieces between the first and the last plain chunk of a batch are tested
    together (``ContentShape.all_fit``): an engine's specials (role, finish, usage,
    ``[DONE]``) come first and last. ``tests/unit/test_addon_trace.py`` checks ``batch``
    against the splitter.
    """

    __slots__ = ("held", "shape", "splitter")

    def __init__(self, shape: ContentShape) -> None:
        self.splitter = SseSplitter()
        self.shape = shape
        self.held = False  # the splitter holds the beginning of an event

    @property
    def pending(self) -> int:
        return self.splitter.pending

    def batch(self, pieces: list[bytes]) -> list[tuple[int, list[SseEvent]]]:
        """The events of the pieces that are not plain content chunks, by index."""
        specials: list[tuple[int, list[SseEvent]]] = []
        shape, n, i = self.shape, len(pieces), 0
        while i < n and (self.held or not shape.fits(pieces[i])):
            specials.append((i, self.feed(pieces[i])))
            i += 1
        last = n
        while last > i and not shape.fits(pieces[last - 1]):
            last -= 1
        if last - i > 2 and shape.all_fit(pieces[i:last]):
            i = last  # nothing held: plain chunks leave the splitter alone
        for j in range(i, n):
            piece = pieces[j]
            if self.held or not shape.fits(piece):
                specials.append((j, self.feed(piece)))
        return specials

    def feed(self, piece: bytes) -> list[SseEvent]:
        if self.held:
            found = self.splitter.feed(piece)
            self.held = self.splitter.pending > 0
            return found
        if len(piece) > 2 and piece.find(b"\n\n") == len(piece) - 2 and b"\r" not in piece:
            sse = classify(piece[:-2])
            self.shape.learn(piece, sse)
            return [sse]
        found = self.splitter.feed(piece)
        self.held = self.splitter.pending > 0
        return found


def batch_sse(st: ResponseState[SseObserver], dts: list[float]) -> list[Any] | None:
    """The ``sse`` entries of the batch of pieces ``st`` keeps (``dts``: their offsets
    from the first), its events counted; None when it is not SSE."""
    pieces, sse = st.kept, st.sse
    if sse is None or not pieces:
        return None
    try:
        specials = sse.batch(pieces)
    except Exception:
        specials = [(i, []) for i in range(len(pieces))]
        log.exception("tracer: observing a response body failed")
    times = st.times
    events, plain = _entries(st, dts, st.sizes, specials, times)
    st.events += len(times) - len(specials)
    if plain >= 0 and (st.first_token_m is None or times[plain] < st.first_token_m):
        st.first_token_m = times[plain]
    return events or None


def _entries(
    st: ResponseState[SseObserver],
    dts: list[float],
    sizes: list[int],
    specials: list[tuple[int, list[SseEvent]]],
    times: list[float],
) -> tuple[list[Any], int]:
    """The batch's ``sse`` entries, and the index of its first plain content chunk.

    Pieces between the specials are plain content chunks, one ``content`` event
    each: they are zipped in runs (C speed); only the specials are looked at.
    """
    if not specials:
        return list(zip(dts, sizes, repeat("content"))), 0
    events: list[Any] = []
    plain = -1
    start = 0
    for i, found in specials:
        if i > start:
            events += zip(dts[start:i], sizes[start:i], repeat("content"))
            if plain < 0:
                plain = start
        dt = dts[i]
        for sse in found:
            events.append([dt, *sse.as_record()])
            count_sse(st, sse, times[i])
        start = i + 1
    if start < len(dts):
        events += zip(dts[start:], sizes[start:], repeat("content"))
        if plain < 0:
            plain = start
    return events, plain
