"""Engine samples with figures out of their range (NaN, infinities, negatives, 1e308, a KV
use of 40) are dropped where the analysis reads them: the verdict is the one without them,
a ``samples_out_of_range`` caveat counts them by figure, and ``tracer report`` draws its
picture. And the exit codes: 2 for bad arguments only, never for a library's error."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import run
from tests.unit.test_findings import ROUTER, Cap, analyze, kinds
from tracer import events as ev
from tracer.analysis.findings.engine_view import EngineFigures
from tracer.capture.files import write_all
from tracer.cli import commands
from tracer.evidence.ranges import MAX_COUNTER, out_of_range

USAGE, RUNTIME = 2, 1

# (figure as the caveat names it, a value out of its range)
BAD = [
    ("state.running", math.nan),
    ("state.running", math.inf),
    ("state.running", -1),
    ("state.running", 1e308),
    ("state.running", 2e6),
    ("state.queued", -1),
    ("state.queued", 1e308),
    ("state.token_usage", 40.0),
    ("state.token_usage", -0.1),
    ("state.gen_throughput", 1e9),
    ("state.gen_throughput", -math.inf),
    ("state.decode_tokens_total", 1e308),
    ("state.generation_tokens_total", -1),
    ("state.running", "3"),
    ("deltas.decode_tokens_total", 1e308),
    ("deltas.decode_tokens_total", math.nan),
    ("deltas.decode_tokens_total", -5),
    ("deltas.generation_tokens_total", 2e8),  # over 1 s: 2e8 tokens/s
    ("interval", -1.0),
    ("interval", math.inf),
]


def _sample(figure: str, value: Any) -> dict[str, Any]:
    """A believable SGLang sample with ``figure`` set to ``value``."""
    s: dict[str, Any] = {
        "state": {"running": 1, "queued": 0, "token_usage": 0.4, "decode_tokens_total": 900},
        "deltas": {"decode_tokens_total": 40, "generation_tokens_total": 40},
        "interval": 1.0,
    }
    where, _, key = figure.partition(".")
    if key:
        s[where][key] = value
    else:
        s[where] = value
    return s


@pytest.mark.parametrize(("figure", "value"), BAD, ids=[f"{f}={v}" for f, v in BAD])
def test_each_figure_out_of_its_range_is_named(figure: str, value: Any) -> None:
    s = _sample(figure, value)
    assert out_of_range(s["state"], s["deltas"], s["interval"]) == [figure]


def test_figures_in_range_and_unknown_ones_are_kept() -> None:
    s = _sample("state.running", 0)
    assert out_of_range(s["state"], s["deltas"], s["interval"]) == []
    edges = {"running": 1_000_000, "token_usage": 1.0, "gen_throughput": 0.0}
    assert out_of_range({**edges, "queued": None, "requests_total": MAX_COUNTER}) == []
    assert out_of_range({"in_flight": 7, "workers_healthy": 2}, None, None) == []
    assert out_of_range({}, {}, 0.0) == []  # a first sample: no deltas, no interval
    # a counter lower than the previous sample's is a restart, not out of range: the
    # poller wrote it with no deltas, and it is kept
    assert out_of_range({"decode_tokens_total": 3}, {}, 1.0) == []


def test_token_rate_is_bounded_per_second_of_interval() -> None:
    assert out_of_range({}, {"decode_tokens_total": 2e8}, 4.0) == []  # 5e7 tokens/s
    assert out_of_range({}, {"decode_tokens_total": 2e8}, 1.0) == ["deltas.decode_tokens_total"]
    assert out_of_range({}, {"requests_total": 2e8}, 1.0) == []  # not tokens


# ---- the analysis: the verdict without them, and the caveat -----------------------------


def _lost_request(bad: list[tuple[str, Any]]) -> Cap:
    """A request lost in the serving stack (engine idle, router holding it), with the
    ``bad`` samples of the engine after each good one but the last."""
    cap = Cap(upstream=ROUTER)
    cap.exchange(1, 1, 0.0, end=None)
    cap.stall(1, 1, 0.0, None)
    for t in range(0, 12):
        cap.engine(float(t), running=0, delta=0)
        cap.engine(float(t), running=0, url=ROUTER + "/metrics", profile="smg", in_flight=1)
        for k, (figure, value) in enumerate(bad if t < 11 else []):  # within the span
            _bad_sample(cap, t + 0.1 + k * 0.01, figure, value)
    return cap


def _wedged(bad: list[tuple[str, Any]]) -> Cap:
    """An engine that stopped decoding mid-stream, with bad samples between the good."""
    cap = Cap(upstream=ROUTER)
    cap.health(0.0)
    cap.exchange(1, 1, 0.0, events=3, end=None)
    head = {"status": 200, "reason": "", "version": "1.1", "headers": [], "sse": True}
    cap._e(ev.ResponseHead, 0.01, conn=1, seq=1, ttfb=0.01, **head)
    cap._e(ev.BodyData, 0.01, conn=1, seq=1, size=300, reads=[], sse=[[0.0, 100, "content"]])
    cap.stall(1, 1, 0.2, 10.0)
    cap._e(
        ev.ResponseEnd, 10.0, conn=1, seq=1, termination="truncated", status=200,
        body_bytes=300, duration=10.0, events=1, close="reset",
    )  # fmt: skip
    for t in range(0, 12):
        cap.engine(float(t), running=1, delta=0)
        for k, (figure, value) in enumerate(bad if t < 11 else []):  # within the span
            _bad_sample(cap, t + 0.1 + k * 0.01, figure, value)
    return cap


def _bad_sample(cap: Cap, t: float, figure: str, value: Any) -> None:
    s = _sample(figure, value)
    cap._e(
        ev.EngineSample,
        t,
        url="http://127.0.0.1:30000/metrics",
        ok=True,
        elapsed=0.001,
        profile="sglang",
        state=s["state"],
        deltas=s["deltas"],
        interval=s["interval"],
    )


SEVERAL = [
    ("state.running", math.nan),
    ("state.queued", math.inf),
    ("state.running", -1),
    ("state.token_usage", 1e308),
    ("deltas.decode_tokens_total", 1e308),
]


@pytest.mark.parametrize("scenario", [_lost_request, _wedged])
def test_the_verdict_is_the_one_without_those_samples(scenario: Any) -> None:
    clean = analyze(scenario([]))
    assert clean["verdict"]["kind"] in ("engine_lost_request", "engine_stall_mid_stream")
    dirty = analyze(scenario(SEVERAL))
    verdict = dict(dirty["verdict"])
    (caveat,) = [c for c in verdict.pop("caveats") if c["kind"] == "samples_out_of_range"]
    assert verdict == {k: v for k, v in clean["verdict"].items() if k != "caveats"}
    assert kinds(dirty) == kinds(clean)
    assert [f["evidence"] for f in dirty["findings"]] == [f["evidence"] for f in clean["findings"]]
    assert dirty["evidence"]["engine_samples"] == clean["evidence"]["engine_samples"]
    assert caveat["count"] == 11 * len(SEVERAL)
    assert caveat["figures"] == {
        "state.running": 22,
        "state.queued": 11,
        "state.token_usage": 11,
        "deltas.decode_tokens_total": 11,
    }
    assert not [c for c in clean["verdict"].get("caveats", []) if c["kind"] == caveat["kind"]]


def test_a_sample_with_several_bad_figures_is_one_sample_dropped() -> None:
    cap = _lost_request([])
    cap._e(
        ev.EngineSample,
        12.5,
        url="http://127.0.0.1:30000/metrics",
        ok=True,
        elapsed=0.001,
        profile="sglang",
        state={"running": 1e308, "queued": -1},
        deltas={"decode_tokens_total": math.nan},
        interval=1.0,
    )
    (caveat,) = [
        c for c in analyze(cap)["verdict"]["caveats"] if c["kind"] == "samples_out_of_range"
    ]
    assert caveat["count"] == 1
    assert caveat["figures"] == {
        "deltas.decode_tokens_total": 1,
        "state.queued": 1,
        "state.running": 1,
    }


def test_without_the_filter_the_engine_view_would_have_failed() -> None:
    """What the drop prevents: a NaN gauge read by the attribution is int(nan)."""
    sample = {"t": 1.0, "url": "http://e/metrics", "ok": True, "profile": "sglang"}
    figures = EngineFigures([{**sample, "state": {"running": math.nan}}], [])
    with pytest.raises(ValueError):
        figures.view(0.0, 2.0)


# ---- tracer report on such a capture --------------------------------------------------


def _capture_file(path: Path) -> None:
    """The lost request, written to a file: the values a JSON capture can hold (a NaN is
    written as null, which is unknown and kept)."""
    cap = _lost_request(
        [("state.running", 1.7e308), ("deltas.decode_tokens_total", 1e308), ("state.queued", -1)]
    )
    write_all(path, cap.events)


def test_report_on_out_of_range_samples_writes_the_report_and_its_picture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capture = tmp_path / "cap.jsonl"
    _capture_file(capture)
    md, doc = tmp_path / "r.md", tmp_path / "r.json"
    code, err = run(["report", str(capture), "-o", str(md), "--json", str(doc)], capsys)
    assert code == 0, err
    assert md.stat().st_size and (tmp_path / "r-timeline.png").stat().st_size
    assert (tmp_path / "r-timeline.svg").stat().st_size
    verdict = json.loads(doc.read_text())["verdict"]
    assert (verdict["party"], verdict["kind"]) == ("engine", "engine_lost_request")
    (caveat,) = [c for c in verdict["caveats"] if c["kind"] == "samples_out_of_range"]
    assert caveat["count"] == 33
    assert caveat["figures"] == {
        "deltas.decode_tokens_total": 11,
        "state.queued": 11,
        "state.running": 11,
    }


# ---- exit codes -----------------------------------------------------------------------


def _raised(fn: Any) -> BaseException:
    try:
        fn()
    except Exception as exc:  # the exception is the test's subject
        return exc
    raise AssertionError("nothing raised")


def _exit(exc: BaseException, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = commands._exit_for(exc, argparse.Namespace(log_level="info"))
    return code, capsys.readouterr().err


def test_a_librarys_value_error_is_a_run_time_failure_without_its_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    exc = _raised(lambda: Figure().add_subplot().set_ylim(0, math.inf))
    code, err = _exit(exc, capsys)
    assert code == RUNTIME
    assert err.count("\n") == 1 and "matplotlib" in err and str(exc) not in err


def test_a_failed_conversion_in_tracer_is_a_run_time_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sample = {"t": 1.0, "url": "http://e/metrics", "ok": True, "profile": "sglang"}
    figures = EngineFigures([{**sample, "state": {"running": math.nan}}], [])
    code, err = _exit(_raised(lambda: figures.view(0.0, 2.0)), capsys)
    assert code == RUNTIME and err.count("\n") == 1


def test_tracers_own_argument_check_is_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from tracer.times import parse_time

    code, err = _exit(_raised(lambda: parse_time("yesterday", 0.0, 1.0)), capsys)
    assert code == USAGE and err.count("\n") == 1


def test_a_picture_that_cannot_be_drawn_is_exit_1_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the picture's bug, `tracer report` says so in one line and exits 1 (not
    2, bad arguments), without matplotlib's own message."""
    from tracer.present import timeline_draw

    def broken(tl: Any, svg: Path, png: Path) -> None:
        from matplotlib.figure import Figure

        Figure().add_subplot().set_ylim(0, math.inf)

    monkeypatch.setattr(timeline_draw, "draw", broken)
    capture = tmp_path / "cap.jsonl"
    _capture_file(capture)
    code, err = run(["report", str(capture), "-o", str(tmp_path / "r.md")], capsys)
    assert code == RUNTIME and err.count("\n") == 1
    assert "timeline picture" in err and "Axis limits" not in err
    assert not (tmp_path / "r.md").exists()


def test_analyze_on_out_of_range_samples_is_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capture = tmp_path / "cap.jsonl"
    _capture_file(capture)
    code, err = run(["analyze", str(capture), "--format", "json"], capsys)
    assert code == 0, err
