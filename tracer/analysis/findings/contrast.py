"""What the failed requests share, against the ones that completed (issue 35).

A rule that fires on a pattern ("a reused connection hung") must first ask whether that
pattern is what tells the failures from the requests that went well. For the requests a
finding concerns, each request feature — reused or fresh, idle gap before it, position
on its connection, the connection's age, body bytes, prompt characters, prompt tokens
(where the engine reported them), ``stream``, ``max_tokens``, model, client connection —
is compared with the same feature of the requests to the same paths that completed at
the same tap over the analysed time range. A feature *separates* them when no completed
request falls in the failed requests' range (numbers) or shares a value with them
(the rest); ``reused`` separates them one way: every failed request was on a reused
connection and no request on a fresh one got nothing back.

One pass over the rows answers every finding at once (``contrast_all``): per tap, the
range of each number and the values of each of the rest over the completed requests
(values counted up to ``MAX_VALUES`` distinct, connections only those the failed
requests were on).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ...wording import counted
from ..rows import RequestRow
from .model import EvidenceItem
from .signs import silent_failure

MAX_VALUES = 64  # distinct values of a feature kept per tap; past it, it is not told
MIN_FAILED = 2  # failed requests needed before a feature can be said to separate them
MAX_QUOTED = 6  # separating features quoted in a finding's evidence


def _round(n: float, step: float, way: int) -> float:
    """``n`` to a multiple of ``step``: down (way -1: a lower bound that holds), up (1)."""
    nudge = 1e-9 if way < 0 else -1e-9
    return float((math.floor if way < 0 else math.ceil)(n / step + nudge)) * step


def _apart(lo: float, hi: float, steps: tuple[float, ...]) -> float:
    """The coarsest step at which ``lo`` rounded down still lies above ``hi`` rounded up
    (the bounds a sentence can say and the figures bear out); the finest one else."""
    for step in steps:
        if _round(lo, step, -1) > _round(hi, step, 1):
            return step
    return steps[-1]


def _kib(lo: float, hi: float) -> tuple[str, str]:
    step = _apart(lo, hi, (1000.0, 100.0, 1.0))
    if step == 1.0 or hi < 10_000:
        return f"{lo:.0f} B", f"{hi:.0f} B"
    digits = 0 if step == 1000.0 else 1
    return (
        f"{_round(lo, step, -1) / 1000:.{digits}f} KB",
        f"{_round(hi, step, 1) / 1000:.{digits}f} KB",
    )


def _secs(lo: float, hi: float) -> tuple[str, str]:
    step = _apart(lo, hi, (0.01, 0.001, 0.000001))
    digits = {0.01: 2, 0.001: 3}.get(step, 6)
    return f"{_round(lo, step, -1):.{digits}f} s", f"{_round(hi, step, 1):.{digits}f} s"


def _whole(word: str) -> Callable[[float, float], tuple[str, str]]:
    def say(lo: float, hi: float) -> tuple[str, str]:
        return f"{lo:.0f}{word}", f"{hi:.0f}{word}"

    return say


@dataclass(frozen=True, slots=True)
class Number:
    """A numeric feature: its name, what it is in words, how a value is written."""

    name: str
    words: str
    # the lower and the higher bound in words, rounded away from each other
    unit: Callable[[float, float], tuple[str, str]]


NUMBERS = (
    Number("request_bytes", "request bodies of", _kib),
    Number("prompt_chars", "prompts of", _whole(" characters")),
    Number("prompt_tokens", "prompts of", _whole(" tokens")),
    Number("max_tokens", "max_tokens", _whole("")),
    Number("idle_before", "an idle gap before them of", _secs),
    Number("seq", "a position on their connection of", _whole("")),
    Number("conn_age", "a connection age of", _secs),
)
VALUES = ("stream", "model", "connection")  # (the target: compared only within, below)


def _number(r: RequestRow, name: str, age: float) -> float | None:
    if name == "conn_age":
        return age
    if name == "prompt_tokens":
        usage = r.usage or {}
        tokens = usage.get("prompt_tokens")
        return float(tokens) if isinstance(tokens, int | float) else None
    if name == "idle_before":
        return r.idle_before if r.reused else None
    value = getattr(r, name)
    return float(value) if isinstance(value, int | float) and value is not None else None


def _value(r: RequestRow, name: str) -> Any:
    if name == "connection":
        return f"{r.tap}/{r.conn}"
    return getattr(r, name)


@dataclass(slots=True)
class _Completed:
    """One tap's completed requests, by feature: ranges and values."""

    count: int = 0
    fresh_failed: int = 0  # requests on fresh connections that got nothing back
    lo: dict[str, float] = field(default_factory=dict)
    hi: dict[str, float] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # how many had it
    values: dict[str, set[Any]] = field(default_factory=lambda: defaultdict(set))
    overflow: set[str] = field(default_factory=set)  # features with too many values
    # other requests on each of the failed requests' connections
    others_on_conns: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, r: RequestRow, age: float, conns: set[str]) -> None:
        self.count += 1
        for f in NUMBERS:
            v = _number(r, f.name, age)
            if v is None:
                continue
            self.seen[f.name] += 1
            self.lo[f.name] = min(self.lo.get(f.name, v), v)
            self.hi[f.name] = max(self.hi.get(f.name, v), v)
        for name in VALUES:
            v = _value(r, name)
            if v is None:
                continue  # a feature it does not have is no value to share
            if name == "connection" and v not in conns:
                continue  # only whether the failed requests' connections had completions
            kept = self.values[name]
            if v in kept or name in self.overflow:
                continue
            if len(kept) >= MAX_VALUES:
                self.overflow.add(name)
            else:
                kept.add(v)


@dataclass(slots=True, kw_only=True)
class Separation:
    """One feature against the completed requests: what the failed had, what the completed
    had, and whether it separates them."""

    feature: str
    separates: bool
    text: str
    figures: dict[str, Any]


@dataclass(slots=True, kw_only=True)
class Contrast:
    """What the failed requests of one finding share against the completed ones of their
    tap: every feature told (``told``), those that separate them (``separating``), and
    whether reuse is what separates them (``reuse_separates``)."""

    tap: str
    what: str  # how the failed requests failed, in a word: "hung", "failed"
    failed: int
    completed: int
    reused_failed: int
    fresh_failed: int  # of the finding's requests, those on fresh connections
    fresh_failed_at_tap: int  # requests on fresh connections at the tap that got nothing back
    told: list[Separation]
    cut_short: int = 0  # fresh members the capture's end cut before they could be hangs

    @property
    def separating(self) -> list[Separation]:
        return [s for s in self.told if s.separates]

    @property
    def reuse_separates(self) -> bool:
        """Every failed request was on a reused connection, and none on a fresh one at the
        tap failed (``fresh_failed_at_tap``, counted over all failures, not just these)."""
        return (
            self.reused_failed > 0
            and self.reused_failed + self.cut_short == self.failed
            and self.fresh_failed_at_tap == 0
        )

    def item(self) -> EvidenceItem:
        """The separating features quoted, with reuse always told (it is the one a team
        would act on), as one evidence item."""
        what = self.what
        parts = [s.text for s in self.separating if s.feature != "reused"][:MAX_QUOTED]
        reuse = (
            f"all {self.failed} {what} on reused connections and none on a fresh one got "
            "nothing back"
            if self.reuse_separates
            else f"{self.reused_failed} of {self.failed} {what} on reused connections, "
            f"{self.fresh_failed} on fresh ones"
            + (
                f"; {counted(self.fresh_failed_at_tap, 'request')} on fresh connections got "
                "nothing back"
                if self.fresh_failed_at_tap
                else ""
            )
        )
        if self.failed == 1:
            reuse = (
                "it was on a reused connection and no request on a fresh one got nothing back"
                if self.reuse_separates
                else "it was on a fresh connection"
                if self.fresh_failed
                else "it was on a reused connection, and requests on fresh ones got nothing "
                "back too"
            )
        head = (
            f"what the {what} request has"
            if self.failed == 1
            else f"what the {self.failed} {what} requests share"
        ) + f" against the {counted(self.completed, 'completed request')} at tap {self.tap}: "
        none = (
            "; no feature separates them"
            if self.failed >= MIN_FAILED
            else "; one request is too few to say what separates it"
        )
        body = "; ".join([*parts, reuse]) if parts else reuse + none
        figures: dict[str, Any] = {
            "failed": self.failed,
            "completed": self.completed,
            "reused_failed": self.reused_failed,
            "fresh_failed": self.fresh_failed,
            "reuse_separates": self.reuse_separates,
            "separating": [s.feature for s in self.separating],
        }
        for s in self.separating[: MAX_QUOTED + 1]:
            figures[s.feature] = s.figures
        return EvidenceItem(text=head + body, tap=self.tap, figures=figures)


def _separate_number(
    f: Number, failed: list[float], done: _Completed, what: str
) -> Separation | None:
    if len(failed) < MIN_FAILED or done.seen.get(f.name, 0) < 2:
        return None  # one request is extreme in something by chance
    flo, fhi = min(failed), max(failed)
    clo, chi = done.lo[f.name], done.hi[f.name]
    n, m = len(failed), done.seen[f.name]
    figures = {"failed": [flo, fhi], "completed": [clo, chi]}
    # the bounds said are ones the figures bear out (rounded away from each other)
    if flo > chi:
        low, high = f.unit(flo, chi)
        text = f"all {n} {what} had {f.words} ≥ {low}; all {m} completed ≤ {high}"
        return Separation(feature=f.name, separates=True, text=text, figures=figures)
    if fhi < clo:
        low, high = f.unit(clo, fhi)
        text = f"all {n} {what} had {f.words} ≤ {high}; all {m} completed ≥ {low}"
        return Separation(feature=f.name, separates=True, text=text, figures=figures)
    return Separation(feature=f.name, separates=False, text="", figures=figures)


def _separate_value(name: str, failed: list[Any], done: _Completed, what: str) -> Separation | None:
    if len(failed) < MIN_FAILED or name in done.overflow:
        return None
    mine = set(failed)
    theirs = done.values.get(name, set())
    figures = {"failed": sorted(map(str, mine)), "completed_share": bool(mine & theirs)}
    if name == "connection":
        if not any(done.others_on_conns[c] for c in mine):
            return None  # connections that carried nothing else say nothing
        separates = not (mine & theirs)
        text = (
            f"no request completed on the {counted(len(mine), 'connection')} they were on"
            if separates
            else ""
        )
        return Separation(feature=name, separates=separates, text=text, figures=figures)
    if not theirs or done.count < 2:
        return None
    separates = not (mine & theirs)
    shown = ", ".join(sorted(map(str, mine)))
    words = {"stream": "stream", "model": "model", "target": "path"}[name]
    text = f"all {len(failed)} {what} had {words} {shown}, which no completed request had"
    return Separation(
        feature=name, separates=separates, text=text if separates else "", figures=figures
    )


def contrast_all(
    requests: Iterable[RequestRow], groups: list[list[RequestRow]], whats: list[str]
) -> list[Contrast | None]:
    """For each group of failed requests (all at one tap), its ``Contrast`` against the
    completed requests of that tap; None for an empty group, or where none completed. One pass over ``requests``
    (in table order: a connection's requests are consecutive, so its age is read from
    its first request's start)."""
    taps = {g[0].tap for g in groups if g}
    failed_ids = {r.id for g in groups for r in g}
    conns: dict[str, set[str]] = defaultdict(set)
    targets: dict[str, set[str]] = defaultdict(set)
    for g in groups:
        for r in g:
            conns[r.tap].add(f"{r.tap}/{r.conn}")
            targets[r.tap].add(r.target)
    done: dict[str, _Completed] = defaultdict(_Completed)
    ages: dict[str, float] = {}
    first: tuple[str, int, float] | None = None
    for r in requests:
        if r.tap not in taps or not r.method:
            continue
        if first is None or (first[0], first[1]) != (r.tap, r.conn) or r.seq == 1:
            first = (r.tap, r.conn, r.start)
        age = max(0.0, r.start - first[2])
        if r.id in failed_ids:
            ages[r.id] = age
            continue
        if f"{r.tap}/{r.conn}" in conns[r.tap]:
            done[r.tap].others_on_conns[f"{r.tap}/{r.conn}"] += 1
        if r.target not in targets[r.tap]:
            continue  # compared only with requests to what the failed ones asked for
        if r.termination == "complete" and (r.status is None or r.status < 400):
            done[r.tap].add(r, age, conns[r.tap])
        elif not r.reused and silent_failure(r):
            done[r.tap].fresh_failed += 1
    out: list[Contrast | None] = []
    for g, what in zip(groups, whats, strict=True):
        if not g:
            out.append(None)
            continue
        tap = g[0].tap
        completed = done[tap]
        if not completed.count:
            out.append(None)  # nothing completed there to tell them from
            continue
        told: list[Separation] = []
        for f in NUMBERS:
            values = [v for r in g if (v := _number(r, f.name, ages.get(r.id, 0.0))) is not None]
            s = _separate_number(f, values, completed, what)
            if s is not None:
                told.append(s)
        for name in VALUES:
            values = [v for r in g if (v := _value(r, name)) is not None]
            s = _separate_value(name, values, completed, what)
            if s is not None:
                told.append(s)
        reused = sum(1 for r in g if r.reused)
        silent_fresh = sum(1 for r in g if not r.reused and silent_failure(r))
        # a member the capture's end cut a moment after it was sent proves nothing either way
        cut_short = sum(1 for r in g if not r.reused and not silent_failure(r))
        out.append(
            Contrast(
                tap=tap,
                what=what,
                failed=len(g),
                completed=completed.count,
                reused_failed=reused,
                fresh_failed=len(g) - reused,
                fresh_failed_at_tap=completed.fresh_failed + silent_fresh,
                cut_short=cut_short,
                told=told,
            )
        )
    return out
