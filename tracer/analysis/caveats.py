"""What the captures may be missing, said beside the verdict.

Apart from the fold (``summary``) because it reads what reading the captures found (lost
records, bad lines, a cut last line, no capture end), not their events.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..wording import counted


def _caveats(
    captures: list[dict[str, Any]],
    taps: dict[str, dict[str, Any]],
    lost: int,
    packet_losses: list[str] | None = None,
    *,
    out_of_range: tuple[int, Mapping[str, int]] = (0, {}),
) -> list[dict[str, Any]]:
    """What the captures may be missing, said beside the verdict (``kind``, the figures,
    ``text``): records the writer lost, lines that could not be read, a cut last line, a
    capture with no end (its tap killed, or still writing: what was in flight then is
    unknown), engine samples dropped for a figure out of its range (``out_of_range``: how
    many samples, and per figure how many had it out of range: ``evidence/ranges.py``)."""
    out: list[dict[str, Any]] = []
    dropped = max(lost, sum(int(t.get("dropped") or 0) for t in taps.values()))
    if dropped:
        text = (
            f"{counted(dropped, 'record')} lost by the capture writer (disk full or too slow): what "
            "they said is missing from this analysis"
        )
        out.append({"kind": "records_lost", "count": dropped, "text": text})
    samples, figures = out_of_range
    if samples:
        named = ", ".join(f"{k} ({n})" for k, n in sorted(figures.items()))
        text = f"{counted(samples, 'engine sample')} dropped, a figure out of its range: {named}"
        out.append(
            {
                "kind": "samples_out_of_range",
                "count": samples,
                "figures": dict(sorted(figures.items())),
                "text": text,
            }
        )
    for reason in packet_losses or []:
        out.append({"kind": "packet_capture_loss", "text": reason})
    for c in captures:
        if c.get("bad_lines"):
            first = (c.get("problems") or [None])[0]
            text = f"{c['path']}: {c['bad_lines']} line(s) could not be read and were skipped"
            out.append(
                {
                    "kind": "bad_lines",
                    "capture": c["path"],
                    "count": c["bad_lines"],
                    "first": first,
                    "text": text + (f" (first: {first})" if first else ""),
                }
            )
        if c.get("torn_tail"):
            text = f"{c['path']}: its last line is cut (the writer stopped mid-line)"
            out.append({"kind": "torn_tail", "capture": c["path"], "text": text})
    for name in sorted(taps):
        if taps[name].get("ended") is None:
            text = (
                f"tap {name}: no capture_end — the tap is still running (a live capture: "
                "stop it for the whole story) or was killed; what was in flight at the "
                "capture's end is unknown"
            )
            out.append({"kind": "no_capture_end", "tap": name, "text": text})
    return out
