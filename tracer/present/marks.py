"""Each hang mark's connections, as lines for the text and Markdown outputs: what the
front tap's client connections were doing when the harness was seen hung (moving,
silent, idle since, quiet, closed), the first ``SHOWN`` of each state, then counts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SHOWN = 10  # connections listed per state and mark; the rest are counted
ORDER = ("silent", "quiet", "moving", "idle", "closed")


def _words(c: dict[str, Any], rel: Callable[[float], str]) -> str:
    since = rel(c["since"]) if c.get("since") is not None else "?"
    state = c["state"]
    if state == "silent":
        return f"in flight and silent since {since} ({c.get('direction')}, {c['request']})"
    if state == "moving":
        return f"in flight and moving ({c['request']})"
    if state == "closed":
        return f"closed at {since}"
    how = "a complete answer" if c.get("complete") else "an answer that was not complete"
    quiet = "; a conversation whose client sent nothing more" if c.get("quiet") else ""
    return f"idle since {since} after {how} ({c['request']}, {c['requests']} requests){quiet}"


def mark_lines(result: dict[str, Any], rel: Callable[[float], str], bullet: str) -> list[str]:
    """One heading line per mark, then its connections by state."""
    lines: list[str] = []
    for m in (result.get("evidence") or {}).get("mark_states") or []:
        counts = m.get("counts") or {}
        told = ", ".join(f"{counts[k]} {k}" for k in ORDER if counts.get(k)) or "none"
        lines.append(f"at the hang mark {rel(m['t'])}, tap {m['tap']}'s connections: {told}")
        for key in ORDER:
            shown = [
                c
                for c in m["connections"]
                if (c.get("quiet") if key == "quiet" else c["state"] == key and not c.get("quiet"))
            ]
            for c in shown[:SHOWN]:
                lines.append(f"{bullet}{c['connection']}: {_words(c, rel)}")
            if len(shown) > SHOWN or counts.get(key, 0) > len(shown[:SHOWN]):
                lines.append(
                    f"{bullet}... and {counts.get(key, 0) - min(len(shown), SHOWN)} more {key}"
                )
    return lines
