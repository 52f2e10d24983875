"""Log lines are data: they go through the redaction policy."""

from __future__ import annotations

import io
import json

from tracer import logs


def test_log_lines_go_through_the_redaction_policy() -> None:
    import structlog

    buf = io.StringIO()
    logs.configure(json=True, level="info", stream=buf)
    try:
        structlog.get_logger("t").warning(
            "anomaly", error="bad line b'X-Api-Key: abc123'", target="/v1?token=zz", n=3
        )
    finally:
        logs.configure()
    line = json.loads(buf.getvalue())
    assert "abc123" not in line["error"] and "zz" not in line["target"] and line["n"] == 3
