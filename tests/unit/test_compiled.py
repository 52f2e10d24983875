"""The compiled hot path (``tracer/compiled.py``, ``docs/compiled.md``).

* The import hook: the build is used when its manifest matches the sources and the
  interpreter, the ``.py`` otherwise (a changed source, another interpreter, a build that
  does not load, ``TRACER_PURE_PYTHON``), and an extension module left beside a source
  is never loaded. No test builds (mypyc takes ~30 s): those that need the build are
  skipped without one (``python -m tracer.compiled build``).
* Differential: the same bytes through the compiled modules and through their ``.py``
  (imported again as ``_pure_tracer``) give the same results: SSE streams cut at random
  reads with LF, CRLF and CR line ends, chunked framing, heads, whole connections.
* The shortcuts of the hot path against what they stand for, in either mode: ``_scan``
  against the classifier's regular expression of old, a stream's plain content chunks
  (``SseSplitter._plain``) against the classifier.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tracer import compiled
from tracer.observe import wire
from tracer.protocol import framing, head, sse
from tracer.protocol.sse import SseSplitter, classify

ROOT = Path(__file__).resolve().parents[2]
TRACER = ROOT / "tracer"
STREAMS = ROOT / "tests" / "data" / "streams"
BUILT = compiled.stale(compiled.BUILD_DIR, compiled.ROOT) is None
PURE_HERE = os.environ.get(compiled.PURE_ENV, "") not in ("", "0")

needs_build = pytest.mark.skipif(not BUILT, reason="no up-to-date build of the hot path")


def _compiled_here() -> bool:
    for name in compiled.HOT:
        importlib.import_module(name)
    return compiled.active() == list(compiled.HOT)


# ---- the import hook -------------------------------------------------------------------


def test_this_process_uses_the_build_exactly_when_it_may() -> None:
    here = _compiled_here()
    if PURE_HERE:
        assert not here and compiled.verdict() == f"{compiled.PURE_ENV} is set"
    elif BUILT:
        assert here and compiled.verdict() is None
        for name in compiled.HOT:
            assert Path(sys.modules[name].__file__ or "").is_relative_to(compiled.BUILD_DIR)
        assert compiled.SHARED in sys.modules
    else:
        assert not here and compiled.verdict() is not None


def test_no_extension_module_is_built_into_the_source_tree() -> None:
    stray = [p for p in TRACER.rglob("*") if p.suffix in (".so", ".pyd")]
    assert not stray


def _source_spec(hook: compiled.HotPath, root: Path, name: str = "tracer.protocol.sse") -> None:
    spec = hook.find_spec(name)
    assert spec is not None and spec.origin == compiled.source_path(str(root), name)


def test_the_variable_turns_the_build_off() -> None:
    hook = compiled.HotPath(compiled.BUILD_DIR, compiled.ROOT, {compiled.PURE_ENV: "1"})
    _source_spec(hook, ROOT)
    assert hook.verdict() == f"{compiled.PURE_ENV} is set"
    assert hook.find_spec(compiled.SHARED) is None
    assert hook.find_spec("tracer.events") is None  # (not a hot module: not the hook's)


@needs_build
def test_a_changed_source_is_pure_python(tmp_path: Path) -> None:
    """A copy of the sources the build was made from: the build matches it until one of
    them changes by a byte."""
    manifest = compiled.read_manifest(compiled.BUILD_DIR)
    assert manifest is not None
    for rel in manifest["sources"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert compiled.stale(compiled.BUILD_DIR, str(tmp_path)) is None
    loaded = compiled.SHARED in sys.modules
    hook = compiled.HotPath(compiled.BUILD_DIR, str(tmp_path), {})
    spec = hook.find_spec("tracer.protocol.sse")
    extension = os.path.join(compiled.BUILD_DIR, manifest["modules"]["tracer.protocol.sse"])
    assert spec is not None and spec.origin == extension
    if not loaded:  # (this process runs the .py: the support module loaded to check goes)
        del sys.modules[compiled.SHARED]
    for rel in ("tracer/protocol/sse.py", "tracer/events.py"):  # compiled, or baked in
        copy = tmp_path / rel
        saved = copy.read_bytes()
        copy.write_bytes(saved + b"\n")
        assert compiled.stale(compiled.BUILD_DIR, str(tmp_path)) == f"{rel} changed since the build"
        hook = compiled.HotPath(compiled.BUILD_DIR, str(tmp_path), {})
        _source_spec(hook, tmp_path)
        assert hook.verdict() == f"{rel} changed since the build"
        copy.write_bytes(saved)


def _fake_build(tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    """A build directory whose manifest matches sources under a root: its "extensions"
    are empty files."""
    root, build = tmp_path / "root", tmp_path / "build"
    sources = {}
    for name in compiled.HOT:
        path = Path(compiled.source_path(str(root), name))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n")
        rel = path.relative_to(root).as_posix()
        sources[rel] = compiled.sha256_file(str(path))
    modules = {}
    for name in (*compiled.HOT, compiled.SHARED):
        rel = name.replace(".", "/") + ".so"
        (build / rel).parent.mkdir(parents=True, exist_ok=True)
        (build / rel).write_bytes(b"")
        modules[name] = rel
    manifest = {
        "format": compiled.FORMAT,
        "interpreter": compiled.interpreter(),
        "modules": modules,
        "artifacts": {rel: compiled.sha256_file(str(build / rel)) for rel in modules.values()},
        "sources": sources,
        "packages": {"h11": compiled.distribution("h11")},
    }
    (build / compiled.MANIFEST).write_text(json.dumps(manifest))
    return root, build, manifest


def _stale_with(build: Path, root: Path, manifest: dict[str, Any], **changes: Any) -> str | None:
    (build / compiled.MANIFEST).write_text(json.dumps({**manifest, **changes}))
    return compiled.stale(str(build), str(root))


def test_what_makes_a_build_stale(tmp_path: Path) -> None:
    root, build, manifest = _fake_build(tmp_path)
    assert compiled.stale(str(build), str(root)) is None
    other = {**manifest["interpreter"], "version": "3.12.0 (elsewhere)"}
    assert _stale_with(build, root, manifest, interpreter=other) == (
        "the build is for another interpreter"
    )
    assert _stale_with(build, root, manifest, format=0) == "the build is of another format"
    fewer = dict(list(manifest["modules"].items())[1:])
    assert _stale_with(build, root, manifest, modules=fewer) == "the build is of other modules"
    h11 = {"h11": "h11-0.0.1.dist-info"}
    assert _stale_with(build, root, manifest, packages=h11) == "h11 changed since the build"
    (build / compiled.MANIFEST).write_text(json.dumps(manifest))
    damaged = manifest["modules"]["tracer.observe.wire"]
    (build / damaged).write_bytes(b"\x7fELF")  # (a cut extension crashes the import)
    assert compiled.stale(str(build), str(root)) == f"{damaged} is not the file that was built"
    (build / damaged).write_bytes(b"")
    assert compiled.stale(str(build), str(root)) is None
    (build / manifest["modules"][compiled.SHARED]).unlink()
    assert compiled.stale(str(build), str(root)) == (
        f"{manifest['modules'][compiled.SHARED]} is missing from the build"
    )
    (build / compiled.MANIFEST).write_text("{not json")
    assert compiled.stale(str(build), str(root)) == f"no build in {build}"


def test_a_build_that_does_not_load_is_pure_python(tmp_path: Path) -> None:
    """The manifest matches, but the support module is no extension (or another build's
    is loaded here): the .py."""
    root, build, _ = _fake_build(tmp_path)
    hook = compiled.HotPath(str(build), str(root), {})
    _source_spec(hook, root)
    why = hook.verdict() or ""
    assert why.startswith(("the build does not load", "another build of the hot path"))
    assert compiled.SHARED not in sys.modules or sys.modules[compiled.SHARED].__file__ != str(
        build / f"{compiled.SHARED}.so"
    )


def test_an_extension_beside_a_source_is_not_loaded(tmp_path: Path) -> None:
    """Pure Python means the .py, also when a hand-run mypyc left an extension beside it
    (the path finder would take the extension first)."""
    source = Path(compiled.source_path(str(tmp_path), "tracer.protocol.sse"))
    source.parent.mkdir(parents=True)
    source.write_text("")
    (source.parent / f"sse{compiled.interpreter()['extension_suffix']}").write_bytes(b"stale")
    _source_spec(compiled.HotPath(str(tmp_path / "no-build"), str(tmp_path), {}), tmp_path)


def test_without_the_tools_the_build_says_so_in_a_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiled, "missing_tools", lambda: "mypyc is not installed")
    failed, line = compiled.build(str(tmp_path))
    assert not failed and line == (
        "compiled hot path not built: mypyc is not installed; pure Python is used"
    )
    assert not list(tmp_path.iterdir())


def test_the_manifest_covers_what_mypyc_reads() -> None:
    sources, packages = compiled.dependencies(str(ROOT))
    for name in compiled.HOT:
        assert Path(compiled.source_path(str(ROOT), name)).relative_to(ROOT).as_posix() in sources
    assert {"tracer/events.py", "tracer/capture/bodies.py", "tracer/redact.py"} <= set(sources)
    assert "h11" in packages and "re" not in packages


# ---- differential: compiled and pure ---------------------------------------------------


@pytest.fixture(scope="module")
def pure() -> Iterator[SimpleNamespace]:
    """The hot modules from their .py, as ``_pure_tracer.*`` (the package imported again
    under another name: its modules are the .py, and the hook is not installed twice)."""
    if not _compiled_here():
        pytest.skip("the hot path is not compiled in this process")
    name = "_pure_tracer"
    spec = importlib.util.spec_from_file_location(
        name, TRACER / "__init__.py", submodule_search_locations=[str(TRACER)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    try:
        spec.loader.exec_module(package)
        modules: dict[str, ModuleType] = {}
        for hot in compiled.HOT:
            module = importlib.import_module(name + hot.removeprefix("tracer"))
            assert (module.__file__ or "").endswith(".py")
            modules[hot.rpartition(".")[2]] = module
        yield SimpleNamespace(**modules)
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def _cuts(data: bytes, rnd: random.Random, most: int = 6) -> list[bytes]:
    cuts = sorted(rnd.sample(range(1, len(data)), min(len(data) - 1, rnd.randint(0, most))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def _event(e: Any) -> tuple[Any, ...]:
    return e.size, e.kind, e.content, e.finish_reason, e.usage, e.error


ATOMS = [
    b'"content"', b'"text"', b'"reasoning_content"', b'"tool_calls"', b'"finish_reason"',
    b'"usage"', b'"error"', b'"object"', b":", b" ", b"\t", b"\x0b", b'"', b"{", b"[", b"}",
    b"]", b",", b'"x"', b'"stop"', b"null", b'{"a":1}', b"[DONE]", b"\xff", b"1",
]  # fmt: skip
LINE_ENDS = [b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n", b"\n\n\n\n", b"\n"]


def _payload(rnd: random.Random) -> bytes:
    if rnd.random() < 0.5:
        return b"".join(rnd.choice(ATOMS) for _ in range(rnd.randint(0, 12)))
    delta = rnd.choice(
        [{"content": rnd.choice(["", "x", '"', None])}, {"tool_calls": [{"id": 1}]},
         {"reasoning_content": "r"}, {"role": "assistant", "content": ""}]
    )  # fmt: skip
    obj: dict[str, Any] = {
        "choices": [{"delta": delta, "finish_reason": rnd.choice([None, "stop"])}]
    }
    if rnd.random() < 0.2:
        obj["usage"] = rnd.choice([None, {"total_tokens": 3}])
    if rnd.random() < 0.1:
        obj = {"error": {"message": "m"}} if rnd.random() < 0.5 else {"object": "error"}
    text = json.dumps(obj, separators=rnd.choice([(",", ":"), (", ", ": ")])).encode()
    return text[: rnd.randint(0, len(text))] if rnd.random() < 0.2 else text


def _block(rnd: random.Random) -> bytes:
    lead = rnd.choice([b"data: ", b"data:", b": ", b"event: x\ndata: ", b"data: {\ndata: ", b""])
    return lead + _payload(rnd)


def test_sse_compiled_and_pure_alike(pure: SimpleNamespace) -> None:
    rnd = random.Random(27)
    for _ in range(400):
        block = _block(rnd)
        assert _event(sse.classify(block)) == _event(pure.sse.classify(block)), block
    for _ in range(300):
        stream = b"".join(_block(rnd) + rnd.choice(LINE_ENDS) for _ in range(rnd.randint(1, 6)))
        pieces = _cuts(stream, rnd)
        for with_ends in (False, True):
            ours, theirs = sse.SseSplitter(), pure.sse.SseSplitter()
            for piece in pieces:
                a: list[int] | None = [] if with_ends else None
                b: list[int] | None = [] if with_ends else None
                got = [_event(e) for e in ours.feed(piece, a)]
                assert got == [_event(e) for e in theirs.feed(piece, b)], stream
                assert a == b and ours.pending == theirs.pending, stream


def _chunked(rnd: random.Random) -> bytes:
    out = []
    for _ in range(rnd.randint(0, 4)):
        data = bytes(rnd.choice(b"ab\r\n;") for _ in range(rnd.randint(1, 20)))
        size = rnd.choice([b"%x", b"%X", b"%x;e=1", b" %x", b"%x\t", b"0%x"]) % len(data)
        size = b"g" if rnd.random() < 0.05 else size
        end = rnd.choice([b"\r\n", b"\r\n", b"\r", b"xx"])
        out.append(size + rnd.choice([b"\r\n", b"\r\n", b"\n"]) + data + end)
    out.append(rnd.choice([b"0\r\n\r\n", b"0\r\nx: y\r\n\r\n", b"0\r\n", b"1" * 17 + b"\r\n"]))
    return b"".join(out)


def _walk(module: ModuleType, pieces: list[bytes], how: str) -> list[Any]:
    decoder = module.BodyDecoder("chunked", 0)
    out: list[Any] = []
    for piece in pieces:
        try:
            if how == "feed":
                out.append((*decoder.feed(piece), decoder.done))
            else:
                parts: list[Any] | None = [] if how == "parts" else None
                out.append((decoder.walk(piece, 0, parts), parts, decoder.done))
        except module.FramingError as exc:
            out.append((str(exc), exc.at, exc.pieces, exc.chunks))
            break
    return out


def test_framing_compiled_and_pure_alike(pure: SimpleNamespace) -> None:
    rnd = random.Random(7)
    for _ in range(300):
        pieces = _cuts(_chunked(rnd), rnd, 4)
        for how in ("feed", "walk", "parts"):
            assert _walk(framing, pieces, how) == _walk(pure.framing, pieces, how), pieces
    for line in (b"", b"a", b"A;x", b" 1", b"f" * 16, b"1" + b"f" * 16, b"1 ", b"10\t;x"):
        assert framing.chunk_size(line) == pure.framing.chunk_size(line)


def _read_head(module: ModuleType, data: bytes, request: bool) -> Any:
    try:
        parsed = (module.parse_request_head if request else module.parse_response_head)(data)
    except module.HeadError as exc:
        return str(exc)
    return parsed.headers, (parsed.method, parsed.target) if request else parsed.status


def test_heads_compiled_and_pure_alike(pure: SimpleNamespace) -> None:
    rnd = random.Random(3)
    lines = [b"Host: x", b"Content-Length: 5", b"Transfer-Encoding: chunked", b"X-A:  v ",
             b"Upgrade: h2c", b"bad line", b"Content-Length: 5, 5", b"N\xe9: v", b""]  # fmt: skip
    for _ in range(300):
        start = rnd.choice([b"POST /v1 HTTP/1.1", b"GET / HTTP/1.0", b"HTTP/1.1 200 OK",
                            b"HTTP/1.1 101 Switching", b"BAD", b"HTTP/1.1 2000 x"])  # fmt: skip
        end = rnd.choice([b"\r\n", b"\n"])
        data = end.join([start, *rnd.sample(lines, rnd.randint(0, 4))]) + end + end + b"body"
        request = not start.startswith(b"HTTP")
        quick = head.quick_request if request else head.quick_response
        pure_quick = pure.head.quick_request if request else pure.head.quick_response
        assert quick(data, 1000) == pure_quick(data, 1000), data
        cut = data.find(end + end) + 2 * len(end)
        assert _read_head(head, data[:cut], request) == _read_head(pure.head, data[:cut], request)
        ours, theirs = head.HeadReader(request=request), pure.head.HeadReader(request=request)
        for piece in _cuts(data, rnd, 3):
            try:
                at: Any = ours.feed(piece)
            except head.HeadError as exc:
                at = str(exc)
            try:
                at_pure: Any = theirs.feed(piece)
            except pure.head.HeadError as exc:
                at_pure = str(exc)
            assert at == at_pure and ours.head == theirs.head, data
            if at != -1:
                break


def _connections(rnd: random.Random) -> Iterator[list[tuple[str, bytes]]]:
    """Connections as steps: the recorded streams, and generated requests and responses."""
    pairs = [("chat_stream.client.bin", name) for name in (
        "vllm_stream.upstream.bin", "spaced_stream.upstream.bin", "router_rechunked.upstream.bin",
        "error_stream.upstream.bin", "no_done.upstream.bin", "truncated.upstream.bin",
        "bad_chunked.upstream.bin", "http10_close.upstream.bin",
    )] + [("keepalive3.client.bin", "keepalive3.upstream.bin"),
          ("pipelined.client.bin", "pipelined.upstream.bin"),
          ("garbage_request.client.bin", "no_request.upstream.bin")]  # fmt: skip
    for client, upstream in pairs:
        yield [("c", (STREAMS / client).read_bytes()), ("u", (STREAMS / upstream).read_bytes())]
    for _ in range(24):
        body = json.dumps({"model": "m", "stream": True, "n": rnd.random()}).encode()
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        events = b"".join(
            b"data: " + _payload(rnd) + rnd.choice(LINE_ENDS[:3]) for _ in range(rnd.randint(1, 8))
        )
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in _cuts(events, rnd, 8))
        sse_head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        plain = b'{"choices":[]}'
        plain_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        )
        steps = [("c", request), ("u", sse_head + chunks + b"0\r\n\r\n")]
        steps += [("c", request), ("u", plain_head % len(plain) + plain)]
        yield steps


def _observe(module: ModuleType, steps: list[tuple[str, bytes]], rnd: random.Random) -> list[Any]:
    events: list[Any] = []
    obs = module.ConnectionObserver(
        tap="t", conn=1, emit=events.append, wall_offset=1e9, opened_m=0.0, bodies="all"
    )
    m = 0.0
    for side, data in steps:
        for piece in _cuts(data, rnd, 8):
            m += rnd.choice([0.001, 0.03, 0.2])
            (obs.client_data if side == "c" else obs.upstream_data)(piece, m)
    obs.upstream_eof(m + 0.01, reset=False)
    obs.close(m + 0.02, shutdown=False)
    return [e.to_record() for e in events]


def test_connections_compiled_and_pure_alike(pure: SimpleNamespace) -> None:
    rnd = random.Random(11)
    for steps in _connections(rnd):
        seed = rnd.random()
        ours = _observe(wire, steps, random.Random(seed))
        assert ours == _observe(pure.wire, steps, random.Random(seed)), steps
        assert ours  # (it observed something)


# ---- the shortcuts against what they stand for -----------------------------------------

# the classifier's pass over a payload before ``_scan`` found its keys with bytes.find
_KEYS = re.compile(
    rb'"(content|text|reasoning_content|tool_calls|finish_reason|usage)"\s*:\s*(.)', re.S
)


def _scan_by_regex(payload: bytes) -> tuple[bool, str | None, bool]:
    content = usage = False
    reason: str | None = None
    for found in _KEYS.finditer(payload):
        key, first = found.group(1), found.group(2)
        end = found.end()
        if key in (b"content", b"text", b"reasoning_content"):
            if first == b'"' and payload[end : end + 1] not in (b'"', b""):
                content = True
        elif key == b"finish_reason":
            if first == b'"':
                close = payload.find(b'"', end)
                if close >= 0:
                    reason = payload[end:close].decode("utf-8", "replace")
        elif key == b"usage":
            usage = usage or first == b"{"
        elif first == b"[" and re.match(rb"\s*\{", payload[end:]):
            content = True
    return content, reason, usage


def test_scan_finds_what_the_regex_found() -> None:
    rnd = random.Random(5)
    for _ in range(3000):
        payload = _payload(rnd)
        at = rnd.randint(0, 3)
        padded = b"xy:"[:at] + payload + b'"usage":{'[: rnd.randint(0, 9)]
        stop = at + len(payload)
        assert sse._scan(padded, at, stop) == _scan_by_regex(payload), payload


def test_plain_content_chunks_are_classified_as_the_classifier_would() -> None:
    """Event-per-chunk streams whose content chunks share a shape, with texts that do and
    do not fit it: each piece's events are the classifier's (a splitter that never uses
    its shortcut says which), and the shortcut is taken."""
    rnd = random.Random(9)
    prefixes = [
        b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"',
        b'data:{"choices":[{"delta":{"role":"assistant","content":"',
        b'data: {"usage":null,"choices":[{"delta":{"content":"',
        b'data: {"error":1,"content":"',
    ]
    suffixes = [b'"},"finish_reason":null}]}', b'"}}]}', b'"},"finish_reason":"stop"}]}',
                b'"}]}],"usage":{"total_tokens":1}}', b'"x', b'"},"tool_calls":[{}]}']  # fmt: skip
    texts = [b"a", b"hello world", b" ", b"\\", b'\\"', b'"', b"\r", b"\n", b"\xc3\xa9",
             b'"usage":{"a":1}', b"[DONE]", b"x" * 12, b""]  # fmt: skip
    shortcuts = 0
    for _ in range(400):
        prefix, suffix = rnd.choice(prefixes), rnd.choice(suffixes)
        ours, reference = SseSplitter(), SseSplitter()
        for _ in range(rnd.randint(1, 12)):
            if rnd.random() < 0.1:
                prefix, suffix = rnd.choice(prefixes), rnd.choice(suffixes)
            text = (
                rnd.choice(texts) if rnd.random() < 0.3 else bytes(rnd.choices(b"ab {}:,\\", k=3))
            )
            piece = prefix + text + suffix + rnd.choice([b"\n\n", b"\n\n", b"\r\n\r\n", b"\n"])
            held = ours.pending
            shortcuts += not held and ours._plain(piece)
            reference._prefix = reference._suffix = b""  # (never a shortcut)
            got = ours.feed(piece)
            assert got == reference.feed(piece) and ours.pending == reference.pending, piece
            whole = piece.count(b"\n") == 2 and piece.endswith(b"\n\n") and b"\r" not in piece
            if whole and not held:
                assert got == [classify(piece[:-2])]
    assert shortcuts > 100
