"""Request bodies in a capture: how a kept body is written, and what a reader derives from it.

A ``request_end`` record that keeps its body (capture version 2) carries the body and not
what follows from it: its SHA-256 and its OpenAI fields (model, stream, max_tokens,
message count). Hashing and parsing a 64 KiB agent context cost a tap about 50 µs on the
data path; a reader does it instead (``derive_request_end``), once, when the capture is
read. A record without its body (not kept: ``--bodies none``, or over the size kept)
carries the hash and the fields as measured by the tap, as version 1 did for every body.
Both taps collect a request body with ``RequestBody``, which decides which of the two.

An agent sends its whole context with every turn, so each kept body mostly repeats one
kept a moment before. From version 3 the capture writer writes such a body as a
reference to that earlier ``request_end`` and what follows the prefix the two share
(``BodySharing``: ``body_base`` = ``[conn, seq, chars]``); the reader puts it back
together (``BodyResolver``) before anything else sees the record.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import OrderedDict, deque
from typing import Any, Literal, NamedTuple

import orjson

from .. import events as ev

BodyEncoding = Literal["utf-8", "base64"]
OPENAI_FIELDS = ("model", "stream", "max_tokens", "messages", "prompt_chars")
# What a request asks, by API: chat, completions, responses / embeddings, SGLang's native
CONTENT_FIELDS = ("messages", "prompt", "input", "text", "input_ids")

SHARE_MIN_CHARS = 4096
"""A shared prefix shorter than this is written out (a reference would save little)."""
SHARE_CANDIDATES = 8
"""The writer looks for a shared prefix among the last this many bodies it queued."""
SHARE_MAX_CHAIN = 8
"""References chain at most this far back: a lost record loses the bodies whose chain
passes through it, never a whole conversation."""
RESOLVE_KEEP = 2 * SHARE_CANDIDATES
"""The reader keeps this many bodies for references (more than the writer can name)."""


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
    chars = prompt_chars(obj)
    if chars is not None:
        out["prompt_chars"] = chars
    content = content_digest(obj)
    if content is not None:
        out["content_sha256"] = content
    return out


def _text_chars(value: Any) -> int:
    """Characters of text in a message's content: a string, or a list of parts whose
    ``text`` fields count (an image part counts nothing)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(
            len(part["text"])
            for part in value
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ) + sum(len(part) for part in value if isinstance(part, str))
    return 0


def prompt_chars(obj: dict[str, Any]) -> int | None:
    """How much text the request asks about: the characters of its messages' contents
    (chat), or of its ``prompt`` (completions). What the failed requests share against
    the completed ones reads it (a hop that swallows large prompts)."""
    messages = obj.get("messages")
    if isinstance(messages, list):
        return sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = obj.get("prompt")
    if prompt is not None:
        return _text_chars(prompt)
    return None


def content_digest(obj: dict[str, Any]) -> str | None:
    """SHA-256 of what a request asks (its ``CONTENT_FIELDS`` entry) in canonical JSON:
    keys sorted, compact, nulls left out of message objects.

    A hop that parses and re-writes request bodies (the SGLang router adds its defaults,
    renames ``max_tokens`` and reorders the keys) changes the body's hash but not this,
    so the analysis can join the requests of taps on both sides of it without request ids.
    """
    for name in CONTENT_FIELDS:
        value = obj.get(name)
        if value is None:
            continue
        if isinstance(value, list):
            value = [
                {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                for m in value
            ]
        try:
            canonical = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # what orjson refuses (integers beyond 64 bits)
            canonical = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(name.encode() + b"=" + canonical).hexdigest()
    return None


class BodyBudget:
    """What all the request bodies one tap holds in memory may take together (bodies
    kept for the capture, JSON kept for its OpenAI fields): past it, a body is hashed as
    it streams instead of held, and its record says so (``body_note``)."""

    __slots__ = ("exceeded", "held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.exceeded = 0  # bodies that went over it


OVER_BUDGET = "over the tap's body memory budget: hashed, not kept"


class RequestBody:
    """A request body as its pieces arrive, for its ``request_end`` record (both taps).

    Its pieces are kept up to ``limit`` bytes, and while the tap's ``budget`` (all the
    bodies it holds) has room; from the piece that passes either (or from the start,
    with ``keep=False``) it is hashed as it goes by instead, the pieces before included.
    ``record`` gives the body's fields once it has ended.
    """

    __slots__ = ("budget", "hash", "held", "limit", "note", "parts", "size")

    def __init__(self, limit: int, *, keep: bool = True, budget: BodyBudget | None = None) -> None:
        self.limit = limit
        self.size = 0
        self.parts: list[bytes] | None = [] if keep else None
        self.hash: Any = None if keep else hashlib.sha256()
        self.budget = budget
        self.held = 0
        self.note: str | None = None

    def add(self, data: bytes) -> None:
        self.size += len(data)
        parts = self.parts
        if parts is None:
            self.hash.update(data)
            return
        budget = self.budget
        over = budget is not None and budget.held + len(data) > budget.limit
        if self.size > self.limit or over:  # hashed from here on, not kept
            self.hash = hashlib.sha256(b"".join(parts))
            self.hash.update(data)
            self.parts = None
            self.release()
            if over and budget is not None:
                budget.exceeded += 1
                self.note = OVER_BUDGET
            return
        parts.append(data)
        if budget is not None:
            budget.held += len(data)
            self.held += len(data)

    def release(self) -> None:
        """Give back to the budget what this body holds."""
        if self.held and self.budget is not None:
            self.budget.held -= self.held
        self.held = 0

    def __del__(self) -> None:  # a body dropped unfinished (its connection cut) gives back
        self.release()

    def record(
        self, *, keep: bool, json_body: bool, redact: frozenset[str] = frozenset()
    ) -> dict[str, Any]:
        """The ``request_end`` fields of the ended body, its pieces let go: the body itself
        when kept (its hash and OpenAI fields are then the reader's work,
        ``derive_request_end``), else its hash and, for JSON, its OpenAI fields."""
        body = b"".join(self.parts) if self.parts is not None else None
        self.parts = None
        self.release()
        if keep and body:
            if redact and json_body:
                body = redact_json(body, redact)
            text, encoding = encode_body(body)
            return {"body": text, "body_encoding": encoding, "body_kept": True}
        digest = (self.hash or hashlib.sha256(body or b"")).hexdigest()
        out: dict[str, Any] = {"body_sha256": digest, "body_kept": self.size == 0}
        if self.note is not None:
            out["body_note"] = self.note
        if body and json_body:
            out |= openai_fields(body)
        return out


def redact_json(body: bytes, names: frozenset[str]) -> bytes:
    """A JSON body with the values of the fields named in ``names`` (at any depth, names
    compared case-blind) replaced by ``[redacted]`` (``--redact-json-field``); a body that
    is not JSON is kept as it is."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: "[redacted]" if isinstance(k, str) and k.lower() in names else walk(v)
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return orjson.dumps(walk(doc))


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


def common_prefix(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share. Blocks of doubling size are
    compared while they match, then the first that does not is halved down to the
    character: each comparison is one ``startswith`` (memcmp), about the shared length
    in all, not a Python loop over characters."""
    n = min(len(a), len(b))
    lo, step = 0, SHARE_MIN_CHARS
    while lo < n:  # a[:lo] == b[:lo]
        hi = min(n, lo + step)
        if not a.startswith(b[lo:hi], lo):
            break
        lo, step = hi, step * 2
    else:
        return n
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a.startswith(b[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


class KeptBody(NamedTuple):
    """A body the writer queued, as a base for later ones."""

    tap: Any
    conn: int
    seq: int
    text: str
    encoding: Any
    chain: int  # references from it back to a body written whole


class BodySharing:
    """The capture writer's side of shared body prefixes.

    ``share`` rewrites a ``request_end`` record that keeps a body of at least
    ``SHARE_MIN_CHARS``: when it shares that many leading characters with one of the last
    ``SHARE_CANDIDATES`` bodies of the same tap and encoding (the same connection's first,
    then the most recent), its ``body`` becomes the rest and ``body_base`` names the
    earlier record and the shared length. A body whose best base ends a chain of
    ``SHARE_MAX_CHAIN`` references is written whole instead, and starts a new chain. It
    returns the body in full, for ``remember`` once the record is queued: a body the
    writer dropped is never named as a base.
    """

    __slots__ = ("_recent",)

    def __init__(self) -> None:
        self._recent: deque[KeptBody] = deque(maxlen=SHARE_CANDIDATES)

    def share(self, record: dict[str, Any]) -> KeptBody | None:
        text = record.get("body")
        if not isinstance(text, str) or len(text) < SHARE_MIN_CHARS:
            return None
        tap, enc = record.get("tap"), record.get("body_encoding")
        conn, seq = record["conn"], record["seq"]
        mine = [k for k in self._recent if k.tap == tap and k.encoding == enc]
        mine.sort(key=lambda k: k.conn == conn)  # stable: the same connection's last
        best, best_len = None, 0
        for kept in reversed(mine):
            shared = common_prefix(text, kept.text)
            if shared > best_len:
                best, best_len = kept, shared
            if shared >= len(text) - (len(text) >> 3):  # most of it: good enough
                break
        if best is not None and best_len >= SHARE_MIN_CHARS and best.chain < SHARE_MAX_CHAIN:
            record["body"] = text[best_len:]
            record["body_base"] = [best.conn, best.seq, best_len]
            return KeptBody(tap, conn, seq, text, enc, best.chain + 1)
        return KeptBody(tap, conn, seq, text, enc, 0)

    def remember(self, kept: KeptBody) -> None:
        self._recent.append(kept)

    def forget(self) -> None:
        """After a failed write: the bodies remembered may not be on disk."""
        self._recent.clear()


class BodyResolver:
    """The reader's side: a ``request_end`` with a ``body_base`` gets its body back.

    Keeps the last ``RESOLVE_KEEP`` kept bodies of a capture by (tap, conn, seq). A
    record whose base is not among them (its record was lost: a failed write, a torn
    line) loses its body, counted in ``unresolved``; everything else in it stays.
    """

    __slots__ = ("_bodies", "unresolved")

    def __init__(self) -> None:
        self._bodies: OrderedDict[tuple[Any, Any, Any], tuple[str, Any]] = OrderedDict()
        self.unresolved = 0

    def reset(self) -> None:
        """A new ``capture_start`` (a capture appended to): its records name only its own."""
        self._bodies.clear()

    def resolve(self, record: dict[str, Any]) -> None:
        text = record.get("body")
        if not isinstance(text, str):
            return
        tap, enc = record.get("tap"), record.get("body_encoding")
        base = record.pop("body_base", None)
        if base is not None:
            conn, seq, shared = base if isinstance(base, list) and len(base) == 3 else (0, 0, 0)
            base_text, base_enc = self._bodies.get((tap, conn, seq), ("", None))
            if base_enc != enc or not isinstance(shared, int) or not 0 < shared <= len(base_text):
                self.unresolved += 1  # its base is not here: lost, or not a base
                record["body"] = record["body_encoding"] = None
                record["body_kept"] = False
                return
            text = base_text[:shared] + text
            record["body"] = text
        if len(text) >= SHARE_MIN_CHARS:
            bodies = self._bodies
            bodies[(tap, record.get("conn"), record.get("seq"))] = (text, enc)
            if len(bodies) > RESOLVE_KEEP:
                bodies.popitem(last=False)
