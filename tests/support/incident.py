"""The incident this project exists for, as real processes: tap "back" -> a ``tracer proxy
--fault`` hop -> tap "front"; or with no tap, tcpdump on both sides of the hop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.engine import engine_running
from tests.support.procs import tracer_proxy
from tests.support.tcpdump import Tcpdump, tcpdump_lo
from tracer.sim.harness import HarnessConfig, HarnessReport, run_harness


@asynccontextmanager
async def taps_around(
    upstream: str,
    fault: str,
    front: Path,
    back: Path,
    *,
    back_args: Sequence[str] = (),
    front_args: Sequence[str] = (),
) -> AsyncIterator[tuple[str, str]]:
    """tap "back" (capture ``back``) -> a proxy with ``tracer proxy --fault FAULT`` -> tap
    "front" (capture ``front``), each a real process; yields (front tap's URL, the hop's)."""
    async with (
        tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", upstream,
            "--tap", "back", "--capture", str(back), *back_args,
        ) as back_tap,
        tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", back_tap.url,
            "--tap", "hop", "--fault", fault,
        ) as hop,
        tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", hop.url,
            "--tap", "front", "--capture", str(front), "--upstream-role", "proxy", *front_args,
        ) as front_tap,
    ):  # fmt: skip
        yield front_tap.url, hop.url


def taps_around_a_hanging_proxy(
    upstream: str, front: Path, back: Path, evidence: list[str]
) -> AbstractAsyncContextManager[tuple[str, str]]:
    """The incident: the hop hangs on the 3rd request of a reused keep-alive connection
    (`--fault hang-on-reuse:3`); both taps with evidence, the front one with probes."""
    taps = ["--stall-after", "0.5", *evidence]
    probes = ["--probe-on-stall", "--probe-interval", "0.5"]
    return taps_around(
        upstream, "hang-on-reuse:3", front, back, back_args=taps, front_args=[*taps, *probes]
    )


@dataclass
class PacketIncident:
    """The incident as tcpdump saw it: the capture, the two server ports (the proxy's,
    the engine's), what the harness saw, and what tcpdump said of itself."""

    pcap: Path
    front: int  # the faulty proxy's listen port: harness -> proxy
    back: int  # the engine's port: proxy -> engine
    report: HarnessReport
    dump: Tcpdump

    @property
    def tap_by_port(self) -> str:
        return f"{self.front}=front,{self.back}=back"


async def packets_around_a_hanging_proxy(pcap: Path) -> PacketIncident:
    """The seed incident with no tap at all: the harness (openai SDK, 2 sessions x 4
    rounds, 3 s deadline) -> a proxy that hangs on the 3rd request of a reused keep-alive
    connection (``tracer proxy --fault hang-on-reuse:3``, writing no capture) -> the
    simulated engine, with ``tcpdump -i lo`` on both sides of the proxy (its listen port
    and the engine's) until every connection has ended (``tcpdump_lo``)."""
    async with engine_running(ttft=0.0, itl=0.002) as sim:
        assert sim.bound is not None
        engine_port = sim.bound[1]
        async with tracer_proxy(
            "proxy", "--listen", "127.0.0.1:0", "--upstream", sim.url,
            "--tap", "hop", "--fault", "hang-on-reuse:3",
        ) as hop:  # fmt: skip
            async with tcpdump_lo(pcap, [hop.port, engine_port]) as dump:
                report = await run_harness(
                    HarnessConfig(
                        base_url=hop.url,
                        sessions=2,
                        rounds=4,
                        think=0.2,
                        max_tokens=6,
                        deadline=3.0,
                    )
                )
                await dump.until_connections_ended()
    return PacketIncident(pcap, hop.port, engine_port, report, dump)
