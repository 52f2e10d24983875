"""nginx from Debian as a real third-party proxy on loopback."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from anyio.abc import Process

from tests.support.net import free_port

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def _conf(prefix: Path, port: int, upstream: str, server: str, location: str) -> Path:
    temps = " ".join(
        f"{name}_temp_path {prefix}/{name};"
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"""daemon off; worker_processes 1; pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log info;
events {{ worker_connections 64; }}
http {{
  access_log off; {temps}
  server {{
    listen 127.0.0.1:{port};
    {server}
    location / {{
      proxy_pass {upstream};
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      {location}
    }}
  }}
}}
"""
    )
    return conf


async def _up(url: str, process: Process) -> bool:
    """Whether nginx answers before its deadline (False: it exited, its port taken)."""
    async with httpx.AsyncClient() as probe:
        with anyio.fail_after(10):
            while process.returncode is None:
                try:
                    await probe.get(url + "/health")
                    return True
                except httpx.HTTPError:
                    await anyio.sleep(0.05)  # (polls with a deadline)
    return False


@asynccontextmanager
async def nginx(
    tmp_path: Path, upstream: str, server: str = "", location: str = "proxy_buffering off;"
) -> AsyncIterator[str]:
    """nginx proxying to ``upstream`` (``server``: directives for its server block,
    ``location``: for its location); yields its URL. Skips the test without nginx."""
    if not Path(NGINX).exists():
        pytest.skip("nginx is not installed (.ci/run installs it)")
    prefix = tmp_path / "nginx"
    (prefix / "logs").mkdir(parents=True)
    for attempt in range(3):  # nginx must be told its port: one taken meanwhile, again
        port = free_port()
        conf = _conf(prefix, port, upstream, server, location)
        process = await anyio.open_process([NGINX, "-p", str(prefix), "-c", str(conf)])
        url = f"http://127.0.0.1:{port}"
        try:
            if await _up(url, process):
                break
            assert attempt < 2, (prefix / "logs" / "error.log").read_text()
        except BaseException:
            await _stop(process)
            raise
        await _stop(process)
    try:
        yield url
    finally:
        await _stop(process)


async def _stop(process: Process) -> None:
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            process.terminate()
        await process.wait()
        await process.aclose()
