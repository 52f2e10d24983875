"""The targets under test: direct, the tracer tap, mitmdump, nginx; how each is started.

Every proxy is pinned to core 1 (``taskset -c 1``) and forwards to the bench upstream.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .procs import Proc, free_port, spawn, wait_port

TARGETS = ("direct", "tracer", "mitmdump", "nginx")
PROXY_CORE = 1

MITM_SCRIPT = '''\
"""Stream every response body (SSE above all): nothing is buffered by mitmdump."""


def responseheaders(flow):
    flow.response.stream = True


def requestheaders(flow):
    flow.request.stream = True
'''

NGINX_CONF = """\
worker_processes 1;
worker_rlimit_nofile 20000;
pid nginx.pid;
error_log logs/error.log warn;
daemon off;
events {{
    worker_connections 8192;
}}
http {{
    access_log off;
    client_body_temp_path tmp/body;
    proxy_temp_path tmp/proxy;
    fastcgi_temp_path tmp/fastcgi;
    uwsgi_temp_path tmp/uwsgi;
    scgi_temp_path tmp/scgi;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    upstream bench_upstream {{
        server 127.0.0.1:{upstream};
        keepalive 64;
        keepalive_requests 100000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://bench_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


@dataclass
class Target:
    name: str
    port: int
    proc: Proc | None = None  # None for direct

    def cpu(self) -> float:
        return self.proc.cpu() if self.proc is not None else 0.0

    def pids(self) -> list[int]:
        return self.proc.pids() if self.proc is not None else []

    def rss(self) -> int:
        return self.proc.rss() if self.proc is not None else 0

    def alive(self) -> bool:
        return self.proc is None or self.proc.alive()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def available(name: str) -> str | None:
    """Why a target cannot run here, or None."""
    if name == "mitmdump" and not (Path(sys.executable).parent / "mitmdump").exists():
        return "mitmdump not in the virtualenv"
    if name == "nginx" and not _nginx():
        return "nginx not installed"
    return None


def _nginx() -> str | None:
    for cand in ("/usr/sbin/nginx", shutil.which("nginx")):
        if cand and Path(cand).exists():
            return cand
    return None


def start(
    name: str, upstream_port: int, out: Path, repo: Path, *, tracer_path: Path | None = None
) -> Target:
    """Start one target listening on a free port; raises RuntimeError if it does not come up."""
    if name == "direct":
        return Target(name, upstream_port)
    port = free_port()
    venv_bin = Path(sys.executable).parent
    upstream = f"http://127.0.0.1:{upstream_port}"
    if name == "tracer":
        # the tap of another checkout (``--tracer-path``): its package first on the path
        exe = [sys.executable, "-m", "tracer"] if tracer_path else [str(venv_bin / "tracer")]
        argv = [
            *exe,
            "proxy",
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream",
            upstream,
            "--capture",
            str(out / "tap.jsonl"),
        ]
        (out / "tap.jsonl").unlink(missing_ok=True)
        env = {**os.environ, "PYTHONPATH": str(tracer_path)} if tracer_path else None
        cwd = tracer_path or repo  # (python -m puts the working directory first on the path)
        proc = spawn("tracer", argv, core=PROXY_CORE, log_dir=out, cwd=cwd, env=env)
    elif name == "mitmdump":
        script = out / "mitm_stream.py"
        script.write_text(MITM_SCRIPT)
        confdir = out / "mitmproxy"
        confdir.mkdir(exist_ok=True)
        argv = [
            str(venv_bin / "mitmdump"),
            "--mode",
            f"reverse:{upstream}",
            "--listen-host",
            "127.0.0.1",
            "-p",
            str(port),
            "-q",
            "--set",
            "stream_large_bodies=1",
            "--set",
            f"confdir={confdir}",
            "-s",
            str(script),
        ]
        proc = spawn("mitmdump", argv, core=PROXY_CORE, log_dir=out, cwd=repo)
    elif name == "nginx":
        binary = _nginx()
        if binary is None:
            raise RuntimeError("nginx not installed")
        prefix = out / "nginx"
        for sub in ("logs", "tmp"):
            (prefix / sub).mkdir(parents=True, exist_ok=True)
        (prefix / "nginx.conf").write_text(NGINX_CONF.format(upstream=upstream_port, port=port))
        argv = [
            binary,
            "-p",
            str(prefix.resolve()) + "/",
            "-c",
            "nginx.conf",
            "-e",
            "logs/error.log",
        ]
        proc = spawn("nginx", argv, core=PROXY_CORE, log_dir=out, cwd=repo)
        proc.extra_children = True  # SIGTERM to the master stops its worker
    else:
        raise ValueError(f"unknown target {name!r}")
    try:
        wait_port(port, proc.popen, timeout=30)
    except RuntimeError as exc:
        proc.stop()
        raise RuntimeError(f"{name}: {exc}\n{proc.log_tail()}") from exc
    return Target(name, port, proc)
