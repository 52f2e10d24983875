"""Real processes: ``tracer proxy`` and mitmdump (with the addons), started on port 0 and
read for the port they took; the addons loaded as mitmproxy loads them."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from tracer.capture.files import read_records

REPO = Path(__file__).resolve().parents[2]
ADDONS = REPO / "addons"
MITMDUMP = Path(sys.executable).parent / "mitmdump"


def load_addon(name: str) -> ModuleType:
    """``addons/NAME.py`` as mitmproxy's ``-s`` loads it: a file, not a package module."""
    spec = importlib.util.spec_from_file_location(f"tracer_addon_{name}", ADDONS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def drain_lines(reader: BufferedByteReceiveStream, lines: list[str]) -> None:
    """Read a process's output into ``lines`` until it ends (so its pipe never fills)."""
    try:
        while True:
            lines.append((await reader.receive_until(b"\n", 1 << 20)).decode())
    except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
        return


def count_records(path: Path, kind: str) -> int:
    """Records of one type in a capture being written (0 while it cannot be read yet)."""
    try:
        return sum(1 for r in read_records(path) if r["type"] == kind)
    except (OSError, ValueError):
        return 0


# ---- tracer proxy -----------------------------------------------------------------------


@dataclass
class Proc:
    process: Process
    port: int
    lines: list[str] = field(default_factory=list)
    admin_port: int | None = None  # where ``--admin`` listens (given 127.0.0.1:0 or not)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin(self) -> str:
        assert self.admin_port is not None, "started without --admin"
        return f"http://127.0.0.1:{self.admin_port}"


_ADMIN = re.compile(r"admin on 127\.0\.0\.1:(\d+)")


@asynccontextmanager
async def tracer_proxy(*args: str, env: dict[str, str] | None = None) -> AsyncIterator[Proc]:
    """``python -m tracer ARGS`` (``proxy ...``), once it says where it listens: with
    ``--listen 127.0.0.1:0`` and ``--admin 127.0.0.1:0`` the kernel picks both ports and
    the start lines name them. Ended with SIGTERM (unless the test ended it). ``env``:
    the process's whole environment, when not this one's."""
    cmd = [sys.executable, "-m", "tracer", *args]
    process = await anyio.open_process(cmd, stdin=None, env=env)
    assert process.stderr is not None
    reader = BufferedByteReceiveStream(process.stderr)
    lines: list[str] = []
    admin_port: int | None = None
    try:
        # (a tap starting on a loaded machine: imports, its capture, the upstream's
        # fingerprint through whatever hop is there; 15 s was once not enough)
        with anyio.fail_after(40):
            while True:
                line = (await reader.receive_until(b"\n", 65536)).decode()
                lines.append(line)
                if line.startswith("{"):  # --log-json: the same news as a JSON line
                    record = json.loads(line)
                    if record["event"] == "admin ready":
                        admin_port = int(record["admin"].rsplit(":", 1)[1])
                    if record["event"] == "listening":
                        found = re.fullmatch(r"127\.0\.0\.1:(\d+)", record["listen"])
                        break
                    continue
                admin = _ADMIN.search(line)
                if admin and line.startswith("tracer proxy"):
                    admin_port = int(admin.group(1))
                found = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
                if found and line.startswith("tracer proxy"):
                    break
        assert found is not None, lines
        proc = Proc(process=process, port=int(found.group(1)), lines=lines, admin_port=admin_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain_lines, reader, lines)
            yield proc
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                await process.wait()
            tg.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.CancelScope(shield=True):
            await process.aclose()


# ---- mitmdump with the addons -------------------------------------------------------------

_MITM_LISTENING = re.compile(r"listening at 127\.0\.0\.1:(\d+)")  # not the web UI's http://


@asynccontextmanager
async def mitmdump(
    upstream: str | None,
    tmp_path: Path,
    *options: str,
    capture: Path | None = None,
    faults: Sequence[str] | None = None,
    web: tuple[int, str] | None = None,
    stop: int = signal.SIGTERM,
) -> AsyncIterator[tuple[str, Path]]:
    """``mitmdump -s addons/trace.py --mode reverse:UPSTREAM`` (None: mitmproxy's regular
    mode, a forward proxy) on a port the kernel picks; yields its URL and capture
    (``capture``, else ``TMP_PATH/mitm.jsonl``), and ends it with ``stop``, checking its
    exit status. ``faults``: addons/faults.py after it, one ``tracer_faults`` each;
    ``web`` (port, password): mitmweb, whose REST API changes options while it runs.
    ``options``: more of mitmdump's command line (``--set NAME=VALUE``)."""
    capture = capture or tmp_path / "mitm.jsonl"
    log_path = tmp_path / f"mitmdump-{time.monotonic_ns()}.log"
    if web is None:
        cmd = [str(MITMDUMP), "--set", "flow_detail=0"]  # it logs when it listens, no flows
    else:
        cmd = [str(MITMDUMP.parent / "mitmweb"), "--web-port", str(web[0])]
        cmd += ["--set", "web_open_browser=false", "--set", f"web_password={web[1]}"]
    # the trace addon first, as addons/faults.py asks
    cmd += ["-s", str(ADDONS / "trace.py"), "--set", f"tracer_capture={capture}"]
    if faults is not None:
        cmd += ["-s", str(ADDONS / "faults.py")]
        for spec in faults:
            cmd += ["--set", f"tracer_faults={spec}"]
    if upstream:
        cmd += ["--mode", f"reverse:{upstream}"]
    cmd += ["--listen-host", "127.0.0.1", "-p", "0", "--set", f"confdir={tmp_path / 'mitmproxy'}"]
    cmd += options
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        with anyio.fail_after(30):  # (a probe connection would be in the capture)
            while not (found := _MITM_LISTENING.search(log_path.read_text(errors="replace"))):
                assert proc.poll() is None, log_path.read_text()
                await anyio.sleep(0.05)  # (polls a file with a deadline)
        yield f"http://127.0.0.1:{found.group(1)}", capture
        proc.send_signal(stop)
        with anyio.fail_after(10):
            while proc.poll() is None:
                await anyio.sleep(0.02)
        assert proc.returncode == (0 if stop == signal.SIGTERM else -stop), log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


# ---- tracer demo ----------------------------------------------------------------------------

DEMO_TIMEOUT = 150  # under a minute on an idle 2-core machine; CI machines are loaded


def tracer_demo(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``tracer demo --out OUT ARGS``, as ``make demo`` runs it; never raises on its exit."""
    return subprocess.run(
        [sys.executable, "-m", "tracer", "demo", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT,
        check=False,
    )
