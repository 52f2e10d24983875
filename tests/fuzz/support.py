"""What the fuzz tests share: the input counter ``make fuzz`` reports, the budget of a
target (a share of the profile's ``max_examples``), a guard that turns a hang into a
failing example, and byte-level mutations of recorded files.

Allowed outcomes, for every target: a read, or the module's own documented error
(``CaptureError`` for a file named as a capture, ``PcapError`` for ``events_from_pcap``,
``HeadError``, ``FramingError``; the SSE splitter and the TCP reassembler have none: they
never raise). Anything else fails the example, and so does an example that runs past the
profile's deadline or spends more than ``CPU_LIMIT`` seconds of CPU (a hang)."""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from types import FrameType

from hypothesis import settings
from hypothesis import strategies as st

COUNTS: Counter[str] = Counter()  # inputs run per target, in this process
CPU_LIMIT = 10.0  # seconds of CPU one example may take before it is a hang


def ran(target: str) -> None:
    """One more input run against ``target`` (``make fuzz`` prints the counts)."""
    COUNTS[target] += 1


def budget(share: float) -> settings:
    """The settings of a test that takes ``share`` of the profile's ``max_examples``
    (the profile is loaded by the conftest before the test modules are imported)."""
    profile = settings.default
    assert profile is not None
    return settings(max_examples=max(1, round(profile.max_examples * share)))


class Hang(Exception):
    """An example that ran past ``CPU_LIMIT`` seconds of CPU."""


def _hang(signum: int, frame: FrameType | None) -> None:
    raise Hang(f"one example took more than {CPU_LIMIT} s of CPU")


@contextmanager
def no_hang(limit: float = CPU_LIMIT) -> Iterator[None]:
    """A hang in the block is a ``Hang`` raised in it (a CPU-time timer: SIGVTALRM, apart
    from the SIGALRM that pytest-timeout arms for the whole test)."""
    previous = signal.signal(signal.SIGVTALRM, _hang)
    signal.setitimer(signal.ITIMER_VIRTUAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


# ---- mutations ---------------------------------------------------------------------

_INTERESTING_BYTES = (0x00, 0x01, 0x0A, 0x0D, 0x20, 0x22, 0x7B, 0x7D, 0x7F, 0x80, 0xFF)
_INTERESTING_WORDS = (
    0,
    1,
    4,
    12,
    0x7F,
    0xFF,
    0xFFFF,
    0x7FFFFFFF,
    0x80000000,
    0xFFFFFFFF,
    0x0A0D0D0A,
    0x1A2B3C4D,
)


@st.composite
def mutated(draw: st.DrawFn, seeds: tuple[bytes, ...], most: int = 8) -> bytes:
    """One of ``seeds`` with 1 to ``most`` mutations: a bit flipped, a byte or a 32-bit
    word set to a value that matters to a parser (a length, a magic, a line end), bytes
    inserted, deleted, duplicated or moved, the file cut short."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, most))):
        n = len(data)
        at = draw(st.integers(0, n))
        op = draw(st.integers(0, 7))
        if op == 0 and n:  # flip a bit
            at = min(at, n - 1)
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == 1 and n:  # an interesting byte
            data[min(at, n - 1)] = draw(st.sampled_from(_INTERESTING_BYTES))
        elif op == 2:  # an interesting word, either byte order
            word = draw(st.sampled_from(_INTERESTING_WORDS))
            data[at : at + 4] = word.to_bytes(4, draw(st.sampled_from(("little", "big"))))
        elif op == 3:  # bytes inserted
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == 4:  # a stretch deleted
            del data[at : at + draw(st.integers(1, 64))]
        elif op == 5:  # a stretch duplicated in place
            data[at:at] = data[at : at + draw(st.integers(1, 256))]
        elif op == 6:  # a stretch copied over another place
            src = draw(st.integers(0, n))
            piece = data[src : src + draw(st.integers(1, 64))]
            data[at : at + len(piece)] = piece
        elif op == 7:  # cut short
            del data[at:]
    return bytes(data)


@st.composite
def cut_up(draw: st.DrawFn, data: st.SearchStrategy[bytes], most: int = 12) -> list[bytes]:
    """Bytes from ``data`` cut into reads at up to ``most`` random places (the reads may
    be empty: a read of nothing must change nothing)."""
    whole = draw(data)
    points = sorted(draw(st.lists(st.integers(0, len(whole)), max_size=most)))
    edges = [0, *points, len(whole)]
    return [whole[a:b] for a, b in pairwise(edges)]
