"""`tracer report` in this process: bad input named, evidence quoted with its times once,
times before the capture start keep their sign. On real captures: tests/integration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tracer.cli.commands import main
from tracer.present.report import _Clock


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["missing.jsonl", "-o", "r.md"], 3, "cannot read missing.jsonl"),
        (["notcap.jsonl", "-o", "r.md"], 3, "not a tracer capture"),
        (["empty.jsonl", "-o", "r.md"], 3, "empty.jsonl: not a tracer capture"),
        (["notcap.jsonl", "-o", "r.txt"], 2, "give a .md file name"),
        (["notcap.jsonl", "-o", "nowhere/r.md"], 2, "directory nowhere does not exist"),
        (["notcap.jsonl", "-o", "r.md", "--max-lanes", "0"], 2, "--max-lanes 0"),
    ],
)
def test_bad_input_is_named(
    tmp_path: Path,
    args: list[str],
    code: int,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "notcap.jsonl").write_text('{"hello": 1}\n')
    (tmp_path / "empty.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    assert main(["report", *args]) == code
    assert message in capsys.readouterr().err


def test_times_before_the_capture_start_keep_their_sign() -> None:
    """An engine window opens 1.5 s before a finding near the start: '-0.092 s', not
    '+-0.092 s'."""
    clock = _Clock(100.0)
    assert (clock.rel(99.908), clock.rel(101.25), clock.rel(None)) == ("-0.092 s", "+1.250 s", "-")


def test_evidence_items_are_quoted_with_their_times_once() -> None:
    """An epoch quoted in an item's text becomes its offset from the start; an item whose
    text quotes no time gets its own ``t`` in front; an item without a time stays as it is."""
    clock = _Clock(1796000000.0)

    def item(text: str, t: float | None) -> dict[str, Any]:
        return {"text": text, "t": t, "tap": "back", "request": None, "figures": {}}

    assert clock.evidence(item("stall t=1796000001.500 upstream_silent", 1796000001.5)) == (
        "stall +1.500 s upstream_silent"
    )
    assert clock.evidence(item("at tap back: 12 events", 1796000002.0)) == (
        "+2.000 s: at tap back: 12 events"
    )
    assert clock.evidence(item("never seen at tap back", None)) == "never seen at tap back"
