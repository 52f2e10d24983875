"""The seed incident from packets alone (issue 28): no tap inline, ``tcpdump -i lo`` on
both sides of the faulty proxy, read as two taps by server port.

harness (openai SDK) -> a proxy that hangs on the 3rd request of a reused keep-alive
connection (``tracer proxy --fault hang-on-reuse:3``) -> the simulated engine; tcpdump
records the proxy's listen port and the engine's. ``tracer analyze x.pcap --tap-by-port
PROXY=front,ENGINE=back`` must blame the proxy for holding the reused connection, as two
taps around it do (tests/e2e/test_flagship_incident.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.analyze import analyze_async
from tests.support.incident import packets_around_a_hanging_proxy
from tests.support.tcpdump import require_tcpdump

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]


async def test_the_seed_incident_from_one_tcpdump_on_both_sides_of_the_proxy(
    tmp_path: Path,
) -> None:
    require_tcpdump()
    incident = await packets_around_a_hanging_proxy(tmp_path / "lo.pcap")
    outcomes = sorted((r.session, r.round, r.outcome) for r in incident.report.rounds)
    # rounds 1 and 2 complete; round 3 (the 3rd request on the reused connection) hangs
    expected = [(s, r, "complete") for s in (1, 2) for r in (1, 2)]
    assert outcomes == sorted([*expected, (1, 3, "hung"), (2, 3, "hung")]), outcomes
    assert incident.dump.dropped() == 0, incident.dump.stderr()

    doc = await analyze_async(incident.pcap, "--tap-by-port", incident.tap_by_port)
    assert {t["tap"]: t["kind"] for t in doc["taps"]} == {"front": "pcap", "back": "pcap"}
    v = doc["verdict"]
    assert (v["party"], v["kind"], v["confidence"]) == ("proxy", "proxy_hung_on_reuse", "high")
    assert {r["party"] for r in v["ruled_out"]} == {"client", "engine"}
    (f,) = [f for f in doc["findings"] if f["id"] == v["finding"]]
    # the two hung requests: the 3rd on each of the harness's connections, never at back
    assert sorted(f["requests"]) == ["front/1/3", "front/2/3"]
    assert any(e["figures"].get("never_seen_at") == ["back"] for e in f["evidence"])
    front = [r for r in doc["requests"] if r["tap"] == "front"]
    back = [r for r in doc["requests"] if r["tap"] == "back"]
    assert sorted((r["seq"], r["termination"]) for r in front) == sorted(
        [(1, "complete"), (2, "complete")] * 2 + [(3, "client_abort")] * 2
    )
    assert sorted((r["seq"], r["termination"]) for r in back) == [
        (1, "complete"),
        (1, "complete"),
        (2, "complete"),
        (2, "complete"),
    ]
    # the same requests at both taps: the proxy passed the first two of each connection on
    assert {r["request_id"] for r in back} == {r["request_id"] for r in front if r["seq"] < 3}
