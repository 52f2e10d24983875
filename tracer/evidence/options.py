"""The engine-evidence options every command that polls engines shares (``tracer proxy``,
``watch``, ``replay``), and the poller they ask for."""

from __future__ import annotations

import argparse
from typing import Any

from ..arguments import http_url, positive_float


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
