"""Where the tap's time goes: py-spy on the tracer during a run (``bench.run --profile``).

py-spy samples the running proxy without stopping it (``--nonblocking``) and writes
collapsed stacks (``--format raw``: ``frame;frame;...;frame count`` per line). Self time of
a function is the share of samples where it is the innermost frame; total time is the
share of samples where it is anywhere on the stack. ``--idle`` is off, so samples where
the loop waits in epoll are not counted: the shares are of the time the proxy was busy.
py-spy pauses the process for each sample (its non-blocking mode misreads idle time).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def pyspy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    if local.exists():
        return str(local)
    return shutil.which("py-spy")


def start(
    pid: int, out: Path, duration: float, rate: int = 250, *, nonblocking: bool = False
) -> subprocess.Popen[bytes]:
    exe = pyspy()
    if exe is None:
        raise RuntimeError("py-spy not installed (.venv/bin/pip install py-spy)")
    return subprocess.Popen(
        [
            "taskset",
            "-c",
            "0",
            exe,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(max(1, round(duration))),
            "--rate",
            str(rate),
            "--format",
            "raw",
            *(["--nonblocking"] if nonblocking else []),
            "--threads",
            "-o",
            str(out),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    parts = Path(path).parts
    for anchor in ("site-packages", "python3.12", "lib"):
        if anchor in parts:
            path = "/".join(parts[parts.index(anchor) + 1 :])
            break
    else:
        if "tracer" in parts:
            path = "/".join(parts[parts.index("tracer") :])
    return f"{m.group('func')} ({path})"


def top(raw: Path, n: int = 15) -> tuple[int, list[tuple[str, float, float]]]:
    """Main-thread samples, and the top ``n`` functions by self share: (function, self, total).

    Only the main thread (the event loop: all forwarding and observation) is counted: py-spy
    takes the capture writer's and the resolver pool's waits for work.
    """
    selfc: Counter[str] = Counter()
    totalc: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, _, rest = stack.partition(";")
        if head.startswith("thread (") and "MainThread" not in head:
            continue
        if head.startswith("thread ("):
            stack = rest
        k = int(count)
        frames = [_short(f) for f in stack.split(";") if f]
        frames = [f for f in frames if not f.startswith("process ")]
        if not frames:
            continue
        samples += k
        selfc[frames[-1]] += k
        for f in set(frames):
            totalc[f] += k
    if not samples:
        return 0, []
    return samples, [(f, c / samples, totalc[f] / samples) for f, c in selfc.most_common(n)]


def render(scen: str, samples: int, rows: list[tuple[str, float, float]]) -> str:
    lines = [
        f"tracer profile, {scen}: {samples} main-thread samples while busy "
        "(self %, total %, function)"
    ]
    lines += [f"  {s * 100:5.1f}  {t * 100:5.1f}  {f}" for f, s, t in rows]
    return "\n".join(lines)
