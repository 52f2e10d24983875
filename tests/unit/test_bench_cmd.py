"""``tracer bench``: its figures (as bench_serving defines them) and its bad arguments, in
this process. Against the simulated engine: tests/integration/test_bench_cmd.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracer.cli import commands as cli
from tracer.tools.bench import figures
from tracer.tools.streamclient import Sample

# ---- figures (pure) --------------------------------------------------------------------


def test_figures_follow_bench_serving_definitions() -> None:
    # request 1: 4 tokens, first at 0.1 s, then every 0.02 s; request 2: 1 token; 3: failed
    one = Sample(start=10.0, end=10.16, ttft=0.1, latency=0.16, output_tokens=4, chunks=4)
    one.itl = [0.02, 0.02, 0.02]
    two = Sample(start=10.0, end=10.05, ttft=0.05, latency=0.05, output_tokens=1, chunks=1)
    bad = Sample(start=10.0, end=10.01, latency=0.01, error="HTTP 500")
    fig = figures([one, two, bad], duration=2.0)
    assert (fig["completed"], fig["failed"], fig["output_tokens"]) == (2, 1, 5)
    assert fig["output_throughput"] == pytest.approx(2.5)
    assert fig["request_throughput"] == pytest.approx(1.0)
    assert fig["ttft_ms"]["mean"] == pytest.approx(75.0)
    assert fig["ttft_ms"]["median"] == pytest.approx(75.0)
    assert fig["ttft_ms"]["p99"] == pytest.approx(50.0 + 50.0 * 0.99)  # linear, as numpy
    # TPOT only for requests with more than one token: (0.16 - 0.1) / 3
    assert fig["tpot_ms"]["mean"] == pytest.approx(20.0)
    assert fig["itl_ms"]["median"] == pytest.approx(20.0)
    assert fig["e2e_ms"]["max"] == pytest.approx(160.0)
    assert fig["observed_concurrency"] == pytest.approx((0.16 + 0.05) / 2.0)


def test_bad_arguments_are_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, in_process: None
) -> None:
    assert cli.main(["bench", "--target", "ftp://x", "--concurrency", "4"]) == 2
    assert "--target 'ftp://x'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--target", "http://127.0.0.1:1", "--concurrency", "64,0"])
    assert exc.value.code == 2
    assert "'0' in '64,0' is not a positive integer" in capsys.readouterr().err
    missing = str(tmp_path / "missing.jsonl")
    assert cli.main(["bench", "--target", "http://127.0.0.1:1", "--concurrency", "1",
                     "--from", missing]) == 3  # fmt: skip
    assert "cannot read" in capsys.readouterr().err
    header = ["--header", "no colon", "--model", "m"]
    assert cli.main(["bench", "--target", "http://127.0.0.1:1", "--concurrency", "1",
                     *header]) == 2  # fmt: skip
    assert "--header 'no colon'" in capsys.readouterr().err
