"""Hypothesis profiles of the fuzz tests, and the count of inputs each target ran.

* ``smoke`` (the default: ``make test``): a few examples per target, derandomized (the
  same inputs every run), so that all of tests/fuzz adds a few seconds;
* ``fuzz`` (``TRACER_FUZZ=1``, or ``--hypothesis-profile=fuzz``; ``make fuzz``): random
  inputs, over 100,000 across the targets.

Each test takes a share of the profile's ``max_examples`` (``support.budget``). Neither
profile keeps a database, and hypothesis's caches are kept in the system's temporary
directory (no .hypothesis directory in the tree). The profile is loaded here, in
``pytest_configure``, before the test modules are imported; it is hypothesis's default
for the whole session (no other tests use hypothesis). At the end of a run the counts of
inputs per target are printed (from every xdist worker: they come with the reports)."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir

from .support import COUNTS

# hypothesis keeps caches (its character tables, constants) even with no database: out of
# the working tree
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "tracer-hypothesis"))

settings.register_profile(
    "smoke",
    max_examples=20,
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    max_examples=8_000,
    derandomize=False,
    database=None,
    deadline=timedelta(seconds=2),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

_TOTALS: Counter[str] = Counter()
_KEY = "fuzz_inputs"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("TRACER_FUZZ", "") not in ("", "0"):
        settings.load_profile("fuzz")
    elif config.getoption("hypothesis_profile", None) is None:
        settings.load_profile("smoke")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    before = Counter(COUNTS)
    try:
        return (yield)
    finally:
        ran = COUNTS - before
        if ran:
            item.user_properties.append((_KEY, dict(ran)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call":  # (the teardown's report has the same properties)
        return
    for key, value in report.user_properties:
        if key == _KEY and isinstance(value, dict):
            _TOTALS.update(value)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _TOTALS:
        return
    write = terminalreporter.write_line
    write(f"fuzz inputs per target (profile {settings.get_current_profile_name()}):")
    for target, n in sorted(_TOTALS.items()):
        write(f"  {target:<28} {n:>9,}")
    write(f"  {'total':<28} {sum(_TOTALS.values()):>9,}")
