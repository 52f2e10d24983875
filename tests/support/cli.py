"""The command line's ``main`` called in this process, as a user's shell would see it."""

from __future__ import annotations

import pytest

from tracer.cli import commands as cli


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``tracer ARGV``: its exit code and stderr, which never holds a traceback."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err
