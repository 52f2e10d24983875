"""The command line's parser: one-line usage errors, defaults in ``--help``, the global
options accepted after any subcommand, and argument types that check at parse time."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import NoReturn
from urllib.parse import urlsplit

EXIT_USAGE = 2


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs as written, and each option's default where it has a meaningful one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, argparse.SUPPRESS)
            or default == []
            or not action.option_strings
            or isinstance(action, argparse._HelpAction | argparse._VersionAction)
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class TracerParser(argparse.ArgumentParser):
    """Every (sub)command parser: a usage error says what is wrong on its first line and
    where help is, without the usage block; ``--log-json`` and ``--log-level`` are taken
    after the subcommand too (the top level's defaults stand unless given)."""

    def __init__(self, *args: object, top: bool = False, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        group = self.add_argument_group("logging (before or after the command)")
        group.add_argument(
            "--log-json",
            action="store_true",
            default=False if top else argparse.SUPPRESS,
            help="log JSON lines, one object per line on stderr (for machines)",
        )
        group.add_argument(
            "--log-level",
            choices=["debug", "info", "warning", "error"],
            default="info" if top else argparse.SUPPRESS,
            help="least severe log lines shown (default: info)",
        )

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """As argparse's, but arguments no parser took are blamed on the command that was
        given them (``tracer analyze: error: unrecognized arguments``), not on ``tracer``."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self._chosen(ns).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns

    def _chosen(self, ns: argparse.Namespace) -> argparse.ArgumentParser:
        """The innermost (sub)command parser the namespace says was chosen."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(ns, action.dest, None) or "")
                if isinstance(sub, TracerParser):
                    return sub._chosen(ns)
        return self

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")
        sys.exit(EXIT_USAGE)


# ---- argument types: each raises ArgumentTypeError, which the parser makes one line ----


def positive_float(text: str) -> float:
    """Seconds, MiB, ratios: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more")
    return value


def http_url(text: str) -> str:
    """An http(s) URL with a host (and a valid port when one is given)."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the port is not a number from 1 to 65535"
        ) from None
    if parts.scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"{text!r}: not an http:// or https:// URL")
    if not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: no host")
    if port == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: port 0")
    return text.strip()


def leaf_exception(exc: BaseException) -> BaseException:
    """The first exception inside task-group wrappers (what actually went wrong)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
