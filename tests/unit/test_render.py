"""Text output: large captures stay readable, the rows that went wrong first."""

from __future__ import annotations

from tracer.present.render import _limited, _request_troubled


def test_text_output_of_a_large_capture_is_limited_troubled_rows_first() -> None:
    rows = [
        {"id": f"t/{i}/1", "termination": "complete", "stalls": [], "status": 200}
        for i in range(100)
    ]
    rows[70]["termination"] = "truncated"
    shown = [r["id"] for r in _limited(rows, 3, _request_troubled)]
    assert shown == ["t/70/1", "t/0/1", "t/1/1"]
    assert len(list(_limited(rows, None, _request_troubled))) == 100
