"""Record three more incident classes from real processes on 127.0.0.1.

    .venv/bin/python -m tests.scenarios.record_classes [NAME...]   (no NAME: every case)
    .venv/bin/python -m tests.scenarios.record_classes --list

The machinery of ``tests/scenarios/record.py`` (``Lab``, ``Case``, the sim engine, the
taps), with cases of its own, written like its cases to ``tests/data/scenarios/<case>/``
(captures and ``expect.json``, read by ``tests/unit/test_scenarios.py``):

- ``expect_continue_unrelayed``: curl (Debian's) posts a body over 1 MiB, so it sends
  ``Expect: 100-continue`` and waits for ``100 Continue`` before its body; the hop (an
  HTTP/1.0 gateway on Python's ``http.server``, ``tests/scenarios/upstreams.py``) never
  answers it and waits for the body.
- ``total_timeout_cuts_streams``: Caddy (Debian's) with a total write deadline
  (``servers { timeouts { write 4s } }``: Go's ``http.Server.WriteTimeout``, counted
  from the request head) cuts every stream at the same age.
- ``sse_line_too_long``: one SSE ``data:`` line longer than aiohttp's ``readline`` limit;
  the aiohttp client reading the stream line by line fails (``LineTooLong``) and closes.

Every process is started here and stopped by its own id (``Lab``); ports come from
binding port 0; each case has a time limit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx

from tests.scenarios import record as base
from tests.scenarios.record import (
    CHAT,
    Case,
    Lab,
    describe,
    free_port,
    stream,
)

UPSTREAMS = [sys.executable, "-m", "tests.scenarios.upstreams"]


async def gateway(lab: Lab, upstream: str) -> str:
    """The HTTP/1.0 gateway of ``tests/scenarios/upstreams.py`` in front of ``upstream``."""
    url = await lab.start(
        "gateway", [*UPSTREAMS, "gateway", "--listen", "127.0.0.1:0", "--upstream", upstream]
    )
    lab.note(
        f"gateway: Python {sys.version.split()[0]} http.server "
        "(BaseHTTPRequestHandler, protocol_version HTTP/1.0) + http.client to its upstream"
    )
    lab.say(f"gateway {url} -> {upstream}")
    return url


async def caddy(lab: Lab, upstream: str, write_timeout: str) -> str:
    """Caddy (Debian's) on loopback: ``reverse_proxy`` to ``upstream`` with a total write
    deadline (Go's ``http.Server.WriteTimeout``)."""
    binary = shutil.which("caddy") or "/usr/bin/caddy"
    port = free_port()
    home = lab.work / "caddy"
    home.mkdir(parents=True, exist_ok=True)
    conf = f"""{{
	admin off
	auto_https off
	servers {{
		timeouts {{
			write {write_timeout}
		}}
	}}
}}
http://127.0.0.1:{port} {{
	reverse_proxy {upstream.removeprefix("http://")}
}}
"""
    path = home / "Caddyfile"
    path.write_text(conf)
    version = subprocess.run([binary, "version"], capture_output=True, text=True).stdout.strip()
    lab.note(f"caddy {version}; servers timeouts write {write_timeout}; reverse_proxy")
    env = f"HOME={home} XDG_DATA_HOME={home}/data XDG_CONFIG_HOME={home}/config"
    argv = ["env", *env.split(), binary, "run", "--config", str(path), "--adapter", "caddyfile"]
    return await lab.start_http("caddy", argv, f"http://127.0.0.1:{port}", "/health")


# ---- expect_continue_unrelayed ---------------------------------------------------------------


def _chat_body(size: int, max_tokens: int) -> bytes:
    """A chat request of about ``size`` bytes: an agent's long context."""
    context = ("The tool returned the following listing. " * (size // 42 + 1))[:size]
    body = {
        **CHAT,
        "max_tokens": max_tokens,
        "messages": [
            {"role": "system", "content": context},
            {"role": "user", "content": "summarise"},
        ],
    }
    return json.dumps(body).encode()


async def curl(lab: Lab, url: str, rid: str, body: Path, *extra: str) -> dict[str, Any]:
    """One streaming POST with curl; what it says of the exchange."""
    argv = [
        "curl",
        "-sS",
        "-v",
        "-N",
        "-o",
        "/dev/null",
        "--http1.1",
        "-H",
        "content-type: application/json",
        "-H",
        f"x-request-id: {rid}",
        "--data-binary",
        f"@{body}",
        *extra,
        "-w",
        "%{http_code} %{size_upload} %{size_download} %{time_starttransfer} %{time_total}",
        f"{url}/v1/chat/completions",
    ]
    start = time.monotonic()
    done = await anyio.run_process(argv, check=False)
    took = time.monotonic() - start
    err = done.stderr.decode(errors="replace")
    code, up, down, ttfb, total = done.stdout.decode().split()
    said = [
        line.removeprefix("> ").removeprefix("< ").removeprefix("* ").strip()
        for line in err.splitlines()
        if line.startswith(("> Expect", "* Done waiting", "< HTTP", "curl: ("))
    ]
    return {
        "exit": done.returncode,
        "status": code,
        "upload": int(float(up)),
        "download": int(float(down)),
        "ttfb": float(ttfb),
        "total": float(total),
        "took": took,
        "said": said,
    }


async def expect_continue_unrelayed(lab: Lab) -> None:
    """tap front -> HTTP/1.0 gateway (Python http.server: never answers Expect:
    100-continue) -> tap back -> engine. curl posts 1.2 MB agent contexts (over 1 MiB: curl
    sends Expect: 100-continue): with its default 1 s wait it sends the body after 1 s; with
    --expect100-timeout 20 it waits, sending nothing, until its --max-time 8 s ends it.
    Small requests (no Expect) go through before and after."""
    engine = await lab.engine("--ttft", "0.05", "--itl", "0.02")
    back = await lab.tap("back", engine, "--engine-metrics", f"{engine}/metrics")
    hop = await gateway(lab, back)
    front = await lab.tap("front", hop)
    version = subprocess.run(["curl", "--version"], capture_output=True, text=True)
    lab.note(
        version.stdout.split("\n")[0].split(" (")[0] + " (Debian): Expect: 100-continue "
        "on POST bodies over 1 MiB"
    )
    big = lab.work / "big.json"
    big.write_bytes(_chat_body(1_200_000, 20))
    small = lab.work / "small.json"
    small.write_bytes(_chat_body(200, 20))
    runs = [
        ("small-1", small, ()),
        ("expect-1s", big, ()),  # curl's default --expect100-timeout 1
        ("expect-waits", big, ("--expect100-timeout", "20", "--max-time", "8")),
        ("small-2", small, ()),
    ]
    for rid, body, extra in runs:
        got = await curl(lab, front, rid, body, *extra)
        lab.note(
            f"curl {rid} ({body.stat().st_size} B body{', ' + ' '.join(extra) if extra else ''}):"
            f" exit {got['exit']}, status {got['status']}, uploaded {got['upload']} B, "
            f"downloaded {got['download']} B, first byte {got['ttfb']:.2f}s, total "
            f"{got['total']:.2f}s; curl -v: {' | '.join(got['said'])}"
        )
    await anyio.sleep(0.5)


# ---- total_timeout_cuts_streams --------------------------------------------------------------


async def total_timeout_cuts_streams(lab: Lab) -> None:
    """tap front -> Caddy (servers timeouts write 4s: a deadline from the request head) ->
    tap back -> engine (50 ms tokens). Three 10 s streams started 0, 1.5 and 3 s in are cut
    ~4 s after each began; 1 s streams before, between and after complete."""
    engine = await lab.engine("--ttft", "0.05", "--itl", "0.05")
    back = await lab.tap("back", engine, "--engine-metrics", f"{engine}/metrics")
    hop = await caddy(lab, back, "4s")
    front = await lab.tap("front", hop)
    plan = [  # (start, request id, max_tokens)
        (0.0, "long-1", 200),
        (0.5, "short-1", 20),
        (1.5, "long-2", 200),
        (3.0, "long-3", 200),
        (5.0, "short-2", 20),
        (7.5, "short-3", 20),
    ]
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as tg:
        for start, rid, tokens in plan:

            async def one(start: float = start, rid: str = rid, tokens: int = tokens) -> None:
                await anyio.sleep(start)
                got = await stream(
                    client, front, max_tokens=tokens, headers={"x-request-id": rid}, timeout=20
                )
                lab.note(
                    describe(f"httpx {rid} ({tokens} tokens, started {start:g}s in)", got)
                    + f", lasted {got['duration']:.2f}s"
                )

            tg.start_soon(one)
    lab.say(f"all streams over after {time.monotonic() - t0:.1f}s")
    await anyio.sleep(0.5)


# ---- sse_line_too_long -----------------------------------------------------------------------


async def _aiohttp_stream(
    session: aiohttp.ClientSession, url: str, rid: str, *, big: int = 0, lines: bool = True
) -> str:
    """One stream read with aiohttp: line by line (``async for line in resp.content``, as
    most SSE clients built on aiohttp read) or with ``iter_any()``; what happened."""
    headers = {"x-request-id": rid}
    if big:
        headers["x-big-event"] = str(big)
    body = {**CHAT, "max_tokens": 60}
    start = time.monotonic()
    events, longest, got = 0, 0, 0
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            if lines:
                async for line in r.content:
                    got += len(line)
                    longest = max(longest, len(line))
                    events += line.startswith(b"data:")
            else:
                buffer = b""
                async for piece in r.content.iter_any():
                    got += len(piece)
                    buffer += piece
                    *done, buffer = buffer.split(b"\n\n")
                    events += len(done)
                    longest = max([longest, *(len(e) for e in done)])
        outcome = "complete"
    except Exception as exc:  # what the client's parser raised is the point
        outcome = f"{type(exc).__name__}: {' '.join(str(exc).split())[:110]}"
    took = time.monotonic() - start
    how = "line by line (async for line in resp.content)" if lines else "resp.content.iter_any()"
    return (
        f"aiohttp {aiohttp.__version__} {rid}{f' (x-big-event {big})' if big else ''}, "
        f"read {how}: {outcome} after {took:.2f}s, {events} events, {got} bytes, "
        f"longest line/event {longest} B"
    )


async def sse_line_too_long(lab: Lab) -> None:
    """tap -> an SSE upstream (tests/scenarios/upstreams.py sse, 50 ms events). aiohttp
    reads each stream line by line: a normal stream completes; one whose 11th event is one
    600 KB data: line (over aiohttp's 512 KiB readline limit, 2 x read_bufsize) fails with
    LineTooLong and the client closes the connection while the upstream is still sending;
    a normal stream again, then the same big event read with iter_any() completes."""
    upstream = await lab.start(
        "sse", [*UPSTREAMS, "sse", "--listen", "127.0.0.1:0", "--itl", "0.05"]
    )
    url = await lab.tap("tap", upstream, "--client-facing")
    limit = 2 * (2**18)  # aiohttp.helpers.DEFAULT_CHUNK_SIZE (read_bufsize) x 2: high water
    lab.note(f"aiohttp {aiohttp.__version__}: readline limit {limit} B (2 x read_bufsize)")
    async with aiohttp.ClientSession() as session:
        for rid, big, lines in (
            ("normal-1", 0, True),
            ("big-lines", 600_000, True),
            ("normal-2", 0, True),
            ("big-iter-any", 600_000, False),
        ):
            lab.note(await _aiohttp_stream(session, url, rid, big=big, lines=lines))
    await anyio.sleep(0.5)


CASES: dict[str, Case] = {
    "expect_continue_unrelayed": Case(
        expect_continue_unrelayed,
        # (proposed kind: no existing kind names a request head with Expect: 100-continue
        # that got neither 100 Continue nor a final answer, its body never sent)
        {"party": "proxy", "kind": "expect_continue_unanswered"},
        forbidden=["engine_*", "client_*"],
        limit=60.0,
    ),
    "total_timeout_cuts_streams": Case(
        total_timeout_cuts_streams,
        {"party": "proxy", "kind": "proxy_cut_stream", "confidence": "high"},
        forbidden=["engine_*", "client_*", "stream_cut"],
        limit=60.0,
    ),
    "sse_line_too_long": Case(
        sse_line_too_long,
        # (proposed kind: the client closed, the upstream still sending, right after one
        # SSE event far longer than any other arrived: its parser's line limit (aiohttp's
        # LineTooLong); client_abort, the existing kind, says only that it left)
        {"party": "client", "kind": "client_line_too_long"},
        forbidden=["engine_*", "proxy_*", "stream_cut"],
        limit=60.0,
    ),
}


def main(argv: list[str] | None = None) -> int:
    """``tests.scenarios.record``'s command line over this module's ``CASES``."""
    return base.main(
        argv, cases=CASES, prog="python -m tests.scenarios.record_classes", doc=__doc__
    )


if __name__ == "__main__":
    raise SystemExit(main())
