"""`tracer demo`: the scenarios the command line offers are the demo's."""

from __future__ import annotations


def test_the_scenarios_listed_by_the_cli_are_the_demo_s() -> None:
    from tracer.cli.demo import DEMOS
    from tracer.tools.demo import SCENARIOS

    assert list(DEMOS) == list(SCENARIOS)
