"""Memory per reader, for a 1 MiB input: the peak of what Python allocates while it is
read (``tracemalloc``) stays under a bound, whatever the input's shape. The bounds:
``CAPTURE_BOUND`` for a 1 MiB capture file (its worst case: one line of 1 MiB, parsed
as JSON), ``READER_BOUND`` for the others (a pcap file, a TCP stream reassembled from
shuffled segments, a head, a chunked body, SSE events, each fed 1 MiB)."""

from __future__ import annotations

import io
import random
import tracemalloc
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import dpkt  # type: ignore[import-untyped]
import pytest

from tracer.capture.reader import CaptureError, read_into
from tracer.observe.tcp import Endpoint, HalfStream
from tracer.protocol.framing import BodyDecoder
from tracer.protocol.head import HeadError, HeadReader
from tracer.protocol.sse import SseSplitter

MiB = 1 << 20
CAPTURE_BOUND = 24 * MiB  # measured: 14 MiB for one 1 MiB line, 0.2 MiB for usual lines
READER_BOUND = 8 * MiB  # measured: 3 MiB at most (an SSE event of 1 MiB in 4 KiB reads)
DATA = Path(__file__).parents[1] / "data"
HEADER = b'{"type":"capture_start","t":1.0,"m":1.0,"tap":"t","version":3}\n'


def peak(read: Callable[[], object]) -> int:
    """The peak of Python's allocations while ``read`` runs (its documented error is a
    read too)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with suppress(CaptureError, HeadError):
            read()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _captures() -> dict[str, bytes]:
    recorded = b"".join(p.read_bytes() for p in sorted(DATA.glob("scenarios/*/*.jsonl")))
    return {
        "recorded": recorded[:MiB],
        "one_line": HEADER + b'{"type":"mark","t":1,"note":"' + b"x" * MiB + b'"}',
        "one_line_torn": HEADER + b'{"type":"mark","t":1,"note":"' + b"x" * MiB,
        "random": random.Random(1).randbytes(MiB),
        "bad_lines": HEADER + (b"not json " * 11 + b"\n") * (MiB // 100),
    }


@pytest.mark.parametrize("shape", sorted(_captures()))
def test_a_capture_file(tmp_path: Path, shape: str) -> None:
    path = tmp_path / "cap.jsonl"
    path.write_bytes(_captures()[shape])
    assert peak(lambda: read_into(path, lambda event: None)) < CAPTURE_BOUND


def test_a_pcap_file(tmp_path: Path) -> None:
    reader = dpkt.pcap.Reader(io.BytesIO((DATA / "pcap" / "hang_on_reuse_lo.pcap").read_bytes()))
    frames = [(float(t), bytes(b)) for t, b in reader]
    out = io.BytesIO()
    writer = dpkt.pcap.Writer(out, linktype=reader.datalink())
    for k in range(MiB // 48_000 + 1):
        for t, frame in frames:
            writer.writepkt(frame, ts=t + 100 * k)
    path = tmp_path / "big.pcap"
    path.write_bytes(out.getvalue()[:MiB])
    assert peak(lambda: read_into(path, lambda event: None)) < READER_BOUND


def test_a_tcp_stream_in_shuffled_segments() -> None:
    rnd = random.Random(2)
    stream = rnd.randbytes(MiB)
    segments = [(i, stream[i : i + 1000]) for i in range(0, MiB, 1000)]
    rnd.shuffle(segments)

    def reassemble() -> None:
        half = HalfStream(1, Endpoint("10.0.0.1", 1))
        half.syn(0.0, 0, ack=False)
        for offset, payload in segments:
            half.segment(0.0, offset + 1, payload)
        half.end(1.0)

    assert peak(reassemble) < READER_BOUND


def _fed(step: int, data: bytes, feed: Callable[[bytes], object]) -> Callable[[], None]:
    def run() -> None:
        for i in range(0, len(data), step):
            feed(data[i : i + step])

    return run


@pytest.mark.parametrize("step", [4096, MiB])
def test_a_head(step: int) -> None:
    head = b"GET / HTTP/1.1\r\nx: " + b"a" * MiB
    assert peak(_fed(step, head, HeadReader(request=True).feed)) < READER_BOUND


@pytest.mark.parametrize("step", [4096, MiB + 10_000])
def test_a_chunked_body(step: int) -> None:
    rnd = random.Random(3)
    body = b"".join(b"3e8\r\n" + rnd.randbytes(1000) + b"\r\n" for _ in range(MiB // 1000))
    assert peak(_fed(step, body + b"0\r\n\r\n", BodyDecoder("chunked").feed)) < READER_BOUND


@pytest.mark.parametrize("step", [4096, 2 * MiB])
@pytest.mark.parametrize("shape", ["events", "one_event"])
def test_sse_events(step: int, shape: str) -> None:
    if shape == "events":
        data = b"".join(
            b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % i for i in range(30_000)
        )
    else:  # one event over MAX_EVENT: the rest of it counted, not kept
        data = b"data: " + b"x" * (MiB + 100) + b"\r\n\r\n"
    assert peak(_fed(step, data[: MiB + 200], SseSplitter().feed)) < READER_BOUND
