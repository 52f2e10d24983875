"""The README and docs/*.md as written.

* Every ``tracer ...`` line in a fenced block of the README and of ``docs/*.md`` is
  accepted by the command line's parser, so the documentation never shows a command the
  CLI rejects. Program output quoted in a block (``tracer proxy: listening on ...``) is
  not a command; the part after a shell operator (``|``, ``>``, ``;``) is not the CLI's.
* The quick start has the commands it promises; pyproject installs the ``tracer`` script.
* Every relative link (and its ``#anchor``) in the README and ``docs/`` resolves.

The quick start run for real: tests/integration/test_readme.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.docs import (
    DOCS,
    FENCE,
    README,
    ROOT,
    argv,
    command_lines,
    fenced_blocks,
    section,
    substitute,
)
from tracer.cli.commands import _parser

# Placeholders a reader fills in: for the parser, any address will do.
PLACEHOLDERS = {"ROUTER:PORT": "127.0.0.1:8000", "ENGINE:PORT": "127.0.0.1:30000"}


# ---- every command line in the docs parses ---------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=[p.relative_to(ROOT).as_posix() for p in DOCS])
def test_every_tracer_line_parses(doc: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [line for block in fenced_blocks(doc.read_text()) for line in command_lines(block)]
    if doc == README:
        assert len(lines) >= 20, lines  # the extraction itself works
    rejected = []
    for line in lines:
        words = substitute(argv(line), PLACEHOLDERS)
        try:
            _parser().parse_args(words[1:])
        except SystemExit as exc:
            err = capsys.readouterr().err.strip()
            rejected.append(f"{line}\n    exit {exc.code}: {err}")
    assert not rejected, "the CLI rejects:\n" + "\n".join(rejected)


def test_the_quick_start_has_the_commands_it_promises() -> None:
    quick = section(README.read_text(), "Quick start")
    blocks = fenced_blocks(quick)
    commands = [argv(line) for block in blocks for line in command_lines(block)]
    assert [c[1] for c in commands] == ["proxy", "report", "analyze", "info"], commands
    proxy = commands[0]
    for option in ("--listen", "--upstream", "--capture", "--engine-metrics"):
        assert option in proxy, option
    assert "--brief" in commands[2]
    assert any(b.lstrip().startswith(("make demo", "make test")) for b in blocks)
    assert "OPENAI_BASE_URL" in quick and "base_url=" in quick
    for way in (". .venv/bin/activate", "pipx install .", ".venv/bin/tracer"):
        assert way in quick, way


def test_pyproject_installs_the_tracer_script() -> None:
    """The quick start's ``pipx install .`` puts ``tracer`` on PATH through this entry."""
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\[project\.scripts\]\s*\ntracer = "tracer\.cli:main"', text, re.M)


# ---- links ---------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = FENCE.sub("", doc.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=[p.relative_to(ROOT).as_posix() for p in DOCS])
def test_every_relative_link_resolves(doc: Path) -> None:
    text = FENCE.sub("", doc.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        found = linked.exists() and (
            not anchor or linked.suffix != ".md" or anchor in anchors(linked)
        )
        if not found:
            broken.append(target)
    assert not broken, broken
