"""Secrets stay out: credential headers are redacted; the rest is left as evidence."""

from __future__ import annotations

import pytest

from tracer.redact import (
    REDACTED,
    is_secret,
    redact_headers,
    redact_target,
    redact_value,
    scrub_text,
)


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


SK = "sk-proj-AbCdEfGhIjKlMnOpQrSt1234"


@pytest.mark.parametrize(
    "name",
    [
        "X-Custom-Auth",
        "X-Auth-Key",
        "Ocp-Apim-Subscription-Key",
        "x-functions-key",
        "X-Access-Tokens",
        "X-Signature",
        "x-jwt-assertion",
    ],
)
def test_names_outside_the_old_list_are_secrets(name: str) -> None:
    assert is_secret(name) and redact_value(name, "v4lue") == REDACTED


@pytest.mark.parametrize(
    ("value", "kept"),
    [
        (f"Bearer {SK}", "Bearer [redacted]"),
        (f"key={SK}; v=1", "key=[redacted]; v=1"),
        ("ghp_" + "a" * 36, REDACTED),
        ("AKIA" + "B" * 16, REDACTED),
        ("application/json", "application/json"),
    ],
)
def test_credential_shaped_values_in_any_header(value: str, kept: str) -> None:
    assert redact_value("X-Note", value) == kept


@pytest.mark.parametrize(
    ("target", "written"),
    [
        ("/v1/models?api_key=abc123&limit=5", "/v1/models?api_key=[redacted]&limit=5"),
        (
            "/v1/x?token=t&access_token=u&code=1",
            "/v1/x?token=[redacted]&access_token=[redacted]&code=1",
        ),
        (f"/v1/chat?q={SK}", "/v1/chat?q=[redacted]"),
        ("/v1/chat/completions", "/v1/chat/completions"),
    ],
)
def test_query_parameters_with_secret_names(target: str, written: str) -> None:
    assert redact_target(target) == written


def test_text_quoted_from_the_wire_is_scrubbed() -> None:
    """h11 quotes a malformed header line whole into its error message."""
    h11_error = f"illegal header line: bytearray(b'Authorization : Bearer {SK}')"
    out = scrub_text(h11_error)
    assert SK not in out and "Bearer" not in out and out.startswith("illegal header line")
    assert scrub_text("X-Api-Key: abc123, other") == "X-Api-Key: [redacted], other"
    assert scrub_text("no secret here: 42") == "no secret here: 42"


def test_a_malformed_secret_header_never_reaches_the_capture() -> None:
    """Through the observer: the anomaly record quotes h11, scrubbed."""
    from tracer.observe.wire import ConnectionObserver

    events: list[object] = []
    obs = ConnectionObserver(tap="t", conn=1, emit=events.append, wall_offset=0.0, opened_m=0.0)
    obs.client_data(
        f"GET /?api_key=zzz HTTP/1.1\r\nAuthorization : Bearer {SK}\r\n\r\n".encode(), 1.0
    )
    assert events and SK not in repr(events) and "zzz" not in repr(events)


def test_an_older_capture_is_scrubbed_when_it_is_read() -> None:
    """A capture written before the policy (a key in the query, h11 quoting a header
    line): the analysis shows neither."""
    from tracer import events as ev
    from tracer.analysis.summary import Summary

    with Summary() as summary:
        summary.feed(ev.CaptureStart(t=1.0, m=1.0, tap="t", tracer_version="0", kind="proxy"))
        summary.feed(ev.ConnOpen(t=1.0, m=1.0, tap="t", conn=1, peer="a:1", local="b:2"))
        summary.feed(
            ev.RequestHead(
                t=1.0, m=1.0, tap="t", conn=1, seq=1, idle_before=0.0, method="GET",
                target="/v1/models?api_key=zzz", version="1.1", headers=[],
            )
        )  # fmt: skip
        summary.feed(
            ev.Anomaly(
                t=2.0, m=2.0, tap="t", conn=1, direction="client", offset=0,
                error=f"illegal header line: b'Authorization : Bearer {SK}'",
            )
        )  # fmt: skip
        text = repr(list(summary.result()["requests"])) + repr(
            list(summary.result()["connections"])
        )
    assert "zzz" not in text and SK not in text
