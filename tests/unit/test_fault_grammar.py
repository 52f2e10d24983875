"""One fault grammar for the tap and the sim engine, sans-I/O: specs in, faults or errors out.

``NAME[:ARG...][@RULE,...]`` is read by ``tracer.faults.spec`` for ``tracer proxy --fault``
(and the mitmproxy addon) and for ``tracer sim engine --fault`` / ``x-sim-fault``; each
side builds its own faults and takes its own rules (``docs/faults.md``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tracer.faults import spec as faultspec
from tracer.faults.plan import KINDS, RULE_KEYS, Rule
from tracer.faults.plan import parse_fault as proxy_fault
from tracer.faults.spec import FaultSpecError, split_spec
from tracer.sim import engine
from tracer.sim.engine import EngineConfig, Fault, SimEngine
from tracer.sim.engine import parse_fault as engine_fault

ROOT = Path(__file__).resolve().parents[2]


# ---- the shared spelling ---------------------------------------------------------------


def test_split_spec_name_args_rules() -> None:
    spec = split_spec(" Stall:after=3: 10 @every=5, times=2 ", engine.FAULT_KINDS, "engine")
    assert spec.text == "Stall:after=3: 10 @every=5, times=2"
    assert spec.name == "stall" and spec.args == ("after=3", "10") and spec.at
    assert spec.rules == (("every", "5"), ("times", "2"))
    assert spec.rule("times") == "2" and spec.rule("nth") is None
    bare = split_spec("drop-request@reuse", KINDS, "proxy", bare=("reuse",))
    assert bare.rules == (("reuse", None),) and bare.args == ()
    assert not split_spec("lost", engine.FAULT_KINDS, "engine").at


def test_each_side_has_its_rules_and_shares_the_counter_ones() -> None:
    assert faultspec.rule_keys("proxy") == RULE_KEYS  # what tracer proxy --help lists
    assert list(RULE_KEYS) == [
        *("path", "method", "header", "pos", "reuse", "every", "prob", "seed", "times")
    ]
    assert faultspec.rule_keys("engine") == engine.RULE_KEYS
    assert list(engine.RULE_KEYS) == ["every", "nth", "from", "prob", "seed", "times"]
    assert set(RULE_KEYS) & set(engine.RULE_KEYS) == {"every", "prob", "seed", "times"}


@pytest.mark.parametrize("side", ["proxy", "engine"])
@pytest.mark.parametrize(
    ("tail", "message"),
    [
        ("@", "nothing after '@' in"),
        ("@evry=2", "unknown rule 'evry' (did you mean every?) in"),
        ("@every=2,every=3", "'every' given twice in"),
        ("@every", "every needs a value in"),
        ("@every=0", "every must be an integer >= 1 (got '0') in"),
        ("@times=x", "times must be an integer >= 1 (got 'x') in"),
        ("@prob=2", "prob must be a number from 0 to 1 (got '2') in"),
        ("@seed=3", "seed without prob in"),
    ],
)
def test_rule_errors_are_the_same_on_both_sides(side: str, tail: str, message: str) -> None:
    parse = proxy_fault if side == "proxy" else engine_fault
    spec = ("drop-request" if side == "proxy" else "lost") + tail
    with pytest.raises(FaultSpecError) as caught:
        parse(spec)
    text = str(caught.value)
    assert text.startswith(message) and f"in {spec!r}" in text, text
    assert "\n" not in text


@pytest.mark.parametrize(
    ("parse", "spec", "message"),
    [
        (proxy_fault, "", "empty fault spec; faults: hang-on-reuse, "),
        (engine_fault, " ", "empty fault spec; faults: stall, wedge, "),
        (
            proxy_fault,
            "hang-on-resue:3",
            "unknown fault 'hang-on-resue' (did you mean hang-on-reuse?)",
        ),
        (engine_fault, "stal:3", "unknown fault 'stal' (did you mean stall?) in 'stal:3'"),
        (engine_fault, "sleep", "unknown fault 'sleep' in 'sleep'; faults: stall, wedge, lost"),
    ],
)
def test_unknown_names(parse: object, spec: str, message: str) -> None:
    assert callable(parse)
    with pytest.raises(FaultSpecError) as caught:
        parse(spec)
    assert str(caught.value).startswith(message), caught.value


# ---- the tap's faults ------------------------------------------------------------------


def test_proxy_specs_parse_to_their_fields() -> None:
    f = proxy_fault("stall-after-events:5:10@every=2,path=/v1/chat/*")
    assert (f.name, f.count, f.seconds, f.spec) == (
        "stall-after-events",
        5,
        10.0,
        "stall-after-events:5:10@every=2,path=/v1/chat/*",
    )
    assert f.rule == Rule(path="/v1/chat/*", every=2)
    assert proxy_fault("drop-request@prob=0.1,seed=7,times=3").rule == Rule(
        prob=0.1, seed=7, times=3
    )
    assert math.isinf(proxy_fault("stall-after-events:1:inf").seconds)
    assert proxy_fault("truncate-after-events:3:reset").how == "reset"
    assert proxy_fault("hang-on-reuse:3").rule == Rule(pos=3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("status:503:every=4", "every=4 is a rule: write status:503@every=4"),
        (
            "status:503:path=/v1:every=4@times=1",
            "path=/v1 and every=4 are rules: write status:503@path=/v1,every=4,times=1",
        ),
        ("stall-after-events:5", "stall-after-events is written stall-after-events:K:S, not "),
        ("stall-after-events:K=5:S=1", "stall-after-events is written stall-after-events:K:S"),
        ("status:abc", "CODE must be an integer >= 400 (got 'abc') in 'status:abc'"),
        ("status:503@nth=2", "the tap takes no rule 'nth' (a rule of tracer sim engine --fault)"),
        ("status:503@from=2", "the tap takes no rule 'from'"),
        ("status:503@pos=2,reuse", "the position given twice (or pos with reuse)"),
    ],
)
def test_bad_proxy_specs_say_what_is_wrong_first(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError) as caught:
        proxy_fault(spec)
    assert str(caught.value).startswith(message), caught.value


def test_proxy_refusals_list_the_taps_rules() -> None:
    with pytest.raises(FaultSpecError) as caught:
        proxy_fault("status:503@nth=2")
    assert str(caught.value).endswith("; the tap's rules: " + ", ".join(RULE_KEYS))


# ---- the engine's faults ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        ("stall", Fault("stall")),
        ("stall:after=3:for=10", Fault("stall", after=3, seconds=10.0)),
        ("stall:3:10", Fault("stall", after=3, seconds=10.0)),
        ("stall:3:for=10", Fault("stall", after=3, seconds=10.0)),
        ("STALL:For=2.5", Fault("stall", seconds=2.5)),
        ("stall:after=0:for=inf", Fault("stall", after=0, seconds=math.inf)),
        ("wedge:1:20@nth=2", Fault("wedge", after=1, seconds=20.0, nth=2)),
        ("close:0", Fault("close", after=0)),
        ("reset:after=2@from=10", Fault("reset", after=2, start=10)),
        ("error:after=1@every=3,times=2", Fault("error", after=1, every=3, times=2)),
        ("lost@nth=2", Fault("lost", nth=2)),
        ("500@prob=0.5,seed=7", Fault("500", prob=0.5, seed=7)),
        ("stall:after=3:for=10@every=5", Fault("stall", after=3, seconds=10.0, every=5)),
    ],
)
def test_engine_specs_parse_to_their_fields(spec: str, fault: Fault) -> None:
    assert engine_fault(spec) == fault


def test_engine_faults_print_in_the_grammar_and_parse_back() -> None:
    for spec in (
        "stall:3:10@every=5",
        "lost@nth=2",
        "reset:after=2@from=10",
        "500@prob=0.25,seed=3,times=4",
    ):
        fault = engine_fault(spec)
        assert engine_fault(str(fault)) == fault
    assert str(engine_fault("stall:3:10@every=5")) == "stall:after=3:for=10@every=5"
    assert str(engine_fault("lost")) == "lost"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # the former spelling: selectors among the arguments
        ("stall:after=3:for=10:every=5", "every=5 is a rule: write stall:after=3:for=10@every=5"),
        ("lost:nth=2", "nth=2 is a rule: write lost@nth=2"),
        ("reset:after=2:from=10", "from=10 is a rule: write reset:after=2@from=10"),
        (
            "reset:after=0:every=5:from=10",
            "every=5 and from=10 are rules: write reset:after=0@every=5,from=10",
        ),
        ("close:after=2:nth=2@times=1", "nth=2 is a rule: write close:after=2@nth=2,times=1"),
    ],
)
def test_the_former_engine_spelling_is_refused_with_the_new_one(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError) as caught:
        engine_fault(spec)
    assert str(caught.value) == message
    fixed = message.partition("write ")[2]
    engine_fault(fixed)  # what it says parses


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("stall:after=-1", "after must be an integer >= 0 (got '-1') in 'stall:after=-1'"),
        ("stall:after", "after must be an integer >= 0 (got 'after')"),
        ("stall:for=x", "for must be seconds >= 0, or inf (got 'x')"),
        (
            "stall:x=1",
            "unknown argument 'x' in 'stall:x=1'; stall is written stall[:after=N][:for=S]",
        ),
        ("stall:aftr=1", "unknown argument 'aftr' (did you mean after?)"),
        ("stall:after=1:after=2", "'after' given twice in"),
        ("stall:for=3:2", "argument '2' by position after a named one in"),
        (
            "stall:1:2:3",
            "too many arguments for stall in 'stall:1:2:3'; it is written stall[:after=N][:for=S]",
        ),
        ("lost:1", "too many arguments for lost in 'lost:1'; it is written lost[@RULE,...]"),
        ("500:for=x", "unknown argument 'for' in '500:for=x'; 500 is written 500[@RULE,...]"),
        ("lost@nth=0", "nth must be an integer >= 1 (got '0')"),
        ("lost@from=x", "from must be an integer >= 1 (got 'x')"),
    ],
)
def test_bad_engine_specs_say_what_is_wrong_first(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError) as caught:
        engine_fault(spec)
    assert str(caught.value).startswith(message), caught.value
    assert isinstance(caught.value, ValueError)  # what the engine's callers catch


@pytest.mark.parametrize(
    "rule", ["pos=2", "reuse", "reuse=2", "path=/v1/chat/", "method=POST", "header=x-a"]
)
def test_rules_that_mean_nothing_to_the_engine_are_refused(rule: str) -> None:
    key = rule.partition("=")[0]
    with pytest.raises(FaultSpecError) as caught:
        engine_fault(f"lost@{rule}")
    text = str(caught.value)
    assert text.startswith(f"the sim engine takes no rule {key!r} (a rule of tracer proxy --fault)")
    assert text.endswith(
        "; the engine's rules, on its completion counter: every, nth, from, prob, seed, times"
    )


def test_x_sim_fault_takes_no_rules() -> None:
    assert engine_fault("stall:2:1", rules=False) == Fault("stall", after=2, seconds=1.0)
    with pytest.raises(FaultSpecError) as caught:
        engine_fault("lost@nth=2", rules=False)
    assert str(caught.value) == (
        "x-sim-fault takes no rules in 'lost@nth=2'; "
        "the header chooses the fault of its own request: write lost"
    )


def _chosen(faults: list[str], n: int, headers: dict[str, str] | None = None) -> list[str]:
    sim = SimEngine(EngineConfig(faults=[engine_fault(f) for f in faults]))
    out = []
    for _ in range(n):
        fault = sim._fault_for(dict(headers or {}))
        out.append(fault.kind if fault else "-")
    return out


def test_engine_rules_count_completions_and_the_first_match_wins() -> None:
    assert _chosen(["lost@nth=2"], 4) == ["-", "lost", "-", "-"]
    assert _chosen(["500@every=2"], 5) == ["-", "500", "-", "500", "-"]
    assert _chosen(["close@from=3"], 4) == ["-", "-", "close", "close"]
    assert _chosen(["reset@every=2,from=3"], 6) == ["-", "-", "-", "reset", "-", "reset"]
    assert _chosen(["lost@every=2,times=2", "500@from=3"], 8) == [
        *("-", "lost", "500", "lost", "500", "500", "500", "500")
    ]
    assert _chosen(["500"], 2) == ["500", "500"]


def test_engine_prob_draws_the_same_every_run() -> None:
    first = _chosen(["500@prob=0.5,seed=7"], 40)
    assert first == _chosen(["500@prob=0.5,seed=7"], 40)
    assert 5 < first.count("500") < 35
    assert _chosen(["500@prob=0"], 5) == ["-"] * 5
    assert _chosen(["500@prob=1,times=2"], 4) == ["500", "500", "-", "-"]


def test_the_header_overrides_the_rules() -> None:
    assert _chosen(["lost"], 2, {"x-sim-fault": "none"}) == ["-", "-"]
    assert _chosen(["lost"], 2, {"x-sim-fault": "close:0"}) == ["close", "close"]
    with pytest.raises(FaultSpecError, match="x-sim-fault takes no rules"):
        _chosen([], 1, {"x-sim-fault": "lost@nth=1"})


# ---- documented once -------------------------------------------------------------------


def _sh_faults(markdown: str) -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", markdown, flags=re.S)
    return [m for block in blocks for m in re.findall(r"--fault '?([^ '\n]+)'?", block)]


def test_docs_faults_md_names_every_fault_and_rule_and_its_examples_parse() -> None:
    doc = (ROOT / "docs" / "faults.md").read_text()
    for name in [*KINDS, *engine.FAULT_KINDS, *faultspec.RULES]:
        assert f"`{name}" in doc, name
    tap, _, rest = doc.partition("## The sim engine's faults")
    sim = rest.partition("\n## ")[0]
    assert len(_sh_faults(tap)) >= 5 and len(_sh_faults(sim)) >= 5
    for spec in _sh_faults(tap):
        proxy_fault(spec)
    for spec in _sh_faults(sim):
        engine_fault(spec)
    # the error shown for the former spelling is the one given
    with pytest.raises(FaultSpecError) as caught:
        engine_fault("stall:after=3:for=10:every=5")
    assert f"`{caught.value}`" in doc
