"""What a tap injected on purpose (``--fault``) is nobody's fault: the findings it caused
give way to one ``injected_fault`` note per tap and spec.

Its own module because finding every request a fault acted on, at the taps in front
too, takes the join, the connection both taps share, or the request's head.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal, NamedTuple

from ...wording import counted
from ..rows import RequestRow
from .context import Context
from .join import JOIN_SLACK
from .model import EvidenceItem, Finding, RuledOut
from .quotes import MAX_QUOTED, more_item, outcome, outcome_text, ts

# injected faults that close a connection between requests: what they do shows on the
# next request, at the tap in front, which never reaches the faulting tap
CLOSING_FAULTS = frozenset({"close-idle-after"})


def injected_by_the_tap(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """What a tap injected on purpose (``--fault``: its ``fault`` records) is never a fault
    of the client, a proxy or the engine: a finding whose requests were all injected (at
    some tap, for a request joined across taps, or found at a tap in front through the
    connection both recorded or by its head) gives way to one ``injected_fault`` note per
    tap and spec, which says what the clients got and what the analysis would have
    called it without the record (what a resilience test, or a test of the analysis,
    wants to read)."""
    if not ctx.e.faults:
        return findings
    records: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    faults_of: dict[str, set[tuple[str, str]]] = defaultdict(set)  # request id -> its faults
    for rec in ctx.e.faults:
        key = (str(rec.get("tap")), str(rec.get("spec") or rec.get("fault")))
        records[key].append(rec)
        if isinstance(rec.get("conn"), int) and isinstance(rec.get("seq"), int):
            faults_of[f"{key[0]}/{rec['conn']}/{rec['seq']}"].add(key)
    groups = [*ctx.join.joined(), *ctx.join.masked_groups(), *ctx.join.bunched_groups()]
    for seen in groups:  # a request's copies at other taps
        keys = set().union(*(faults_of.get(r.id, set()) for r in seen.values()))
        if keys:
            for r in seen.values():
                faults_of[r.id] |= keys
    later = _through_the_connection(ctx, records, set(faults_of))
    linked = {hit.row.id for found in later.values() for hit in found}
    for key, found in _by_head(ctx, records, set(faults_of) | linked, groups).items():
        later[key] = later.get(key, []) + found
    for key, found in later.items():
        for hit in found:
            faults_of[hit.row.id].add(key)
    kept: list[Finding] = []
    read_as: dict[tuple[str, str], set[str]] = defaultdict(set)
    for f in findings:
        if f.requests and all(rid in faults_of for rid in f.requests):
            for rid in f.requests:
                for key in faults_of[rid]:
                    read_as[key].add(f.kind)
        else:
            kept.append(f)
    rows = {r.id: r for r in ctx.interesting if r.injected}
    return kept + [
        _injected_note(k, records[k], rows, read_as[k], later.get(k, [])) for k in sorted(records)
    ]


class _Found(NamedTuple):
    """A request at a tap in front that a fault of the tap behind acted on, found without
    a request join: ``there`` is what it is at the faulting tap (its connection, or for
    ``by_head`` its request), ``how`` how it was found."""

    row: RequestRow
    there: str
    how: Literal["after_close", "same_position", "by_head"]


def _through_the_connection(
    ctx: Context, records: dict[tuple[str, str], list[dict[str, Any]]], covered: set[str]
) -> dict[tuple[str, str], list[_Found]]:
    """Requests at a tap in front that a fault of the tap behind acted on, found through
    the connection the two taps share (``Context.conns_in_front``) where no request join
    found them: a request written after the faulting tap had closed the connection
    (``close-idle-after``) never reached it, and one it stopped reading (``half-open``)
    reached it without the body a join goes by. The request in front is the one at the
    same position on the connection (a tap relays a connection's requests in order), or
    for a close, any after it. By fault."""
    acts: dict[tuple[str, int], list[tuple[tuple[str, str], int, float, bool]]] = defaultdict(list)
    for key, recs in records.items():
        for rec in recs:
            conn, seq = rec.get("conn"), rec.get("seq")
            if isinstance(conn, int) and isinstance(seq, int):
                closing = rec.get("fault") in CLOSING_FAULTS
                acts[(key[0], conn)].append((key, seq, float(rec["t"]), closing))
    if not acts:
        return {}
    ids = {f"{tap}/{conn}": (tap, conn) for tap, conn in acts}
    fronts = {(f.tap, f.conn): back for back, f in ctx.conns_in_front(set(acts)).items()}
    found: dict[tuple[str, str], list[_Found]] = defaultdict(list)
    for r in ctx.interesting:
        back = fronts.get((r.tap, r.conn))
        if back is None or r.id in covered or not r.method:
            continue
        for key, seq, t, closing in acts[ids[back]]:
            slack = ctx.join.slack(r.tap, key[0])
            after = r.seq > seq and r.start >= t - slack
            same = r.seq == seq and r.start <= t + slack
            if closing and after:
                found[key].append(_Found(r, back, "after_close"))
                break
            if not closing and same:
                found[key].append(_Found(r, back, "same_position"))
                break
    return found


def _by_head(
    ctx: Context,
    records: dict[tuple[str, str], list[dict[str, Any]]],
    covered: set[str],
    groups: list[dict[str, RequestRow]],
) -> dict[tuple[str, str], list[_Found]]:
    """The copies at taps in front of a request the faulting tap read only the head of
    (``half-open``), where a hop between the taps leaves no shared connection: no body to
    join them by, so the latest unjoined request with the same method and target that a
    tap in front began at most ``JOIN_SLACK`` before it."""
    rows = {r.id: r for r in ctx.interesting}
    joined = {r.id for g in groups if len(g) > 1 for r in g.values()}  # to another tap
    rank = {tap: i for i, tap in enumerate(ctx.order)}
    by_head: dict[tuple[str, str], list[RequestRow]] = defaultdict(list)
    for r in ctx.interesting:
        if r.id not in covered and r.id not in joined:
            by_head[(r.method, r.target)].append(r)
    taken: set[str] = set()
    found: dict[tuple[str, str], list[_Found]] = defaultdict(list)
    for key, recs in records.items():
        for rec in recs:
            back = rows.get(f"{key[0]}/{rec.get('conn')}/{rec.get('seq')}")
            if back is None or back.request_complete or back.id in joined:
                continue
            fronts: dict[str, RequestRow] = {}
            for r in by_head.get((back.method, back.target), []):
                slack = ctx.join.slack(r.tap, back.tap)
                if (
                    rank.get(r.tap, 0) < rank.get(back.tap, 0)
                    and r.id not in taken
                    and back.start - JOIN_SLACK <= r.start <= back.start + slack
                    and (r.tap not in fronts or r.start > fronts[r.tap].start)
                ):
                    fronts[r.tap] = r
            taken.update(r.id for r in fronts.values())
            found[key] += [_Found(r, back.id, "by_head") for r in fronts.values()]
    return found


def _injected_note(
    key: tuple[str, str],
    records: list[dict[str, Any]],
    rows: dict[str, RequestRow],
    read_as: set[str],
    later: list[_Found],
) -> Finding:
    tap, spec = key
    ids = sorted(
        {f"{tap}/{r['conn']}/{r['seq']}" for r in records if isinstance(r.get("seq"), int)}
        | {hit.row.id for hit in later},
        key=lambda rid: (
            rid.split("/")[0],
            *(int(x) if x.isdigit() else 0 for x in rid.split("/")[-2:]),
        ),
    )
    evidence: list[EvidenceItem] = []
    for rec in records[:MAX_QUOTED]:
        seq = rec.get("seq")
        rid = f"{tap}/{rec.get('conn')}" + (f"/{seq}" if isinstance(seq, int) else "")
        row = rows.get(rid)
        line = f"{ts(rec['t'])} {rid}" + (f" {row.method} {row.target}" if row else "")
        line += f": {rec.get('detail') or spec}"
        figures: dict[str, Any] = {"fault": spec, "read_as": sorted(read_as)}
        if rec.get("detail"):
            figures["detail"] = rec["detail"]
        if row is not None:
            line += f"; the client got {outcome_text(row)}"
            figures |= outcome(row)
        evidence.append(
            EvidenceItem(
                text=line,
                t=float(rec["t"]),
                tap=tap,
                request=rid if isinstance(seq, int) else None,
                figures=figures,
            )
        )
    if len(records) > MAX_QUOTED:
        evidence.append(more_item(len(records) - MAX_QUOTED, "injection(s)"))
    for r, there, found in later[:MAX_QUOTED]:
        link = f" ({r.tap}/{r.conn} is {there}, one TCP connection)"
        how = {
            "after_close": f"written at tap {r.tap} after tap {tap} had closed the connection"
            + link,
            "same_position": f"the same request at tap {r.tap}, request {r.seq} on both" + link,
            "by_head": f"the same request at tap {r.tap} as {there}, matched by its head",
        }[found]
        evidence.append(
            EvidenceItem(
                text=f"{ts(r.start)} {r.id} {r.method} {r.target}: {how}; the client got "
                f"{outcome_text(r)}",
                t=r.start,
                tap=r.tap,
                request=r.id,
                figures={"found": found, "there": there, "fault": spec} | outcome(r),
            )
        )
    if len(later) > MAX_QUOTED:
        evidence.append(more_item(len(later) - MAX_QUOTED, "such request(s)"))
    summary = (
        f"Tap {tap} injected `{spec}` itself (opt-in --fault), {counted(len(records), 'time')}"
        + (f", on {counted(len(ids), 'request')}" if ids else "")
        + ": not a fault of the client, a proxy or the engine."
    )
    if read_as:
        summary += f" Without its fault records it would read as: {', '.join(sorted(read_as))}."
    why = f"tap {tap} injected it on purpose (its fault records)"
    return Finding(
        party="none",
        kind="injected_fault",
        summary=summary,
        requests=ids,
        connections=sorted({f"{tap}/{r.get('conn')}" for r in records}),
        evidence=evidence,
        ruled_out=[RuledOut(p, why) for p in ("client", "proxy", "engine")],
        confidence="high",
        settle=None,
        note=True,
        t=min(float(r["t"]) for r in records),
    )
