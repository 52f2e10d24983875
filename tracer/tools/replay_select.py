"""``tracer replay --only``: which of a capture's requests the replay sends.

Apart from the capture's reading and the comparison because it is the command line's
part: a criterion that selects nothing is an error, not an empty run.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from .replay_capture import Capture, CapturedRequest


@dataclass
class Selection:
    """``--only``: connections, requests (one or a range of positions), x-request-id globs.

    No criterion: everything. Several: a request is selected when any of them selects it.
    """

    conns: set[int] = field(default_factory=set)
    requests: set[tuple[int, int]] = field(default_factory=set)
    ranges: list[tuple[int, int, int]] = field(default_factory=list)  # conn, first, last
    ids: list[str] = field(default_factory=list)

    @property
    def everything(self) -> bool:
        return not (self.conns or self.requests or self.ranges or self.ids)

    def selects(self, req: CapturedRequest) -> bool:
        if self.everything or req.conn in self.conns or (req.conn, req.seq) in self.requests:
            return True
        if any(c == req.conn and a <= req.seq <= b for c, a, b in self.ranges):
            return True
        rid = req.request_id
        return rid is not None and any(fnmatch.fnmatchcase(rid, g) for g in self.ids)

    def check(self, capture: Capture) -> None:
        """Every criterion must select something: a typo is an error, not an empty run."""
        have = sorted(capture.conns)
        span = f"{have[0]}-{have[-1]}" if have else "none"
        for c in sorted(
            self.conns | {c for c, _ in self.requests} | {c for c, _, _ in self.ranges}
        ):
            if c not in capture.conns:
                raise ValueError(f"--only: the capture has no connection {c} (it has {span})")
        for c, s in sorted(self.requests):
            if s > len(capture.conns[c].requests):
                raise ValueError(
                    f"--only req={c}:{s}: connection {c} has "
                    f"{len(capture.conns[c].requests)} requests"
                )
        reqs = capture.requests()
        for glob in self.ids:
            if not any(r.request_id and fnmatch.fnmatchcase(r.request_id, glob) for r in reqs):
                raise ValueError(f"--only id={glob}: no request has an x-request-id matching it")


ONLY_HELP = (
    "select what to replay (repeatable; a request is replayed when any selects it): "
    "conn=N[,M...] whole connections; req=C:S a request (C:A-B positions A to B, or an "
    "analysis id TAP/C/S); id=GLOB requests whose x-request-id matches (e.g. id='s1-*' "
    "for session 1 of tracer sim harness)"
)


def parse_only(values: list[str]) -> Selection:
    sel = Selection()
    for value in values:
        key, sep, rest = value.partition("=")
        key = key.strip().lower()
        if not sep or not rest.strip():
            raise ValueError(f"--only {value!r}: expected KEY=VALUE (conn=, req= or id=)")
        for item in (x.strip() for x in rest.split(",")):
            if not item:
                continue
            if key == "conn":
                sel.conns.add(_positive(item, value))
            elif key == "req":
                _parse_req(item, value, sel)
            elif key == "id":
                sel.ids.append(item)
            else:
                raise ValueError(f"--only {value!r}: unknown key {key!r} (conn, req or id)")
    return sel


def _parse_req(item: str, value: str, sel: Selection) -> None:
    if "/" in item:  # an analysis id: TAP/CONN/SEQ
        parts = item.rsplit("/", 2)
        if len(parts) != 3:
            raise ValueError(f"--only {value!r}: {item!r} is not TAP/CONN/SEQ")
        sel.requests.add((_positive(parts[1], value), _positive(parts[2], value)))
        return
    conn, sep, pos = item.partition(":")
    if not sep:
        raise ValueError(f"--only {value!r}: {item!r} is not CONN:SEQ (e.g. req=3:2)")
    first, dash, last = pos.partition("-")
    c, a = _positive(conn, value), _positive(first, value)
    if dash:
        b = _positive(last, value)
        if b < a:
            raise ValueError(f"--only {value!r}: empty range {pos}")
        sel.ranges.append((c, a, b))
    else:
        sel.requests.add((c, a))


def _positive(text: str, value: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"--only {value!r}: {text!r} is not a number >= 1")
    return int(text)
