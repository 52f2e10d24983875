"""The command lines of the README and docs/*.md, read as a newcomer copies them."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
OPERATORS = set("|&;<>()")


def section(text: str, heading: str) -> str:
    """The text under ``## heading``, up to the next ``## `` heading."""
    found = re.search(rf"^## {re.escape(heading)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, f"README.md has no '## {heading}' section"
    return found.group(1)


def fenced_blocks(text: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(text)]


def command_lines(block: str) -> Iterator[str]:
    """The ``tracer ...`` command lines of a code block, continuation lines joined."""
    pending = ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        words = line.split()
        if len(words) < 2 or words[0] != "tracer":
            continue
        names = [w for w in words[1:3] if not w.startswith("-")]
        if any(w.endswith(":") for w in names):
            continue  # a command's own output: ``tracer proxy: ...``, ``tracer sim engine: ...``
        yield line


def argv(line: str) -> list[str]:
    """The words a shell gives ``tracer``: comments dropped, nothing after ``|``, ``>``..."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    for word in lexer:
        if word and set(word) <= OPERATORS:
            break
        words.append(word)
    return words


def substitute(words: list[str], subs: dict[str, str]) -> list[str]:
    out = []
    for word in words:
        for old, new in subs.items():
            word = word.replace(old, new)
        out.append(word)
    return out
