"""``--tap-by-port 8000=front,30000=back:engine``: one passive tap per server port, and
what the server behind a port is where it is declared (a packet capture cannot ask)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, cast

ROLES: tuple[str, ...] = ("engine", "router", "proxy")  # what may be declared
Role = Literal["engine", "router", "proxy"]


def checked_role(role: str) -> Role:
    """A declared role, checked."""
    if role not in ROLES:
        raise ValueError(f"upstream role must be engine, router or proxy, not {role!r}")
    return cast(Role, role)


@dataclass(frozen=True, slots=True)
class TapsByPort:
    """``--tap-by-port``: server port -> tap name, and the roles declared for the taps
    (tap name -> what the server behind its port is: ``engine``, ``router``, ``proxy``)."""

    taps: dict[int, str]
    roles: dict[str, Role] = field(default_factory=dict)


def parse_tap_by_port(spec: str) -> TapsByPort:
    """``8000=front,30000=back:engine`` -> taps {8000: "front", 30000: "back"}, roles
    {"back": "engine"}: ``PORT=TAP[:ROLE]``, the role what the server at the port is (a
    tap of several ports has one role: given on one of them, or alike on each)."""
    out: dict[int, str] = {}
    roles: dict[str, Role] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        port_s, sep, named = part.partition("=")
        name, colon, role = (x.strip() for x in named.partition(":"))
        if not sep or not name:
            raise ValueError(f"{part!r}: expected PORT=TAP or PORT=TAP:ROLE, e.g. 8000=front")
        try:
            port = int(port_s)
        except ValueError:
            raise ValueError(f"{part!r}: {port_s!r} is not a port number") from None
        if not 0 < port < 65536:
            raise ValueError(f"{part!r}: port {port} is out of range")
        if port in out:
            raise ValueError(f"{part!r}: port {port} given twice")
        if colon:
            if role not in ROLES:
                raise ValueError(f"{part!r}: role must be engine, router or proxy")
            if roles.get(name, role) != role:
                raise ValueError(f"{part!r}: tap {name} is given role {roles[name]} too")
            roles[name] = checked_role(role)
        out[port] = name
    if not out:
        raise ValueError("no PORT=TAP given")
    return TapsByPort(out, roles)
