"""Request bodies in a capture: how a kept body is written, and what a reader derives from it.

A ``request_end`` record that keeps its body (capture version 2) carries the body and not
what follows from it: its SHA-256 and its OpenAI fields (model, stream, max_tokens,
message count). Hashing and parsing a 64 KiB agent context cost a tap about 50 µs on the
data path; a reader does it instead (``derive_request_end``), once, when the capture is
read. A record without its body (not kept: ``--bodies none``, or over the size kept)
carries the hash and the fields as measured by the tap, as version 1 did for every body.
Both taps collect a request body with ``RequestBody``, which decides which of the two.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, Literal

import orjson

from . import events as ev

BodyEncoding = Literal["utf-8", "base64"]
OPENAI_FIELDS = ("model", "stream", "max_tokens", "messages")


def encode_body(body: bytes) -> tuple[str, BodyEncoding]:
    """A body as record text: UTF-8 when it is, base64 otherwise."""
    try:
        return body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(body).decode("ascii"), "base64"


def decode_body(text: str, encoding: str | None) -> bytes:
    """``encode_body`` undone (raises ``ValueError`` on bad base64)."""
    if encoding == "base64":
        return base64.b64decode(text)
    return text.encode("utf-8")


def openai_fields(body: bytes) -> dict[str, Any]:
    """model, stream, max_tokens and message count from an OpenAI-style JSON body."""
    try:
        obj = orjson.loads(body)  # several times faster; it refuses a little json takes
    except ValueError:
        try:
            obj = json.loads(body)  # (NaN, integers beyond 64 bits, ...)
        except (ValueError, RecursionError):
            return {}
    if not isinstance(obj, dict):
        return {}
    out: dict[str, Any] = {}
    model = obj.get("model")
    if isinstance(model, str):
        out["model"] = model
    stream = obj.get("stream")
    if isinstance(stream, bool):
        out["stream"] = stream
    max_tokens = obj.get("max_tokens", obj.get("max_completion_tokens"))
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        out["max_tokens"] = max_tokens
    messages = obj.get("messages")
    if isinstance(messages, list):
        out["messages"] = len(messages)
    return out


class RequestBody:
    """A request body as its pieces arrive, for its ``request_end`` record (both taps).

    Its pieces are kept up to ``limit`` bytes; from the piece that passes it (or from the
    start, with ``keep=False``) it is hashed as it goes by instead, the pieces before
    included. ``record`` gives the body's fields once it has ended.
    """

    __slots__ = ("hash", "limit", "parts", "size")

    def __init__(self, limit: int, *, keep: bool = True) -> None:
        self.limit = limit
        self.size = 0
        self.parts: list[bytes] | None = [] if keep else None
        self.hash: Any = None if keep else hashlib.sha256()

    def add(self, data: bytes) -> None:
        self.size += len(data)
        parts = self.parts
        if parts is None:
            self.hash.update(data)
        elif self.size > self.limit:  # hashed from here on, not kept
            self.hash = hashlib.sha256(b"".join(parts))
            self.hash.update(data)
            self.parts = None
        else:
            parts.append(data)

    def record(self, *, keep: bool, json_body: bool) -> dict[str, Any]:
        """The ``request_end`` fields of the ended body, its pieces let go: the body itself
        when kept (its hash and OpenAI fields are then the reader's work,
        ``derive_request_end``), else its hash and, for JSON, its OpenAI fields."""
        body = b"".join(self.parts) if self.parts is not None else None
        self.parts = None
        if keep and body:
            text, encoding = encode_body(body)
            return {"body": text, "body_encoding": encoding, "body_kept": True}
        digest = (self.hash or hashlib.sha256(body or b"")).hexdigest()
        out: dict[str, Any] = {"body_sha256": digest, "body_kept": self.size == 0}
        if body and json_body:
            out |= openai_fields(body)
        return out


def derived_facts(body: str, encoding: str | None) -> dict[str, Any]:
    """``body_sha256`` and the OpenAI fields of a kept body; {} when it cannot be decoded."""
    try:
        raw = decode_body(body, encoding)
    except ValueError:
        return {}
    return {"body_sha256": hashlib.sha256(raw).hexdigest(), **openai_fields(raw)}


def derive_request_end(record: dict[str, Any]) -> None:
    """Fill in a ``request_end`` record's hash and OpenAI fields from its kept body, where the
    tap left them to the reader (no ``body_sha256``). A record that has them is left alone."""
    body = record.get("body")
    if "body_sha256" in record or not isinstance(body, str):
        return
    for key, value in derived_facts(body, record.get("body_encoding")).items():
        record.setdefault(key, value)


def request_fields(end: ev.RequestEnd) -> dict[str, Any]:
    """The OpenAI fields of a ``RequestEnd`` event as it was emitted (for a live sink: the
    tap's events have not been through a reader): its own, or derived from its kept body."""
    if end.body_sha256 is not None or end.body is None:
        return {k: v for k in OPENAI_FIELDS if (v := getattr(end, k)) is not None}
    facts = derived_facts(end.body, end.body_encoding)
    return {k: facts[k] for k in OPENAI_FIELDS if k in facts}
