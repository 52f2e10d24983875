"""Record the seed incident as tcpdump sees it, for ``tests/unit/test_pcap_seed.py``:

    .venv/bin/python -m tests.scenarios.record_pcap       (as root, or with CAP_NET_RAW)

The run of ``tests/e2e/test_pcap_seed_incident.py`` (``tests.support.incident.
packets_around_a_hanging_proxy``): the harness (openai SDK, 2 sessions x 4 rounds) -> a
proxy that hangs on the 3rd request of a reused keep-alive connection (``tracer proxy
--fault hang-on-reuse:3``) -> the simulated engine, every port the kernel's choice, with
``tcpdump -i lo`` on the proxy's port and the engine's until every connection has ended.
The capture is trimmed to those two ports' TCP packets (``tcpdump -r``: the end mark the
helper sends goes), checked (the harness saw rounds 1-2 complete and round 3 hang on
both sessions, the kernel dropped nothing, ``tracer analyze --tap-by-port`` says
``proxy_hung_on_reuse``), and only then written to ``tests/data/pcap/`` as
``hang_on_reuse_lo.pcap`` with ``hang_on_reuse_lo.json`` (the ports, for
``--tap-by-port``). Every process is started here and stopped by its id.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio

from tests.support.analyze import analyze_here
from tests.support.incident import packets_around_a_hanging_proxy
from tests.support.tcpdump import tcpdump_path, tcpdump_unavailable

DATA = Path(__file__).resolve().parents[1] / "data" / "pcap"
NAME = "hang_on_reuse_lo"
MAX_BYTES = 300_000


def trim(raw: Path, out: Path, ports: tuple[int, int], binary: str) -> None:
    """The capture's TCP packets of the two ports, as tcpdump copies them (byte for byte)."""
    argv = [binary, "-n", "-r", str(raw), "-w", str(out)]
    if os.geteuid() == 0:
        argv += ["-Z", "root"]  # (else it writes as user tcpdump)
    argv.append(" or ".join(f"tcp port {p}" for p in ports))
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def check(pcap: Path, tap_by_port: str) -> dict[str, object]:
    doc = analyze_here(pcap, "--tap-by-port", tap_by_port)
    verdict = doc["verdict"]
    got = (verdict["party"], verdict["kind"], verdict["confidence"])
    if got != ("proxy", "proxy_hung_on_reuse", "high"):
        raise SystemExit(f"the recording reads as {got}, not the incident: not written")
    return dict(verdict)


async def record(work: Path) -> None:
    reason = tcpdump_unavailable()
    binary = tcpdump_path()
    if reason is not None or binary is None:
        raise SystemExit(reason or "no tcpdump")
    raw = work / "raw.pcap"
    incident = await packets_around_a_hanging_proxy(raw)
    outcomes = sorted((r.session, r.round, r.outcome) for r in incident.report.rounds)
    hung = [(s, r) for s, r, outcome in outcomes if outcome == "hung"]
    if hung != [(1, 3), (2, 3)] or len(outcomes) != 6:
        raise SystemExit(f"the harness saw {outcomes}, not the incident: not written")
    if incident.dump.dropped() != 0:
        raise SystemExit(f"the kernel dropped packets: {incident.dump.stderr()}")
    trimmed = work / f"{NAME}.pcap"
    trim(raw, trimmed, (incident.front, incident.back), binary)
    size = trimmed.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{size} bytes: more than {MAX_BYTES} for test data")
    verdict = check(trimmed, incident.tap_by_port)
    meta = {
        "recorded_by": "python -m tests.scenarios.record_pcap",
        "front": incident.front,
        "back": incident.back,
        "tap_by_port": incident.tap_by_port,
        "harness": [f"session {s} round {r}: {outcome}" for s, r, outcome in outcomes],
        "verdict": {k: verdict[k] for k in ("party", "kind", "confidence")},
    }
    DATA.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(trimmed, DATA / f"{NAME}.pcap")
    (DATA / f"{NAME}.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"{DATA / f'{NAME}.pcap'}: {size} bytes, {incident.tap_by_port}", file=sys.stderr)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tracer-pcap-") as work:
        anyio.run(record, Path(work))


if __name__ == "__main__":
    main()
