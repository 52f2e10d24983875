"""Kept request bodies and what a reader derives from them (``tracer/capture/bodies.py``)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from tests.support.analyze import analyze_here
from tracer import events as ev
from tracer.capture.bodies import (
    SHARE_MAX_CHAIN,
    common_prefix,
    decode_body,
    derive_request_end,
    encode_body,
    request_fields,
)
from tracer.capture.files import CaptureWriter, ReadStats, read_events, read_records

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
    assert request_fields(live) == {
        "model": "m",
        "stream": True,
        "max_tokens": 7,
        "messages": 1,
        "prompt_chars": 1,
    }
    measured = ev.RequestEnd(t=1.0, m=1.0, tap="t", conn=1, seq=1, complete=True,
                             body_bytes=9, body_sha256="b" * 64, model="n")  # fmt: skip
    assert request_fields(measured) == {"model": "n"}


# ---- shared prefixes (capture version 3) --------------------------------------------


def test_common_prefix_agrees_with_a_character_loop() -> None:
    rng = random.Random(7)
    for _ in range(300):
        shared = rng.choice([0, 1, 4095, 4096, 4097, 12287, 12288, 30000, rng.randrange(40000)])
        base = "".join(rng.choice('ab"é') for _ in range(shared))
        a = base + "".join(rng.choice("xyz") for _ in range(rng.randrange(3)))
        b = base + "".join(rng.choice("xyzq") for _ in range(rng.randrange(5000)))
        loop = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        assert common_prefix(a, b) == loop
        assert common_prefix(b, a) == common_prefix(a, b)


def _turns(n: int, *, start: str = "", tail: str = "") -> list[bytes]:
    """An agent conversation's request bodies: each turn repeats the one before and adds
    a few kB (the history), then ends differently (the closing fields)."""
    history = '{"model":"m","stream":true,"messages":[{"role":"system","content":"' + start
    out = []
    for k in range(n):
        history += f'"}},{{"role":"user","content":"turn {k}: ' + "tool output é " * 300
        out.append((history + f'"}}],"max_tokens":{k}{tail}}}').encode())
    return out


def _request_end(conn: int, seq: int, raw: bytes) -> ev.RequestEnd:
    text, enc = encode_body(raw)
    return ev.RequestEnd(t=1.0, m=1.0, tap="t", conn=conn, seq=seq, complete=True,
                         body_bytes=len(raw), body=text, body_encoding=enc, body_kept=True)  # fmt: skip


def _capture(path: Path, **options: Any) -> CaptureWriter:
    writer = CaptureWriter(path, **options)
    writer.write(ev.CaptureStart(t=0.0, m=0.0, tap="t", tracer_version="0", kind="proxy"))
    return writer


def _bodies_read(path: Path) -> tuple[list[ev.RequestEnd], ReadStats]:
    stats = ReadStats()
    ends = [e for e in read_events(path, stats) if isinstance(e, ev.RequestEnd)]
    return ends, stats


def test_a_conversation_is_written_once_and_read_back_whole(tmp_path: Path) -> None:
    """Two conversations interleaved on two connections, and a binary body: every body
    reads back as written, with its hash; the capture holds about one copy of each
    conversation instead of one per turn."""
    first, second = _turns(6, start="alpha"), _turns(6, start="beta", tail=',"n":1')
    binary = b"\xff\xfe" + b"\x00\x01" * 5000
    sent: list[tuple[int, int, bytes]] = []
    for k in range(6):
        sent += [(1, k + 1, first[k]), (2, k + 1, second[k])]
    sent += [(3, 1, binary), (3, 2, binary + b"!")]
    path = tmp_path / "c.jsonl"
    writer = _capture(path)
    for conn, seq, raw in sent:
        assert writer.write(_request_end(conn, seq, raw))
    writer.finish("t", "stopped")
    ends, stats = _bodies_read(path)
    assert [decode_body(e.body or "", e.body_encoding) for e in ends] == [r for _, _, r in sent]
    assert [e.body_sha256 for e in ends] == [hashlib.sha256(r).hexdigest() for _, _, r in sent]
    assert ends[0].model == "m" and ends[-1].body_sha256 is not None
    assert stats.bodies_unresolved == 0
    records = [r for r in read_records(path) if r["type"] == "request_end"]
    bases = [r.get("body_base") for r in records]
    assert bases[2][:2] == [1, 1] and bases[3][:2] == [2, 1]  # its own conversation's
    assert bases[-1] is not None  # the binary body shares its base64 text too
    assert path.stat().st_size < sum(len(r) for r in first[-1:] + second[-1:]) * 1.6


def test_a_dropped_body_is_never_named_as_a_base(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    writer = _capture(path, max_pending_bytes=12_000, flush_interval=3600.0)  # one batch
    a, b = _turns(1, start="a")[0], _turns(3, start="b")[1:]  # 4.6, 9.3 and 14 kB
    assert writer.write(_request_end(1, 1, a))
    assert not writer.write(_request_end(2, 1, b[0]))  # the batch is full: dropped
    writer.write(_request_end(2, 2, b[1]))  # whole (dropped too), not 4.6 kB naming b[0]
    writer.close()  # flushes at once
    ends, stats = _bodies_read(path)
    assert stats.bodies_unresolved == 0 and ends[0].body is not None
    assert all(e.body is not None for e in ends)


def test_after_a_failed_write_no_body_before_it_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    writer = _capture(path, flush_interval=0.001)
    turns = _turns(3, start="x")
    deadline = time.monotonic() + 10
    while not writer.written:  # poll: the header on disk
        assert time.monotonic() < deadline, "the header was not written"
        time.sleep(0.005)
    good_fd, bad_fd = writer._fd, os.open(os.devnull, os.O_RDONLY)  # writes to it fail
    try:
        writer._fd = bad_fd
        writer.write(_request_end(1, 1, turns[0]))
        while not writer.dropped:  # poll for the writer thread's failed write
            assert time.monotonic() < deadline, "the write did not fail"
            time.sleep(0.005)
    finally:
        writer._fd = good_fd
        os.close(bad_fd)
    writer.write(_request_end(1, 2, turns[1]))
    writer.write(_request_end(1, 3, turns[2]))
    writer.close()
    ends, stats = _bodies_read(path)
    assert stats.bodies_unresolved == 0
    assert [decode_body(e.body or "", e.body_encoding) for e in ends] == turns[1:]


def test_a_lost_base_loses_only_the_bodies_that_lead_back_to_it(tmp_path: Path) -> None:
    """A chain of references is at most SHARE_MAX_CHAIN long: then a body is written
    whole, so losing a record loses the rest of its chain, not the conversation."""
    path = tmp_path / "c.jsonl"
    writer = _capture(path)
    turns = _turns(SHARE_MAX_CHAIN + 4, start="y")
    for seq, raw in enumerate(turns, 1):
        writer.write(_request_end(1, seq, raw))
    writer.close()
    lines = path.read_bytes().splitlines(keepends=True)
    assert b"body_base" not in lines[1] and b"body_base" in lines[2]
    assert b"body_base" not in lines[SHARE_MAX_CHAIN + 2]  # whole again
    del lines[1]  # the first turn's record, which the second names
    path.write_bytes(b"".join(lines))
    ends, stats = _bodies_read(path)
    assert stats.bodies_unresolved == SHARE_MAX_CHAIN
    assert stats.describe(str(path))["bodies_unresolved"] == SHARE_MAX_CHAIN
    lost = ends[:SHARE_MAX_CHAIN]
    assert all(e.body is None and not e.body_kept and e.body_sha256 is None for e in lost)
    assert [e.body_bytes for e in lost] == [len(t) for t in turns[1 : SHARE_MAX_CHAIN + 1]]
    kept = [decode_body(e.body or "", e.body_encoding) for e in ends[SHARE_MAX_CHAIN:]]
    assert kept == turns[SHARE_MAX_CHAIN + 1 :]


def test_an_appended_capture_names_only_its_own_bodies(tmp_path: Path) -> None:
    """Two writers one after the other on one file number their connections alike: the
    second's references must not reach the first's bodies."""
    path = tmp_path / "c.jsonl"
    first, second = _turns(2, start="one"), _turns(2, start="two")
    for turns in (first, second):
        writer = _capture(path, append="t")  # the second run extends the first's capture
        assert writer.write(_request_end(1, 1, turns[0]))
        writer.write(_request_end(1, 2, turns[1]))
        writer.close()
    lines = path.read_bytes().splitlines(keepends=True)
    del lines[4]  # the second writer's first body: its second now names a lost record
    path.write_bytes(b"".join(lines))
    ends, stats = _bodies_read(path)
    assert [decode_body(e.body or "", e.body_encoding) for e in ends[:2]] == first
    assert ends[2].body is None and stats.bodies_unresolved == 1  # not first[0]'s text


def test_analyze_json_counts_lost_bodies_and_takes_a_capture_without_requests(
    tmp_path: Path,
) -> None:
    """The lost body shows in `tracer analyze --format json`; and a capture with no request
    at all (a tap that saw no traffic) gives empty tables, not a crash."""
    path = tmp_path / "c.jsonl"
    writer = _capture(path)
    turns = _turns(2, start="z")
    for seq, raw in enumerate(turns, 1):
        writer.write(_request_end(1, seq, raw))
    writer.close()
    lines = path.read_bytes().splitlines(keepends=True)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(lines[0])
    path.write_bytes(lines[0] + lines[2])  # the second turn without the first
    for capture, lost in ((path, 1), (empty, 0)):
        result = analyze_here(capture)
        assert result["captures"][0]["bodies_unresolved"] == lost
        assert result["requests"] == [] and result["connections"] == []


def test_the_body_memory_budget_bounds_every_body_held_together() -> None:
    """Two bodies streaming at once under a 1 KiB budget: the first is held, the second
    goes over and is hashed as it streams (its record says so); the budget is given back
    when a body ends, or is dropped unfinished."""
    from tracer.capture.bodies import OVER_BUDGET, BodyBudget, RequestBody

    budget = BodyBudget(1024)
    first, second = RequestBody(1 << 20, budget=budget), RequestBody(1 << 20, budget=budget)
    first.add(b"a" * 600)
    second.add(b"b" * 300)
    assert budget.held == 900
    second.add(b"b" * 300)  # 1,200 > 1,024: hashed from here on
    assert second.parts is None and budget.held == 600 and budget.exceeded == 1
    record = second.record(keep=True, json_body=True)
    assert record["body_note"] == OVER_BUDGET and not record["body_kept"]
    assert record["body_sha256"] == hashlib.sha256(b"b" * 600).hexdigest()
    assert first.record(keep=True, json_body=False)["body_kept"] and budget.held == 0
    third = RequestBody(1 << 20, budget=budget)
    third.add(b"c" * 100)
    assert budget.held == 100
    del third  # its connection was cut mid-body
    assert budget.held == 0


def test_redact_json_field_replaces_the_named_fields_at_any_depth() -> None:
    from tracer.capture.bodies import RequestBody, redact_json

    body = b'{"model": "m", "messages": [{"role": "user", "Content": "my secret plan"}], "n": 1}'
    out = json.loads(redact_json(body, frozenset({"content"})))
    assert out["messages"][0] == {"role": "user", "Content": "[redacted]"} and out["n"] == 1
    assert redact_json(b"not json", frozenset({"content"})) == b"not json"
    kept = RequestBody(1 << 20)
    kept.add(body)
    record = kept.record(keep=True, json_body=True, redact=frozenset({"content"}))
    assert "my secret plan" not in record["body"] and record["body_kept"]
