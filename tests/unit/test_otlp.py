"""`tracer proxy --otlp`: the collector URL it is given becomes the traces URL."""

from __future__ import annotations

import pytest

from tracer.present.otlp import traces_url


def test_traces_url() -> None:
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    for bad in ("c:4318", "ftp://c", "http://c:notaport"):
        with pytest.raises(ValueError, match="--otlp"):
            traces_url(bad)
