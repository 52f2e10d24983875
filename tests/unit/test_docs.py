"""The capture format documentation shows a valid example of every record type."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tracer import events as ev

ROOT = Path(__file__).resolve().parents[2]


def test_every_event_type_is_documented_with_a_parseable_example() -> None:
    doc = (ROOT / "captures" / "README.md").read_text()
    examples = [json.loads(line) for line in re.findall(r"^\{.*\}$", doc, flags=re.M)]
    documented = {e["type"] for e in examples}
    assert documented == set(ev.event_types()), set(ev.event_types()) ^ documented
    for example in examples:
        assert ev.from_record(example) is not None, example
    assert f"version {ev.CAPTURE_VERSION}" in doc
