"""The engine-evidence options every command that polls engines shares (``tracer proxy``,
``watch``, ``replay``, ``sniff``) and the poller they ask for; the probe-on-stall options
(``proxy``, ``sniff``) and the prober they ask for."""

from __future__ import annotations

import argparse
from typing import Any

from ..arguments import http_url, positive_float, positive_int


def engine_arguments(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument(
        "--engine-metrics",
        action="append",
        default=[],
        metavar="URL",
        type=http_url,
        required=required,
        help="an engine's, worker's or the router's Prometheus /metrics URL "
        "(repeatable); scraped every --metrics-interval into the capture",
    )
    p.add_argument(
        "--metrics-interval",
        type=positive_float,
        default=1.0,
        metavar="SECONDS",
        help="how often the metrics and health URLs are read",
    )
    p.add_argument(
        "--metrics-timeout",
        type=positive_float,
        default=2.0,
        metavar="SECONDS",
        help="a scrape slower than this is recorded as failed",
    )
    p.add_argument(
        "--health",
        action="append",
        default=[],
        type=http_url,
        metavar="URL",
        help="a health URL polled on the same schedule (e.g. the router's /readiness)",
    )
    p.add_argument(
        "--engine-profile",
        choices=["sglang", "vllm", "llamacpp", "smg", "sgl_router"],
        help="metric names to expect (default: detected from what the endpoint exposes)",
    )
    p.add_argument(
        "--keep-raw-metrics", action="store_true", help="also keep metrics no profile knows, raw"
    )


def engine_poller(args: argparse.Namespace, tap: str, emit: Any, wall_offset: float) -> Any:
    """The engine poller the evidence options ask for (``_engine_arguments``), or None."""
    from .poller import EnginePoller, PollerConfig

    if not args.engine_metrics and not args.health:
        return None
    config = PollerConfig(
        urls=list(args.engine_metrics),
        interval=args.metrics_interval,
        timeout=args.metrics_timeout,
        health_urls=list(args.health),
        keep_raw=getattr(args, "keep_raw_metrics", False),
        profile=args.engine_profile,
    )
    return EnginePoller(config, tap=tap, emit=emit, wall_offset=wall_offset)


def probe_arguments(p: argparse.ArgumentParser, *, upstream: str = "the upstream") -> None:
    """The probe-on-stall options (``tracer proxy``, ``sniff``): ``upstream`` names what
    the probes' ``upstream`` target is for this command."""
    p.add_argument(
        "--probe-on-stall",
        action="store_true",
        help=f"on a stall, send a tiny request over a fresh connection to {upstream} and "
        "to each --engine-metrics host, and record the outcome (off by default)",
    )
    p.add_argument(
        "--probe-kind",
        choices=["models", "completion", "health"],
        default="models",
        help="GET /v1/models (default), a 1-token completion, or GET /health",
    )
    p.add_argument("--probe-model", metavar="NAME", help="model for --probe-kind completion")
    p.add_argument(
        "--probe-interval",
        type=positive_float,
        default=5.0,
        metavar="SECONDS",
        help="at most one round of probes per this many seconds",
    )
    p.add_argument(
        "--probe-busy-threshold",
        type=positive_int,
        default=32,
        metavar="N",
        help="skip probes while an engine reports running+queued >= N",
    )


def stall_prober(
    args: argparse.Namespace,
    *,
    upstream_url: str,
    tap: str,
    emit: Any,
    wall_offset: float,
    spawn: Any,
    load: Any,
) -> Any:
    """The prober the probe options ask for (``probe_arguments``), or None: a sink that
    probes on each stall start (``load``: the engine poller, whose samples say busy)."""
    if not args.probe_on_stall:
        return None
    from .probes import ProbeConfig, Prober, engine_base

    return Prober(
        ProbeConfig(
            upstream_url=upstream_url,
            engine_urls=[engine_base(u) for u in args.engine_metrics],
            kind=args.probe_kind,
            model=args.probe_model,
            min_interval=args.probe_interval,
            busy_threshold=args.probe_busy_threshold,
        ),
        tap=tap,
        emit=emit,
        wall_offset=wall_offset,
        spawn=spawn,
        load=load,
    )
