"""``kill -9`` of a loaded tap, three times (``make kill-soak`` does it twenty times):
each capture reads (``tracer info``, ``tracer analyze --format json``) and holds every
request the client saw complete more than FLUSH_INTERVAL + 0.5 s before the kill.

Marked ``soak`` (``pytest -m soak`` runs this tier alone); about 10 s on two cores, so it
stays in ``make test``."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import kill_soak

pytestmark = [pytest.mark.soak, pytest.mark.timeout(180)]


def test_every_capture_reads_and_keeps_what_completed_before_the_kill(tmp_path: Path) -> None:
    opts = kill_soak.Options(kills=3, seed=7, concurrency=16, kill_min=1.0, kill_max=2.0)
    ok, rounds = kill_soak.run(opts, tmp_path)
    problems = [f"round {r.n}: {p}" for r in rounds for p in r.problems]
    assert ok and not problems, problems
    assert len(rounds) == 3
    assert all(r.info_ok and r.analyze_ok for r in rounds)
    assert sum(r.checked for r in rounds) > 0, "no request completed long enough before a kill"
