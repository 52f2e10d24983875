"""`tracer replay`: the connection structure reproduced exactly, fresh connections, the
hang-on-reuse differential, read pacing, and clear errors.

Captures are made for real (sim engine <- tap <- the openai-SDK harness); the replay runs
as the real CLI in a subprocess."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.support.captures import slow_reader_capture
from tests.support.engine import engine_running
from tests.support.procs import tracer_proxy
from tests.support.tap import running_tap
from tracer import events as ev
from tracer.analysis.summary import Summary
from tracer.capture.files import read_events
from tracer.sim.harness import HarnessConfig, HarnessReport, run_harness
from tracer.tools.replay_compare import load, structure

pytestmark = pytest.mark.anyio


async def replay(*args: str) -> tuple[int, dict[str, Any] | None, str]:
    """Run ``tracer replay ... --format json``: exit code, the document, stderr."""
    result = await anyio.run_process(
        [sys.executable, "-m", "tracer", "replay", *args, "--format", "json"], check=False
    )
    doc = json.loads(result.stdout) if result.returncode == 0 else None
    return result.returncode, doc, result.stderr.decode()


async def capture_session(
    upstream_port: int, tmp_path: Path, config: HarnessConfig, **tap: Any
) -> tuple[Path, HarnessReport]:
    """Run the harness through an in-process tap; the tap's capture and the harness's report."""
    async with running_tap(upstream_port, tmp_path, **tap) as handle:
        report = await run_harness(replace(config, base_url=handle.url))
    return handle.capture, report


def per_conn(path: Path) -> list[list[int]]:
    return structure(load(path))


async def test_replay_reproduces_connections_and_reuse_exactly(tmp_path: Path) -> None:
    async with engine_running(ttft=0.0, itl=0.002) as engine:
        assert engine.bound is not None
        original, report = await capture_session(
            engine.bound[1],
            tmp_path,
            HarnessConfig(base_url="", sessions=3, rounds=3, think=0.15, max_tokens=6),
        )
        assert all(r.ok for r in report.rounds)
        out = tmp_path / "replay.jsonl"
        code, doc, err = await replay(
            str(original),
            "--target",
            engine.url,
            "--capture",
            str(out),
            "--engine-metrics",
            f"{engine.url}/metrics",
        )
        assert code == 0, err
        assert doc is not None
        fresh_out = tmp_path / "fresh.jsonl"
        code, fresh, err = await replay(
            str(original),
            "--target",
            engine.url,
            "--connections",
            "fresh",
            "--header",
            "Authorization: Bearer sk-given-again",
            "--capture",
            str(fresh_out),
        )
        assert code == 0, err
        assert fresh is not None

    # the same connections, each carrying the same requests at the same positions
    assert per_conn(original) == [[1, 2, 3]] * 3
    assert per_conn(out) == per_conn(original)
    assert doc["structure"] == {
        "original": [[1, 2, 3]] * 3,
        "replay": [[1, 2, 3]] * 3,
        "same": True,
    }
    # request by request: same positions, same request ids, same outcome
    for row in doc["requests"]:
        o, r = row["original"], row["replay"]
        assert (r["seq"], r["request_id"], r["outcome"]) == (o["seq"], o["request_id"], "complete")
    replayed = load(out)
    assert replayed.kind == "replay"
    samples = [e for e in read_events(out) if isinstance(e, ev.EngineSample)]
    assert samples and samples[0].ok and samples[0].profile == "sglang"
    rid_conns = {
        tuple(r.request_id for r in c.requests) for c in replayed.conns.values()
    }  # each session's rounds stay together on one connection
    assert rid_conns == {
        tuple(r.request_id for r in c.requests) for c in load(original).conns.values()
    }
    # start offsets: generous margins on a loaded machine (the bench measures them)
    errors = [abs(row["start_offset_error"]) for row in doc["requests"]]
    assert max(errors) < 0.1, errors
    assert doc["verdict"]["reproduced"] is True
    assert any("authorization" in note for note in doc["notes"])  # redacted: not sent
    assert b"sk-sim-harness" not in out.read_bytes()

    # --connections fresh: one request per connection, every one complete
    assert per_conn(fresh_out) == [[1]] * 9
    assert fresh["structure"]["same"] is False
    assert [row["replay"]["outcome"] for row in fresh["requests"]] == ["complete"] * 9
    # --header put back what the capture redacted (and the replay's capture redacts it again)
    assert fresh["notes"] == []
    for req in load(fresh_out).requests():
        assert ["Authorization", "Bearer [redacted]"] in req.headers
    assert b"sk-given-again" not in fresh_out.read_bytes()

    # the replay's capture is a capture: the analysis of `tracer analyze` reads it
    summary = Summary()
    for event in read_events(out):
        summary.feed(event)
    totals = summary.result()["totals"]
    assert (totals["requests"], totals["reused_requests"]) == (9, 6)


async def test_hang_on_reuse_reproduced_and_fresh_connections_complete(tmp_path: Path) -> None:
    async with engine_running(ttft=0.0, itl=0.002) as engine:
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            engine.url,
            "--tap",
            "faulty",
            "--fault",
            "hang-on-reuse:3",
        ) as faulty:
            original, report = await capture_session(
                faulty.port,
                tmp_path,
                HarnessConfig(
                    base_url="", sessions=2, rounds=4, think=0.05, max_tokens=4, deadline=1.5
                ),
                stall_after=0.5,
            )
            outcomes = sorted((r.session, r.round, r.outcome) for r in report.rounds)
            assert outcomes == [
                (s, n, "hung" if n == 3 else "complete") for s in (1, 2) for n in (1, 2, 3)
            ]
            code, same, err = await replay(
                str(original),
                "--target",
                faulty.url,
                "--stall-timeout",
                "1",
                "--capture",
                str(tmp_path / "same.jsonl"),
            )
            assert code == 0, err
            assert same is not None
            code, fresh, err = await replay(
                str(original),
                "--target",
                faulty.url,
                "--connections",
                "fresh",
                "--stall-timeout",
                "1",
                "--capture",
                str(tmp_path / "fresh.jsonl"),
            )
            assert code == 0, err
            assert fresh is not None

    def outcomes_of(doc: dict[str, Any], side: str) -> dict[str, str]:
        return {row["request"]: row[side]["outcome"] for row in doc["requests"]}

    expected = {f"{c}:{s}": "hung" if s == 3 else "complete" for c in (1, 2) for s in (1, 2, 3)}
    assert outcomes_of(same, "original") == expected
    # the same connections: the 3rd request on each reused connection hangs again
    assert outcomes_of(same, "replay") == expected
    for row in same["requests"]:
        if row["replay"]["outcome"] == "hung":
            assert row["replay"]["seq"] == 3
            assert "--stall-timeout" in row["replay"]["detail"]
    assert same["verdict"]["reproduced"] is True
    assert same["structure"]["same"] is True
    # fresh connections: everything completes, and the verdict says where it diverged
    assert set(outcomes_of(fresh, "replay").values()) == {"complete"}
    assert fresh["verdict"]["reproduced"] is False
    assert fresh["verdict"]["diverged_at"] in ("1:3", "2:3")
    assert "original hung, replay complete" in fresh["verdict"]["summary"]
    assert per_conn(tmp_path / "fresh.jsonl") == [[1]] * 6


async def test_a_fault_the_capturing_tap_injected_is_named_when_the_replay_differs(
    tmp_path: Path,
) -> None:
    """Captured through a tap that injected the hang itself (``--fault``), replayed straight
    to the engine: the divergence is the missing fault, and the verdict says so."""
    from tracer.faults.plan import parse_fault

    async with engine_running(ttft=0.0, itl=0.002) as engine:
        assert engine.bound is not None
        config = HarnessConfig(
            base_url="", sessions=1, rounds=3, think=0.05, max_tokens=4, deadline=1.5
        )
        original, report = await capture_session(
            engine.bound[1],
            tmp_path,
            config,
            stall_after=0.5,
            faults=[parse_fault("hang-on-reuse:2")],
        )
        assert [r.outcome for r in report.rounds] == ["complete", "hung"]
        code, doc, err = await replay(
            str(original),
            "--target",
            engine.url,
            "--stall-timeout",
            "1",
            "--capture",
            str(tmp_path / "replay.jsonl"),
        )
    assert code == 0, err
    assert doc is not None and doc["verdict"]["diverged_at"] == "1:2"
    assert (
        "original hung (injected by the capturing tap: hang-on-reuse:2; replay through a "
        "tracer proxy with the same --fault to have it again), replay complete"
    ) in doc["verdict"]["summary"]
    row = next(r for r in doc["requests"] if r["request"] == "1:2")
    assert row["original"]["injected"] == ["hang-on-reuse:2"] and row["replay"]["injected"] is None


async def test_missing_bodies_is_a_clear_error(tmp_path: Path) -> None:
    async with engine_running(ttft=0.0, itl=0.001) as engine:
        assert engine.bound is not None
        original, _ = await capture_session(
            engine.bound[1],
            tmp_path,
            HarnessConfig(base_url="", sessions=1, rounds=2, think=0.0, max_tokens=2),
            bodies="none",
        )
        out = tmp_path / "never.jsonl"
        code, _, err = await replay(str(original), "--target", engine.url, "--capture", str(out))
        assert code == 3
        assert "1:1, 1:2: its body was not kept" in err
        assert "--bodies requests" in err
        assert not out.exists()


# ---- a hand-made capture: read pacing, --speed, --only ------------------------------------


async def test_replay_reads_no_faster_than_the_original_client(tmp_path: Path) -> None:
    original = tmp_path / "slow.jsonl"
    slow_reader_capture(original)
    async with engine_running(ttft=0.0, itl=0.0) as engine:
        code, doc, err = await replay(
            str(original), "--target", engine.url, "--capture", str(tmp_path / "a.jsonl")
        )
        assert code == 0, err
        code, fast, err = await replay(
            str(original),
            "--target",
            engine.url,
            "--speed",
            "3",
            "--capture",
            str(tmp_path / "b.jsonl"),
        )
        assert code == 0, err
    assert doc is not None and fast is not None
    # the engine answers in milliseconds, the client reads at the original client's pace
    # (its last bytes 0.61 s after the head), and request 2 follows when it is done
    first, second = doc["requests"]
    assert first["replay"]["duration"] < 0.3  # what the tap saw of the engine
    assert first["replay"]["read_time"] >= 0.6
    assert second["original"]["start_offset"] == pytest.approx(0.649, abs=0.001)
    assert second["replay"]["start_offset"] >= 0.6
    assert fast["requests"][0]["replay"]["read_time"] >= 0.6 / 3 * 0.85  # (timer slack)
    assert fast["requests"][0]["replay"]["read_time"] < 0.55
    assert fast["requests"][1]["replay"]["start_offset"] >= 0.6 / 3 * 0.85
    assert fast["requests"][1]["replay"]["start_offset"] < 0.55
    assert [r["replay"]["outcome"] for r in doc["requests"]] == ["complete", "complete"]


async def test_a_flowing_stream_is_never_cut_by_the_stall_timeout(tmp_path: Path) -> None:
    original = tmp_path / "slow.jsonl"
    slow_reader_capture(original)
    one = ("--only", "req=1:1", "--stall-timeout", "0.5")
    async with engine_running(ttft=0.0, itl=0.1) as engine:  # 12 tokens, 0.1 s apart
        code, flowing, err = await replay(
            str(original), "--target", engine.url, *one, "--capture", str(tmp_path / "a.jsonl")
        )
        assert code == 0, err
        code, capped, err = await replay(
            str(original),
            "--target",
            engine.url,
            *one,
            "--timeout",
            "0.6",
            "--capture",
            str(tmp_path / "b.jsonl"),
        )
        assert code == 0, err
    assert flowing is not None and capped is not None
    [row] = flowing["requests"]
    assert row["replay"]["outcome"] == "complete"
    assert row["replay"]["duration"] > 1.0  # longer than the stall timeout, twice over
    [row] = capped["requests"]
    assert row["replay"]["outcome"] == "hung"
    assert "--timeout" in row["replay"]["detail"]
    assert row["replay"]["termination"] == "client_abort"
