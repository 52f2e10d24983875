"""A live view of a running tap, through its admin endpoint (tracer proxy --admin).

Every --interval seconds it reads the tap's /status and redraws in place: the tap's
totals; the engines' running/queued requests and token rate (when the tap polls engine
metrics); the requests in flight with their age and the time since their last byte,
stalls highlighted; the open connections with their reuse count and idle time; the
recent findings (stalls, anomalies, failed or cut responses). q or Ctrl-C quits; when
the tap goes away it says so and exits 1. Made for SSH: no mouse, no alternate screen
(the last view stays in the scrollback). With --once, or when stdout is not a
terminal, it prints one snapshot as plain text and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import select
import signal
import sys
import termios
import tty
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..protocol.addresses import parse_hostport

DEFAULT_ADMIN = "127.0.0.1:9100"
PLAIN_WIDTH = 160

_KIND_STYLE = {
    "stall": "bold red",
    "stall_end": "yellow",
    "truncated": "bold red",
    "client_abort": "red",
    "in_flight": "red",
    "unparsed": "magenta",
    "anomaly": "magenta",
    "tracer_response": "red",
    "connect_failed": "bold red",
    "http_error": "red",
    "stream_error": "red",
    "scrape_failed": "yellow",
    "fault": "cyan",
    "probe": "blue",
    "mark": "bold cyan",
    "fault_plan": "cyan",
}


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare this command's options."""
    parser.epilog = (
        "examples:\n"
        "  tracer proxy ... --admin 127.0.0.1:9100     (the tap it watches)\n"
        "  tracer top --admin 127.0.0.1:9100            live, until q\n"
        "  tracer top --admin 127.0.0.1:9100 --once     one snapshot as text\n"
    )
    parser.add_argument(
        "--admin",
        default=DEFAULT_ADMIN,
        metavar="HOST:PORT",
        help=f"the tap's admin endpoint (tracer proxy --admin ...; default {DEFAULT_ADMIN})",
    )
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period"
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="print one snapshot as plain text and exit (also when stdout is not a terminal)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="the tap counts as gone when /status takes longer than this",
    )


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise ValueError(f"--interval must be a positive number of seconds (got {args.interval})")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds (got {args.timeout})")
    url = status_url(args.admin)
    with httpx.Client(timeout=args.timeout, trust_env=False) as client:
        try:
            status = fetch(client, url)
        except TapGone as exc:
            print(f"tracer top: cannot read {url}: {exc}", file=sys.stderr)
            return 1
        if args.once or not sys.stdout.isatty():
            width = int(os.environ.get("COLUMNS", "0") or 0) or PLAIN_WIDTH
            sys.stdout.write(render_text(status, width=width))
            return 0
        return _live(client, url, status, args.interval)


def status_url(admin: str) -> str:
    """``HOST:PORT`` or ``http://HOST:PORT`` to the ``/status`` URL."""
    if "://" in admin:
        parts = urlsplit(admin)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--admin {admin!r}: expected HOST:PORT or http://HOST:PORT")
        admin = parts.netloc
    host, port = parse_hostport(admin)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/status"


class TapGone(Exception):
    """The admin endpoint did not answer with a tap's status."""


def fetch(client: httpx.Client, url: str) -> dict[str, Any]:
    try:
        response = client.get(url)
    except httpx.HTTPError as exc:
        raise TapGone(str(exc) or type(exc).__name__) from exc
    if response.status_code != 200:
        raise TapGone(f"HTTP {response.status_code}")
    try:
        status = response.json()
    except ValueError as exc:
        raise TapGone("the answer is not JSON: not a tracer admin endpoint?") from exc
    if not isinstance(status, dict) or "connections" not in status:
        raise TapGone("the answer has no connections: not a tracer admin endpoint?")
    return status


# ---- the live loop --------------------------------------------------------------------


def _live(client: httpx.Client, url: str, status: dict[str, Any], interval: float) -> int:
    console = Console()
    gone: str | None = None
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with (
            _keys() as key,
            Live(
                render(status, limit=_limit(console.height), footer=interval),
                console=console,
                auto_refresh=False,
                redirect_stderr=False,
            ) as live,
        ):
            while True:
                if key(interval) in ("q", "Q"):
                    break
                try:
                    status = fetch(client, url)
                except TapGone as exc:
                    gone = str(exc)
                    break
                live.update(
                    render(status, limit=_limit(console.height), footer=interval), refresh=True
                )
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    if gone is not None:
        print(f"tracer top: the tap went away ({url}: {gone})", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """``key(timeout)``: a key pressed within ``timeout`` seconds, or None (just waits
    when stdin is not a terminal). The terminal is put back as it was on exit."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    saved = termios.tcgetattr(fd) if fd is not None else None

    def key(timeout: float) -> str | None:
        if fd is None:
            select.select([], [], [], timeout)
            return None
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return None
        data = os.read(fd, 64)
        return data[-1:].decode("latin-1") if data else "q"

    try:
        if fd is not None:
            tty.setcbreak(fd)
        yield key
    finally:
        if fd is not None and saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _limit(height: int) -> int:
    """Rows per table so that the view fits the terminal (four tables and headers)."""
    return max(3, (height - 18) // 3)


# ---- rendering (pure) -----------------------------------------------------------------


def render_text(status: dict[str, Any], *, width: int = PLAIN_WIDTH, limit: int = 50) -> str:
    """One snapshot as plain text: no colour, no box drawing."""
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False, no_color=True)
    console.print(render(status, limit=limit, plain=True))
    return "".join(line.rstrip() + "\n" for line in out.getvalue().splitlines())


def render(
    status: dict[str, Any], *, limit: int = 20, plain: bool = False, footer: float | None = None
) -> RenderableType:
    """The whole view of one ``/status`` document (a pure function of it)."""
    parts: list[RenderableType] = [_header(status)]
    engines = status.get("engines") or []
    if engines:
        parts.append(_engines(engines, plain))
    parts.append(_in_flight(status, limit, plain))
    parts.append(_connections(status, limit, plain))
    parts.append(_recent(status.get("recent") or [], limit, plain))
    if footer is not None:
        parts.append(Text(f"q quits · refreshed every {footer:g}s", style="dim"))
    return Group(*parts)


def _table(title: str, plain: bool) -> Table:
    return Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=None if plain else box.SIMPLE_HEAD,
        pad_edge=False,
        header_style="" if plain else "bold",
        show_edge=False,
    )


def _header(status: dict[str, Any]) -> Text:
    totals = status.get("totals") or {}
    text = Text()
    text.append(f"tracer top · tap {status.get('tap', '?')}", style="bold")
    text.append(f" -> {status.get('upstream', '?')}")
    text.append(f" · up {dur(status.get('uptime'))}")
    if status.get("stall_after") is not None:
        text.append(f" · stall after {dur(status['stall_after'])}")
    faults = (status.get("faults") or {}).get("faults")
    if faults:  # this tap alters traffic on purpose: say so on top
        text.append(" · injecting " + ", ".join(faults), style="cyan")
    conns = status.get("connections") or []
    line = [
        f"connections {totals.get('connections_open', len(conns))} open"
        + (f" / {totals['connections']} total" if "connections" in totals else ""),
    ]
    if "requests" in totals:
        line.append(f"requests {totals['requests']}")
    in_flight = sum(len(c.get("in_flight") or []) for c in conns)
    line.append(f"in flight {in_flight}")
    text.append("\n" + " · ".join(line))
    stalled = totals.get("stalls_active", 0)
    if stalled:
        text.append(f" · STALLED {stalled}", style="bold red")
    ends = {k: v for k, v in (totals.get("terminations") or {}).items() if v}
    problems = [f"{k} {v}" for k, v in ends.items() if k != "complete"]
    for key, label in (("anomalies", "anomalies"), ("upstream_connect_failures", "connect fail")):
        if totals.get(key):
            problems.append(f"{label} {totals[key]}")
    if "complete" in ends:
        text.append(f" · complete {ends['complete']}")
    if problems:
        text.append(" · " + " · ".join(problems), style="red")
    return text


def _engines(engines: list[dict[str, Any]], plain: bool) -> Table:
    table = _table("engines (their own metrics)", plain)
    for name, justify in (
        ("engine", "left"),
        ("profile", "left"),
        ("running", "right"),
        ("queued", "right"),
        ("KV use", "right"),
        ("tokens/s", "right"),
        ("sample", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for e in engines:
        rate = e.get("tokens_per_s")
        if rate is None:
            rate = e.get("gen_throughput")
        usage = e.get("token_usage")
        sample = f"{dur(e.get('age'))} ago"
        style = ""
        if not e.get("ok", True):
            sample += f" FAILED: {e.get('error') or '?'}"
            style = "red"
        _row(
            table,
            str(e.get("url", "?")),
            str(e.get("profile") or "?"),
            _num(e.get("running")),
            _num(e.get("queued")),
            "-" if usage is None else f"{usage:.0%}",
            _num(rate),
            sample,
            style=style,
        )
    return table


def _in_flight(status: dict[str, Any], limit: int, plain: bool) -> RenderableType:
    rows = [
        (conn, req)
        for conn in status.get("connections") or []
        for req in conn.get("in_flight") or []
    ]
    if not rows:
        return Text("requests in flight: none", style="bold")
    stall_after = status.get("stall_after") or 0
    rows.sort(key=lambda cr: (not cr[1].get("stalled"), -(cr[1].get("age") or 0)))
    table = _table(f"requests in flight ({len(rows)})", plain)
    for name, justify in (
        ("conn", "right"),
        ("#", "right"),
        ("request", "left"),
        ("status", "right"),
        ("age", "right"),
        ("last byte", "right"),
        ("bytes", "right"),
        ("events", "right"),
        ("state", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for conn, req in rows[:limit]:
        quiet = req.get("last_byte_age") or 0
        if req.get("stalled"):
            state, style = f"STALLED ({req['stalled']})", "bold red"
        elif stall_after and quiet >= stall_after / 2:
            state, style = "quiet", "yellow"
        elif req.get("status") is None:
            state, style = "waiting for head", ""
        else:
            state, style = "streaming", "green"
        request = req.get("request") or req.get("method") or "?"
        if req.get("request_id"):
            request += f"  [{req['request_id']}]"
        _row(
            table,
            str(conn.get("conn")),
            str(req.get("seq")),
            request,
            _num(req.get("status")),
            dur(req.get("age")),
            f"{dur(quiet)} ago",
            size(req.get("response_bytes")),
            _num(req.get("events")),
            state,
            style=style,
        )
    return _capped(table, len(rows), limit)


def _connections(status: dict[str, Any], limit: int, plain: bool) -> RenderableType:
    conns = list(status.get("connections") or [])
    if not conns:
        return Text("connections: none open", style="bold")
    conns.sort(key=lambda c: (not c.get("in_flight"), c.get("idle") or 0, c.get("conn") or 0))
    table = _table(f"connections open ({len(conns)})", plain)
    for name, justify in (
        ("conn", "right"),
        ("peer", "left"),
        ("age", "right"),
        ("requests", "right"),
        ("reused", "right"),
        ("state", "left"),
        ("idle", "right"),
        ("from client", "right"),
        ("from upstream", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in conns[:limit]:
        served = int(c.get("requests") or 0)
        busy = bool(c.get("in_flight"))
        _row(
            table,
            str(c.get("conn")),
            str(c.get("peer", "?")),
            dur(c.get("age")),
            str(served),
            f"{max(0, served - 1)}x",
            "active" if busy else "idle",
            "-" if busy else dur(c.get("idle")),
            size(c.get("bytes_from_client")),
            size(c.get("bytes_from_upstream")),
            style="" if busy else "dim",
        )
    return _capped(table, len(conns), limit)


def _recent(recent: list[dict[str, Any]], limit: int, plain: bool) -> RenderableType:
    if not recent:
        return Text(
            "recent findings: none (no stalls, anomalies or failed responses)", style="bold"
        )
    table = _table("recent findings (newest first)", plain)
    for name, justify in (("when", "right"), ("kind", "left"), ("request", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    table.add_column("detail", justify="left", overflow="fold")
    for r in recent[:limit]:
        where = ""
        if r.get("conn") is not None:
            where = f"conn {r['conn']}" + (f" #{r['seq']}" if r.get("seq") is not None else "")
        kind = str(r.get("kind", "?"))
        _row(
            table,
            f"{dur(r.get('age'))} ago",
            Text(kind, style=_KIND_STYLE.get(kind, "")),
            where,
            str(r.get("detail", "")),
        )
    return _capped(table, len(recent), limit)


def _row(table: Table, *cells: str | Text, style: str = "") -> None:
    """Cells as literal text: a peer like ``[::1]:80`` or an id in brackets is not markup."""
    table.add_row(*(c if isinstance(c, Text) else Text(c) for c in cells), style=style)


def _capped(table: Table, total: int, limit: int) -> RenderableType:
    if total <= limit:
        return table
    return Group(table, Text(f"  ... and {total - limit} more", style="dim"))


def dur(seconds: Any) -> str:
    """0.4s, 12.3s, 4m05s, 2h03m: short, fixed-ish width."""
    if not isinstance(seconds, int | float):
        return "-"
    s = max(0.0, float(seconds))
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def size(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.1f}"
    return str(int(value)) if isinstance(value, int | float) else str(value)
