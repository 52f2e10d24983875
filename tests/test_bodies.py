"""Kept request bodies and what a reader derives from them (``tracer/bodies.py``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tracer import events as ev
from tracer.bodies import derive_request_end, encode_body, request_fields
from tracer.capture import read_events

BODY = b'{"model":"m","stream":true,"max_tokens":7,"messages":[{"role":"user","content":"x"}]}'


def _end(**fields: object) -> dict[str, object]:
    return {"type": "request_end", "t": 1.0, "m": 1.0, "tap": "t", "conn": 1, "seq": 1,
            "complete": True, "body_bytes": len(BODY), **fields}  # fmt: skip


def test_a_version_2_record_gets_its_hash_and_fields_from_its_body() -> None:
    text, enc = encode_body(BODY)
    rec = _end(body=text, body_encoding=enc, body_kept=True)
    derive_request_end(rec)
    assert rec["body_sha256"] == hashlib.sha256(BODY).hexdigest()
    assert (rec["model"], rec["stream"], rec["max_tokens"], rec["messages"]) == ("m", True, 7, 1)


def test_a_binary_body_is_decoded_before_it_is_hashed() -> None:
    raw = b"\xff\x00" + BODY
    text, enc = encode_body(raw)
    rec = _end(body=text, body_encoding=enc, body_kept=True)
    derive_request_end(rec)
    assert enc == "base64" and rec["body_sha256"] == hashlib.sha256(raw).hexdigest()
    assert "model" not in rec  # not JSON


def test_a_record_with_its_hash_is_left_as_the_tap_wrote_it() -> None:
    """Version 1 records, and version 2 records of bodies not kept, carry what was measured."""
    rec = _end(body=BODY.decode(), body_encoding="utf-8", body_sha256="a" * 64, model="x")
    derive_request_end(rec)
    assert rec["body_sha256"] == "a" * 64 and rec["model"] == "x" and "stream" not in rec


def test_a_body_that_does_not_decode_derives_nothing() -> None:
    rec = _end(body="not base64 at all!", body_encoding="base64", body_kept=True)
    derive_request_end(rec)
    assert "body_sha256" not in rec and "model" not in rec


def test_the_reader_derives_and_a_live_sink_can_too(tmp_path: Path) -> None:
    text, enc = encode_body(BODY)
    header = ev.CaptureStart(t=0.0, m=0.0, tap="t", tracer_version="0", kind="proxy").to_record()
    path = tmp_path / "c.jsonl"
    lines = [header, _end(body=text, body_encoding=enc, body_kept=True)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    read = [e for e in read_events(path) if isinstance(e, ev.RequestEnd)]
    assert read[0].body_sha256 == hashlib.sha256(BODY).hexdigest() and read[0].model == "m"
    live = ev.RequestEnd(t=1.0, m=1.0, tap="t", conn=1, seq=1, complete=True,
                         body_bytes=len(BODY), body=text, body_encoding=enc, body_kept=True)  # fmt: skip
    assert request_fields(live) == {"model": "m", "stream": True, "max_tokens": 7, "messages": 1}
    measured = ev.RequestEnd(t=1.0, m=1.0, tap="t", conn=1, seq=1, complete=True,
                             body_bytes=9, body_sha256="b" * 64, model="n")  # fmt: skip
    assert request_fields(measured) == {"model": "n"}
