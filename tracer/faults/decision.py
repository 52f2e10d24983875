"""Which faults a request gets: ``FaultPlan`` (the faults of one tap and their counters)
decides each request head, in arrival order, and returns a ``Decision``.

A module of its own so that ``connection.py`` (``ConnectionFaults`` asks the plan) and
``plan.py`` (the fault layer's face, which re-exports both) import it and not each other;
``plan.py`` says how the fault layer works.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from .kinds import Fault


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
