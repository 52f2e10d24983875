"""The incident this project exists for, as real processes: tap "back" -> a ``tracer proxy
--fault`` hop -> tap "front"."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

from tests.support.procs import tracer_proxy


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
