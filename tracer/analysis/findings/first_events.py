"""First events held behind a response head: the statistics the join and the delivery
analyzer share (per tap pair, and per tap on fresh against reused connections).

Apart from the join because they are about one symptom (a hop without TCP_NODELAY that
holds the first event until the head's ACK), not about joining requests across taps.
"""

from __future__ import annotations

# A hop that writes a response's head and its first event separately without TCP_NODELAY
# holds the event until the head's ACK, which the next host delays (Linux: 40 ms and up,
# at most 200 ms): the first event comes that long after the head at the taps in front
# of the hop, at once (within FIRST_EVENT_PROMPT) at the taps behind it.
FIRST_EVENT_HELD = (0.030, 0.220)
FIRST_EVENT_PROMPT = 0.010


class Holds:
    """First events one tap got late and another at once: how many, how late (the first
    ``SAMPLE``), and the first few (their positions at the two taps)."""

    SAMPLE = 1024

    def __init__(self) -> None:
        self.count = 0
        self.delays: list[float] = []
        self.examples: list[tuple[int, int]] = []

    def add(self, delay: float, positions: tuple[int, int]) -> None:
        self.count += 1
        if len(self.delays) < self.SAMPLE:
            self.delays.append(delay)
        if len(self.examples) < 3:
            self.examples.append(positions)


class FreshReused:
    """One tap's streams by how soon their first event came after the response head: on
    fresh connections at once (within ``FIRST_EVENT_PROMPT``) or not, on reused ones
    within ``FIRST_EVENT_HELD`` or not; the held ones' waits (the first ``SAMPLE``) and
    the first few of each kind (positions)."""

    SAMPLE = 1024

    def __init__(self) -> None:
        self.fresh = self.fresh_prompt = self.reused = self.reused_held = 0
        self.waits: list[float] = []
        self.examples: dict[bool, list[int]] = {False: [], True: []}  # reused -> positions

    def add(self, reused: bool, wait: float, pos: int) -> None:
        if reused:
            self.reused += 1
            fits = FIRST_EVENT_HELD[0] <= wait <= FIRST_EVENT_HELD[1]
            self.reused_held += fits
            if fits and len(self.waits) < self.SAMPLE:
                self.waits.append(wait)
        else:
            self.fresh += 1
            fits = wait <= FIRST_EVENT_PROMPT
            self.fresh_prompt += fits
        if fits and len(self.examples[reused]) < 2:
            self.examples[reused].append(pos)

    @property
    def pattern(self) -> bool:
        """Most streams on reused connections held, most on fresh ones not: the hold
        depends on the connection, not on the engine's first token."""
        return (
            self.reused_held >= 3
            and self.reused_held * 2 >= self.reused
            and self.fresh_prompt >= 1
            and self.fresh_prompt * 2 >= self.fresh
        )
