"""Every sentence a finding says is backed by its own evidence (issue 35, point 5).

Each finding's ``summary`` and each ``ruled_out[].why`` is checked against the finding's
``evidence`` items (``captures/ANALYSIS.md``), for every scenario of the recorded matrix
(``tests/data/scenarios/*/expect.json``, analysed in-process as ``test_scenarios`` does)
and for the built event streams of ``test_findings`` and ``test_claims`` (each of their
tests is run once with ``Summary.result`` recording what it returned; whether their own
asserts hold is their business, not this file's). Notes are checked like faults.

**Numbers.** Every number a sentence states must be among the evidence's numbers: the
items' ``figures`` (recursively through lists and dicts, and the length of each list),
the numbers their ``text`` quotes, and a few counts of the items themselves (the
distinct requests they name, plus the ``more`` of a "... and N more" item; the distinct
connections; how many items carry each figure). It is compared at the sentence's own
precision: ``3 s`` is any figure in [2.5, 3.5], ``2.53 s`` any in [2.525, 2.535], an
integer without a unit only itself. A unit converts: ``ms`` against seconds too, ``s``
against milliseconds, ``KB``/``MB`` as 1000/10^6 bytes, ``KiB``/``MiB`` as 1024/2^20,
``%`` against a fraction too; a rate in ``tok/s`` must be an engine item's ``progress``
(or ``finished``) over its ``progress_span``. A time ``t=…`` must be an item's ``t`` or
a time an item's text quotes. Not numbers: names and ids (tap names such as ``e2``,
``front/1/3``, ``x-request-id=…``, ``HTTP/1.1``, ``5xx``, URLs and addresses, a
`quoted` fault spec), counts in words ("one burst"), and the few numbers about other
software a kind compares with (``REFERENCES``).

**Yes/no claims** (``RULES`` below, each with its own docstring): a phrase that says
something did or did not happen must agree with the figures that say so. A phrase about
requests is read against the items of the tap it names in its own clause (the sentence
split at ``:``, ``;``, "while", "but"), or else against the items of the finding's own
requests.

A failure lists, per scenario, each (finding kind, sentence, what is not backed).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.unit import test_claims as built_claims
from tests.unit import test_findings as built_findings
from tests.unit.test_scenarios import CASES, SCENARIOS, analyze
from tracer.analysis.summary import Summary

Item = dict[str, Any]

# --- numbers ----------------------------------------------------------------------------

_IGNORED = re.compile(
    r"""
      `[^`]*`                          # a quoted name or fault spec: `hang-on-reuse:3`
    | \b[a-z][\w+.-]*://\S+            # a URL
    | \bx-request-id=\S+               # a request id
    | \bHTTP/\d(?:\.\d)?               # a protocol version
    | \b\d+(?:\.\d+){3}(?::\d+)?       # an address
    | \b[A-Za-z][\w.-]*(?:/\d+)+       # a connection or request id: front/1, front/1/3
    | \b\d+xx\b                        # a status class
    """,
    re.VERBOSE,
)
_TIME = re.compile(r"\bt=(\d+(?:\.\d+)?)")
_NUMBER = re.compile(
    r"""
    (?<![\w.:/@])(?<![A-Za-z]-)        # not inside a name: e2, s1-r2, tap/1
    (?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:e[+-]?\d+)?)
    (?P<unit>\s?(?:ms|s|KiB|KB|MiB|MB|B|%|tok/s))?
    (?![\w/]|\.\d)
    """,
    re.VERBOSE,
)
_SCALES: dict[str, tuple[float, ...]] = {
    "": (1.0,),
    "s": (1.0, 1000.0),  # seconds, or a figure in milliseconds
    "ms": (1.0, 0.001),  # milliseconds, or a figure in seconds
    "KB": (1.0, 1000.0),
    "KiB": (1.0, 1024.0),
    "MB": (1.0, 1e6),
    "MiB": (1.0, 1024.0**2),
    "B": (1.0,),
    "%": (1.0, 0.01),
}


@dataclass(frozen=True, slots=True)
class Stated:
    """A number as a sentence writes it: its value, how far off a figure may be at the
    precision written, and its unit."""

    written: str
    value: float
    tolerance: float
    unit: str


def _stated(num: str, unit: str) -> Stated:
    plain = num.replace(",", "")
    mantissa, _, exp = plain.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    value = float(plain)
    tolerance = 0.0 if not decimals and not unit and not exp else 0.5 * 10.0 ** (-decimals)
    tolerance *= 10.0 ** int(exp or 0)
    return Stated(f"{num}{unit}", value, tolerance, unit.strip())


def numbers_in(sentence: str) -> tuple[list[Stated], list[Stated]]:
    """The numbers a sentence states and the times ``t=…`` it quotes, names left out."""
    times = [_stated(m.group(1), "") for m in _TIME.finditer(sentence)]
    rest = _TIME.sub(" ", sentence)
    rest = _IGNORED.sub(" ", rest)
    numbers = [_stated(m["num"], m["unit"] or "") for m in _NUMBER.finditer(rest)]
    return numbers, [Stated(t.written, t.value, 0.0005, "") for t in times]


def _figure_numbers(value: Any) -> Iterator[float]:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int | float):
        if math.isfinite(value):
            yield float(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _figure_numbers(v)
    elif isinstance(value, list | tuple):
        yield float(len(value))
        for v in value:
            yield from _figure_numbers(v)


def evidence_numbers(items: list[Item]) -> tuple[list[float], list[float], list[float]]:
    """Every number the evidence holds, every time it holds, and the engines' rates
    (tokens over ``progress_span``)."""
    numbers: list[float] = []
    times: list[float] = [e["t"] for e in items if e["t"] is not None]
    requests = {e["request"] for e in items if e["request"]}
    for e in items:
        numbers.extend(_figure_numbers(e["figures"]))
        quoted, quoted_times = numbers_in(e["text"])
        numbers.extend(n.value for n in quoted)
        times.extend(t.value for t in quoted_times)
    more = sum(
        e["figures"].get("more", 0) for e in items if isinstance(e["figures"].get("more"), int)
    )
    numbers += [len(requests), len(requests) + more]
    numbers.append(len({r.rsplit("/", 1)[0] for r in requests}))  # distinct connections
    carrying = Counter(k for e in items for k in e["figures"])
    numbers += [float(n) for n in carrying.values()]  # "3 connections failed": 3 items with conn
    rates = [
        f[k] / f["progress_span"]
        for e in items
        if (f := e["figures"]).get("progress_span")
        for k in ("progress", "finished")
        if isinstance(f.get(k), int | float)
    ]
    return numbers, times, rates


def backed(n: Stated, pool: list[float]) -> bool:
    for scale in _SCALES.get(n.unit, (1.0,)):
        want, tol = n.value * scale, n.tolerance * scale
        if any(abs(v - want) <= tol + 1e-9 * max(1.0, abs(want)) for v in pool):
            return True
    return False


# --- yes/no claims ----------------------------------------------------------------------

_CLAUSE = re.compile(r"[:;]|\bwhile\b|\bbut\b")
_TAP = re.compile(r"\btap ([\w.-]+)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Claim:
    """What a rule reads: the finding's evidence, the items about requests in the
    claim's scope, the tap its clause names (if one), and the phrase matched."""

    items: list[Item]
    scoped: list[Item]
    tap: str | None
    phrase: re.Match[str]


def _scope(
    finding: dict[str, Any], sentence: str, m: re.Match[str]
) -> tuple[list[Item], str | None]:
    """The items a phrase about requests speaks of: those of the tap its clause names
    (the nearest before it, else after it), else those of the finding's own requests."""
    items = finding["evidence"]
    known = {e["tap"] for e in items if e["tap"]}
    cuts = [0, *[c.end() for c in _CLAUSE.finditer(sentence)], len(sentence) + 1]
    start = max(c for c in cuts if c <= m.start())
    end = min(c for c in cuts if c > m.start())
    named = [
        (t.start(), t.group(1).rstrip(".").lower())
        for t in _TAP.finditer(sentence, start, end)
        if t.group(1).rstrip(".").lower() in known
    ]
    before = [name for at, name in named if at < m.start()]
    tap = before[-1] if before else (named[0][1] if named else None)
    about = [e for e in items if e["request"]]
    if tap is not None:
        return [e for e in about if e["tap"] == tap], tap
    own = [e for e in about if e["request"] in set(finding["requests"])]
    return own or about, None


def _engine(items: list[Item]) -> list[dict[str, Any]]:
    return [e["figures"] for e in items if "running_max" in e["figures"]]


def _nothing_came(c: Claim) -> str | None:
    """ "none/nothing/no event(s)/no token(s)/no bytes … reached|came|arrived", "no
    answer", "without answering": no item in scope has ``events`` > 0 or ``done``; for
    nothing at all (not "none"/"no event"/"no token"), no ``response_bytes`` > 0 and no
    ``status`` either."""
    words = c.phrase.group(0).lower()
    events_only = words.startswith(("none", "no event", "no token"))
    for e in c.scoped:
        f = e["figures"]
        said = [
            f"{k}={f[k]}"
            for k in ("events", "done", "response_bytes", "status")
            if f.get(k) not in (None, 0, False) and (not events_only or k in ("events", "done"))
        ]
        if said:
            return f"{e['request']}: {', '.join(said)}"
    return None


def _never_reached(c: Claim) -> str | None:
    """ "never reached tap X" / "never reached the next tap": an item ``never_seen_at``
    names that tap (any tap for "the next tap"), and no item is about a request at it."""
    named = c.phrase.group("tap")
    named = named.rstrip(".").lower() if named else None
    unseen = {t for e in c.items for t in e["figures"].get("never_seen_at", [])}
    if not (unseen if named is None else named in unseen):
        return f"no never_seen_at figure names {named or 'a next tap'}"
    there = [
        e["request"] for e in c.items if e["request"] and e["tap"] in ({named} if named else unseen)
    ]
    return f"requests seen there: {there}" if there else None


def _done(c: Claim) -> str | None:
    """ "[DONE]": said to have come, every item in scope with ``done`` has it true; said
    not to ("without/no/not/never … [DONE]", "[DONE]=no"), false. And one item says."""
    text = c.phrase.string
    before = text[max(0, c.phrase.start() - 30) : c.phrase.start()]
    negative = bool(re.search(r"\b(without|no|not|never)\b", before)) or text[
        c.phrase.end() :
    ].startswith("=no")
    dones = [(e["request"], e["figures"]["done"]) for e in c.scoped if "done" in e["figures"]]
    if not dones:
        return "no item in scope has a done figure"
    wrong = [r for r, d in dones if d is negative]
    return f"done={not negative} is not what {wrong} say" if wrong else None


def _idle(c: Claim) -> str | None:
    """ "the engine(s)/serving stack … idle", "idle engine", "no engine runs": every
    engine-figures item has ``running_max`` 0, ``queued_max`` 0 and ``progress`` 0 (the
    definition of idle, ANALYSIS.md), and there is one."""
    engines = _engine(c.items)
    if not engines:
        return "no engine figures"
    busy = [
        f"{k}={f[k]:g}"
        for f in engines
        for k in ("running_max", "queued_max", "progress")
        if f.get(k) not in (None, 0)
    ]
    return ", ".join(busy) or None


def _generated(c: Claim) -> str | None:
    """ "tokens were generated", "produced tokens", "was generating": an item has
    ``progress`` or ``finished`` > 0, or ``generating`` true."""
    if any(
        (e["figures"].get("progress") or 0) > 0
        or (e["figures"].get("finished") or 0) > 0
        or e["figures"].get("generating") is True
        for e in c.items
    ):
        return None
    return "no item has progress, finished > 0 or generating"


def _flat(c: Claim) -> str | None:
    """ "progress stayed/was flat", "progress figure did not move": every engine-figures
    item has ``progress`` 0, and there is one."""
    engines = _engine(c.items)
    if not engines:
        return "no engine figures"
    moved = [f"progress={f['progress']:g}" for f in engines if f.get("progress")]
    return ", ".join(moved) or None


def _flowing(c: Claim) -> str | None:
    """ "still flowing/coming", "bytes were arriving": an item in scope has
    ``response_bytes`` or ``events`` > 0."""
    if any(
        (e["figures"].get("response_bytes") or 0) > 0 or (e["figures"].get("events") or 0) > 0
        for e in c.scoped
    ):
        return None
    return f"no response bytes in scope ({c.tap or 'own requests'})"


def _fresh_answered(c: Claim) -> str | None:
    """ "fresh connections (or probes) answered": an item has ``fresh_completed`` > 0 or
    a probe with ``probe_outcome`` ok."""
    if any(
        (e["figures"].get("fresh_completed") or 0) > 0 or e["figures"].get("probe_outcome") == "ok"
        for e in c.items
    ):
        return None
    return "no fresh_completed > 0 nor a probe ok"


def _nothing_in_flight(c: Claim) -> str | None:
    """ "nothing (was) in flight": every item with an ``in_flight`` figure (of the tap the
    clause names, if it names one) has it 0, and there is one."""
    counts = [
        e["figures"]["in_flight"]
        for e in c.items
        if "in_flight" in e["figures"] and (c.tap is None or e["tap"] == c.tap)
    ]
    if not counts:
        return "no in_flight figure"
    wrong = [f"in_flight={n}" for n in counts if n]
    return ", ".join(wrong) or None


def _request_complete(c: Claim) -> str | None:
    """ "reached tap X / the tap complete" (the request, client to tap): no item in scope
    has ``request_complete`` false. (The response's ``termination`` is another matter:
    a request that reached the tap whole and then hung ends client_abort.)"""
    wrong = [e["request"] for e in c.scoped if e["figures"].get("request_complete") is False]
    return f"request_complete=false for {wrong}" if wrong else None


def _answer_complete(c: Claim) -> str | None:
    """ "complete answer(s)", "delivered whole": no item in scope has ``complete`` false
    or a ``termination`` other than complete."""
    wrong = [
        f"{e['request']}: {k}={e['figures'][k]}"
        for e in c.scoped
        for k in ("complete", "termination")
        if k in e["figures"] and e["figures"][k] not in (True, "complete")
    ]
    return "; ".join(wrong) or None


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    pattern: re.Pattern[str]
    check: Callable[[Claim], str | None]


def _rule(name: str, pattern: str, check: Callable[[Claim], str | None]) -> Rule:
    return Rule(name, re.compile(pattern, re.IGNORECASE), check)


RULES = (
    _rule(
        "nothing came",
        r"\b(?:none|nothing|no events?|no tokens?|no bytes?)\s+(?:\w+\s+)?"
        r"(?:reached|came|arrived)\b|\bno answer\b|\bwithout answering\b",
        _nothing_came,
    ),
    _rule(
        "never reached", r"\bnever reached (?:tap (?P<tap>[\w.-]+)|the next tap)", _never_reached
    ),
    _rule("[DONE]", r"\[DONE\]", _done),
    _rule(
        "engine idle",
        r"\b(?:engines?|serving stack)\s+(?:\w+\s+){0,3}idle\b|\bidle (?:engines?|serving stack)\b"
        r"|\bno engine runs\b",
        _idle,
    ),
    _rule(
        "tokens generated",
        r"\btokens were generated\b|\bproduced tokens\b|\bwas generating\b",
        _generated,
    ),
    _rule(
        "progress flat",
        r"\bprogress (?:stayed|was|remained) flat\b|\bprogress figure did not move\b",
        _flat,
    ),
    _rule("still flowing", r"\bstill (?:flowing|coming)\b|\bbytes were arriving\b", _flowing),
    _rule("fresh answered", r"\bfresh connections (?:or probes )?answered\b", _fresh_answered),
    _rule("nothing in flight", r"\bnothing (?:was )?in flight\b", _nothing_in_flight),
    _rule("request complete", r"\breached (?:tap [\w.-]+|the tap) complete\b", _request_complete),
    _rule("answer complete", r"\bcomplete answers?\b|\bdelivered whole\b", _answer_complete),
)


# --- the check --------------------------------------------------------------------------


# Numbers about other software, not about the capture, by kind: left out of the check
# (each one a documented limit the sentence compares a figure with).
REFERENCES: dict[str, re.Pattern[str]] = {
    # "(Go's bufio.Scanner 64 KiB, aiohttp 128-512 KiB)": SSE parsers' line limits
    "client_line_too_long": re.compile(r"\([^()]*\b(?:bufio\.Scanner|aiohttp)\b[^()]*\)"),
}


def sentences(finding: dict[str, Any]) -> Iterator[str]:
    yield finding["summary"]
    for r in finding.get("ruled_out") or []:
        yield r["why"]


def problems(finding: dict[str, Any]) -> list[str]:
    """What the finding's sentences state that its evidence does not back."""
    items = finding["evidence"]
    pool, times, rates = evidence_numbers(items)
    out: list[str] = []
    for sentence in sentences(finding):
        unbacked: list[str] = []
        reference = REFERENCES.get(finding["kind"])
        numbers, quoted = numbers_in(reference.sub(" ", sentence) if reference else sentence)
        unbacked += [
            f"number {n.written!r}"
            for n in numbers
            if not backed(n, rates if n.unit == "tok/s" else pool)
        ]
        unbacked += [f"time t={t.written}" for t in quoted if not backed(t, times)]
        for rule in RULES:
            for m in rule.pattern.finditer(sentence):
                scoped, tap = _scope(finding, sentence, m)
                why = rule.check(Claim(items, scoped, tap, m))
                if why:
                    unbacked.append(f"{rule.name} {m.group(0)!r}: {why}")
        out += [f"{finding['kind']} | {sentence!r} | {u}" for u in unbacked]
    return out


def _report(name: str, findings: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    found: list[str] = []
    for f in findings:
        key = json.dumps(
            [f["kind"], f["summary"], f.get("ruled_out"), f["evidence"]],
            sort_keys=True,
            default=str,
        )
        if key not in seen:
            seen.add(key)
            found += problems(f)
    assert not found, (
        f"{name}: {len(found)} sentence(s) not backed by their evidence:\n" + "\n".join(found)
    )


# --- the recorded scenarios -------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_recorded_scenario_sentences(name: str) -> None:
    case = SCENARIOS / name
    expect = json.loads((case / "expect.json").read_text())
    result = analyze(case, expect["captures"], expect.get("hang_at"))
    assert result["findings"] or expect["no_faults"], name
    _report(name, result["findings"])


# --- the built event streams of test_findings and test_claims ---------------------------


def _calls(fn: Callable[..., Any]) -> list[dict[str, Any]]:
    """The keyword arguments of each case of a test (its parametrize marks expanded);
    none when it needs a fixture."""
    calls: list[dict[str, Any]] = [{}]
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        values = [
            v.values if hasattr(v, "values") and hasattr(v, "marks") else v for v in mark.args[1]
        ]
        calls = [
            {**c, **dict(zip(names, v if len(names) > 1 else (v,), strict=True))}
            for c in calls
            for v in values
        ]
    if set(inspect.signature(fn).parameters) - set(calls[0]):
        return []
    return calls


BUILT = {
    f"{module.__name__.rsplit('.', 1)[-1]}::{name}[{i}]": (fn, kwargs)
    for module in (built_findings, built_claims)
    for name, fn in sorted(vars(module).items())
    if name.startswith("test_") and inspect.isfunction(fn) and fn.__module__ == module.__name__
    for i, kwargs in enumerate(_calls(fn))
}


@pytest.mark.parametrize("name", sorted(BUILT))
def test_built_stream_sentences(name: str) -> None:
    fn, kwargs = BUILT[name]
    results: list[dict[str, Any]] = []
    result = Summary.result

    def recording(self: Summary, *args: Any, **kw: Any) -> dict[str, Any]:
        out = result(self, *args, **kw)
        results.append(out)
        return out

    # its own asserts are test_findings'/test_claims' to report, not this file's
    outcomes = (Exception, pytest.fail.Exception, pytest.skip.Exception)
    with pytest.MonkeyPatch.context() as mp, contextlib.suppress(*outcomes):
        mp.setattr(Summary, "result", recording)
        fn(**kwargs)
    _report(name, [dict(f) for r in results for f in r["findings"]])


# --- the checker itself -----------------------------------------------------------------


def _item(
    text: str, figures: dict[str, Any], request: str | None = "tap/1/1", t: float | None = None
) -> Item:
    return {
        "text": text,
        "t": t,
        "tap": "tap" if request else None,
        "request": request,
        "figures": figures,
    }


HELD = {
    "kind": "proxy_held_stream",
    "requests": ["tap/1/1"],
    "ruled_out": [],
    "evidence": [
        _item(
            "termination=client_abort, status=200, response bytes=5721, events=27, [DONE]=yes",
            {
                "termination": "client_abort",
                "status": 200,
                "response_bytes": 5721,
                "events": 27,
                "done": True,
            },
        ),
        _item(
            "engine metrics t=1000.000 to t=1005.300: running≤1, queued≤0, "
            "decode progress +100 tokens",
            {"running_max": 1, "queued_max": 0, "progress": 100.0, "finished": 0.0},
            request=None,
            t=1000.0,
        ),
        _item("stall t=1000.100 upstream_silent for 2.998 s", {"duration": 2.998123}, t=1000.1),
        _item(
            "request bodies of ≥ 60 KB",
            {"request_bytes": {"failed": [60123.0, 60123.0]}},
            request=None,
        ),
    ],
}


def test_the_checker_catches_a_held_stream_said_to_have_received_nothing() -> None:
    """The bug of issue 35: evidence events=27, [DONE]=yes, 5,721 bytes; the summary said
    none reached the tap."""
    found = problems(HELD | {"summary": "Tokens were generated while none reached the tap."})
    assert len(found) == 1 and "nothing came" in found[0] and "events=27" in found[0], found
    found = problems(HELD | {"summary": "For 5.3 s no event reached the tap, without [DONE]."})
    assert [p for p in found if "nothing came" in p] and [p for p in found if "[DONE]" in p], found


def test_the_checker_reads_numbers_at_the_sentences_precision() -> None:
    ok = "all 27 events and data: [DONE] reached the tap; 3.0 s, 3 s, 2998 ms, 60 KB, 5,721 B"
    assert (
        problems(HELD | {"summary": ok + " (t=1000.100, from front/1/3, tap e2, HTTP/1.1)."}) == []
    )
    found = problems(
        HELD | {"summary": "26 events over 3.01 s, 61 KB, t=1000.200; the engine was idle."}
    )
    assert len(found) == 5, found
    assert [
        n.written for n in numbers_in("a 5xx at front/2/1 x-request-id=s1-r2 after 0.208 s")[0]
    ] == ["0.208 s"]
