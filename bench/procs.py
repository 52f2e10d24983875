"""Processes the bench starts, and what /proc says about them (CPU time, RSS).

Every process is started by ``spawn`` and stopped by ``Proc.stop``: SIGTERM to its own PID,
then SIGKILL to that PID if it is still there after a grace period. Nothing else is killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

CLK_TCK = os.sysconf("SC_CLK_TCK")
HAVE_TASKSET = shutil.which("taskset") is not None


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads, from /proc/PID/stat (in seconds)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0.0
    fields = raw[raw.rfind(b")") + 2 :].split()
    # after the comm: state(0) ppid(1) ... utime is field 14 overall, i.e. index 11 here
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def steal_seconds(core: int) -> float:
    """Time this VM's ``core`` was runnable while the host ran something else (``steal``
    in /proc/stat), in seconds; 0 where /proc/stat has no such core or column. A proxy on
    a stolen core is late by that much, and direct, which does not use that core, is not:
    no process of the VM shows it (``foreign_cpu``)."""
    name = f"cpu{core}"
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == name:
                    return int(fields[8]) / CLK_TCK if len(fields) > 8 else 0.0
    except (OSError, ValueError):
        pass
    return 0.0


def foreign_cpu(ours: set[int]) -> dict[int, float]:
    """CPU seconds of every process not in ``ours`` (nor their children): the VM's other load."""
    out: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in ours:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        if int(fields[1]) in ours:  # a child of ours (wrk under taskset, nginx worker)
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def rss_kib(pid: int) -> int:
    """VmRSS of a process in KiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    """Direct children of a process (e.g. nginx's workers)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until 127.0.0.1:port accepts, the process dies, or the timeout passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} before listening")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            try:
                s.connect(("127.0.0.1", port))
                return
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not listening on 127.0.0.1:{port} after {timeout:g}s")
        time.sleep(0.05)


@dataclass
class Proc:
    """A process this bench started; ``pids`` are measured, only ``popen.pid`` is signalled."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes] | None = None
    stop_signal: int = signal.SIGTERM
    extra_children: bool = False  # count the children's CPU and RSS too (nginx workers)
    _kids: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def pids(self) -> list[int]:
        if self.extra_children:
            if not self._kids:
                self._kids = children(self.pid)
            return [self.pid, *self._kids]
        return [self.pid]

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids())

    def rss(self) -> int:
        return sum(rss_kib(p) for p in self.pids())

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, self.stop_signal)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.popen.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(grace)
                for kid in self._kids:  # children it started and could not stop itself
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(kid, signal.SIGKILL)
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    core: int,
    log_dir: Path,
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
) -> Proc:
    """Start ``argv`` pinned to one core, stdout and stderr to ``log_dir/name.log``."""
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "wb")  # noqa: SIM115  (closed by Proc.stop)
    cmd = list(argv)
    preexec = None
    if HAVE_TASKSET:
        cmd = ["taskset", "-c", str(core), *cmd]
    else:

        def preexec() -> None:
            os.sched_setaffinity(0, {core})

    popen = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=env,
        preexec_fn=preexec,
    )
    return Proc(name=name, popen=popen, log_path=log_path, log_file=log_file)
