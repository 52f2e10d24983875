"""Requests that say they are a tap's own (``x-tracer-probe``) and that no capture of the
analysis vouches for: they stay client requests, and a note says so.

A tap leaves a request out of its tables only when the header carries the nonce of a
capture in the analysis (``protocol/probe_mark``): the header alone is anyone's to send,
and a client that sent it must not hide its request from the incident report.
"""

from __future__ import annotations

from ...wording import counted
from .context import Context
from .model import EvidenceItem, Finding


def analyze_probe_marks(ctx: Context) -> list[Finding]:
    ids, total = ctx.e.unvouched, ctx.e.unvouched_total
    if not total:
        return []
    summary = (
        f"{counted(total, 'request')} carried x-tracer-probe that no capture in this analysis "
        "vouches for (no tap here sent them with its run's nonce): they are counted as "
        "client requests."
    )
    return [
        Finding(
            party="unknown",
            kind="probe_header_unvouched",
            summary=summary,
            requests=list(ids),
            connections=sorted({i.rsplit("/", 1)[0] for i in ids}),
            evidence=[
                EvidenceItem(
                    text=f"{counted(total, 'request')} with x-tracer-probe and no known nonce"
                    + (f" (the first {len(ids)} named)" if len(ids) < total else ""),
                    figures={"requests": total},
                )
            ],
            ruled_out=[],
            confidence="high",
            settle="the capture of the tap that sent them, if a tap did (its capture_start "
            "holds the nonce); otherwise the client sends the header itself",
            note=True,
        )
    ]
