"""Addresses as the command line gives them: ``HOST:PORT`` and ``http://HOST:PORT``."""

from __future__ import annotations

from urllib.parse import urlsplit


def parse_upstream(url: str) -> tuple[str, int]:
    """``http://host:port`` (path ignored) to host and port; https is refused clearly."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http":
        raise ValueError(f"upstream must be an http:// URL (got {parts.scheme}://)")
    if not parts.hostname:
        raise ValueError(f"upstream URL has no host: {url!r}")
    try:
        parts.port  # noqa: B018  (urllib checks the port when it is read)
    except ValueError:
        raise ValueError(
            f"upstream URL {url!r}: the port is not a number from 1 to 65535"
        ) from None
    if parts.port == 0:
        raise ValueError(f"upstream URL has port 0: {url!r}")
    return parts.hostname, parts.port or 80


def parse_hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT (port 0 to 65535), got {value!r}")
    return (host.strip("[]") or "127.0.0.1"), int(port)
