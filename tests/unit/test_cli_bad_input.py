"""Every command against bad input: an exit code that says what kind of failure, one line
on stderr, never a traceback. The CLI's ``main`` in this process; what needs a port or a
process: tests/integration/test_cli_bad_input.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import run
from tracer.cli import commands as cli

SCENARIO = Path(__file__).parent.parent / "data" / "scenarios" / "busy_at_capacity" / "tap.jsonl"


JUNK = {
    "random.bin": bytes(range(256)) * 4,
    "empty.jsonl": b"",
    "notes.txt": b"not a capture\nat all\n",
    "dump.pcap": b"\xd4\xc3\xb2\xa1" + bytes(40),
    "dump.pcapng": b"\x0a\x0d\x0d\x0a" + bytes(40),
}


USAGE, RUNTIME, INPUT = 2, 1, 3


@pytest.mark.parametrize("name", list(JUNK))
@pytest.mark.parametrize("command", ["analyze", "info", "report", "replay"])
def test_a_file_that_is_not_a_capture_is_refused_by_every_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, name: str
) -> None:
    path = tmp_path / name
    path.write_bytes(JUNK[name])
    extra = {
        "report": ["-o", str(tmp_path / "r.md")],
        "replay": ["--target", "http://127.0.0.1:9", "--capture", str(tmp_path / "rp.jsonl")],
    }.get(command, [])
    code, err = run([command, str(path), *extra], capsys)
    assert code == INPUT, err
    assert str(path) in err or command == "info"
    assert not (tmp_path / "r.md").exists() and not (tmp_path / "rp.jsonl").exists()


@pytest.mark.parametrize(
    "args",
    [
        [
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--stall-after",
            "0",
        ],
        [
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--stall-after",
            "-1",
        ],
        [
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--engine-metrics",
            "notaurl",
        ],
        [
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--health",
            "ftp://x/",
        ],
        ["proxy", "--listen", "nowhere", "--upstream", "http://127.0.0.1:9"],
        ["proxy", "--listen", "127.0.0.1:70000", "--upstream", "http://127.0.0.1:9"],
        ["proxy", "--listen", "127.0.0.1:0", "--upstream", "http://127.0.0.1:99999"],
        [
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--fault",
            "bogus",
        ],
        [
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--max-connections",
            "-1",
        ],
        [
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--metrics-interval",
            "nan",
        ],
        [
            "watch",
            "--engine-metrics",
            "http://127.0.0.1:9/metrics",
            "--capture",
            "w.jsonl",
            "--duration",
            "0",
        ],
        ["analyze", str(SCENARIO), "--hang-at", "+9999"],
        ["analyze", str(SCENARIO), "--hang-at", "yesterday"],
        ["analyze", str(SCENARIO), "--limit", "-5"],
        ["proxy", "--listen", "127.0.0.1:0"],
        ["nonsense"],
    ],
    ids=lambda a: " ".join(a[:1] + a[-2:]),
)
def test_bad_arguments_are_one_line_and_exit_2(
    args: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, err = run(args, capsys)
    assert code == USAGE, err
    first = err.splitlines()[0]
    assert first.startswith("tracer") and ("error" in first or first.startswith("tracer: "))
    assert len(err.splitlines()) <= 2  # the reason, and where help is
    assert not (tmp_path / "w.jsonl").exists()


def test_hang_at_outside_the_captures_names_their_range(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = run(["analyze", str(SCENARIO), "--hang-at", "+9999"], capsys)
    assert code == USAGE and "+0 to +11.274 s" in err


def test_demo_to_a_folder_it_cannot_make(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["demo", "--out", "/proc/no/such/place"], capsys)
    assert code == RUNTIME and err.count("\n") == 1


def test_info_says_what_a_capture_holds(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    code = cli.main(["info", str(SCENARIO), "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["schema"] == "tracer.info/1"
    (one,) = doc["captures"]
    assert one["capture"] and one["tap"] == "tap" and one["ended_cleanly"]
    assert one["upstream_role"] == "engine (inferred)" and one["records_lost"] == 0
    assert one["by_type"]["request"] == 16 and one["start"].endswith("Z")


def test_every_option_with_a_default_shows_it_in_help() -> None:
    """--help of every command: each option with a default says what it is."""
    import argparse

    from tracer.arguments import HelpFormatter

    def walk(parser: argparse.ArgumentParser, name: str) -> list[str]:
        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    missing += walk(sub, f"{name} {sub_name}")
            elif action.option_strings and action.default not in (None, False, [], "==SUPPRESS=="):
                shown = HelpFormatter(name)._get_help_string(action) or ""
                if not action.help or "default" not in shown:
                    missing.append(f"{name} {action.option_strings[0]}")
        return missing

    assert walk(cli._parser(), "tracer") == []
