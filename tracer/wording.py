"""Counts in sentences: "1 connection", "2 connections", never "1 connections"."""

from __future__ import annotations


def counted(count: int, word: str, plural: str | None = None) -> str:
    """``count`` and ``word``, in the plural unless the count is one."""
    return f"{count} {word if count == 1 else (plural or word + 's')}"
