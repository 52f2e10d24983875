"""Secrets stay out: credential headers are redacted; the rest is left as evidence."""

from __future__ import annotations

import pytest

from tracer.redact import REDACTED, is_secret, redact_headers, redact_value


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("Authorization", "Bearer sk-live-abc", "Bearer [redacted]"),
        ("authorization", "Basic dXNlcjpwYXNz", "Basic [redacted]"),
        ("AUTHORIZATION", "sk-no-scheme", REDACTED),
        ("Proxy-Authorization", "Digest username=x, response=y", "Digest [redacted]"),
        ("Cookie", "session=abc; other=1", REDACTED),
        ("Set-Cookie", "route=xyz; Path=/", REDACTED),
        ("X-Api-Key", "key-123", REDACTED),
        ("api-key", "azure-key", REDACTED),
        ("x-goog-api-key", "g", REDACTED),
        ("X-Auth-Token", "t", REDACTED),
        ("x-csrf-token", "t", REDACTED),
        ("X-Client-Secret", "s", REDACTED),
        ("x-db-password", "p", REDACTED),
        ("x-session-id", "s", REDACTED),
        ("openai-api-key", "k", REDACTED),
    ],
)
def test_secret_headers(name: str, value: str, expected: str) -> None:
    assert is_secret(name)
    assert redact_value(name, value) == expected


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("Content-Type", "application/json"),
        ("x-request-id", "req-1"),
        ("User-Agent", "OpenAI/Python 1.54.4"),
        ("x-ratelimit-remaining-tokens", "9000"),
        ("x-ratelimit-limit-tokens", "10000"),
        ("Content-Length", "12"),
        ("traceparent", "00-abc-def-01"),
    ],
)
def test_other_headers_are_kept(name: str, value: str) -> None:
    assert not is_secret(name)
    assert redact_value(name, value) == value


def test_redact_headers_keeps_order_case_and_duplicates() -> None:
    raw = [
        (b"Host", b"x"),
        (b"Authorization", b"Bearer SECRET"),
        (b"Cookie", b"a=SECRET"),
        (b"Cookie", b"b=SECRET"),
        (b"X-Note", "caf\u00e9".encode("latin-1")),
    ]
    out = redact_headers(raw)
    assert out == [
        ["Host", "x"],
        ["Authorization", "Bearer [redacted]"],
        ["Cookie", REDACTED],
        ["Cookie", REDACTED],
        ["X-Note", "caf\u00e9"],
    ]
    assert "SECRET" not in repr(out)
