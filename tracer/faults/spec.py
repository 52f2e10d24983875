"""The one spelling of a fault spec, for every place that takes one (``docs/faults.md``).

``tracer proxy --fault``, the mitmproxy addon (``tracer_faults``), the admin API's
``/faults``, ``tracer sim engine --fault`` and the sim engine's ``x-sim-fault`` header all
read ``NAME[:ARG...][@RULE,...]``:

* ``NAME``: the fault; each side has its own (``faults.KINDS`` for the tap,
  ``sim.engine.FAULT_KINDS`` for the engine).
* ``ARG``: ``VALUE`` or ``KEY=VALUE``, joined by ``:``. The tap's faults take theirs
  positionally (``stall-after-events:5:10``); the engine's are named and may be given
  either way (``stall:after=3:for=10`` = ``stall:3:10``).
* ``RULE``: which requests the fault applies to, ``KEY=VALUE`` (or a bare ``KEY``), joined
  by ``,``; every one given must hold. ``RULES`` says which side takes which rule and
  what it means there; a rule the other side takes is refused with a message saying so.

This module splits a spec and checks what is common to both sides (the name, the rule
keys, the values of the counter rules, a rule written among the arguments); each side
builds its own fault from the ``Spec``. Every error is a ``FaultSpecError``, one line,
what is wrong first, then the spec (``in 'SPEC'``), then a hint.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Side = Literal["proxy", "engine"]

SIDES: dict[Side, str] = {
    "proxy": "tracer proxy --fault",  # and the mitmproxy addon, and the admin API
    "engine": "tracer sim engine --fault",
}
_WHO: dict[Side, str] = {"proxy": "the tap", "engine": "the sim engine"}
_RULES_HERE: dict[Side, str] = {
    "proxy": "the tap's rules",
    "engine": "the engine's rules, on its completion counter",
}


class FaultSpecError(ValueError):
    """A fault spec that does not parse; the message says what is wrong and how to write it."""


@dataclass(frozen=True, slots=True)
class RuleDoc:
    """One rule key: what it means on each side that takes it."""

    proxy: str | None
    engine: str | None

    def on(self, side: Side) -> str | None:
        return self.proxy if side == "proxy" else self.engine


RULES: dict[str, RuleDoc] = {
    "path": RuleDoc(
        "path=PREFIX or path=GLOB (*, ?, [..]; * also matches /): the request path", None
    ),
    "method": RuleDoc("method=POST: the request method", None),
    "header": RuleDoc(
        "header=NAME or header=NAME:GLOB: the request carries that header (with a "
        "value the glob matches; no commas in it)",
        None,
    ),
    "pos": RuleDoc("pos=N or pos=N+: the N-th request on its connection (N+: N and later)", None),
    "reuse": RuleDoc(
        "reuse: any keep-alive reuse (pos >= 2); reuse=N: the same as pos=N, N >= 2", None
    ),
    "every": RuleDoc(
        "every=N: every N-th request the other conditions match (N, 2N, ...)",
        "every=N: completions N, 2N, ... on the engine's counter",
    ),
    "nth": RuleDoc(None, "nth=K: completion K only"),
    "from": RuleDoc(None, "from=K: completion K and later"),
    "prob": RuleDoc(
        "prob=P: with probability P (0..1), drawn from a generator seeded by seed",
        "prob=P: with probability P (0..1), drawn from a generator seeded by seed",
    ),
    "seed": RuleDoc(
        "seed=S: the seed of prob (default 0: the same draws every run)",
        "seed=S: the seed of prob (default 0: the same draws every run)",
    ),
    "times": RuleDoc("times=N: at most N injections", "times=N: at most N injections"),
}


def rule_keys(side: Side) -> dict[str, str]:
    """The rules ``side`` takes, each with its usage there, in ``RULES`` order."""
    return {key: text for key, doc in RULES.items() if (text := doc.on(side)) is not None}


@dataclass(frozen=True, slots=True)
class Spec:
    """A spec split: its name and arguments as written, its rules checked against a side."""

    text: str  # the spec, stripped: what a fault records as its spec
    name: str  # lower case, one of the side's names
    args: tuple[str, ...]  # stripped, as written
    rules: tuple[tuple[str, str | None], ...]  # (key lower case, value; None: a bare key)
    at: bool = False  # an '@' was written

    def rule(self, key: str) -> str | None:
        return next((value for k, value in self.rules if k == key), None)


def fail(spec: str, problem: str, hint: str = "") -> FaultSpecError:
    """The one shape of an error: what is wrong, in which spec, then how to write it."""
    return FaultSpecError(f"{problem} in {spec!r}" + (f"; {hint}" if hint else ""))


def near(word: str, choices: Collection[str]) -> str:
    """`` (did you mean X?)`` when a choice is close to ``word``, else ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def split_spec(
    text: str, names: Collection[str], side: Side, *, bare: Collection[str] = ()
) -> Spec:
    """``NAME[:ARG...][@RULE,...]``, the name one of ``names``, the rules ``side``'s.

    ``bare``: the rules that may be written without a value. Checks the name, that no
    argument is a rule (the engine's former spelling), the rule keys (unknown, the other
    side's, given twice, without a value) and ``seed`` without ``prob``; the values are
    the side's to check (``count_rule`` for the counter rules)."""
    spec = text.strip()
    if not spec:
        raise FaultSpecError(f"empty fault spec; faults: {', '.join(names)}")
    head, at, tail = spec.partition("@")
    name, *args = (part.strip() for part in head.split(":"))
    name = name.lower()
    if name not in names:
        raise fail(
            spec, f"unknown fault {name!r}{near(name, names)}", f"faults: {', '.join(names)}"
        )
    misplaced = [a for a in args if a.partition("=")[0].strip().lower() in RULES and "=" in a]
    if misplaced:
        kept = ":".join([name, *(a for a in args if a not in misplaced)])
        moved = ",".join([*misplaced, *([tail.strip()] if tail.strip() else [])])
        what = " and ".join(misplaced)
        verb = "is a rule" if len(misplaced) == 1 else "are rules"
        raise FaultSpecError(f"{what} {verb}: write {kept}@{moved}")
    rules = _split_rules(spec, tail, side, bare) if at else ()
    return Spec(spec, name, tuple(args), rules, at=bool(at))


def _split_rules(
    spec: str, text: str, side: Side, bare: Collection[str]
) -> tuple[tuple[str, str | None], ...]:
    keys = rule_keys(side)
    if not text.strip():
        raise fail(spec, "nothing after '@'", f"rules: {', '.join(keys)}")
    out: list[tuple[str, str | None]] = []
    for part in text.split(","):
        key, eq, value = (s.strip() for s in part.partition("="))
        key = key.lower()
        if key not in keys:
            if key in RULES:
                other: Side = "engine" if side == "proxy" else "proxy"
                raise fail(
                    spec,
                    f"{_WHO[side]} takes no rule {key!r} (a rule of {SIDES[other]})",
                    f"{_RULES_HERE[side]}: {', '.join(keys)}",
                )
            raise fail(spec, f"unknown rule {key!r}{near(key, keys)}", f"rules: {', '.join(keys)}")
        if any(k == key for k, _ in out):
            raise fail(spec, f"{key!r} given twice")
        if not eq and key in bare:
            out.append((key, None))
            continue
        if not value:
            raise fail(spec, f"{key} needs a value", keys[key])
        out.append((key, value))
    given = {k for k, _ in out}
    if "seed" in given and "prob" not in given:
        raise fail(spec, "seed without prob", "seed is the seed of prob; give prob too")
    return tuple(out)


def positional(spec: Spec, least: int, most: int, usage: str) -> None:
    """The tap's faults: ``least`` to ``most`` positional arguments."""
    if not least <= len(spec.args) <= most or any("=" in a for a in spec.args):
        raise FaultSpecError(f"{spec.name} is written {usage}, not {spec.text!r}")


def bind_args(spec: Spec, params: Sequence[str], usage: str) -> dict[str, str]:
    """The engine's faults: arguments by position (in ``params`` order) or ``KEY=VALUE``."""
    bound: dict[str, str] = {}
    named = False
    for i, arg in enumerate(spec.args):
        key, eq, value = (s.strip() for s in arg.partition("="))
        if eq:
            key = key.lower()
            named = True
            if key not in params:
                hint = f"{spec.name} is written {usage}"
                raise fail(spec.text, f"unknown argument {key!r}{near(key, params)}", hint)
            if key in bound:
                raise fail(spec.text, f"{key!r} given twice")
            bound[key] = value
            continue
        if named:
            raise fail(spec.text, f"argument {arg!r} by position after a named one")
        if i >= len(params):
            raise fail(spec.text, f"too many arguments for {spec.name}", f"it is written {usage}")
        bound[params[i]] = arg
    return bound


def to_int(spec: str, what: str, value: str, least: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        raise fail(spec, f"{what} must be an integer >= {least} (got {value!r})")
    return number


def to_seconds(spec: str, what: str, value: str, *, finite: bool) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if math.isnan(seconds) or seconds < 0 or (finite and math.isinf(seconds)):
        more = "" if finite else ", or inf"
        raise fail(spec, f"{what} must be seconds >= 0{more} (got {value!r})")
    return seconds


def to_prob(spec: str, value: str) -> float:
    try:
        prob = float(value)
    except ValueError:
        prob = math.nan
    if not 0.0 <= prob <= 1.0:
        raise fail(spec, f"prob must be a number from 0 to 1 (got {value!r})")
    return prob


COUNTER_RULES = frozenset(("every", "nth", "from", "times", "seed", "prob"))


def count_rule(spec: str, key: str, value: str) -> int | float:
    """The value of a counter rule (``COUNTER_RULES``), both sides' the same."""
    if key == "prob":
        return to_prob(spec, value)
    return to_int(spec, key, value, 0 if key == "seed" else 1)


def counter_rules(spec: Spec) -> Mapping[str, int | float]:
    """The counter rules of ``spec``, checked."""
    return {
        key: count_rule(spec.text, key, value)
        for key, value in spec.rules
        if key in COUNTER_RULES and value is not None
    }
