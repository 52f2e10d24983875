"""Secrets stay out: one policy for everything written or shown — capture, logs, admin
status, OTLP, analysis and report, native tap and mitmproxy addon alike.

What is redacted:

* headers whose name says they hold a credential: it contains auth, key, token, secret,
  session, signature, passw(ord), credential or cookie (plus the known vendor names
  in ``_ALWAYS``) — but not rate-limit and usage figures (``x-ratelimit-remaining-tokens``):
  they are evidence;
* query parameters with such names (``?api_key=...``): ``redact_target``;
* values shaped like a credential in any header or text: ``Bearer …``, OpenAI-style
  ``sk-…`` keys, and a few vendors' key prefixes: ``scrub_text``;
* any text quoted from the wire into an anomaly or a log line (h11's error messages
  quote a malformed header line whole): ``scrub_text`` also redacts ``Name: value``
  pairs whose name is a secret's.

Bodies are kept only as ``--bodies`` says (prompts are kept by design with
``requests``); ``--redact-json-field NAME`` redacts JSON fields in kept bodies.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import quote, unquote

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
        "ocp-apim-subscription-key",
        "x-functions-key",
        "x-access-tokens",
    }
)
_LOOKS_SECRET = re.compile(
    r"auth|key|token|secret|session|signature|passw|credential|cookie|jwt", re.I
)
# names that say what a figure is, not a credential: rate limits and usage are evidence
_EVIDENCE = re.compile(r"ratelimit|rate-limit|remaining|usage|-count\b|^keep-alive$", re.I)
# credentials by their shape, wherever they appear
_SHAPES = re.compile(
    r"(?i)(\bbearer\s+)[^\s,;\"'\\]+"
    r"|\b(?:sk|rk|pk)-[A-Za-z0-9_\-]{12,}"
    r"|\b(?:AKIA|ASIA)[A-Z0-9]{12,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}"
    r"|\bxox[abprs]-[A-Za-z0-9\-]{10,}"
    r"|\bAIza[0-9A-Za-z_\-]{20,}"
)
# a "Name: value" or "name=value" pair inside quoted text
_PAIR = re.compile(r"([A-Za-z0-9_.\-]+)(\s*[:=]\s*)([^\s,;&'\"\\)]+)")


def is_secret(name: str) -> bool:
    lower = name.lower()
    if lower in _ALWAYS:
        return True
    return bool(_LOOKS_SECRET.search(lower)) and not _EVIDENCE.search(lower)


def redact_value(name: str, value: str) -> str:
    """A header's value as written: a secret's dropped (the scheme of an Authorization
    header kept: ``Bearer``), any other's scrubbed of credential-shaped strings."""
    if not is_secret(name):
        return scrub_text(value)
    if name.lower() in ("authorization", "proxy-authorization") and " " in value:
        return value.split(" ", 1)[0] + " " + REDACTED
    return REDACTED


def scrub_text(text: str) -> str:
    """Text from the wire (a header value, an error message quoting a header line, a log
    field) with credential-shaped strings and secret-named pairs redacted."""
    if not text:
        return text
    text = _SHAPES.sub(lambda m: (m.group(1) or "") + REDACTED, text)
    if ":" in text or "=" in text:
        text = _PAIR.sub(
            lambda m: (
                m.group(1) + m.group(2) + REDACTED
                if is_secret(m.group(1)) and m.group(3) != REDACTED
                else m.group(0)
            ),
            text,
        )
    return text


def redact_target(target: str) -> str:
    """A request target with the values of secret-named query parameters redacted
    (``/v1/models?api_key=…`` → ``/v1/models?api_key=[redacted]``), and credential-shaped
    strings anywhere in it."""
    path, sep, query = target.partition("?")
    if not sep:
        return scrub_text(target) if "-" in target or "_" in target else target
    params = []
    for part in query.split("&"):
        name, eq, value = part.partition("=")
        if eq and is_secret(unquote(name)):
            value = quote(REDACTED)
        params.append(name + eq + value)
    return scrub_text(path) + "?" + scrub_text("&".join(params))


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
