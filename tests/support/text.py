"""Reading what a command printed for people."""

from __future__ import annotations


def line_with(text: str, needle: str) -> str:
    """The first line of ``text`` with ``needle`` in it."""
    lines = [line for line in text.splitlines() if needle in line]
    assert lines, f"no line with {needle!r} in:\n{text}"
    return lines[0]
