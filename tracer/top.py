"""``tracer top`` (not built yet)."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare this command's options."""


def run(args: argparse.Namespace) -> int:
    raise ValueError("tracer top is not built yet")
