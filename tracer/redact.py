"""Secrets stay out: header values that carry credentials are redacted before anything
is written (capture, logs, admin status)."""

from __future__ import annotations

import re
from collections.abc import Iterable

REDACTED = "[redacted]"

_ALWAYS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "cookie",
        "set-cookie",
        "x-api-key",
        "api-key",
        "openai-api-key",
        "x-goog-api-key",
        "x-auth-token",
        "x-amz-security-token",
    }
)
# Any other header whose name says it holds a credential (but not token counts such as
# ``x-ratelimit-remaining-tokens``: they are evidence).
_LOOKS_SECRET = re.compile(r"(api[-_]?key|token(?!s)|secret|passw|credential|session)", re.I)


def is_secret(name: str) -> bool:
    lower = name.lower()
    return lower in _ALWAYS or bool(_LOOKS_SECRET.search(lower))


def redact_value(name: str, value: str) -> str:
    """Keep the scheme of an Authorization header (``Bearer``), drop the credential."""
    if not is_secret(name):
        return value
    if name.lower() in ("authorization", "proxy-authorization") and " " in value:
        return value.split(" ", 1)[0] + " " + REDACTED
    return REDACTED


_NAMES: dict[bytes, tuple[str, bool]] = {}  # header name -> (as text, holds a secret)
# (name, value) as read -> the pair as written: the same few headers come with every
# request, so most pairs cost one lookup. Cleared when full (a burst of unique values
# must not keep the usual ones out for good). The lists are shared between records,
# which nothing changes once emitted.
_PAIRS: dict[tuple[bytes, bytes], list[str]] = {}
MAX_PAIRS = 4096


def redact_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[list[str]]:
    """Header pairs to ``[name, value]`` strings, secrets redacted."""
    out: list[list[str]] = []
    for pair in headers:
        written = _PAIRS.get(pair)
        if written is None:
            written = _redact_pair(*pair)
            if len(_PAIRS) >= MAX_PAIRS:
                _PAIRS.clear()
            _PAIRS[pair] = written
        out.append(written)
    return out


def _redact_pair(raw_name: bytes, raw_value: bytes) -> list[str]:
    known = _NAMES.get(raw_name)
    if known is None:
        name = raw_name.decode("latin-1")
        known = (name, is_secret(name))
        if len(_NAMES) < 4096:
            _NAMES[raw_name] = known
    name, secret = known
    value = raw_value.decode("latin-1")
    return [name, redact_value(name, value) if secret else value]
