"""The simulated engine's faults: what each does, their spelling, the rules that choose.

Apart from the server because a fault is data (its spelling, its arguments, the rules
that choose a completion), read from ``--fault`` and ``x-sim-fault``; the server
(``engine``) does what each one says.

Faults (``parse_fault``): ``NAME[:ARG...][@RULE,...]``, the spelling of ``tracer proxy
--fault`` (``faultspec``; ``docs/faults.md``). The arguments are named and may be given by
position too (``stall:after=3:for=10`` = ``stall:3:10``):

=========================  =============================================================
``stall[:after][:for]``    after ``after`` tokens (default 1) the request gets no tokens
                           for ``for`` seconds (default 30); it stays in the running
                           batch, other requests go on
``wedge[:after][:for]``    after ``after`` tokens the whole scheduler stops for ``for``
                           seconds: no tokens for anyone, gauges and counters frozen,
                           ``/v1/loads`` waits
``lost``                   the request is read and never answered; it is neither running
                           nor queued
``close[:after]``          after ``after`` content chunks (0: right after the response
                           head) the connection is closed with FIN, without the
                           terminating chunk
``reset[:after]``          the same with RST
``500``                    HTTP 500 with SGLang's JSON error body, before any stream
``error[:after]``          after ``after`` content chunks, ``data: {"error": {...}}``,
                           ``data: [DONE]`` and a clean end of the chunked body
                           (SGLang's abort)
``ignore-disconnect``      the request is answered as usual, but a client that goes away
                           does not abort it: it stays in the running batch and decodes
                           on to its ``max_tokens`` (counted running, ``realtime_tokens``
                           moving, finished at the end, never counted aborted), holding
                           its batch slot meanwhile (vLLM #9428: "Running: 1 reqs"
                           minutes after the disconnect)
=========================  =============================================================

Rules (``--fault`` only) on the engine's completion counter (1, 2, 3 ...): ``every=N``
(completions N, 2N, ...), ``nth=K`` (completion K only), ``from=K`` (K and later),
``times=N`` (at most N injections), ``prob=P[,seed=S]``; none means every completion.
The first fault whose rules match wins. ``x-sim-fault`` chooses its own request's fault
(no rules) and overrides ``--fault``. Examples: ``stall:after=3:for=10@every=5``,
``lost@nth=2``, ``reset:after=0@from=4``, ``ignore-disconnect@nth=1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..faults.spec import bind_args, counter_rules, fail, rule_keys, split_spec, to_int, to_seconds

FAULT_KINDS = ("stall", "wedge", "lost", "close", "reset", "500", "error", "ignore-disconnect")
FAULT_ARGS: dict[str, tuple[str, ...]] = {  # each fault's arguments, in positional order
    "stall": ("after", "for"),
    "wedge": ("after", "for"),
    "lost": (),
    "close": ("after",),
    "reset": ("after",),
    "500": (),
    "error": ("after",),
    "ignore-disconnect": (),
}
FAULT_USAGE = {
    kind: kind + "".join(f"[:{a}={'S' if a == 'for' else 'N'}]" for a in args) + "[@RULE,...]"
    for kind, args in FAULT_ARGS.items()
}
RULE_KEYS: dict[str, str] = rule_keys("engine")  # the engine's rules (faultspec.RULES)


@dataclass(frozen=True)
class Fault:
    """One engine fault: what it does (kind, after, seconds) and its rules."""

    kind: str
    after: int = 1
    seconds: float = 30.0
    every: int | None = None
    nth: int | None = None
    start: int | None = None  # from=
    times: int | None = None
    prob: float | None = None
    seed: int = 0

    def matches(self, seq: int) -> bool:
        """The counter rules (every, nth, from) for completion ``seq``; ``times`` and
        ``prob`` are counted by the engine (``SimEngine._fault_for``)."""
        if self.nth is not None and seq != self.nth:
            return False
        if self.every is not None and seq % self.every != 0:
            return False
        return not (self.start is not None and seq < self.start)

    def __str__(self) -> str:
        parts = [self.kind]
        if "after" in FAULT_ARGS[self.kind]:
            parts.append(f"after={self.after}")
        if "for" in FAULT_ARGS[self.kind]:
            parts.append(f"for={self.seconds:g}")
        rules = [
            f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
            for key, value in (
                ("every", self.every),
                ("nth", self.nth),
                ("from", self.start),
                ("times", self.times),
                ("prob", self.prob),
                ("seed", self.seed if self.prob is not None and self.seed else None),
            )
            if value is not None
        ]
        return ":".join(parts) + (f"@{','.join(rules)}" if rules else "")


def parse_fault(spec: str, *, rules: bool = True) -> Fault:
    """``NAME[:ARG...][@RULE,...]`` (``faultspec``'s spelling) to a ``Fault``; raises
    ``FaultSpecError`` (a ``ValueError``). ``rules=False``: a spec that chooses the fault
    of its own request (``x-sim-fault``), where rules have no meaning."""
    parts = split_spec(spec, FAULT_KINDS, "engine")
    kind, text = parts.name, parts.text
    if parts.at and not rules:
        raise fail(
            text,
            "x-sim-fault takes no rules",
            f"the header chooses the fault of its own request: write {text.partition('@')[0]}",
        )
    args = bind_args(parts, FAULT_ARGS[kind], FAULT_USAGE[kind])
    values: dict[str, Any] = {}
    if "after" in args:
        values["after"] = to_int(text, "after", args["after"], 0)
    if "for" in args:
        values["seconds"] = to_seconds(text, "for", args["for"], finite=False)
    counters = counter_rules(parts)
    for key, value in counters.items():
        if key == "prob":
            values["prob"] = float(value)
        else:
            values["start" if key == "from" else key] = int(value)
    return Fault(kind=kind, **values)
