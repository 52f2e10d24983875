"""Every reader takes a packet capture (tcpdump's pcap, pcapng) as the taps it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracer.cli import commands as cli

PCAP = Path(__file__).resolve().parent.parent / "data" / "pcap"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


def test_analyze_reads_a_pcap_as_a_tap(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "analyze", str(PCAP / "sse_lo.pcap"), "--format", "json")
    doc = json.loads(out)
    assert code == 0 and [t["tap"] for t in doc["taps"]] == ["pcap"]
    rows = [(r["method"], r["target"], r["sse"], r["status"]) for r in doc["requests"]]
    assert rows == [("POST", "/v1/chat/completions", True, 200), ("GET", "/v1/models", False, 200)]
    assert all(r["termination"] == "complete" for r in doc["requests"])
    assert doc["requests"][1]["reused"]  # the second request on the same keep-alive connection


def test_a_hang_in_a_pcap_is_the_stall_a_tap_would_have_seen(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "analyze", str(PCAP / "hang_any.pcap"), "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["verdict"]["kind"] == "upstream_silent"
    (stalled,) = [r for r in doc["requests"] if r["stalls"]]
    assert stalled["stalls"][0]["direction"] == "upstream_silent"


def test_info_and_the_port_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "info", str(PCAP / "sse_lo.pcap"), "--format", "json")
    (one,) = json.loads(out)["captures"]
    assert code == 0 and one["capture"] and one["by_type"]["request"] == 2
    code, _, err = run(capsys, "analyze", str(PCAP / "sse_lo.pcap"), "--tap-by-port", "front")
    assert code == 2 and "PORT=TAP" in err
    code, _, err = run(capsys, "analyze", str(PCAP / "sse_lo.pcap"), "--port", "1")
    assert code == 3 and "no HTTP/1.1 connection to port 1" in err  # not an all-clear


def test_replay_reads_a_pcap_as_its_tap(tmp_path: Path) -> None:
    """The requests a pcap holds, with their bodies, are what replay would send."""
    from tracer.tools.replay import plan
    from tracer.tools.replay_capture import load
    from tracer.tools.replay_select import parse_only

    original = load(PCAP / "sse_lo.pcap")
    jobs = plan(original, parse_only([]), fresh=False)
    sent = [r for job in jobs for r in job.requests]
    assert len(jobs) == 1 and len(sent) == 2  # one keep-alive connection, two requests
    from tracer.tools.replay_plan import missing_bodies

    assert not missing_bodies(jobs)  # the request bodies came from the packets


def test_replay_takes_one_tap_of_a_two_sided_pcap_by_its_port() -> None:
    """A pcap of both sides of a proxy is two taps: replay sends one of them, the one
    ``--port`` names (or the tap ``--tap-by-port`` gives alone), and refuses both at once."""
    import json

    from tracer.capture.files import CaptureError, PacketOptions
    from tracer.tools.replay_capture import load

    seed = PCAP / "hang_on_reuse_lo.pcap"
    meta = json.loads((PCAP / "hang_on_reuse_lo.json").read_text())
    front = load(seed, PacketOptions(ports=(meta["front"],)))
    back = load(seed, PacketOptions(ports=(meta["back"],)))
    assert len(front.requests()) == 6 and len(back.requests()) == 4  # two never got through
    with pytest.raises((ValueError, CaptureError)):
        taps = ((meta["front"], "front"), (meta["back"], "back"))
        load(seed, PacketOptions(taps=taps))
