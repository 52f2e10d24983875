"""tcpdump on the loopback, as an engineer takes a capture: started by its id, waited on
until it captures, stopped with SIGINT once the last packet is in the file.

``tcpdump -i lo -U --immediate-mode -w FILE 'tcp port A or tcp port B ...'``: every packet
is handed to tcpdump as it is captured and written to the file at once. When the traffic
is over, a UDP datagram (the *end mark*, a random payload, to a loopback port in the
filter) is sent and the file read until it holds it: the packets captured before it are
then in the file too, and tcpdump is stopped.

A test that needs it skips only when tcpdump is missing or may not capture (not root, no
CAP_NET_RAW): tcpdump's own complaint is the reason. ``.ci/run`` installs it from Debian
and CI runs as root, so there the tests run.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from tracer.observe.packets import Packet, decode_frame
from tracer.observe.pcap import PcapError, read_frames
from tracer.observe.tcp import ACK, FIN, RST, SYN, Endpoint

READY_TIMEOUT = 20.0  # tcpdump starts in well under a second; a loaded CI machine is slow
MARK_TIMEOUT = 20.0
POLL = 0.02
_NOT_PERMITTED = (
    "permission",
    "not permitted",
    "you don't have",
    "socket: operation",
)


def tcpdump_path() -> str | None:
    found = shutil.which("tcpdump")
    if found is None and os.path.exists("/usr/sbin/tcpdump"):
        found = "/usr/sbin/tcpdump"  # (not on a user's PATH on some systems)
    return found


class TcpdumpUnavailable(RuntimeError):
    """tcpdump is not installed, or may not capture here (not root, no CAP_NET_RAW)."""


@functools.cache
def tcpdump_unavailable() -> str | None:
    """Why tcpdump cannot capture on lo here (None: it can). ``tcpdump -i lo -d`` opens
    the device to compile a filter for it, and exits: it says so when it may not."""
    binary = tcpdump_path()
    if binary is None:
        return "tcpdump is not installed (.ci/run installs it from Debian)"
    done = subprocess.run(
        [binary, "-i", "lo", "-d", "tcp"], capture_output=True, text=True, timeout=30, check=False
    )
    said = done.stderr.strip()
    if done.returncode != 0 and any(words in said.lower() for words in _NOT_PERMITTED):
        return f"tcpdump may not capture here (root or CAP_NET_RAW needed): {said}"
    return None  # (any other failure shows when it is started, as a failure)


def require_tcpdump() -> None:
    """Skip the test, saying why, when tcpdump is missing or may not capture; call it
    first in the test (a skip raised inside a task group would be an error)."""
    reason = tcpdump_unavailable()
    if reason is not None:
        pytest.skip(reason)


@dataclass
class Tcpdump:
    path: Path  # the pcap file it writes
    pid: int
    log: Path  # its stderr

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def dropped(self) -> int | None:
        """The packets the kernel dropped, as tcpdump says when it has stopped (a pcap
        file does not say: a drop shows in it only as bytes missing from a stream)."""
        found = re.search(r"(\d+) packets? dropped by kernel", self.stderr())
        return int(found.group(1)) if found else None

    async def until_connections_ended(self, timeout: float = 15.0) -> None:
        """Wait until every TCP connection in the file so far has ended (a FIN each way,
        or a reset): its last packets are in the capture."""
        with anyio.fail_after(timeout):
            while open_connections(self.path):
                await anyio.sleep(POLL)  # (polls the file with a deadline)


def open_connections(path: Path) -> int:
    """TCP connections in a capture (maybe still being written) not ended yet: without a
    FIN from each side or a reset."""
    fins: dict[tuple[Endpoint, Endpoint], set[Endpoint]] = {}
    ended: set[tuple[Endpoint, Endpoint]] = set()
    try:
        frames = list(read_frames(path))  # (a torn last record: the frames before it)
    except PcapError:
        return 0  # not even the file header yet: no packet
    for frame in frames:
        packet = decode_frame(frame.linktype, frame.data, frame.t)
        if not isinstance(packet, Packet):
            continue
        a, b = sorted((packet.src, packet.dst))
        key = (a, b)
        flags = packet.segment.flags
        if flags & SYN and not flags & ACK:  # a new connection (or one on a reused 4-tuple)
            fins[key] = set()
            ended.discard(key)
        seen = fins.setdefault(key, set())
        if flags & FIN:
            seen.add(packet.src)
        if flags & RST or len(seen) == 2:
            ended.add(key)
    return len(fins.keys() - ended)


def port_filter(ports: Iterable[int], mark_port: int) -> str:
    tcp = " or ".join(f"tcp port {p}" for p in ports)
    return f"({tcp}) or (udp and dst port {mark_port})"


@asynccontextmanager
async def tcpdump_lo(path: Path, ports: Iterable[int]) -> AsyncIterator[Tcpdump]:
    """``tcpdump -i lo`` writing ``path`` (pcap) for the TCP ``ports``, capturing once this
    yields; on exit the end mark is sent, awaited in the file, and tcpdump stopped with
    SIGINT (its exit waited for: the file is complete). ``TcpdumpUnavailable`` when
    tcpdump is not installed or says it may not capture (tests call ``require_tcpdump``
    first); any other failure to start is an ``AssertionError``."""
    binary = tcpdump_path()
    if binary is None:
        raise TcpdumpUnavailable("tcpdump is not installed")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as mark:
        mark.bind(("127.0.0.1", 0))  # held: the end mark's port, nobody else's
        mark_port = int(mark.getsockname()[1])
        log = path.with_suffix(".tcpdump.log")
        # -B 32768 (KiB): in immediate mode the kernel's ring has one slot per packet, each
        # as large as lo's 64 KiB MTU; the default 2 MiB is ~30 slots, and a burst of small
        # packets overran it (the kernel dropped some: bytes missing from the streams).
        # -Z root: as root, Debian's tcpdump would write the file as user tcpdump (it
        # drops its privileges first), which may not write into the test's directory
        argv = [binary, "-i", "lo", "-n", "-U", "--immediate-mode", "-B", "32768"]
        argv += ["-w", str(path)]
        if os.geteuid() == 0:
            argv += ["-Z", "root"]
        argv.append(port_filter(ports, mark_port))
        with log.open("wb") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        dump = Tcpdump(path, proc.pid, log)
        try:
            await _until_listening(proc, dump)
            await _start_mark(mark, mark_port, dump)
            yield dump
            await _end_mark(mark, mark_port, dump)
        finally:
            _stop(proc)


async def _until_listening(proc: subprocess.Popen[bytes], dump: Tcpdump) -> None:
    with anyio.fail_after(READY_TIMEOUT):
        while "listening on lo" not in (said := dump.stderr()):
            if proc.poll() is not None:
                if any(words in said.lower() for words in _NOT_PERMITTED):
                    raise TcpdumpUnavailable(said.strip())
                raise AssertionError(f"tcpdump exited {proc.returncode}: {said}")
            await anyio.sleep(POLL)  # (polls its stderr with a deadline)


async def _start_mark(mark: socket.socket, port: int, dump: Tcpdump) -> None:
    """tcpdump's "listening on lo" can come before packets are written: send a mark until one is in
    the file, so that what the test sends next is captured (a client's first requests
    were missing from a capture under load)."""
    token = uuid.uuid4().bytes
    with anyio.fail_after(MARK_TIMEOUT):
        while token not in dump.path.read_bytes():
            mark.sendto(token, ("127.0.0.1", port))
            await anyio.sleep(POLL)  # (polls the file with a deadline)


async def _end_mark(mark: socket.socket, port: int, dump: Tcpdump) -> None:
    """Send the end mark and wait until the file holds it (and so what came before)."""
    token = uuid.uuid4().bytes
    mark.sendto(token, ("127.0.0.1", port))
    with anyio.fail_after(MARK_TIMEOUT):
        while token not in dump.path.read_bytes():
            await anyio.sleep(POLL)  # (polls the file with a deadline)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)  # tcpdump's own end: flush, close the file
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)
