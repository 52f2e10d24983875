"""A tap-less run: what ``tcpdump`` recorded reads as the tap that was there (issue 28).

One run, two observation points: the multi-round harness (openai SDK) -> ``tracer proxy``
(the tap, writing its capture) -> the simulated engine, all on 127.0.0.1, with an engine
that sends an error event on its 3rd completion and closes the 5th mid-stream. Meanwhile
``tcpdump -i lo`` records the tap's listen port and the engine's port. The pcap is read
twice: ``--port TAP`` (the client's connections to the tap: the tap's own client side)
and ``--port ENGINE`` (the tap's connections to the engine: the tap-less view, as if the
harness had talked to the engine directly). Each must give the tap's request and
connection tables and findings.

What must agree exactly: every request row's method, target, status, termination, events,
body bytes, seq, x-request-id, hashes, OpenAI fields, keep-alive reuse; every connection
row's closing side and how, bytes each way, requests, anomalies; the findings' kinds,
parties, confidence, requests and ruled-out parties; the verdict; the totals.

What differs, and why:

* times. The tap stamps bytes when its process reads them; a packet is stamped when the
  kernel sends it (microseconds, the file's resolution). So they bracket the tap's: a
  request's bytes leave the client (pcap, tap port) before the tap reads them, and the
  tap reads them before it writes them to the engine (pcap, engine port); a response's
  bytes go the other way. ``start``: pcap-tap <= tap <= pcap-engine; ``first_event``,
  ``last_event``, ``end``: pcap-engine <= tap <= pcap-tap; so ``ttfb``, ``first_token``,
  ``duration``: pcap-engine <= tap <= pcap-tap. Each within ``CLOCK`` (the tap's wall
  clock is its monotonic clock plus an offset taken at its start). How far apart they
  may be is the tap's relay latency, a scheduling delay on a loaded machine: ``SPREAD``.
  ``max_gap``, ``idle_before`` (gaps, no order) and the connections' ``closed`` and
  ``duration`` within ``SPREAD``; ``zero_gaps``, ``bunch_gaps`` (gaps classified by their
  length: two events in one read at the tap, two segments on the wire) are not compared.
* ``upstream_connect``: the tap times its own connect() to the engine (in its event loop);
  the pcap times a SYN to its SYN-ACK (in the kernel): at the tap port the client's to
  the tap, at the engine port the very handshake of the tap's connect() (pcap <= tap).
  Both under ``SPREAD``.
* addresses: a passive tap has no socket of its own (``upstream_local`` None). Tap port:
  the same client (``peer``), the tap as the server (``upstream``). Engine port: the
  tap's upstream socket is the client (``peer`` = the tap's ``upstream_local``).
* a client's FIN that crosses a response's last bytes at the tap (the openai SDK closes at
  an error event while ``data: [DONE]`` is on its way): the tap port's packets have the
  FIN first (in flight at the close, a half close), the tap read the engine's bytes first
  (neither). Both right where each looked; allowed for that connection at the tap port.
* connection numbers at the engine port: the tap connects upstream at a connection's first
  request, so two sessions racing number their engine connections in the order their
  first requests came; rows are matched by address there (by number at the tap port).
* what the upstream is. The tap asks the engine what it is at its start (its fingerprint:
  GET /get_server_info, a connection of its own, taken before tcpdump starts so that it is
  not in the pcap) and calls a stream the engine closed ``engine_truncated`` (engine,
  high); a passive capture cannot ask and says ``stream_cut`` (unknown, medium). That is
  knowledge, not observation: compared above is what each saw, the tap's capture without
  the ``topology`` record its fingerprint wrote (what ``--no-fingerprint`` writes). Then
  the knowledge, declared: the pcap at the engine port read with ``--upstream-role
  engine`` gives the findings (kinds, parties, confidence, requests) and the verdict of
  the tap with its fingerprint.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.analyze import analyze_async
from tests.support.engine import engine_running
from tests.support.net import wait_until
from tests.support.procs import count_records, tracer_proxy
from tests.support.tcpdump import require_tcpdump, tcpdump_lo
from tracer.capture.files import read_records
from tracer.sim.engine_faults import parse_fault
from tracer.sim.harness import HarnessConfig, run_harness

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

CLOCK = 0.001  # s: the tap's wall clock against the kernel's, and the µs roundings
SPREAD = 0.25  # s: the tap's relay latency (scheduling on a loaded 2-core machine)
FAULTS = ("error:after=2@nth=3", "close:after=2@nth=5")  # the engine's 3rd and 5th completions

# request fields that are times or follow from them
TIMES = {
    "start",
    "end",
    "first_event",
    "last_event",
    "max_event_at",
    "ttfb",
    "first_token",
    "duration",
}
GAPS = {"max_gap", "idle_before"}
BY_TIMING = {"zero_gaps", "bunch_gaps"}
NAMES = {"id", "tap", "conn"}
CONN_TIMES = {"opened", "closed", "duration", "upstream_connect"}
CONN_ADDRESSES = {"peer", "upstream", "upstream_local"}


async def test_a_tcpdump_capture_reads_as_the_tap_that_was_there(tmp_path: Path) -> None:
    require_tcpdump()
    capture, pcap = tmp_path / "tap.jsonl", tmp_path / "lo.pcap"
    faults = [parse_fault(spec) for spec in FAULTS]
    async with engine_running(ttft=0.05, itl=0.01, faults=faults) as sim:
        assert sim.bound is not None
        engine_port = sim.bound[1]
        async with tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", sim.url, "--tap", "t",
            "--capture", str(capture),
        ) as tap:  # fmt: skip
            # its fingerprint taken (its connection closed) before the packets are captured
            await wait_until(lambda: count_records(capture, "topology") == 1, timeout=15)
            async with tcpdump_lo(pcap, [tap.port, engine_port]) as dump:
                report = await run_harness(
                    HarnessConfig(
                        base_url=tap.url,
                        sessions=2,
                        rounds=4,
                        think=0.1,
                        max_tokens=8,
                        deadline=10.0,
                    )
                )

                await dump.until_connections_ended()  # (their last FINs too)
    outcomes = Counter(r.outcome for r in report.rounds)
    assert outcomes["error"] == 1 and outcomes["truncated"] == 1, report.rounds
    assert dump.dropped() == 0, f"the capture is incomplete: {dump.stderr()}"

    observed = without_topology(capture, tmp_path / "tap-observed.jsonl")
    numbers = await compare(observed, pcap, tap.port, engine_port)
    await compare_declared(capture, pcap, engine_port, numbers)


def without_topology(capture: Path, out: Path) -> Path:
    """The tap's capture without its ``topology`` record (as with ``--no-fingerprint``)."""
    kept = [r for r in read_records(capture) if r["type"] != "topology"]
    assert len(kept) == sum(1 for _ in read_records(capture)) - 1
    out.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in kept))
    return out


async def compare_declared(
    capture: Path, pcap: Path, engine_port: int, numbers: dict[int, int]
) -> None:
    """The tap with its fingerprint against the pcap at the engine's port with the role
    declared: the same findings and verdict."""
    at_tap = await analyze_async(capture)
    back = await analyze_async(pcap, "--port", str(engine_port), "--upstream-role", "engine")
    topo = at_tap["taps"][0]["topology"]
    assert (topo["upstream_role"], topo["basis"]) == ("engine", "inferred"), topo
    declared = back["taps"][0]["topology"]
    assert (declared["upstream_role"], declared["basis"]) == ("engine", "declared"), declared

    kinds = {(f["kind"], f["party"]) for f in at_tap["findings"]}
    assert kinds == {("engine_error_event", "engine"), ("engine_truncated", "engine")}, kinds
    assert sorted((f["kind"], f["party"]) for f in back["findings"]) == sorted(
        (f["kind"], f["party"]) for f in at_tap["findings"]
    )
    assert findings(back, numbers) == findings(at_tap, None)
    assert pick(back["verdict"], "kind", "party", "confidence") == pick(
        at_tap["verdict"], "kind", "party", "confidence"
    )


async def compare(capture: Path, pcap: Path, tap_port: int, engine_port: int) -> dict[int, int]:
    """The tap's capture against the pcap read at the tap's port and at the engine's;
    returns the engine port's connection numbers -> the tap's."""
    at_tap = await analyze_async(capture)
    front = await analyze_async(pcap, "--port", str(tap_port))
    back = await analyze_async(pcap, "--port", str(engine_port))

    # what the tap saw: a finding for each fault
    kinds = {(f["kind"], f["party"]) for f in at_tap["findings"]}
    assert kinds == {("engine_error_event", "engine"), ("stream_cut", "unknown")}, kinds

    tap_conns = {c["conn"]: c for c in at_tap["connections"]}
    # the tap port: the same connections, numbered alike, the same clients
    front_conns = {c["conn"]: c for c in front["connections"]}
    assert {n: c["peer"] for n, c in front_conns.items()} == {
        n: c["peer"] for n, c in tap_conns.items()
    }
    # the engine port: the tap's upstream connections, found by the tap's end of them
    by_local = {c["upstream_local"]: n for n, c in tap_conns.items()}
    back_to_tap = {c["conn"]: by_local[c["peer"]] for c in back["connections"]}
    assert sorted(back_to_tap.values()) == sorted(tap_conns)
    front_to_tap = {n: n for n in front_conns}

    for view, doc, numbers in (
        ("tap port", front, front_to_tap),
        ("engine port", back, back_to_tap),
    ):
        where = f"pcap at the {view}"
        assert doc["taps"][0]["kind"] == "pcap"
        compare_totals(at_tap, doc, where)
        compare_connections(at_tap, doc, numbers, where, engine_side=view == "engine port")
        compare_requests(at_tap, doc, numbers, where, engine_side=view == "engine port")
        assert findings(doc, numbers) == findings(at_tap, None), where
        assert pick(doc["verdict"], "kind", "party", "confidence") == pick(
            at_tap["verdict"], "kind", "party", "confidence"
        )
    return back_to_tap


# ---- the comparisons ---------------------------------------------------------------


def pick(row: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: row[k] for k in keys}


def compare_totals(tap: dict[str, Any], pcap: dict[str, Any], where: str) -> None:
    # (``events``: records, and the tap writes records a passive tap has no cause to)
    keys = ("connections", "requests", "reused_requests", "stalls", "terminations")
    assert pick(pcap["totals"], *keys) == pick(tap["totals"], *keys), where


def compare_connections(
    tap: dict[str, Any],
    pcap: dict[str, Any],
    numbers: dict[int, int],
    where: str,
    *,
    engine_side: bool,
) -> None:
    tap_rows = {c["conn"]: c for c in tap["connections"]}
    assert len(pcap["connections"]) == len(tap_rows), where
    for row in pcap["connections"]:
        ours = tap_rows[numbers[row["conn"]]]
        what = f"{where}: connection {row['id']} (tap's {ours['id']})"
        same = set(ours) - CONN_TIMES - CONN_ADDRESSES - NAMES
        if not engine_side and crossed(row, ours, tap["requests"]):
            same -= {"in_flight_at_close", "half_close"}
        assert pick(row, *same) == pick(ours, *same), what
        assert row["upstream_local"] is None, what  # no socket of its own
        if engine_side:
            assert (row["peer"], row["upstream"]) == (ours["upstream_local"], ours["upstream"])
            assert ours["opened"] <= row["opened"] + CLOCK, what  # the tap connects after
        else:
            assert row["peer"] == ours["peer"], what
            assert row["opened"] <= ours["opened"] + CLOCK, what  # the tap accepts after
        assert abs(row["opened"] - ours["opened"]) <= SPREAD, what
        for key in ("closed", "duration"):
            assert abs(row[key] - ours[key]) <= SPREAD, (what, key, row[key], ours[key])
        # the pcap: a SYN to its SYN-ACK, in the kernel; the tap: its connect() to the
        # engine, in its event loop (at the engine port, around that very handshake)
        assert 0 <= row["upstream_connect"] <= SPREAD, what
        assert 0 <= ours["upstream_connect"] <= SPREAD, what
        if engine_side:
            assert row["upstream_connect"] <= ours["upstream_connect"] + CLOCK, what


def crossed(row: dict[str, Any], ours: dict[str, Any], requests: list[dict[str, Any]]) -> bool:
    """The client's FIN crossed the last bytes of a response at the tap: on the wire the FIN
    came first (in flight at the close, the server wrote on after it: a half close); the
    tap had read those bytes from the engine before it read the client's FIN (nothing in
    flight). Both right, each where it looked; the response itself the same at both (its
    row is compared). E.g. the openai SDK closes at an error event, and the engine's
    ``data: [DONE]`` and last chunk are on their way."""
    last = max((r for r in requests if r["conn"] == ours["conn"]), key=lambda r: r["seq"])
    return (
        row["closed_by"] == ours["closed_by"] == "client"
        and (row["in_flight_at_close"], row["half_close"]) == (True, "client")
        and (ours["in_flight_at_close"], ours["half_close"]) == (False, None)
        and last["end"] is not None
        and ours["closed"] - SPREAD <= last["end"] <= ours["closed"]
    )


def compare_requests(
    tap: dict[str, Any],
    pcap: dict[str, Any],
    numbers: dict[int, int],
    where: str,
    *,
    engine_side: bool,
) -> None:
    tap_rows = {(r["conn"], r["seq"]): r for r in tap["requests"]}
    assert len(pcap["requests"]) == len(tap_rows), where
    for row in pcap["requests"]:
        ours = tap_rows[(numbers[row["conn"]], row["seq"])]
        what = f"{where}: request {row['id']} (tap's {ours['id']})"
        same = set(ours) - TIMES - GAPS - BY_TIMING - NAMES
        assert pick(row, *same) == pick(ours, *same), what
        assert row["id"] == f"pcap/{row['conn']}/{row['seq']}", what
        # the request's bytes: client -> (pcap, tap port) -> tap -> (pcap, engine port)
        before, after = (ours, row) if engine_side else (row, ours)
        assert before["start"] <= after["start"] + CLOCK, (what, "start")
        # the response's bytes the other way; an interval from one to the other
        for key in ("first_event", "last_event", "end", "ttfb", "first_token", "duration"):
            if ours[key] is None:
                assert row[key] is None, (what, key)
                continue
            early, late = (row, ours) if engine_side else (ours, row)
            assert early[key] <= late[key] + 2 * CLOCK, (what, key, early[key], late[key])
        for key in TIMES | GAPS:
            if ours[key] is not None:
                assert abs(row[key] - ours[key]) <= SPREAD, (what, key, row[key], ours[key])


def findings(doc: dict[str, Any], numbers: dict[int, int] | None) -> list[tuple[Any, ...]]:
    """The findings as (kind, party, confidence, requests, connections, ruled out), with
    requests and connections named as at the tap (its connection numbers)."""

    def conn_id(ref: str) -> str:
        _, conn, *seq = ref.split("/")
        n = int(conn) if numbers is None else numbers[int(conn)]
        return "/".join([str(n), *seq])

    return sorted(
        (
            f["kind"],
            f["party"],
            f["confidence"],
            tuple(sorted(map(conn_id, f["requests"]))),
            tuple(sorted(map(conn_id, f["connections"]))),
            tuple(sorted(r["party"] for r in f["ruled_out"])),
        )
        for f in doc["findings"]
    )
