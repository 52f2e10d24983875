"""The chain of hops the evidence shows (``client → ? → front → back → router → 2
engines``), and why each link is believed: what the analysis takes to be in between.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

from .context import Context, netloc
from .engine_view import ENGINE_PROFILES
from .join import addr_key


def topology(ctx: Context) -> dict[str, Any]:
    """The chain of hops the evidence shows, client side first, and why: what each
    tap's upstream is (declared, fingerprinted, or an engine URL's host), and whether two
    adjacent taps share their TCP connections (no hop between) or not (a hop, "?")."""
    taps = ctx.order or sorted(ctx.e.taps)
    if not taps:
        return {}
    why: list[str] = []
    first = taps[0]
    if first in ctx.e.client_facing:
        parts = ["client", first]
        why.append(f"tap {first} is client-facing (--client-facing)")
    else:
        parts = ["client", "?", first]
        why.append(f"nothing says the client connects to tap {first} directly (--client-facing)")
    locals_: dict[str, set[str]] = defaultdict(set)
    peers: dict[str, set[str]] = defaultdict(set)
    for c in ctx.e.connections:
        if c.upstream_local and len(locals_[c.tap]) < 65536:
            locals_[c.tap].add(addr_key(c.upstream_local))
        if len(peers[c.tap]) < 65536:
            peers[c.tap].add(addr_key(c.peer))
    for a, b in itertools.pairwise(taps):
        if locals_[a] & peers[b]:
            why.append(f"tap {a}'s upstream connections are tap {b}'s client connections")
        else:
            parts.append("?")
            why.append(f"tap {a}'s upstream connections were not seen at tap {b}: a hop between")
        parts.append(b)
    last = taps[-1]
    topo = ctx.e.taps.get(last, {}).get("topology") or {}
    server = topo.get("server") or {}
    role = ctx.role(last)
    engines = len(
        {netloc(str(x["url"])) for x in ctx.e.engine if x.get("profile") in ENGINE_PROFILES}
    )
    if role == "router":
        parts.append("router")
        if engines:
            parts.append(f"{engines} engine{'s' if engines != 1 else ''}")
    elif role == "engine":
        kind = server.get("kind")
        parts.append(f"engine ({kind})" if kind else "engine")
    elif role == "proxy":
        parts += ["proxy", "?"]
    elif ctx.tap_serving(last):
        parts.append("serving stack")
        why.append(f"tap {last}'s upstream is the host of an --engine-metrics/--health URL")
    else:
        parts.append("?")
    for tap in taps:
        t = ctx.e.taps.get(tap, {}).get("topology") or {}
        if t.get("upstream_role"):
            basis = t.get("basis", "unknown")
            said = "; ".join(t.get("evidence") or [])
            why.append(
                f"tap {tap}'s upstream: {t['upstream_role']} ({basis})"
                + (f": {said}" if said else "")
            )
    return {"chain": " → ".join(parts), "taps": taps, "why": why}
